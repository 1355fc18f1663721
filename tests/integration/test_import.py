"""`kbd import WF DIR` with real files (docs/search.md "Importing markdown"): idempotent,
`--update`, `--dry-run` byte-identical, never outside the workflow's own
`context/`, links/FIFOs in DIR skipped, audience refusals, audited. Through the
daemon: tests/integration/test_cli_remote.py (parity) and test_api.py (route)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import orjson
import pytest

from kbd.service import importing
from kbd.state.audit import AUDIT_NAME
from tests.helpers import KbRoot, snapshot

TEAM = {"owners": ["alice"], "editors": ["carol"], "readers": ["bob"]}


@pytest.fixture
def kb(tmp_path: Path) -> KbRoot:
    kb = KbRoot.create(tmp_path / "root")
    kb.workflow("wf", access=TEAM)
    kb.workflow("other", access=TEAM)
    return kb


def _docs(base: Path) -> Path:
    docs = base / "docs"
    (docs / "ENG").mkdir(parents=True)
    (docs / "LEAD" / "deep").mkdir(parents=True)
    (docs / "ENG" / "Onboarding.md").write_text("# Onboarding\n\n## Who is here\nalice\n")
    (docs / "LEAD" / "Manager 1-1.md").write_text("---\ntitle: Manager 1:1\n---\nweekly\n")
    (docs / "LEAD" / "deep" / "Notes.markdown").write_text("# Deep notes\nx\n")
    (docs / "LEAD" / "image.png").write_bytes(b"\x89PNG")
    return docs


def _import(kb: KbRoot, docs: Path, *extra: str, as_: str = "alice") -> dict[str, object]:
    r = kb.call("import", "wf", str(docs), "--as", as_, "--json", *extra)
    assert r.code == 0, r.err
    out: dict[str, object] = r.json()
    return out


def _paths(result: dict[str, object], key: str) -> list[str]:
    rows = result[key]
    assert isinstance(rows, list)
    return [str(r["path"]) for r in rows]


def _context(kb: KbRoot, wid: str = "wf") -> Path:
    return kb.workflows / wid / "knowledgebase" / "context"


def test_import_places_documents_by_container_and_title(kb: KbRoot, tmp_path: Path) -> None:
    docs = _docs(tmp_path)
    result = _import(kb, docs)
    assert sorted(_paths(result, "created")) == [
        "context/deep/deep-notes.md",
        "context/eng/onboarding.md",
        "context/lead/manager-1-1.md",
    ]
    assert result["skipped"] == [] and result["workflow_id"] == "wf"
    text = (_context(kb) / "eng" / "onboarding.md").read_text()
    assert (
        text == '---\ntitle: "Onboarding"\nimported_from: "ENG/Onboarding.md"\n---\n\n## Who is here\nalice\n'
    )
    assert "# Onboarding" not in text  # the H1 is the title, stripped from the body
    # Nothing outside context/ changed, and the other workflow is untouched.
    assert (_context(kb) / "about.md").read_text() == "about wf\n"
    assert sorted(p.name for p in _context(kb, "other").iterdir()) == ["about.md"]


def test_imported_documents_keep_their_titles_in_search(kb: KbRoot, tmp_path: Path) -> None:
    """The H1 an import moves into ``title:`` is what search hits are titled by, never the file name."""
    _import(kb, _docs(tmp_path))
    sid = kb.open_session("wf", kind="builder", kb_access="read", actor="alice")
    for query, title in (("alice", "Onboarding"), ("weekly", "Manager 1:1"), ("x", "Deep notes")):
        r = kb.call("search", sid, query, "--as", "alice", "--json")
        assert r.code == 0, r.err
        assert [h["title"] for h in r.json()["hits"]] == [title], (query, r.json())


def test_a_second_import_finds_everything_unchanged(kb: KbRoot, tmp_path: Path) -> None:
    docs = _docs(tmp_path)
    first = _import(kb, docs)
    before = snapshot(kb.workflows)
    second = _import(kb, docs)
    assert second["created"] == second["updated"] == [] and second["skipped"] == []
    assert sorted(_paths(second, "unchanged")) == sorted(_paths(first, "created"))
    assert snapshot(kb.workflows) == before  # not even rewritten (mtimes equal)


def test_a_changed_document_is_updated_only_with_update(kb: KbRoot, tmp_path: Path) -> None:
    docs = _docs(tmp_path)
    _import(kb, docs)
    target = _context(kb) / "eng" / "onboarding.md"
    old = target.read_bytes()
    (docs / "ENG" / "Onboarding.md").write_text("# Onboarding\n\nrewritten\n")
    plain = _import(kb, docs)
    assert plain["skipped"] == [{"file": "ENG/Onboarding.md", "reason": "changed (use --update)"}]
    assert target.read_bytes() == old
    updated = _import(kb, docs, "--update")
    assert _paths(updated, "updated") == ["context/eng/onboarding.md"] and updated["skipped"] == []
    assert target.read_text().endswith("\nrewritten\n")
    assert sorted(_paths(updated, "unchanged")) == [
        "context/deep/deep-notes.md",
        "context/lead/manager-1-1.md",
    ]


@pytest.mark.parametrize("update", [False, True])
def test_dry_run_writes_nothing_and_reports_the_same(kb: KbRoot, tmp_path: Path, update: bool) -> None:
    docs = _docs(tmp_path)
    flags = ("--update",) if update else ()
    shutil_free = snapshot(kb.root, skip=("state",))
    dry = _import(kb, docs, "--dry-run", *flags)
    assert snapshot(kb.root, skip=("state",)) == shutil_free
    assert dry["dry_run"] is True
    real = _import(kb, docs, *flags)
    assert {k: dry[k] for k in ("created", "updated", "unchanged", "skipped")} == {
        k: real[k] for k in ("created", "updated", "unchanged", "skipped")
    }
    # And after a change: the dry run names the update (or the skip) without doing it.
    (docs / "ENG" / "Onboarding.md").write_text("# Onboarding\nnew\n")
    before = snapshot(kb.root, skip=("state",))
    dry = _import(kb, docs, "--dry-run", *flags)
    assert snapshot(kb.root, skip=("state",)) == before
    if update:
        assert _paths(dry, "updated") == ["context/eng/onboarding.md"]
    else:
        assert dry["skipped"] == [{"file": "ENG/Onboarding.md", "reason": "changed (use --update)"}]


def test_dry_run_into_a_kb_without_context_creates_nothing(kb: KbRoot, tmp_path: Path) -> None:
    ctx = _context(kb)
    for p in ctx.iterdir():
        p.unlink()
    ctx.rmdir()
    docs = _docs(tmp_path)
    dry = _import(kb, docs, "--dry-run")
    assert len(_paths(dry, "created")) == 3 and not ctx.exists()
    _import(kb, docs)
    assert (ctx / "eng" / "onboarding.md").is_file()


def test_links_fifos_and_devices_in_dir_are_skipped_unread(kb: KbRoot, tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "Secret.md").write_text("# Secret\nroot's eyes only\n")
    docs = _docs(tmp_path)
    (docs / "ENG" / "linked.md").symlink_to(secret / "Secret.md")
    (docs / "linked-folder").symlink_to(secret)
    os.mkfifo(docs / "ENG" / "pipe.md")
    os.mknod(docs / "ENG" / "null.md", 0o600 | 0o020000, os.makedev(1, 3))  # a character device
    (docs / "ENG" / "big.md").write_bytes(b"# Big\n" + b"x" * (1024 * 1024))
    (docs / "ENG" / "latin1.md").write_bytes(b"# Caf\xe9\n")
    (docs / "ENG" / "untitled.md").write_text("no heading\n")
    done = threading.Event()
    result: dict[str, object] = {}

    def run() -> None:  # a FIFO that were opened would hang the import: it must finish
        result.update(_import(kb, docs))
        done.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert done.wait(30), "the import hung (a FIFO was opened?)"
    reasons = {s["file"]: s["reason"] for s in result["skipped"]}  # type: ignore[attr-defined]
    assert "symbolic link" in reasons["ENG/linked.md"] and "symbolic link" in reasons["linked-folder"]
    assert "FIFO" in reasons["ENG/pipe.md"] and "device" in reasons["ENG/null.md"]
    assert "larger than 1048576 bytes" in reasons["ENG/big.md"]
    assert reasons["ENG/latin1.md"] == "not UTF-8 text" and "no title" in reasons["ENG/untitled.md"]
    assert len(_paths(result, "created")) == 3
    assert not list(_context(kb).rglob("secret*.md"))
    assert b"root's eyes only" not in b"".join(p.read_bytes() for p in _context(kb).rglob("*.md"))


def test_names_that_are_not_utf8_are_skipped_and_shown_escaped(kb: KbRoot, tmp_path: Path) -> None:
    """A file or folder name that is not UTF-8 is skipped with a reason (its
    name escaped), and the rest is imported: never an internal error (70). The
    imported folder's own name, a container, is used escaped."""
    docs = _docs(tmp_path)
    (docs / "ENG" / os.fsdecode(b"b\xffd.md")).write_text("# Bad name\nx\n")
    (docs / os.fsdecode(b"dir\xfe")).mkdir()
    (docs / os.fsdecode(b"dir\xfe") / "In.md").write_text("# Inside\nx\n")
    (docs / "ENG" / os.fsdecode(b"skip\xff.png")).write_bytes(b"not markdown: passed over")
    result = _import(kb, docs)
    assert result["skipped"] == [
        {"file": "ENG/b\\xffd.md", "reason": "the file name is not valid UTF-8"},
        {"file": "dir\\xfe/", "reason": "the folder name is not valid UTF-8; not walked"},
    ]
    assert len(_paths(result, "created")) == 3
    text = kb.call("import", "wf", str(docs), "--as", "alice")
    assert text.code == 0, text.err
    assert "skipped   ENG/b\\xffd.md: the file name is not valid UTF-8" in text.out
    top = tmp_path / os.fsdecode(b"Caf\xe9")
    top.mkdir()
    (top / "Menu.md").write_text("# Menu\nsoup\n")
    result = _import(kb, top)
    assert _paths(result, "created") == ["context/caf-xe9/menu.md"]
    assert 'imported_from: "Caf\\\\xe9/Menu.md"' in (_context(kb) / "caf-xe9" / "menu.md").read_text()


def test_names_that_are_not_utf8_sent_to_the_operation_are_reported_escaped(kb: KbRoot) -> None:
    """What a daemon receives may hold lone surrogates (JSON ``\\udcff``): the
    operation skips such a document and shows every name escaped."""
    host = kb.host()
    docs = [("ENG/b\udcffd.md", b"# Bad\n"), ("ENG/ok.md", b"# Fine\n")]
    result = importing.import_docs(host, "wf", docs, folder="top\ud800", actor=host.actor("alice"),
                                   skipped=[("x\udcfe.md", "reason \udcfe")]).to_json()  # fmt: skip
    assert result["skipped"] == [
        {"file": "x\\xfe.md", "reason": "reason \\xfe"},
        {"file": "ENG/b\\xffd.md", "reason": "the file name is not valid UTF-8"},
    ]
    assert _paths(result, "created") == ["context/eng/fine.md"]
    assert orjson.dumps(result)  # encodable: no lone surrogate left


def test_a_link_planted_in_context_is_never_written_through(kb: KbRoot, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (_context(kb) / "eng").symlink_to(outside)  # a container folder that leaves the KB
    (_context(kb) / "lead").mkdir()
    victim = tmp_path / "victim.md"
    victim.write_text("untouched\n")
    (_context(kb) / "lead" / "manager-1-1.md").symlink_to(victim)  # a target that is a link
    docs = _docs(tmp_path)
    for flags in ((), ("--update",)):
        result = _import(kb, docs, *flags)
        reasons = {s["file"]: s["reason"] for s in result["skipped"]}  # type: ignore[attr-defined]
        assert "symbolic link" in reasons["ENG/Onboarding.md"]
        assert "symbolic link" in reasons["LEAD/Manager 1-1.md"]
    assert list(outside.iterdir()) == [] and victim.read_text() == "untouched\n"
    assert (_context(kb) / "lead" / "manager-1-1.md").is_symlink()


def test_context_itself_a_link_refuses_the_import(kb: KbRoot, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    ctx = _context(kb)
    for p in ctx.iterdir():
        p.unlink()
    ctx.rmdir()
    ctx.symlink_to(outside)
    r = kb.call("import", "wf", str(_docs(tmp_path)), "--as", "alice")
    assert r.code == 77 and "symbolic link" in r.err
    assert list(outside.iterdir()) == []


def test_network_shaped_documents_cannot_leave_context(kb: KbRoot) -> None:
    """What a daemon receives is names and bytes: a container `..`, a title with
    `/`, a name with `..` all stay inside context/ or are skipped."""
    host = kb.host()
    alice = host.actor("alice")
    docs = [
        ("x.md", b"# Top\n"),  # container = the folder name given: '..'
        ("../evil.md", b"# Evil\n"),
        ("A/../../evil.md", b"# Evil\n"),
        ("ENG/slash.md", b"# ../../../../etc/cron.d/x\n"),
        ("ENG/fm.md", b'---\ntitle: "a/b/../c"\n---\nbody\n'),
        ("/abs/x.md", b"# Abs\n"),
    ]
    before = snapshot(kb.root, skip=("state",))
    result = importing.import_docs(host, "wf", docs, folder="..", actor=alice).to_json()
    created = sorted(_paths(result, "created"))
    assert created == ["context/eng/a-b-c.md", "context/eng/etc-cron-d-x.md"]
    reasons = {s["file"]: s["reason"] for s in result["skipped"]}
    assert "no letter or digit" in reasons["x.md"]
    assert all("bad file name" in reasons[f] for f in ("../evil.md", "A/../../evil.md", "/abs/x.md"))
    after = snapshot(kb.root, skip=("state",))
    changed = {k for k in after if before.get(k) != after[k]}
    ctx = "workflows/wf/knowledgebase/context"
    assert changed == {ctx, f"{ctx}/eng", f"{ctx}/eng/a-b-c.md", f"{ctx}/eng/etc-cron-d-x.md"}


def test_two_documents_for_one_target_and_a_hand_written_file(kb: KbRoot, tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    (docs / "ENG").mkdir(parents=True)
    (docs / "ENG" / "a.md").write_text("# Same Title\nfrom a\n")
    (docs / "ENG" / "b.md").write_text("# same  title\nfrom b\n")
    (docs / "ENG" / "c.md").write_text("# Hand\nimported\n")
    (_context(kb) / "eng").mkdir()
    (_context(kb) / "eng" / "hand.md").write_text("written by a person\n")
    for flags in ((), ("--update",)):
        result = _import(kb, docs, *flags)
        reasons = {s["file"]: s["reason"] for s in result["skipped"]}  # type: ignore[attr-defined]
        assert reasons["ENG/b.md"] == "same target context/eng/same-title.md as ENG/a.md (imported first)"
        assert "not an import of ENG/c.md" in reasons["ENG/c.md"]
    assert (_context(kb) / "eng" / "hand.md").read_text() == "written by a person\n"
    assert "from a" in (_context(kb) / "eng" / "same-title.md").read_text()


@pytest.mark.parametrize(
    ("who", "code"),
    [("bob", 77), ("svc", 77), ("dave", 66), ("carol", 0), ("ops", 0)],
)
def test_who_may_import(kb: KbRoot, tmp_path: Path, who: str, code: int) -> None:
    docs = _docs(tmp_path)
    before = snapshot(kb.root, skip=("state",))
    r = kb.call("import", "wf", str(docs), "--as", who)
    assert r.code == code, r.err
    if code:
        assert snapshot(kb.root, skip=("state",)) == before
        if code == 66:
            assert "no workflow with ID 'wf'" in r.err  # word for word a missing workflow's answer
    records = [orjson.loads(line) for line in (kb.root / "state" / AUDIT_NAME).read_bytes().splitlines()]
    last = records[-1]
    assert last["event"] == ("import_refused" if code else "import") and last["actor"] == who
    if not code:
        assert (last["created"], last["updated"], last["unchanged"], last["skipped"]) == (3, 0, 0, 0)


@pytest.mark.requires_root  # fails, never skips, under CI's KBD_REQUIRE_ALL_FEATURES=1
def test_files_belong_to_the_owner_of_context(kb: KbRoot, tmp_path: Path) -> None:
    ctx = _context(kb)
    os.chown(ctx, 4321, 4322)
    ctx.chmod(0o2750)
    _import(kb, _docs(tmp_path))
    for p in [ctx / "eng", ctx / "eng" / "onboarding.md"]:
        st = p.stat()
        assert (st.st_uid, st.st_gid) == (4321, 4322), p
    assert (ctx / "eng").stat().st_mode & 0o7777 == 0o2750
    assert (ctx / "eng" / "onboarding.md").stat().st_mode & 0o7777 == 0o640


def test_a_missing_or_non_folder_dir_is_a_clear_error(kb: KbRoot, tmp_path: Path) -> None:
    r = kb.call("import", "wf", str(tmp_path / "nosuch"), "--as", "alice")
    assert r.code == 66 and "does not exist" in r.err
    f = tmp_path / "file.md"
    f.write_text("# x\n")
    r = kb.call("import", "wf", str(f), "--as", "alice")
    assert r.code in (2, 77), r.err  # click refuses a file where DIR is asked (usage), else kbd does


def test_text_output_lists_changes_and_quiet_and_verbose_say_less_and_more(
    kb: KbRoot, tmp_path: Path
) -> None:
    docs = _docs(tmp_path)
    first = kb.call("import", "wf", str(docs), "--as", "alice")
    assert first.code == 0, first.err
    assert [ln.split()[0] for ln in first.out.splitlines()] == ["created"] * 3 + ["import"], first.out
    assert first.out.splitlines()[-1] == "import into wf: 3 created, 0 updated, 0 unchanged, 0 skipped"
    assert first.err == ""  # not a terminal: no progress
    again = kb.call("import", "wf", str(docs), "--as", "alice")
    # Unchanged documents are counted, not listed (5,000 of them printed 5,000 lines).
    assert again.out == "import into wf: 0 created, 0 updated, 3 unchanged, 0 skipped\n", again.out
    verbose = kb.call("import", "wf", str(docs), "--as", "alice", "--verbose")
    assert [ln.split()[0] for ln in verbose.out.splitlines()] == ["unchanged"] * 3 + ["import"], verbose.out
    (docs / "ENG" / "Onboarding.md").write_text("# Onboarding\n\nchanged\n")
    quiet = kb.call("import", "wf", str(docs), "--as", "alice", "--update", "-q")
    assert quiet.out == "import into wf: 0 created, 1 updated, 2 unchanged, 0 skipped\n", quiet.out
    both = kb.call("import", "wf", str(docs), "--as", "alice", "-q", "-v")
    assert both.code == 2 and "--quiet and --verbose exclude each other" in both.err


def test_a_terminal_sees_progress_on_stderr(kb: KbRoot, tmp_path: Path) -> None:
    import pty
    import subprocess

    docs = tmp_path / "many"
    for i in range(120):
        (docs / f"T{i % 4}").mkdir(parents=True, exist_ok=True)
        (docs / f"T{i % 4}" / f"doc-{i}.md").write_text(f"# Doc {i}\nbody {i}\n")
    leader, follower = pty.openpty()
    try:
        proc = subprocess.run(kb.cli_argv("import", "wf", str(docs), "--as", "alice"), stdout=subprocess.PIPE,
                              stderr=follower, env=kb.cli_env("import"), timeout=120, check=False)  # fmt: skip
        os.close(follower)
        follower = -1
        err = b""
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # EIO: the terminal's other end is closed and drained
                break
            if not chunk:
                break
            err += chunk
    finally:
        os.close(leader)
        if follower >= 0:
            os.close(follower)
    text = err.decode()
    assert proc.returncode == 0, text
    assert f"reading {docs}" in text and "importing into wf" in text and "120/120" in text, text
    assert (
        proc.stdout.decode().splitlines()[-1]
        == "import into wf: 120 created, 0 updated, 0 unchanged, 0 skipped"
    )

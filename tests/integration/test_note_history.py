"""Note history and conflict handling (docs/notes.md "Note history") with real
processes, a real root and real sandboxes.

``src`` (owner bob, reader alice) lets ``con`` (owner alice) write into its
``notes/``; ``con`` attaches it as ``src`` with write access; dave is an
outsider. Every version is ``sha256:<hex>`` of the note's bytes as stored.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from kbd.core.config import parse_config
from kbd.core.knowledge import body_of
from kbd.errors import InvalidConfig
from kbd.state import audit
from kbd.state.history import HISTORY_DIR
from tests.helpers import CliResult, KbRoot


def version(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def build(kb: KbRoot) -> tuple[Path, str]:
    src = kb.workflow("src", access={"owners": ["bob"], "readers": ["alice"], "allowed_kb_writers": ["con"]})
    kb.workflow("con", access={"owners": ["alice"]}, sources=[{"workflow_id": "src", "alias": "src",
                                                                "access": "write"}])  # fmt: skip
    sid = kb.open_session("con", kind="execution", kb_access="read-write", actor="alice")
    return src / "knowledgebase" / "notes", sid


def write(kb: KbRoot, sid: str, name: str, text: str, *extra: str) -> CliResult:
    return kb.call("notes", "write", sid, "src", name, "--file", "-", "--json", *extra, input=text.encode())


def log(kb: KbRoot, rel: str, who: str = "alice") -> dict[str, Any]:
    r = kb.call("notes", "log", "src", rel, "--as", who, "--json")
    assert r.code == 0, r.err
    doc: dict[str, Any] = r.json()
    return doc


def set_history(kb: KbRoot, **caps: int) -> None:
    cfg = kb.root / "kbd.yaml"
    lines = "".join(f"  {k}: {v}\n" for k, v in caps.items())
    cfg.write_text(cfg.read_text() + f"note_history:\n{lines}")


@pytest.fixture
def world(kb: KbRoot) -> tuple[KbRoot, Path, str]:
    notes, sid = build(kb)
    return kb, notes, sid


def _writer(kb: KbRoot, sid: str, path: Path, expected: str) -> subprocess.Popen[bytes]:
    """A real `kbd notes write` process (its content from a file, so both start at once)."""
    argv = [sys.executable, "-m", "kbd", "--root", str(kb.root), "notes", "write", sid, "src", "race.md",
            "--file", str(path), "--json", "--expected-version", expected]  # fmt: skip
    return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_two_processes_expecting_one_version_exactly_one_wins(world: tuple[KbRoot, Path, str]) -> None:
    """Two real processes write the same note, both from the version they read:
    the notes mutex serialises them and the check runs under it, so exactly one
    wins and the other gets 75 naming the winner's version (several rounds)."""
    kb, notes, sid = world
    first = write(kb, sid, "race.md", "# Race\nstart\n")
    assert first.code == 0, first.err
    current = first.json()["version"]
    assert current == version((notes / "race.md").read_bytes())
    for round_ in range(3):
        texts = []
        for n in range(2):
            texts.append(kb.root.parent / f"race-{round_}-{n}.md")
            texts[-1].write_text(f"# Race\nround {round_} by writer {n}\n")
        procs = [_writer(kb, sid, path, current) for path in texts]
        results: list[tuple[int, bytes, bytes]] = []
        for p in procs:
            out, err_bytes = p.communicate(timeout=60)
            results.append((p.returncode, out, err_bytes))
        winners = [r for r in results if r[0] == 0]
        losers = [r for r in results if r[0] != 0]
        assert len(winners) == 1 and len(losers) == 1, results
        won = orjson.loads(winners[0][1])["version"]
        code, _, err = losers[0]
        assert code == 75, err
        assert b"error[note-version-conflict]" in err and won.encode() in err and current.encode() in err, err
        on_disk = (notes / "race.md").read_bytes()
        assert version(on_disk) == won
        newest = log(kb, "notes/race.md")["versions"][0]
        assert (newest["version"], newest["previous"], newest["expected"]) == (won, current, current)
        current = won
    assert len(log(kb, "notes/race.md")["versions"]) == 4  # the first write and one winner per round


def test_expected_none_means_must_not_exist(world: tuple[KbRoot, Path, str]) -> None:
    kb, notes, sid = world
    made = write(kb, sid, "new.md", "fresh\n", "--expected-version", "none")
    assert made.code == 0, made.err
    again = write(kb, sid, "new.md", "second\n", "--expected-version", "none")
    assert again.code == 75 and made.json()["version"] in again.err, again.err
    stale = write(kb, sid, "gone.md", "x\n", "--expected-version", made.json()["version"])
    assert stale.code == 75 and "is at version none" in stale.err, stale.err
    assert not (notes / "gone.md").exists()
    records = [r for r in audit.read(kb.root / "state") if r["event"] == "note_refused"]
    assert [r["code"] for r in records[-2:]] == ["note-version-conflict"] * 2


def test_a_writer_without_a_version_keeps_last_writer_wins_and_the_lost_update_shows(
    world: tuple[KbRoot, Path, str],
) -> None:
    kb, notes, sid = world
    v0 = write(kb, sid, "plan.md", "# Plan\nbase\n").json()["version"]
    v1 = write(kb, sid, "plan.md", "# Plan\nbase\nA's line\n", "--expected-version", v0).json()["version"]
    # B read v0 too, names no version: today's behaviour, its whole content wins.
    b = write(kb, sid, "plan.md", "# Plan\nbase\nB's line\n")
    assert b.code == 0, b.err
    v2 = b.json()["version"]
    assert (notes / "plan.md").read_text().endswith("base\nB's line\n")
    newest, middle, oldest = log(kb, "notes/plan.md")["versions"]
    assert (newest["version"], newest["previous"], newest["expected"]) == (v2, v1, None)
    assert (middle["version"], middle["expected"]) == (v1, v0) and oldest["version"] == v0
    diff = kb.call("notes", "diff", "src", "notes/plan.md", "--as", "alice")
    assert diff.code == 0 and "-A's line\n" in diff.out and "+B's line\n" in diff.out, diff.out
    text = kb.call("notes", "log", "src", "notes/plan.md", "--as", "alice")
    assert text.out.splitlines()[1].endswith("unchecked"), text.out
    lost = kb.call("notes", "show", "src", "notes/plan.md", "--version", v1, "--as", "alice")
    assert lost.code == 0 and lost.out.endswith("A's line\n")


def test_bytes_written_outside_kbd_are_recorded_before_the_next_write(
    world: tuple[KbRoot, Path, str],
) -> None:
    kb, notes, sid = world
    original = (notes / "fact.md").read_bytes()  # written by the source's own agent, never recorded
    w = write(kb, sid, "fact.md", "a contributed fact\n", "--as", "alice")
    assert w.code == 0, w.err
    newest, found = log(kb, "notes/fact.md")["versions"]
    assert (found["version"], found["how"], found["principal"]) == (version(original), "found", None)
    assert (newest["previous"], newest["how"], newest["principal"], newest["workflow"], newest["session"]) == (
        version(original), "write", "alice", "con", sid,
    )  # fmt: skip


@pytest.mark.requires_bwrap
@pytest.mark.requires_landlock(abi=2)
def test_a_shell_command_under_a_write_grant_records_versions(
    world: tuple[KbRoot, Path, str], exec_mode: str
) -> None:
    """In this process's child and through the daemon's exec broker alike."""
    kb, notes, sid = world
    r = kb.cli("exec", sid, "--", "sh", "-c", 'echo first > "$WORKFLOW_KB_SRC/notes/cmd.md"')
    assert r.code == 0, r.err
    r = kb.cli("exec", sid, "--", "sh", "-c", 'echo second >> "$WORKFLOW_KB_SRC/notes/cmd.md"')
    assert r.code == 0, r.err
    # Each command's change was committed through the write path (docs/notes.md "Staged contributions"): the
    # body as the shell left it, under provenance.
    stored = (notes / "cmd.md").read_bytes()
    assert body_of(stored.decode()) == "first\nsecond\n"
    newest, first = log(kb, "notes/cmd.md")["versions"]
    assert (first["how"], first["session"], first["workflow"]) == ("command", sid, "con")
    # Who ran it: the local operator in process (her user name), uid 0's principal through the daemon.
    assert first["principal"] == ("local:root" if exec_mode == "in_process" else "ops")
    assert (newest["version"], newest["previous"], newest["how"]) == (
        version(stored),
        first["version"],
        "command",
    )
    # A command that leaves a note as it was records nothing new.
    assert kb.cli("exec", sid, "--", "sh", "-c", 'touch "$WORKFLOW_KB_SRC/notes/cmd.md"').code == 0
    assert len(log(kb, "notes/cmd.md")["versions"]) == 2
    shown = kb.call("notes", "show", "src", "notes/cmd.md", "--version", first["version"], "--as", "bob")
    assert body_of(shown.out) == "first\n"


def _blobs(kb: KbRoot) -> list[Path]:
    return [p for p in (kb.root / "state" / HISTORY_DIR).rglob("blobs/*") if not p.name.startswith(".")]


def test_retention_keeps_the_newest_versions_within_both_caps(kb: KbRoot) -> None:
    set_history(kb, max_versions=3)
    notes, sid = build(kb)
    versions = [write(kb, sid, "keep.md", f"# Keep\nedit {n}\n").json()["version"] for n in range(5)]
    kept = [v["version"] for v in log(kb, "notes/keep.md")["versions"]]
    assert kept == versions[::-1][:3]
    assert sorted(p.name for p in _blobs(kb)) == sorted(v.removeprefix("sha256:") for v in kept)
    gone = kb.call("notes", "show", "src", "notes/keep.md", "--version", versions[0], "--as", "alice")
    assert gone.code == 66 and "not in its history" in gone.err
    # A byte cap: each version is ~140 bytes, so 300 bytes keep two.
    size = len((notes / "keep.md").read_bytes())
    cfg = kb.root / "kbd.yaml"
    cfg.write_text(
        cfg.read_text().replace("max_versions: 3", f"max_versions: 50\n  max_bytes: {2 * size + 10}")
    )
    v5 = write(kb, sid, "keep.md", "# Keep\nedit 5\n").json()["version"]
    assert [v["version"] for v in log(kb, "notes/keep.md")["versions"]] == [v5, versions[-1]]
    assert len(_blobs(kb)) == 2


def test_restore_is_for_owners_audited_a_new_version_and_recreates_an_absent_note(
    world: tuple[KbRoot, Path, str],
) -> None:
    kb, notes, sid = world
    v0 = write(kb, sid, "r.md", "# R\none\n").json()["version"]
    v1 = write(kb, sid, "r.md", "# R\ntwo\n").json()["version"]
    v0_bytes = kb.call("notes", "show", "src", "notes/r.md", "--version", v0, "--as", "bob").out.encode()
    denied = kb.call("notes", "restore", "src", "notes/r.md", "--as", "alice")  # a reader of src
    assert denied.code == 77 and "only its owners or an admin" in denied.err
    assert version((notes / "r.md").read_bytes()) == v1
    done = kb.call(
        "notes", "restore", "src", "notes/r.md", "--as", "bob", "--json"
    )  # default: the one before
    assert done.code == 0, done.err
    assert done.json() == {"workflow_id": "src", "relpath": "notes/r.md", "version": v0, "previous": v1,
                           "bytes": len(v0_bytes)}  # fmt: skip
    assert (notes / "r.md").read_bytes() == v0_bytes
    newest = log(kb, "notes/r.md")["versions"][0]
    assert (newest["version"], newest["previous"], newest["how"], newest["principal"]) == (
        v0,
        v1,
        "restore",
        "bob",
    )
    (notes / "r.md").unlink()
    back = kb.call("notes", "restore", "src", "notes/r.md", "--version", v1, "--as", "ops", "--json")
    assert back.code == 0 and back.json()["previous"] is None, back.err
    assert version((notes / "r.md").read_bytes()) == v1
    events = [r for r in audit.read(kb.root / "state") if r["event"].startswith("note_restore")]
    assert [(e["event"], e.get("actor")) for e in events] == [
        ("note_restore_refused", "alice"), ("note_restored", "bob"), ("note_restored", "ops"),
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("who", "argv", "code", "says"),
    [
        ("dave", ["log", "src", "notes/x.md"], 66, "error[workflow-not-found]"),
        ("dave", ["restore", "src", "notes/x.md"], 66, "error[workflow-not-found]"),
        (
            "alice",
            ["show", "src", "notes/x.md", "--version", "sha256:abc"],
            65,
            "--version must be `sha256:`",
        ),
        ("alice", ["show", "src", "notes/x.md", "--version", "sha256:" + "a" * 64], 66, "not in its history"),
        ("alice", ["diff", "src", "notes/x.md", "--against", "v1"], 65, "--against must be"),
        ("alice", ["show", "src", "notes/never.md"], 66, "has no recorded history"),
        ("alice", ["log", "src", "context/about.md"], 65, "beneath notes/"),
        ("alice", ["log", "src", "notes/../../soul/x"], 65, "error[invalid-path]"),
        (
            "bob",
            ["restore", "src", "notes/x.md", "--version", "sha256:" + "a" * 64],
            66,
            "not in its history",
        ),
    ],
)
def test_refusals_are_clear(
    world: tuple[KbRoot, Path, str], who: str, argv: list[str], code: int, says: str
) -> None:
    kb, _, sid = world
    assert write(kb, sid, "x.md", "# X\n").code == 0
    r = kb.call("notes", *argv, "--as", who)
    assert (r.code, says in r.err) == (code, True), r.err


def test_a_bad_expected_version_writes_nothing(world: tuple[KbRoot, Path, str]) -> None:
    kb, notes, sid = world
    r = write(kb, sid, "bad.md", "x\n", "--expected-version", "sha1:1234")
    assert r.code == 65 and "--expected-version" in r.err, r.err
    assert not (notes / "bad.md").exists()
    assert not (kb.root / "state" / HISTORY_DIR).exists() or not _blobs(kb)


def _history_bytes(kb: KbRoot) -> int:
    """What the source's history keeps on disk: every blob's bytes."""
    return sum(p.stat().st_size for p in _blobs(kb))


def _big_note(n: int) -> str:
    """~900 KB of text, distinct for each n, that the injection gate lets through."""
    lines = (" ".join(hashlib.sha256(f"{n}-{i}-{j}".encode()).hexdigest()[:10] for j in range(9))
             for i in range(9_000))  # fmt: skip
    return f"# Bulk {n}\n" + "\n".join(lines) + "\n"


QUOTA = 2 << 20  # notes_quota.max_bytes in these tests: the source's history budget is twice it


def set_quota(kb: KbRoot) -> None:
    path = kb.root / "kbd.yaml"
    doc = yaml.safe_load(path.read_text())
    doc["notes_quota"] = {"max_bytes": QUOTA, "max_files": 100}
    path.write_text(yaml.safe_dump(doc))


def test_distinct_large_notes_written_and_deleted_keep_history_within_the_sources_budget(kb: KbRoot) -> None:
    """The security review's loop: distinct ~900 KB notes written, deleted,
    again and again. notes/ stays under its quota; the source's history never
    holds more than twice it (the default budget), after every write."""
    set_quota(kb)
    notes, sid = build(kb)
    written = 0
    for round_ in range(6):
        for k in range(2):
            text = _big_note(2 * round_ + k)
            r = write(kb, sid, f"bulk-{round_}-{k}.md", text)
            assert r.code == 0, r.err
            written += len(text)
            assert _history_bytes(kb) <= 2 * QUOTA, (round_, k, _history_bytes(kb))
        for k in range(2):
            (notes / f"bulk-{round_}-{k}.md").unlink()  # by the source's owner, or a granted shell command
    assert written > 2.5 * (2 * QUOTA)  # far more than the budget went through
    kept = _history_bytes(kb)
    assert 2 * QUOTA - 1_000_000 < kept <= 2 * QUOTA  # the budget is used, not more
    # The newest notes' histories are what is left, the oldest went first.
    assert log(kb, "notes/bulk-5-1.md")["versions"] and not log(kb, "notes/bulk-0-0.md")["versions"]
    # A deleted note kept can still be restored while its history lasts.
    back = kb.call("notes", "restore", "src", "notes/bulk-5-1.md", "--version",
                   log(kb, "notes/bulk-5-1.md")["versions"][0]["version"], "--as", "bob")  # fmt: skip
    assert back.code == 0, back.err
    assert (notes / "bulk-5-1.md").read_text().endswith(_big_note(11).split("\n", 2)[2])


@pytest.mark.requires_bwrap
@pytest.mark.requires_landlock(abi=2)
def test_notes_a_shell_command_writes_and_deletes_are_held_to_the_same_budget(
    kb: KbRoot, exec_mode: str
) -> None:
    """The same loop through `kbd exec` under a write grant: each command
    writes a distinct ~900 KB note and removes the previous one; the versions
    its audit records evict the deleted notes' histories."""
    set_quota(kb)
    _, sid = build(kb)
    for n in range(8):
        script = f'cat > "$WORKFLOW_KB_SRC/notes/cmd-{n}.md" && rm -f "$WORKFLOW_KB_SRC/notes/cmd-{n - 1}.md"'
        r = kb.cli("exec", sid, "--", "sh", "-c", script, input=_big_note(100 + n).encode())
        assert r.code == 0, r.err
        assert _history_bytes(kb) <= 2 * QUOTA, (n, _history_bytes(kb))
    assert log(kb, "notes/cmd-7.md")["versions"][0]["how"] == "command"
    assert not log(kb, "notes/cmd-0.md")["versions"]


@pytest.mark.parametrize(
    ("doc", "says"),
    [
        ({"note_history": {"max_versions": 0}}, "note_history.max_versions must be a whole number from 1"),
        ({"note_history": {"max_bytes": "1M"}}, "note_history.max_bytes must be a whole number"),
        ({"note_history": {"keep": 3}}, "keep"),
        ({"note_history": 5}, "note_history"),
        ({"note_history": {"source_max_bytes": -1}}, "note_history.source_max_bytes must be a whole number"),
        ({"note_history": {"deleted_days": "30d"}}, "note_history.deleted_days must be a whole number"),
    ],
)
def test_history_settings_are_checked(tmp_path: Path, doc: dict[str, Any], says: str) -> None:
    with pytest.raises(InvalidConfig) as err:
        parse_config({"host": "h", **doc}, root=tmp_path)
    assert says in err.value.message


def test_history_lives_in_state_never_in_a_source(world: tuple[KbRoot, Path, str]) -> None:
    kb, notes, sid = world
    before = sorted(p.name for p in notes.iterdir())
    write(kb, sid, "where.md", "# Where\n")
    assert sorted(p.name for p in notes.iterdir()) == sorted([*before, "where.md"])
    assert _blobs(kb) and all((kb.root / "state") in p.parents for p in _blobs(kb))

"""Read sessions under the real sandbox (docs/sessions.md, docs/sandbox.md): real shells, the real
kernel, real bubblewrap, through the real `kbd exec`.

Consumer ``con`` attaches source ``src`` (alias ``src``, access read); both are
owned by alice. A sibling ``other`` (also alice's, so the audience rule alone
would allow it) is *not* attached. Every refused write also proves that the
host tree is unchanged: names, types, modes, mtimes and bytes.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import CliResult, Entry, KbRoot, exec_mode_for, snapshot

# Real commands under bubblewrap.
# Every test runs on both exec paths: in-process and through the daemon's broker.
pytestmark = [pytest.mark.requires_bwrap, pytest.mark.usefixtures("exec_mode")]

KINDS = ("execution", "reviewer_strategic")
PRIVATE_NAMES = ("workflow.json", "soul", "learnings", "runs", "credentials")
# What the kernel says when a sandboxed command is refused (never kbd's own error[...]).
KERNEL_REFUSALS = (
    "Read-only file system",
    "Permission denied",
    "Operation not permitted",
    "Device or resource busy",
    "Invalid cross-device link",
    "No such file or directory",
    "Directory nonexistent",
)


# -- helpers ------------------------------------------------------------------------------


def open_session(kb: KbRoot, wid: str, kind: str, kb_access: str) -> dict[str, Any]:
    r = kb.call("session", "open", wid, "--kind", kind, "--kb-access", kb_access, "--as", "alice", "--json")
    assert r.code == 0, r.err
    doc: dict[str, Any] = r.json()
    return doc


def sh(kb: KbRoot, sid: str, script: str) -> CliResult:
    return kb.cli("exec", sid, "--", "sh", "-c", script)


def env_of(r: CliResult) -> dict[str, str]:
    assert r.code == 0, r.err
    return dict(line.split("=", 1) for line in r.out.splitlines() if "=" in line)


def assert_kernel_refused(r: CliResult) -> None:
    """The command ran (kbd did not refuse it) and the kernel refused the operation."""
    assert r.code != 0, f"expected a refusal, got exit 0: {r.out!r}"
    assert "error[" not in r.err, f"kbd itself refused instead of the sandbox: {r.err}"
    assert any(m in r.err for m in KERNEL_REFUSALS), r.err


@dataclass(frozen=True)
class ReadWorld:
    kb: KbRoot
    src: Path
    con: Path
    other: Path
    kb_path: Path  # the source KB's canonical path, as announced in WORKFLOW_KB_SRC
    sids: dict[str, str]  # kind -> session id (kb_access read)

    def watched(self) -> dict[str, dict[str, Entry]]:
        """Host state, after checking that the fixture's files are still intact
        (so an earlier leak cannot make a later refusal pass vacuously)."""
        kb = self.src / "knowledgebase"
        assert (kb / "notes" / "fact.md").read_bytes() == b"src\n"
        assert (kb / "context" / "about.md").read_bytes() == b"about src\n"
        assert (self.src / "soul" / "persona.md").read_bytes() == b"soul-of-src\n"
        assert (self.other / "knowledgebase" / "notes" / "fact.md").read_bytes() == b"other\n"
        assert KbRoot.read_manifest(self.con)["knowledgebase_sources"][0]["workflow_id"] == "src"
        assert (self.con / "replacement.json").is_file()
        return {"src": snapshot(self.src), "con": snapshot(self.con), "other": snapshot(self.other)}


def build(kb: KbRoot) -> tuple[Path, Path, Path]:
    team = {"owners": ["alice"]}
    src = kb.workflow("src", access=team)
    other = kb.workflow("other", access=team)
    con = kb.workflow("con", access=team, sources=[{"workflow_id": "src", "alias": "src", "access": "read"}])
    (src / "soul" / "persona.md").write_text("soul-of-src\n")
    (other / "soul" / "persona.md").write_text("soul-of-other\n")
    (con / "replacement.json").write_text('{"id": "con", "knowledgebase_sources": []}\n')
    return src, con, other


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, exec_mode: str) -> Iterator[ReadWorld]:
    """One root for the checks that change no configuration. Each test compares the
    host before and after its own command, so a leak in one test cannot hide in another."""
    kb = KbRoot.create(tmp_path_factory.mktemp("sandbox-read") / "root")
    src, con, other = build(kb)
    sids: dict[str, str] = {}
    kb_path: Path | None = None
    for kind in KINDS:
        doc = open_session(kb, "con", kind, "read")
        sids[kind] = doc["session_id"]
        assert doc["env"]["WORKFLOW_KB_ACCESS"] == "read"
        kb_path = Path(doc["env"]["WORKFLOW_KB_SRC"])
    assert kb_path is not None and kb_path == (src / "knowledgebase").resolve()
    with exec_mode_for(kb, exec_mode):
        yield ReadWorld(kb, src, con, other, kb_path, sids)


# -- the source KB is readable ------------------------------------------------------------


READS: dict[str, tuple[str, str]] = {
    "cat": ('cat "$WORKFLOW_KB_SRC/notes/fact.md"', "src\n"),
    "cat-context": ('cat "$WORKFLOW_KB_SRC/context/about.md"', "about src\n"),
    "grep": ('grep -rn src "$WORKFLOW_KB_SRC/notes"', "fact.md:1:src"),
    "ls": ('ls "$WORKFLOW_KB_SRC/notes"', "_index.json\nfact.md\n"),
}


@pytest.mark.parametrize("case", sorted(READS))
@pytest.mark.parametrize("kind", KINDS)
def test_source_kb_is_readable(world: ReadWorld, kind: str, case: str) -> None:
    script, expected = READS[case]
    r = sh(world.kb, world.sids[kind], script)
    assert r.code == 0, r.err
    if case == "grep":
        assert expected in r.out
    else:
        assert r.out == expected


# -- ... and read-only --------------------------------------------------------------------


SOURCE_WRITES = {
    "overwrite": 'echo x > "$WORKFLOW_KB_SRC/notes/fact.md"',
    "append": 'echo x >> "$WORKFLOW_KB_SRC/notes/fact.md"',
    "truncate": ': > "$WORKFLOW_KB_SRC/notes/fact.md"',
    "new-file": 'echo x > "$WORKFLOW_KB_SRC/notes/new.md"',
    "rm": 'rm -f "$WORKFLOW_KB_SRC/notes/fact.md"',
    "mv": 'mv "$WORKFLOW_KB_SRC/notes/fact.md" "$WORKFLOW_KB_SRC/notes/moved.md"',
    "mkdir": 'mkdir "$WORKFLOW_KB_SRC/notes/sub"',
    "chmod": 'chmod 666 "$WORKFLOW_KB_SRC/notes/fact.md"',
    "context": 'echo x > "$WORKFLOW_KB_SRC/context/about.md"',
    "kb-root": 'echo x > "$WORKFLOW_KB_SRC/new.md"',
}


@pytest.mark.parametrize("case", sorted(SOURCE_WRITES))
@pytest.mark.parametrize("kind", KINDS)
def test_writes_into_a_read_source_fail_and_leave_the_host_unchanged(
    world: ReadWorld, kind: str, case: str
) -> None:
    before = world.watched()
    r = sh(world.kb, world.sids[kind], SOURCE_WRITES[case])
    assert_kernel_refused(r)
    assert world.watched() == before
    assert (world.src / "knowledgebase" / "notes" / "fact.md").read_bytes() == b"src\n"
    assert not (world.src / "knowledgebase" / "notes" / "new.md").exists()


# -- the source's private folders stay invisible ------------------------------------------


@pytest.mark.parametrize("target", ["workflow.json", "soul/persona.md", "credentials/token"])
@pytest.mark.parametrize("kind", KINDS)
def test_source_private_files_are_unreadable(world: ReadWorld, kind: str, target: str) -> None:
    before = world.watched()
    for path in (world.src / target, world.kb_path / ".." / target):
        r = sh(world.kb, world.sids[kind], f"cat {shlex.quote(str(path))}")
        assert_kernel_refused(r)
        assert r.out == ""
    assert world.watched() == before


@pytest.mark.parametrize("kind", KINDS)
def test_source_workflow_folder_listing_reveals_nothing_private(world: ReadWorld, kind: str) -> None:
    """bwrap must create the KB's parent folders as bare mount points inside the
    sandbox, so the folder may exist there; it must never show the host's entries."""
    r = sh(world.kb, world.sids[kind], f"ls -A {shlex.quote(str(world.src))}")
    listed = set(r.out.split())
    assert r.code != 0 or listed <= {"knowledgebase"}, (r.code, r.out, r.err)
    for name in PRIVATE_NAMES:
        assert name not in listed
    for name in ("persona.md", "token", "secret-src"):
        assert name not in r.out


# -- unattached siblings ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "script",
    [
        "cat {other}/knowledgebase/notes/fact.md",
        "ls -A {other}/knowledgebase",
        "cat {other}/credentials/token",
        "cat {other}/soul/persona.md",
    ],
    ids=["cat-note", "ls-kb", "cat-token", "cat-soul"],
)
@pytest.mark.parametrize("kind", KINDS)
def test_an_unattached_sibling_is_unreadable(world: ReadWorld, kind: str, script: str) -> None:
    before = world.watched()
    r = sh(world.kb, world.sids[kind], script.format(other=shlex.quote(str(world.other))))
    assert_kernel_refused(r)
    assert r.out == ""
    assert world.watched() == before


# -- the consumer's own workflow.json -------------------------------------------------------


MANIFEST_WRITES = {
    "append": "echo x >> workflow.json",
    "truncate": ": > workflow.json",
    "rm": "rm -f workflow.json",
    "mv-away": "mv workflow.json moved.json",
    "mv-over": "mv replacement.json workflow.json",
    "chmod": "chmod 600 workflow.json",
}


@pytest.mark.parametrize("case", sorted(MANIFEST_WRITES))
@pytest.mark.parametrize("kind", KINDS)
def test_own_workflow_json_cannot_be_modified(world: ReadWorld, kind: str, case: str) -> None:
    manifest = (world.con / "workflow.json").read_bytes()
    before = world.watched()
    r = sh(world.kb, world.sids[kind], MANIFEST_WRITES[case])
    assert_kernel_refused(r)
    assert (world.con / "workflow.json").read_bytes() == manifest
    assert not (world.con / "moved.json").exists()
    assert world.watched() == before


# -- kb_access none ----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_kb_access_none_sees_no_knowledge_base(world: ReadWorld, kind: str) -> None:
    doc = open_session(world.kb, "con", kind, "none")
    sid = doc["session_id"]
    assert doc["env"] == {"WORKFLOW_KB_ACCESS": "none"}

    env = env_of(world.kb.cli("exec", sid, "--", "env"))
    assert {k: v for k, v in env.items() if k.startswith("WORKFLOW_KB_")} == {"WORKFLOW_KB_ACCESS": "none"}

    before = world.watched()
    # The source KB (its canonical path, known from another session) is not there.
    r = sh(world.kb, sid, f"cat {shlex.quote(str(world.kb_path / 'notes' / 'fact.md'))}")
    assert_kernel_refused(r)
    assert r.out == ""
    r = sh(world.kb, sid, f"ls -A {shlex.quote(str(world.kb_path))}")
    assert_kernel_refused(r)
    assert r.out == ""

    # The consumer's own knowledgebase/ is an empty, read-only stand-in.
    r = sh(world.kb, sid, "ls -A knowledgebase")
    assert r.code == 0, r.err
    assert r.out == ""
    r = sh(world.kb, sid, "cat knowledgebase/notes/fact.md")
    assert_kernel_refused(r)
    assert r.out == ""
    r = sh(world.kb, sid, "echo x > knowledgebase/planted.md")
    assert_kernel_refused(r)
    assert world.watched() == before


# -- detaching on disk takes effect at the next command ----------------------------------------


def test_detach_on_disk_cuts_reads_at_the_next_exec(kb: KbRoot) -> None:
    _, con, _ = build(kb)
    sid = open_session(kb, "con", "execution", "read")["session_id"]
    env = env_of(kb.cli("exec", sid, "--", "env"))
    cached = env["WORKFLOW_KB_SRC"]
    fact = shlex.quote(f"{cached}/notes/fact.md")
    r = sh(kb, sid, f"cat {fact}")
    assert (r.code, r.out) == (0, "src\n"), r.err

    # Hand-edit the consumer's manifest (as a user with an editor would): no kbd involved.
    doc = kb.read_manifest(con)
    doc["knowledgebase_sources"] = [s for s in doc["knowledgebase_sources"] if s["alias"] != "src"]
    kb.write_manifest(con, doc)

    r = sh(kb, sid, f"cat {fact}")
    assert_kernel_refused(r)
    assert r.out == ""
    r = sh(kb, sid, f"ls -A {shlex.quote(cached)}")
    assert_kernel_refused(r)
    assert r.out == ""
    env = env_of(kb.cli("exec", sid, "--", "env"))
    assert "WORKFLOW_KB_SRC" not in env
    assert env["WORKFLOW_KB_ACCESS"] == "read"

"""Names (docs/access.md "Names"): one rule for every RELPATH kbd accepts — ``kbd read``,
``kbd ls``, ``kbd check``, ``kbd notes write`` — through the real CLI, the real
daemon's API and the library, and ``check --mode write`` below a source's
``notes/`` agreeing with ``notes write`` on every name (a hypothesis property).

Refused everywhere: C0/C1 control characters and DEL (a name would forge lines
in listings, agent context and logs) and backslashes (other platforms read a
separator). A trailing ``/`` names a folder: ``notes/fact.md/`` is ENOTDIR.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given

from kbd.errors import KbdError
from kbd.service import notes as note_ops
from kbd.service import sessions as session_ops
from kbd.service.sessions import RootSessions
from tests.helpers import OPERATOR, KbRoot, snapshot
from tests.integration.daemon import Daemon, issue_tokens, serving
from tests.strategies import note_relpaths

#: name → (what the error must say). Each one is refused by every entry point.
BAD_NAMES: dict[str, tuple[str, str]] = {
    "newline": ("evil\nWORKFLOW_KB_X=1.md", "U+000A"),
    "carriage-return": ("a\r.md", "U+000D"),
    "escape": ("a\x1b[31m.md", "U+001B"),
    "del": ("a\x7f.md", "U+007F"),
    "c1-nel": ("a\x85.md", "U+0085"),
    "c1-csi": ("a\x9b.md", "U+009B"),
    "backslash": ("a\\b.md", "backslash"),
    "backslash-traversal": ("..\\..\\soul\\x.md", "backslash"),
}


@dataclass
class Names:
    kb: KbRoot
    src: Path
    sid: str

    @property
    def notes(self) -> Path:
        return self.src / "knowledgebase" / "notes"


@pytest.fixture
def names(kb: KbRoot) -> Names:
    """``src`` (bob's) lets ``con`` (alice's) write; alice's execution session writes."""
    src = kb.workflow("src", access={"owners": ["bob"], "readers": ["alice"], "allowed_kb_writers": ["con"]})
    kb.workflow(
        "con",
        access={"owners": ["alice"]},
        sources=[{"workflow_id": "src", "alias": "src", "access": "write"}],
    )
    n = Names(kb, src, kb.open_session("con", kind="execution", kb_access="read-write", actor="alice"))
    # Files with such names may already exist (a shell wrote them): still refused.
    for name, _ in BAD_NAMES.values():
        if "/" not in name:
            (n.notes / name).write_text("planted\n")
    return n


# -- through the CLI ----------------------------------------------------------------------
# The tables run kbd's entry point in this process (KbRoot.call); the trailing-slash and
# escaped-listing tests below run the real `kbd` subprocess.


@pytest.mark.parametrize("case", sorted(BAD_NAMES))
def test_cli_refuses_bad_names_everywhere(names: Names, case: str) -> None:
    name, why = BAD_NAMES[case]
    kb = names.kb
    before = snapshot(kb.root, skip=("state",))
    runs = {
        "read": kb.call("read", "con", "src", f"notes/{name}", "--as", "alice"),
        "ls": kb.call("ls", "con", "src", f"notes/{name}", "--as", "alice"),
        "notes write": kb.call("notes", "write", names.sid, "src", name, input=b"a note\n"),
    }
    for what, r in runs.items():
        assert r.code == 65, (what, r.code, r.out, r.err)
        first = r.err.splitlines()[0]
        assert first.startswith("error[invalid-path]:") and why in first, (what, r.err)
        assert r.out == "", what
    for mode in ("read", "write"):
        r = kb.call("check", names.sid, str(names.notes.resolve() / name), "--mode", mode, "--json")
        assert r.code == 77, (mode, r.err)
        assert r.json()["allowed"] is False and why in r.json()["reason"], (mode, r.out)
    assert snapshot(kb.root, skip=("state",)) == before


def test_cli_trailing_slash_on_a_file_is_refused_not_read(names: Names) -> None:
    kb = names.kb
    for rel in ("notes/fact.md/", "notes/fact.md/.", "notes/fact.md//"):
        r = kb.cli("read", "con", "src", rel, "--as", "alice")
        assert (r.code, r.out) == (66, ""), (rel, r.err)
        assert r.err.startswith("error[path-not-found]") and "folder" in r.err, r.err
    r = kb.cli("notes", "write", names.sid, "src", "fact.md/", input=b"x\n")
    assert r.code == 65 and "ends with '/'" in r.err, r.err
    fact = str(names.notes.resolve() / "fact.md")
    for mode in ("read", "write"):
        r = kb.cli("check", names.sid, fact + "/", "--mode", mode, "--json")
        assert r.code == 77 and r.json()["allowed"] is False, (mode, r.out)
        assert kb.cli("check", names.sid, fact, "--mode", mode).code == 0, mode
    # A folder keeps working with or without the slash.
    assert kb.cli("ls", "con", "src", "notes/", "--as", "alice").code == 0


@pytest.mark.parametrize("name", ["_INDEX.json", "_Index.JSON", "\uff3findex.json", "sub/_INDEX.json"])
def test_cli_check_write_refuses_what_notes_write_refuses(names: Names, name: str) -> None:
    """Before: `kbd check --mode write` allowed notes/_INDEX.json, which notes write refuses."""
    kb = names.kb
    (names.notes / "sub").mkdir(exist_ok=True)
    r = kb.call("check", names.sid, str(names.notes.resolve() / name), "--mode", "write", "--json")
    assert r.code == 77, r.out
    assert (
        r.json() == {"allowed": False, "reason": r.json()["reason"]} and "_index.json" in r.json()["reason"]
    )
    w = kb.call("notes", "write", names.sid, "src", name, input=b"{}\n")
    assert w.code == 77 and "_index.json" in w.err


def test_cli_ls_still_shows_odd_names_escaped(names: Names) -> None:
    """Listing a folder is allowed; odd names in it are shown escaped, one per line."""
    r = names.kb.cli("ls", "con", "src", "notes", "--as", "alice")
    assert r.code == 0, r.err
    assert "evil\\nWORKFLOW_KB_X=1.md" in r.out and "\nWORKFLOW_KB_X" not in r.out


# -- the property: check(write) and notes write agree on every name --------------------------


def _reset(notes: Path, keep: set[str]) -> None:
    for entry in os.listdir(notes):
        if entry not in keep:
            path = notes / entry
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()


@given(rel=note_relpaths())
def test_check_write_and_notes_write_agree_on_names(kb: KbRoot, rel: str) -> None:
    if not (kb.workflows / "src").exists():
        kb.workflow("src", access={"owners": ["bob"], "readers": ["alice"], "allowed_kb_writers": ["con"]})
        kb.workflow(
            "con",
            access={"owners": ["alice"]},
            sources=[{"workflow_id": "src", "alias": "src", "access": "write"}],
        )
        (kb.workflows / "src" / "knowledgebase" / "notes" / "sub").mkdir()
    notes = kb.workflows / "src" / "knowledgebase" / "notes"
    sessions = RootSessions(kb.host())
    plan = session_ops.open_session(
        sessions, "con", actor=sessions.host.actor("alice"), kind="execution", kb_access="read-write"
    )
    sid = str(plan.session_id)
    try:
        checked = session_ops.check(
            sessions, sid, f"{notes.resolve()}/{rel}", "write", actor=OPERATOR
        ).to_json()
        try:
            note_ops.write(sessions, sid, "src", rel, b"a note\n", actor=OPERATOR)
            written: str | None = None
        except KbdError as err:
            written = f"{err.code}: {err.message}"
        assert checked["allowed"] is (written is None), (rel, checked, written)
    finally:
        # Each example starts from the same tree: a folder left by an earlier one
        # (`sub/a.md/x.md`) would turn a name question into a file-type one.
        _reset(notes / "sub", set())
        _reset(notes, {"fact.md", "_index.json", "sub"})


# -- through the real daemon's API ----------------------------------------------------------


@dataclass
class Api:
    names: Names
    daemon: Daemon
    client: httpx.Client


@pytest.fixture
def api(names: Names, tmp_path: Path) -> Iterator[Api]:
    tokens = issue_tokens(names.kb.root, ["alice"])
    with serving(names.kb.root, home=tmp_path / "home") as daemon:
        client = daemon.client(tokens["alice"])
        try:
            yield Api(names, daemon, client)
        finally:
            client.close()


def _error(r: httpx.Response, status: int, code: str) -> str:
    assert r.status_code == status, (r.status_code, r.text)
    err: dict[str, Any] = r.json()["error"]
    assert err["code"] == code, err
    message: str = err["message"]
    return message


def test_api_refuses_bad_names_everywhere(api: Api) -> None:
    n, c = api.names, api.client
    before = snapshot(n.kb.root, skip=("state",))
    base = "/v1/workflows/con/sources/src"
    for case, (name, why) in sorted(BAD_NAMES.items()):
        assert why in _error(c.get(f"{base}/file", params={"path": f"notes/{name}"}), 400, "invalid-path"), (
            case
        )
        assert why in _error(c.get(f"{base}/dir", params={"path": f"notes/{name}"}), 400, "invalid-path"), (
            case
        )
        r = c.post(f"/v1/sessions/{n.sid}/notes", json={"alias": "src", "path": name, "content": "a note\n"})
        assert why in _error(r, 400, "invalid-path"), case
        for mode in ("read", "write"):
            r = c.post(
                f"/v1/sessions/{n.sid}/check", json={"path": f"{n.notes.resolve()}/{name}", "mode": mode}
            )
            assert r.status_code == 200 and r.json()["allowed"] is False and why in r.json()["reason"], (
                case,
                r.text,
            )
    assert snapshot(n.kb.root, skip=("state",)) == before


def test_api_trailing_slash_and_index_lookalike(api: Api) -> None:
    n, c = api.names, api.client
    r = c.get("/v1/workflows/con/sources/src/file", params={"path": "notes/fact.md/"})
    _error(r, 404, "path-not-found")
    assert c.get("/v1/workflows/con/sources/src/file", params={"path": "notes/fact.md"}).status_code == 200
    r = c.post(
        f"/v1/sessions/{n.sid}/check", json={"path": f"{n.notes.resolve()}/_INDEX.json", "mode": "write"}
    )
    assert r.status_code == 200 and r.json()["allowed"] is False, r.text
    r = c.post(f"/v1/sessions/{n.sid}/notes", json={"alias": "src", "path": "_INDEX.json", "content": "{}"})
    _error(r, 403, "permission-denied")

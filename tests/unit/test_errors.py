"""The error tree (kbd/errors/__init__.py): complete, consistent, drawn correctly, and
translated at its choke points (docs/cli.md "Exit codes").

- Every KbdError subclass anywhere in kbd is defined in kbd.errors, has a
  unique kebab-case code (a subclass that defines none is a transport variant
  of its parent and keeps its exit code), an exit code from docs/cli.md "Exit codes", an HTTP
  status of the right class, and a row in the docstring's tree that states
  exactly its exit code, status and code.
- A full disk is ``no-space`` (75), never "permission denied": on a real tmpfs
  whose blocks or inodes are exhausted, during a real note write.
"""

from __future__ import annotations

import ast
import errno
import importlib
import json
import os
import pkgutil
import re
import sqlite3
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

import kbd
from kbd import errors
from kbd.errors import (
    REASON_ERRORS,
    Busy,
    KbdError,
    NoSpace,
    NotFound,
    PathNotFound,
    PathRefused,
    PermissionDenied,
    SourceUnavailable,
    SourceUnusable,
    StateCorrupt,
    from_oserror,
)
from kbd.service import notes as note_ops
from kbd.service import sessions as session_ops
from kbd.service.sessions import RootSessions
from kbd.state import audit
from tests.helpers import OPERATOR, KbRoot, snapshot

CONTRACT_EXIT_CODES = {2, 65, 66, 69, 70, 75, 77}  # docs/cli.md, less 0 (success is not an error)
KEBAB = re.compile(r"^[a-z]+(-[a-z]+)*$")
TREE_ROW = re.compile(r"^\s{4}[│├└─ ]*([A-Z][A-Za-z]+)\s+(\d+)\s+(\d{3})\s+([a-z-]+)(?:\s|$)")


def _all_modules() -> None:
    """Import every kbd module, so classes defined anywhere are seen."""
    for info in pkgutil.walk_packages(kbd.__path__, "kbd."):
        if info.name != "kbd.__main__":  # it runs the CLI
            importlib.import_module(info.name)


def _subclasses(cls: type[KbdError]) -> Iterator[type[KbdError]]:
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def _tree() -> dict[str, tuple[int, int, str]]:
    assert errors.__doc__ is not None
    rows: dict[str, tuple[int, int, str]] = {}
    for line in errors.__doc__.splitlines():
        m = TREE_ROW.match(line)
        if m:
            name, exit_code, status, code = m.groups()
            assert name not in rows, f"{name} is drawn twice"
            rows[name] = (int(exit_code), int(status), code)
    return rows


_all_modules()
ALL: list[type[KbdError]] = [KbdError, *_subclasses(KbdError)]


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.__name__)
def test_every_error_class_lives_in_the_tree(cls: type[KbdError]) -> None:
    assert cls.__module__ == "kbd.errors", f"{cls.__name__} is defined in {cls.__module__}, not kbd.errors"
    assert KEBAB.fullmatch(cls.code), cls.code
    assert cls.exit_code in CONTRACT_EXIT_CODES, cls.exit_code
    status = cls.http_status
    assert isinstance(status, int) and 400 <= status < 600, status
    # The caller's fault (usage, input, not found, denied) is 4xx; a bug is 5xx.
    if cls.exit_code in (2, 65, 66, 77):
        assert status < 500, (cls.__name__, status)
    if cls.exit_code == 70:
        assert status >= 500, (cls.__name__, status)
    if "code" not in cls.__dict__:
        # A transport variant of its parent: same code, same exit code.
        parent = cls.__mro__[1]
        assert issubclass(parent, KbdError) and parent.exit_code == cls.exit_code, cls.__name__
    drawn = _tree().get(cls.__name__)
    assert drawn is not None, f"{cls.__name__} is missing from the tree drawn in kbd/errors/__init__.py"
    assert drawn == (cls.exit_code, cls.http_status, cls.code), f"{cls.__name__} is drawn as {drawn}"


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.__name__)
def test_every_error_has_one_http_answer(cls: type[KbdError]) -> None:
    """The daemon's routes, body limit and connection layer all answer through
    http_answer: the class's status, the envelope, Retry-After only where a
    retry soon can succeed."""
    err = cls.__new__(cls)
    KbdError.__init__(err, "m", hint="h")
    status, body, headers = errors.http_answer(err)
    assert (status, body) == (cls.http_status, {"error": {"code": cls.code, "message": "m", "hint": "h"}})
    retry = issubclass(cls, errors.Busy) and not issubclass(cls, errors.VersionConflict)
    assert headers == ({"Retry-After": "1"} if retry else {}), cls.__name__


def test_an_answer_quoting_text_that_is_not_unicode_is_still_encodable() -> None:
    """A message may quote what a client sent; a lone surrogate (a JSON
    ``\\ud800`` escape) is shown as its escape, so the answer can be encoded
    (it was an unencodable envelope, a 500, before; docs/api.md "Errors")."""
    _, body, _ = errors.http_answer(errors.InvalidInput("no workflow a\ud800b", hint="h\udfff"))
    assert body["error"]["message"] == "no workflow a\\ud800b" and body["error"]["hint"] == "h\\udfff"
    assert json.dumps(body, ensure_ascii=False).encode("utf-8")


def test_only_the_boundaries_build_error_answers() -> None:
    """The envelope is built in kbd/errors/ only (admin's `validate --json`
    report embeds one error as data); no interface builds its own."""
    package = Path(errors.__file__).parent.parent
    builders = {
        p.relative_to(package).as_posix() for p in package.rglob("*.py") if "to_dict()" in p.read_text()
    }
    assert builders == {"errors/__init__.py", "service/admin.py"}


def test_codes_are_unique_and_the_tree_has_no_stale_rows() -> None:
    owners: dict[str, str] = {}
    for cls in ALL:
        if "code" in cls.__dict__:
            assert cls.code not in owners, f"{cls.__name__} and {owners[cls.code]} share {cls.code!r}"
            owners[cls.code] = cls.__name__
    names = {cls.__name__ for cls in ALL}
    assert set(_tree()) == names, set(_tree()) ^ names


@pytest.mark.parametrize("reason", ["not_found", "audience_denied", "invalid_entry", "kb_missing"])
def test_one_reason_table_sets_exit_code_and_status(reason: str) -> None:
    like = REASON_ERRORS.get(reason)
    for err in (SourceUnusable("x", reason=reason), SourceUnavailable("x", reason=reason)):
        expected = (
            (like.exit_code, like.http_status) if like else (type(err).exit_code, type(err).http_status)
        )
        assert (err.exit_code, err.http_status, err.reason) == (*expected, reason)
        assert err.exit_code in CONTRACT_EXIT_CODES
    assert (REASON_ERRORS["not_found"], REASON_ERRORS["audience_denied"]) == (NotFound, PermissionDenied)


@pytest.mark.parametrize(
    ("code", "cls"),
    [
        (errno.ENOSPC, NoSpace),
        (errno.EDQUOT, NoSpace),
        (errno.EACCES, PermissionDenied),
        (errno.EPERM, PermissionDenied),
        (errno.ENOENT, NotFound),
        (errno.ENOTDIR, PathNotFound),
        (errno.ELOOP, PathRefused),
        (errno.EAGAIN, Busy),
        (errno.EIO, KbdError),
    ],
)
def test_from_oserror(code: int, cls: type[KbdError]) -> None:
    err = from_oserror(OSError(code, os.strerror(code), "/host/secret/path"), what="write 'a.md'")
    assert type(err) is cls
    assert err.message == f"cannot write 'a.md': {os.strerror(code)}"
    assert "/host" not in err.message  # the OS's file name is never repeated


def test_from_sqlite_on_real_databases(tmp_path: Path) -> None:
    from kbd.state.sqlite import from_sqlite

    db = tmp_path / "s.db"
    holder = sqlite3.connect(db, isolation_level=None)
    holder.execute("CREATE TABLE t (x BLOB)")
    holder.execute("BEGIN IMMEDIATE")
    other = sqlite3.connect(db, timeout=0, isolation_level=None)
    with pytest.raises(sqlite3.OperationalError) as locked:
        other.execute("BEGIN IMMEDIATE")
    assert type(from_sqlite(locked.value)) is Busy
    holder.execute("ROLLBACK")
    # A database that may not grow: SQLITE_FULL, the disk-full answer.
    holder.execute("PRAGMA max_page_count = 2")
    with pytest.raises(sqlite3.OperationalError) as full:
        holder.execute("INSERT INTO t VALUES (zeroblob(100000))")
    assert type(from_sqlite(full.value)) is NoSpace
    holder.close()
    other.close()
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"this is not a database" * 100)
    with pytest.raises(sqlite3.DatabaseError) as corrupt:
        sqlite3.connect(junk).execute("SELECT * FROM sqlite_master")
    assert type(from_sqlite(corrupt.value)) is StateCorrupt


# -- a full disk during a note write ------------------------------------------------------------


@pytest.fixture
def small_disk(kb: KbRoot) -> Iterator[Path]:
    """A real, tiny tmpfs (256 KiB, 64 inodes) mounted inside the root's workflows."""
    if os.geteuid() != 0:
        pytest.fail("mounting the test's tmpfs needs root (the suite runs as root)")
    disk = kb.workflows / "disk"
    disk.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k,nr_inodes=64,mode=0755", "kbd-test", str(disk)],
                   check=True)  # fmt: skip
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=True)


def _world(kb: KbRoot, disk: Path) -> tuple[RootSessions, str, Path]:
    """Source ``src`` on the small disk, writable by ``con`` (alice's); an open session of ``con``."""
    src = kb.workflow("src", folder="disk/src",
                      access={"owners": ["bob"], "readers": ["alice"], "allowed_kb_writers": ["con"]})  # fmt: skip
    kb.workflow("con", access={"owners": ["alice"]},
                sources=[{"workflow_id": "src", "alias": "src", "access": "write"}])  # fmt: skip
    sessions = RootSessions(kb.host())
    plan = session_ops.open_session(
        sessions, "con", actor=sessions.host.actor("alice"), kind="execution", kb_access="read-write"
    )
    sid = plan.session_id
    assert sid is not None
    assert src.is_relative_to(disk)
    return sessions, sid, src / "knowledgebase" / "notes"


def _fill_blocks(disk: Path) -> None:
    fd = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)


def _fill_inodes(disk: Path) -> None:
    for i in range(1000):
        try:
            (disk / f"inode-{i}").touch()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
            return
    raise AssertionError("the tmpfs never ran out of inodes")


def _refused_for_space(sessions: RootSessions, sid: str, relpath: str) -> KbdError:
    seen = len(audit.read(sessions.host.config.state_dir))
    with pytest.raises(KbdError) as info:
        note_ops.write(sessions, sid, "src", relpath, b"a note\n", actor=OPERATOR)
    err = info.value
    assert (err.code, err.exit_code, err.http_status) == ("no-space", 75, 507), (err.code, err.message)
    assert not isinstance(err, PermissionDenied)
    assert "No space left on device" in err.message and "permission" not in err.message.lower()
    events = [e for e in audit.read(sessions.host.config.state_dir)[seen:] if e["event"].startswith("note_")]
    assert [(e["event"], e["code"]) for e in events] == [("note_refused", "no-space")]
    return err


@pytest.mark.parametrize("relpath", ["new.md", "sub/deeper/new.md"])
def test_out_of_inodes_is_no_space_not_permission_denied(kb: KbRoot, small_disk: Path, relpath: str) -> None:
    sessions, sid, _ = _world(kb, small_disk)
    _fill_inodes(small_disk)
    before = snapshot(kb.root, skip=("state",))
    _refused_for_space(sessions, sid, relpath)
    assert snapshot(kb.root, skip=("state",)) == before, "a refused write changed the host"


def test_out_of_blocks_is_no_space_not_permission_denied(kb: KbRoot, small_disk: Path) -> None:
    sessions, sid, notes = _world(kb, small_disk)
    _fill_blocks(small_disk)
    names = sorted(os.listdir(notes))
    _refused_for_space(sessions, sid, "new.md")
    assert sorted(os.listdir(notes)) == names  # no note, no temp file left behind
    # The same through the real CLI: the error line and exit 75.
    r = kb.cli("notes", "write", sid, "src", "other.md", "--file", "-", input=b"a note\n")
    assert r.code == 75 and r.err.startswith("error[no-space]: "), r.err
    assert "permission" not in r.err.lower()
    # Space freed: the same write succeeds.
    (small_disk / "filler").unlink()
    assert note_ops.write(sessions, sid, "src", "new.md", b"a note\n", actor=OPERATOR).path == "notes/new.md"


def _constructions(package: Path, names: set[str]) -> dict[str, set[str]]:
    """Class name of ``names`` → the modules of ``package`` that construct it
    (``X(…)`` or ``errors.X(…)``). Inside the package's errors.py a
    construction counts only in a function some other module calls (the
    translators and the not-found answers), never in a helper nobody uses."""
    trees = {p.relative_to(package).as_posix(): ast.parse(p.read_text()) for p in package.rglob("*.py")}

    def called(node: ast.Call) -> str | None:
        f = node.func
        return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None

    outside_calls = {
        called(n) for rel, tree in trees.items() if rel != "errors.py"
        for n in ast.walk(tree) if isinstance(n, ast.Call)
    }  # fmt: skip
    found: dict[str, set[str]] = {}
    for rel, tree in trees.items():
        scopes: list[ast.AST] = [tree]
        if rel == "errors.py":
            scopes = [f for f in tree.body if isinstance(f, ast.FunctionDef) and f.name in outside_calls]
        for scope in scopes:
            for node in ast.walk(scope):
                if isinstance(node, ast.Call) and (name := called(node)) in names:
                    found.setdefault(name, set()).add(rel)
    return found


CONSTRUCTED = _constructions(Path(kbd.__file__).parent, {cls.__name__ for cls in ALL})


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.__name__)
def test_every_error_class_is_raised_somewhere_in_kbd(cls: type[KbdError]) -> None:
    """A class of the tree that nothing in kbd/ constructs is a code no user can
    ever see (as AudienceDenied was, while audience refusals answered as
    PermissionDenied): remove it, or raise it where it applies."""
    assert CONSTRUCTED.get(cls.__name__), f"nothing in kbd/ raises {cls.__name__}"


def test_the_raise_scan_counts_only_real_constructions(tmp_path: Path) -> None:
    (tmp_path / "errors.py").write_text(
        "class Used(Exception): ...\nclass Helper(Exception): ...\nclass Dead(Exception): ...\n"
        "class Defined(Exception): ...\n"
        "def translate(): return Helper('x')\ndef unused(): return Dead('x')\n"
    )
    (tmp_path / "ops.py").write_text(
        "import errors\nfrom errors import Used, translate\n"
        "def op():\n    translate()\n    raise errors.Used('x')\n"
    )
    found = _constructions(tmp_path, {"Used", "Helper", "Dead", "Defined"})
    assert found == {"Used": {"ops.py"}, "Helper": {"errors.py"}}


def test_docs_errors_lists_every_code_as_the_tree_declares_it() -> None:
    """docs/errors.md's table is the error tree's own (code, class, parent, exit code, HTTP status,
    hint): a new class, a changed code or hint fails here until the document says it too."""
    from kbd.errors.render import reference_rows

    doc = (Path(__file__).parents[2] / "docs" / "errors.md").read_text()
    table = doc.split("<!-- error-table:", 1)[1].split("<!-- /error-table -->", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    assert rows == reference_rows(), "regenerate the table: kbd.errors.render.reference_rows()"
    codes = {line.split("`")[1] for line in rows}
    assert {
        "internal",
        "usage",
        "invalid-input",
        "not-found",
        "permission-denied",
        "note-version-conflict",
    } <= codes

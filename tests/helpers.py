"""Test helpers: build roots and workflows on disk, run the real CLI."""

from __future__ import annotations

import contextlib
import os
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import yaml

from kbd.core.principals import LocalOperator
from kbd.fs.rootinit import init_root
from kbd.service.root import Root
from tests.waiting import wait_for

# The trusted local operator, as the CLI creates it for session commands.
OPERATOR = LocalOperator.current()

PRINCIPALS: list[dict[str, Any]] = [
    {"id": "alice"},
    {"id": "bob"},
    {"id": "carol"},
    {"id": "dave"},
    {"id": "ops", "admin": True},
    {"id": "svc", "kind": "service"},
    {"id": "mallory", "disabled": True},
    {"id": "exadmin", "admin": True, "disabled": True},
]


@dataclass
class CliResult:
    code: int
    out: str
    err: str

    def json(self) -> Any:
        return orjson.loads(self.out)


# How `kbd exec` runs in a test (docs/daemon.md): in this process's child as it
# always did, or as a thin client of a real daemon serving the root.
EXEC_MODES = ("in_process", "brokered")
IN_PROCESS_ENV = {"KBD_NO_DAEMON": "1"}


@dataclass
class KbRoot:
    root: Path
    # Added to the environment of every `kbd exec` that :meth:`cli` runs: a
    # test only reaches a daemon through its exec_mode (exec_mode_for).
    exec_env: dict[str, str] = field(default_factory=lambda: dict(IN_PROCESS_ENV))
    # Called with a workflow ID after :meth:`workflow` created it. A daemon sees a
    # workflow created behind its back once its watcher reports the new folder
    # (a registry miss never walks, docs/daemon.md): brokered tests wait for that
    # here, as an execution host would wait for the workflow.changed event.
    settle: Callable[[str], None] | None = None

    @classmethod
    def create(
        cls, root: Path, *, host: str = "test-host", principals: list[dict[str, Any]] | None = None
    ) -> KbRoot:
        init_root(root, host=host, force=False, demo=False)
        (root / "principals.yaml").write_text(yaml.safe_dump({"principals": principals or PRINCIPALS}))
        return cls(root)

    @property
    def workflows(self) -> Path:
        return self.root / "workflows"

    def workflow(
        self,
        wid: str,
        *,
        folder: str | None = None,
        kb: bool = True,
        sources: list[dict[str, Any]] | None = None,
        **fields: Any,
    ) -> Path:
        """Create a workflow folder with a KB (context/, notes/fact.md, notes/_index.json)
        and private folders. Extra keyword fields go into workflow.json as given."""
        path = self.workflows / (folder or wid)
        path.mkdir(parents=True)
        doc: dict[str, Any] = {"id": wid, **fields}
        if sources is not None:
            doc["knowledgebase_sources"] = sources
        self.write_manifest(path, doc)
        if kb:
            (path / "knowledgebase" / "context").mkdir(parents=True)
            (path / "knowledgebase" / "notes").mkdir()
            (path / "knowledgebase" / "context" / "about.md").write_text(f"about {wid}\n")
            (path / "knowledgebase" / "notes" / "fact.md").write_text(f"{wid}\n")
            (path / "knowledgebase" / "notes" / "_index.json").write_text('{"notes": ["fact.md"]}\n')
        for private in ("soul", "learnings", "runs", "credentials"):
            (path / private).mkdir()
        (path / "credentials" / "token").write_text(f"secret-{wid}\n")
        if self.settle is not None:
            self.settle(wid)
        return path

    @staticmethod
    def write_manifest(path: Path, doc: dict[str, Any]) -> None:
        (path / "workflow.json").write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))

    @staticmethod
    def read_manifest(path: Path) -> dict[str, Any]:
        data: dict[str, Any] = orjson.loads((path / "workflow.json").read_bytes())
        return data

    def edit(self, path: Path, **changes: Any) -> None:
        """Hand-edit workflow.json (as a user with an editor would)."""
        doc = self.read_manifest(path)
        doc.update(changes)
        self.write_manifest(path, doc)

    def host(self) -> Root:
        # sweep_interval=0: every lookup re-verifies every manifest, as a fresh CLI call does.
        return Root(self.root, sweep_interval=0)

    def cli_argv(self, *args: str) -> list[str]:
        """The argv of the real `kbd` command against this root."""
        return [sys.executable, "-m", "kbd", "--root", str(self.root), *args]

    def cli_env(self, *args: str, env: dict[str, str] | None = None) -> dict[str, str]:
        """The environment :meth:`cli` runs ``args`` with (no KBD_* of the runner's)."""
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("KBD_")}
        if args[:1] == ("exec",) or not args:
            full_env.update(self.exec_env)
        full_env.update(env or {})
        return full_env

    def cli(
        self, *args: str, input: bytes | str | None = None, env: dict[str, str] | None = None,
        timeout: float = 60, stdin: bytes | str | None = None,
    ) -> CliResult:  # fmt: skip
        """Run the real `kbd` command in a subprocess against this root."""
        data = input if input is not None else stdin
        proc = subprocess.run(
            self.cli_argv(*args),
            input=data.encode() if isinstance(data, str) else data,
            capture_output=True,
            env=self.cli_env(*args, env=env),
            timeout=timeout,
            check=False,
        )
        return CliResult(proc.returncode, proc.stdout.decode(), proc.stderr.decode())

    def audit_events(self, name: str) -> list[dict[str, Any]]:
        """The root's audit records of event ``name``, oldest first."""
        path = self.root / "state" / "audit.log"
        if not path.exists():
            return []
        records = [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]
        return [r for r in records if r.get("event") == name]

    def set_config(self, **fields: Any) -> None:
        """Set top-level keys of kbd.yaml (as an operator's editor would)."""
        path = self.root / "kbd.yaml"
        doc = yaml.safe_load(path.read_text())
        doc.update(fields)
        path.write_text(yaml.safe_dump(doc))

    def call(self, *args: str, input: bytes | None = None, env: dict[str, str] | None = None) -> CliResult:
        """Run `kbd` like :meth:`cli`, but in this process (see :func:`run_in_process`)."""
        return run_in_process(["--root", str(self.root), *args], input=input, env=env)

    def open_session(self, wid: str, *, kind: str, kb_access: str, actor: str) -> str:
        """``kbd session open`` through the real entry point; the new session's ID."""
        r = self.call(
            "session", "open", wid, "--kind", kind, "--kb-access", kb_access, "--as", actor, "--json"
        )
        assert r.code == 0, r.err
        return str(r.json()["session_id"])


def issue_token(root: Path, pid: str, *, timeout: float = 10.0) -> str:
    """A fixture's bearer token for ``pid``: only its SHA-256 is stored in
    principals.yaml (the one-line edit kbd makes, comments and layout kept), and
    nothing is audited, unlike `kbd principals token` (rotate_token)."""
    import hashlib
    import secrets

    from kbd.core.principals_edit import SetField
    from kbd.fs import principals_file

    token = "kbd_" + secrets.token_urlsafe(32)

    def decide(current: principals_file.Current) -> SetField:
        assert current.principals.get(pid) is not None, f"no principal {pid!r} to give a token"
        return SetField(pid, "token_sha256", hashlib.sha256(token.encode()).hexdigest())

    principals_file.update(root, decide, timeout=timeout)
    return token


@contextlib.contextmanager
def exec_mode_for(kb: KbRoot, mode: str) -> Iterator[None]:
    """Run ``kb``'s `kbd exec` calls in ``mode`` for the block: ``brokered``
    serves the root with the real daemon on its default socket (uid 0 mapped to
    the admin ``ops``, as a root operator's uid would be) and points
    ``KBD_SOCKET`` at it; the daemon is stopped and checked afterwards."""
    assert mode in EXEC_MODES, mode
    if mode == "in_process":
        yield
        return
    from tests.integration import daemon

    daemon.map_uid(kb.root, "ops", os.getuid())
    with daemon.serving(kb.root) as served:
        client = served.client()

        def settle(wid: str) -> None:
            # 404 while the daemon's watcher has not yet reported the new folder.
            wait_for(lambda: client.get(f"/v1/workflows/{wid}").status_code != 404, 10,
                     f"the daemon to see workflow {wid!r}")  # fmt: skip

        kb.exec_env = {"KBD_SOCKET": str(served.sock)}
        kb.settle = settle
        try:
            yield
        finally:
            kb.exec_env = dict(IN_PROCESS_ENV)
            kb.settle = None


def run_in_process(argv: list[str], *, input: bytes | None, env: dict[str, str] | None) -> CliResult:
    """Run kbd's real entry point (``kbd.cli.entry.main``) in this process with the
    same argv, environment and standard descriptors a subprocess would get: fds
    0-2 point at files (kbd writes JSON with os.write on fd 1), KBD_* comes only
    from ``env``, and the exit code is the one ``sys.exit`` carried.

    It saves a fresh interpreter per case (~0.3 s of imports), so tables of
    validation cases whose subject is the message, exit code and unchanged files
    use it; every command keeps smoke tests through the real subprocess
    (:meth:`KbRoot.cli`). Not for ``kbd exec`` or ``kbd serve``: they start
    processes and signal handlers that belong in a process of their own."""
    from kbd.cli import entry

    assert argv[2:3] not in (["exec"], ["serve"]), "exec and serve run in a subprocess: use KbRoot.cli"
    saved_env = os.environ.copy()
    saved = (sys.argv, sys.stdin, sys.stdout, sys.stderr)
    with tempfile.TemporaryFile() as fin, tempfile.TemporaryFile() as fout, tempfile.TemporaryFile() as ferr:
        fin.write(input or b"")
        fin.seek(0)
        sys.stdout.flush()
        sys.stderr.flush()
        saved_fds = [os.dup(fd) for fd in (0, 1, 2)]
        try:
            for fd, f in zip((0, 1, 2), (fin, fout, ferr), strict=True):
                os.dup2(f.fileno(), fd)
            for key in [k for k in os.environ if k.startswith("KBD_")]:
                del os.environ[key]
            os.environ.update(env or {})
            sys.argv = ["kbd", *argv]
            sys.stdin = open(0, encoding="utf-8", closefd=False)  # noqa: SIM115 - closed below
            sys.stdout = open(1, "w", encoding="utf-8", closefd=False)  # noqa: SIM115
            sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False)  # noqa: SIM115
            code = _exit_code(entry.main)
        finally:
            for stream in (sys.stdin, sys.stdout, sys.stderr):
                with contextlib.suppress(OSError, ValueError):
                    stream.close()  # flushes what is still buffered
            sys.argv, sys.stdin, sys.stdout, sys.stderr = saved
            os.environ.clear()
            os.environ.update(saved_env)
            for fd, copy in zip((0, 1, 2), saved_fds, strict=True):
                os.dup2(copy, fd)
                os.close(copy)
        fout.seek(0)
        ferr.seek(0)
        return CliResult(code, fout.read().decode(), ferr.read().decode())


def _exit_code(main: Callable[[], None]) -> int:
    """The status a process running ``main`` would exit with (as sys.exit sets it)."""
    try:
        main()
    except SystemExit as exc:
        if exc.code is None:
            return 0
        if isinstance(exc.code, int):
            return exc.code
        sys.stderr.write(f"{exc.code}\n")
        return 1
    return 0


@contextlib.contextmanager
def holding_notes_mutex(kb: KbRoot, workflow: str) -> Iterator[None]:
    """This process holds WORKFLOW's notes mutex for the duration (the real lock:
    every daemon and ``kbd exec`` under test is another process)."""
    from kbd.fs.notes import notes_lock

    notes = os.open(kb.workflows / workflow / "knowledgebase" / "notes", os.O_RDONLY | os.O_DIRECTORY)
    try:
        with notes_lock(kb.root / "state", notes, timeout=5, who={"workflow": "holder"}):
            yield
    finally:
        os.close(notes)


@contextlib.contextmanager
def lock_attempts(kb: KbRoot, kind: str = "notes") -> Iterator[Callable[[], bool]]:
    """For the block: a callable that is true once anyone opened a lock file of
    ``kind`` (kbd.fs.locks.lock_path) since the block began (inotify IN_OPEN). A
    lock waiter opens the lock file at every attempt (filelock), so this observes
    a ``kbd exec`` that has reached its wait for a mutex another process holds."""
    import ctypes
    import struct

    libc = ctypes.CDLL(None, use_errno=True)
    locks = kb.root / "state" / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
    assert fd >= 0, os.strerror(ctypes.get_errno())
    in_open = 0x20
    try:
        assert libc.inotify_add_watch(fd, bytes(locks), in_open) >= 0, os.strerror(ctypes.get_errno())
        seen: list[bytes] = []

        def opened() -> bool:
            with contextlib.suppress(BlockingIOError):
                data = os.read(fd, 65536)
                while data:
                    _wd, _mask, _cookie, size = struct.unpack_from("iIII", data)
                    seen.append(data[16 : 16 + size].rstrip(b"\0"))
                    data = data[16 + size :]
            return any(name.startswith(f"{kind}-".encode()) and name.endswith(b".lock") for name in seen)

        yield opened
    finally:
        os.close(fd)


def process_state(pid: int) -> str | None:
    """The state letter of process ``pid`` from /proc (``Z``: a zombie), or None
    when there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return stat[stat.rindex(b")") + 2 :].split(b" ", 1)[0].decode()  # after "pid (comm) "


def alive(pid: int) -> bool:
    """Process ``pid`` exists and is not a zombie."""
    return process_state(pid) not in (None, "Z", "X")


def live_processes() -> Iterator[tuple[int, list[str]]]:
    """(pid, command line) of every live process this host shows in /proc."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            raw = Path(f"/proc/{entry}/cmdline").read_bytes()
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if alive(int(entry)):
            yield int(entry), [part.decode(errors="replace") for part in raw.split(b"\0")[:-1]]


Entry = tuple[str, int, int, bytes]


def snapshot(root: Path, *, skip: tuple[str, ...] = ()) -> dict[str, Entry]:
    """Every entry under ``root`` (links not followed): type, mode, mtime, content,
    leaving out the top-level folders named in ``skip``. Two equal snapshots mean
    nothing under ``root`` was created, removed or changed."""
    out: dict[str, Entry] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        if Path(dirpath) == root:
            dirnames[:] = [d for d in dirnames if d not in skip]
        for name in [*dirnames, *filenames]:
            path = Path(dirpath) / name
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                kind, data = "link", os.readlink(path).encode()
            elif stat.S_ISREG(st.st_mode):
                kind, data = "file", path.read_bytes()
            elif stat.S_ISDIR(st.st_mode):
                kind, data = "dir", b""
            else:
                kind, data = "other", b""
            out[str(path.relative_to(root))] = (kind, st.st_mode, st.st_mtime_ns, data)
    return out

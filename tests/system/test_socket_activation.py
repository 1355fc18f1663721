"""The service as its units start it (docs/multi-user.md "Service notes"): `kbd serve` launched by
systemd-socket-activate with the service's own ExecStart and Environment (read
from systemd/kbd.service, paths mapped into a temporary folder) on a socket
with the mode, owner and group systemd/kbd.socket gives it, serves a real
non-root user of group ``kbd`` — over HTTP and through the exec broker — and
the socket refuses a user outside the group (the client's exit 77)."""

from __future__ import annotations

import grp
import os
import pwd
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import pytest

from tests.helpers import KbRoot
from tests.integration import daemon
from tests.system.units import (
    KBD_BIN,
    KBD_DOCS,
    RUNTIME,
    STATE_ROOT,
    directives,
    environment,
    exec_start,
    rewrite,
)

pytestmark = [pytest.mark.requires_bwrap, pytest.mark.timeout(180), pytest.mark.requires_reachable_checkout]

REPO = Path(__file__).resolve().parents[2]
GROUP = "kbd"
READY_TIMEOUT = 30.0


@dataclass
class User:
    name: str
    uid: int
    gid: int


def _useradd(name: str, *groups: str) -> User:
    extra = ["-G", ",".join(groups)] if groups else []
    subprocess.run(["useradd", "--no-create-home", "--shell", "/bin/sh", *extra, name], check=True)
    pw = pwd.getpwnam(name)
    return User(name, pw.pw_uid, pw.pw_gid)


@pytest.fixture
def kbd_group() -> Iterator[int]:
    """Group ``kbd`` (the units' SocketGroup): created for the test when the host
    has none, and then removed again."""
    try:
        yield grp.getgrnam(GROUP).gr_gid
        return
    except KeyError:
        pass
    subprocess.run(["groupadd", GROUP], check=True)
    try:
        yield grp.getgrnam(GROUP).gr_gid
    finally:
        subprocess.run(["groupdel", GROUP], check=False)


@pytest.fixture
def users(kbd_group: int) -> Iterator[tuple[User, User]]:
    """A member of group kbd and a user outside it, removed afterwards."""
    tag = uuid.uuid4().hex[:8]
    made: list[str] = []
    try:
        member = _useradd(f"kbdm{tag}", GROUP)
        made.append(member.name)
        outsider = _useradd(f"kbdo{tag}")
        made.append(outsider.name)
        yield member, outsider
    finally:
        for name in made:
            subprocess.run(["userdel", name], check=False)


def as_user(u: User, argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        ["setpriv", "--reuid", str(u.uid), "--regid", str(u.gid), "--init-groups", *argv],
        capture_output=True, env=env, timeout=60, check=False, cwd="/",
    )  # fmt: skip


def _lines(stream: IO[bytes], out: queue.Queue[bytes | None]) -> None:
    with stream:
        for line in iter(stream.readline, b""):
            out.put(line)
    out.put(None)


@dataclass
class Activated:
    proc: subprocess.Popen[bytes]
    sock: Path
    lines: queue.Queue[bytes | None]
    reader: threading.Thread

    def stop(self) -> tuple[int, str]:
        """SIGTERM; (exit status, everything it printed on stderr)."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=20)
            raise AssertionError("kbd serve did not stop on SIGTERM") from None
        finally:
            self.reader.join(timeout=20)
        err = b""
        while (line := self.lines.get(timeout=5)) is not None:
            err += line
        return code, err.decode(errors="replace")


def activate(base: Path, root: Path) -> Activated:
    """systemd-socket-activate with the units' socket, environment and command,
    every host path mapped under ``base``; returns once the socket listens,
    before the daemon runs (it starts on the first connection)."""
    tool = shutil.which("systemd-socket-activate")
    assert tool is not None, "systemd-socket-activate is missing: apt-get install -y systemd"
    paths = {
        KBD_BIN: f"{sys.prefix}/bin/kbd",
        KBD_DOCS: "/usr/share/doc/kbd",
        STATE_ROOT: str(root),
        RUNTIME: str(base / "run" / "kbd"),
    }
    socket_unit, service = directives("kbd.socket"), directives("kbd.service")
    (listen,) = socket_unit["ListenStream"]
    sock = Path(rewrite(listen, paths))
    # systemd creates the socket's missing folders root-owned with DirectoryMode.
    for folder in (sock.parent.parent, sock.parent):
        folder.mkdir(mode=0o700, exist_ok=True)
        os.chmod(folder, int(socket_unit["DirectoryMode"][0], 8))
    argv = [rewrite(word, paths) for word in exec_start(service)]
    assert argv[0] == f"{sys.prefix}/bin/kbd" and os.access(argv[0], os.X_OK), argv
    env = {k: v for k, v in os.environ.items() if not k.startswith("KBD_")}
    flags = [f"--setenv={k}={rewrite(v, paths)}" for k, v in environment(service).items()]
    proc = subprocess.Popen([tool, f"--listen={sock}", *flags, *argv], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)  # fmt: skip
    assert proc.stderr is not None
    lines: queue.Queue[bytes | None] = queue.Queue()
    reader = threading.Thread(target=_lines, args=(proc.stderr, lines), daemon=True)
    reader.start()
    first = lines.get(timeout=READY_TIMEOUT)
    assert first == f"Listening on {sock} as 3.\n".encode(), first
    # What systemd does at bind time: SocketMode, SocketUser, SocketGroup.
    os.chown(sock, pwd.getpwnam(socket_unit["SocketUser"][0]).pw_uid,
             grp.getgrnam(socket_unit["SocketGroup"][0]).gr_gid)  # fmt: skip
    os.chmod(sock, int(socket_unit["SocketMode"][0], 8))
    return Activated(proc, sock, lines, reader)


def test_socket_activated_service_serves_group_kbd_and_refuses_others(users: tuple[User, User]) -> None:
    member, outsider = users
    base = Path(tempfile.mkdtemp(prefix="kbd-activated-", dir="/tmp"))
    try:
        os.chmod(base, 0o755)  # noqa: S103 - the way to the socket's folder, as /run is
        kb = KbRoot.create(base / "root")
        kbd_gid = grp.getgrnam(GROUP).gr_gid
        for folder in (
            kb.root,
            kb.workflows,
        ):  # the member's way to its grants (bwrap opens them as the caller)
            os.chown(folder, 0, kbd_gid)
        kb.workflow("w", access={"owners": ["alice"]})
        daemon.map_uid(kb.root, "alice", member.uid)
        sid = kb.open_session("w", kind="execution", kb_access="read", actor="alice")
        served = activate(base, kb.root)
        try:
            env = {k: v for k, v in os.environ.items() if not k.startswith("KBD_")}
            env.update(HOME="/", PATH="/usr/bin:/bin", PYTHONPATH=str(REPO), KBD_SOCKET=str(served.sock))
            # The first connection starts the daemon; the request waits in the backlog.
            http = as_user(member, [sys.executable, "-c", LIST_WORKFLOWS, str(served.sock)], env)
            assert http.returncode == 0, http.stderr.decode()
            assert http.stdout.decode().split() == ["200", "w"], http.stdout
            ran = as_user(member, [sys.executable, "-m", "kbd", "--root", str(kb.root), "exec", sid, "--",
                                   "sh", "-c", "id -u; cat knowledgebase/notes/fact.md"], env)  # fmt: skip
            assert ran.returncode == 0, ran.stderr.decode()
            assert ran.stdout.decode().split() == [str(member.uid), "w"]
            refused = as_user(outsider, [sys.executable, "-m", "kbd", "--root", str(kb.root), "exec", sid, "--",
                                         "true"], env)  # fmt: skip
            assert refused.returncode == 77, refused.stderr.decode()
            assert refused.stderr.decode().startswith("error[permission-denied]:"), refused.stderr
            raw = as_user(outsider, [sys.executable, "-c", CONNECT, str(served.sock)], env)
            assert raw.stdout.decode().strip() == "EACCES", raw.stderr.decode()
        finally:
            code, err = served.stop()
        assert code == 0, err
        assert "Traceback" not in err, err
    finally:
        shutil.rmtree(base, ignore_errors=True)


LIST_WORKFLOWS = """
import sys, httpx
with httpx.Client(transport=httpx.HTTPTransport(uds=sys.argv[1]), base_url="http://kbd", timeout=30) as c:
    r = c.get("/v1/workflows")
print(r.status_code, *[w["id"] for w in r.json()["workflows"]])
"""

CONNECT = """
import errno, socket, sys
s = socket.socket(socket.AF_UNIX)
try:
    s.connect(sys.argv[1])
    print("connected")
except OSError as exc:
    print(errno.errorcode[exc.errno])
"""

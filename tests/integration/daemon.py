"""Run the REAL daemon (`python -m kbd serve`) as a subprocess for integration tests.

`serving(root)` starts `kbd --root ROOT serve --socket ROOT/state/run/kbd.sock`,
waits for its one readiness line on stdout (read by a pump thread and taken
from a queue with a timeout: never a sleep), yields a :class:`Daemon`, then
sends SIGTERM and asserts that the daemon exits 0 within a timeout and removes
its socket. Clients are httpx clients over the Unix socket.

The daemon loads principals.yaml when it starts, so tokens must be issued (and
uid mappings written) before it starts.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx
import yaml

from tests.helpers import issue_token

READY_PREFIX = "kbd: serving on "
START_TIMEOUT = 30.0
STOP_TIMEOUT = 15.0
REQUEST_TIMEOUT = 15.0


def socket_path(root: Path) -> Path:
    return root / "state" / "run" / "kbd.sock"


def clean_env(home: Path | None = None) -> dict[str, str]:
    """The test process's environment without KBD_* (the root is always passed explicitly)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KBD_")}
    if home is not None:
        env["HOME"] = str(home)
        env["XDG_DATA_HOME"] = str(home / ".local" / "share")
    return env


def issue_tokens(root: Path, pids: Iterable[str]) -> dict[str, str]:
    """A fresh bearer token for each principal (only its SHA-256 is stored)."""
    return {pid: issue_token(root, pid, timeout=10.0) for pid in pids}


def map_uid(root: Path, pid: str, uid: int) -> None:
    """Rewrite principals.yaml so that ``pid`` is mapped to ``uid`` (SO_PEERCRED auth)."""
    path = root / "principals.yaml"
    doc: dict[str, Any] = yaml.safe_load(path.read_text())
    for entry in doc["principals"]:
        if entry["id"] == pid:
            entry["uid"] = uid
        else:
            entry.pop("uid", None)
    path.write_text(yaml.safe_dump(doc, sort_keys=False))


class _Pump(threading.Thread):
    """Drains one pipe of the daemon so it can never block on a full pipe."""

    def __init__(self, stream: IO[bytes], lines: queue.Queue[bytes | None] | None) -> None:
        super().__init__(daemon=True)
        self.stream = stream
        self.lines = lines
        self.data = bytearray()

    def run(self) -> None:
        try:
            for line in iter(self.stream.readline, b""):
                self.data += line
                if self.lines is not None:
                    self.lines.put(line)
        finally:
            if self.lines is not None:
                self.lines.put(None)  # EOF


@dataclass
class Daemon:
    root: Path
    sock: Path
    proc: subprocess.Popen[bytes]
    _out: _Pump
    _err: _Pump
    _clients: list[httpx.Client] = field(default_factory=list)

    @property
    def stderr(self) -> str:
        return self._err.data.decode(errors="replace")

    @property
    def stdout(self) -> str:
        return self._out.data.decode(errors="replace")

    def client(self, token: str | None = None, *, headers: dict[str, str] | None = None) -> httpx.Client:
        """A client over the socket; ``token`` becomes a Bearer header, ``headers`` are sent as given.
        Closed when the daemon stops."""
        hdrs = dict(headers or {})
        if token is not None:
            hdrs["Authorization"] = f"Bearer {token}"
        c = httpx.Client(
            transport=httpx.HTTPTransport(uds=str(self.sock)),
            base_url="http://kbd",
            headers=hdrs,
            timeout=REQUEST_TIMEOUT,
        )
        self._clients.append(c)
        return c

    def _close_clients(self) -> None:
        for c in self._clients:
            c.close()
        self._clients.clear()

    def _reap(self) -> None:
        self._out.join(timeout=STOP_TIMEOUT)
        self._err.join(timeout=STOP_TIMEOUT)
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()

    def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        """SIGTERM; assert a clean exit (status 0) within ``timeout`` and that the socket is gone."""
        self._close_clients()
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(
                f"kbd serve did not exit within {timeout}s of SIGTERM\n{self.stderr}"
            ) from None
        self._reap()
        assert code == 0, f"kbd serve exited {code} after SIGTERM\n{self.stderr}"
        assert not os.path.lexists(self.sock), "kbd serve left its socket behind"
        assert "Traceback" not in self.stderr, self.stderr

    def kill(self) -> None:
        """Cleanup after a failure elsewhere: no assertions."""
        self._close_clients()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=STOP_TIMEOUT)
        self._reap()


# Sets RLIMIT_NOFILE, then becomes `python ARGS…` (same pid): no preexec_fn.
_NOFILE_SHIM = (
    "import os, resource, sys; "
    "resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[1]), int(sys.argv[2]))); "
    "os.execv(sys.executable, [sys.executable, *sys.argv[3:]])"
)


def start(
    root: Path,
    *,
    sock: Path | None = None,
    home: Path | None = None,
    nofile: tuple[int, int] | None = None,
    prefix: Sequence[str] = (),
    args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> Daemon:
    """Start `kbd serve` and return once it has printed its readiness line.
    ``nofile``: the (soft, hard) open-file limit the daemon starts with.
    ``prefix``: a command that execs the daemon (e.g. ``unshare --mount``: its
    pid is then the daemon's). ``args``: more `kbd serve` options; ``env``:
    variables set on top of :func:`clean_env`."""
    sock = sock or socket_path(root)
    argv = [sys.executable, "-m", "kbd", "--root", str(root), "serve", "--socket", str(sock), *args]
    if nofile is not None:
        argv = [sys.executable, "-c", _NOFILE_SHIM, str(nofile[0]), str(nofile[1]), *argv[1:]]
    proc = subprocess.Popen(
        [*prefix, *argv],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**clean_env(home), **(env or {})},
    )
    assert proc.stdout is not None and proc.stderr is not None
    lines: queue.Queue[bytes | None] = queue.Queue()
    out, err = _Pump(proc.stdout, lines), _Pump(proc.stderr, None)
    out.start()
    err.start()
    daemon = Daemon(root=root, sock=sock, proc=proc, _out=out, _err=err)
    try:
        line = lines.get(timeout=START_TIMEOUT)
    except queue.Empty:
        daemon.kill()
        raise AssertionError(
            f"kbd serve printed no readiness line within {START_TIMEOUT}s\n{daemon.stderr}"
        ) from None
    if line is None:
        daemon.kill()
        raise AssertionError(f"kbd serve exited {proc.returncode} before it was ready\n{daemon.stderr}")
    assert line.decode() == f"{READY_PREFIX}{sock}\n", line
    return daemon


@contextlib.contextmanager
def serving(
    root: Path,
    *,
    sock: Path | None = None,
    home: Path | None = None,
    nofile: tuple[int, int] | None = None,
    prefix: Sequence[str] = (),
    args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> Iterator[Daemon]:
    """The daemon for the duration of the block; stopped (and checked) afterwards.
    If the block fails, the daemon is killed without masking that failure."""
    daemon = start(root, sock=sock, home=home, nofile=nofile, prefix=prefix, args=args, env=env)
    try:
        yield daemon
    except BaseException:
        daemon.kill()
        raise
    daemon.stop()

"""Run the REAL Knowledge page server (`python -m kbd ui --no-browser`) for tests.

:func:`serving_ui` starts it, reads the one-time URL from stdout's first line
(from a queue with a timeout, never a sleep), yields a :class:`Ui`, then sends
SIGTERM and asserts a clean exit (status 0, no traceback). Requests go over
real HTTP to 127.0.0.1 with httpx; :meth:`Ui.login` exchanges the token for the
cookie as a browser would, :meth:`Ui.change` sends a change as the page does
(cookie, X-KBD-CSRF, same Origin).
"""

from __future__ import annotations

import contextlib
import queue
import re
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.integration.daemon import START_TIMEOUT, STOP_TIMEOUT, _Pump, clean_env

URL = re.compile(r"http://127\.0\.0\.1:(\d+)/\?token=([A-Za-z0-9_-]{20,})\n")


@dataclass
class Ui:
    proc: subprocess.Popen[bytes]
    port: int
    token: str
    _out: _Pump
    _err: _Pump
    _clients: list[httpx.Client] = field(default_factory=list)
    csrf: str = ""

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def origin(self) -> str:
        return self.base

    @property
    def stderr(self) -> str:
        return self._err.data.decode(errors="replace")

    def client(self, **kwargs: Any) -> httpx.Client:
        c = httpx.Client(base_url=self.base, timeout=15.0, follow_redirects=False, **kwargs)
        self._clients.append(c)
        return c

    def login(self) -> httpx.Client:
        """A client holding the page's cookie (the token used up) and the CSRF token in ``self.csrf``."""
        c = self.client()
        r = c.get("/", params={"token": self.token})
        assert r.status_code == 303, (r.status_code, r.text)
        assert c.cookies.get("kbd_ui"), r.headers
        me = c.get("/api/me")
        assert me.status_code == 200, me.text
        self.csrf = me.json()["csrf"]
        return c

    def change(self, c: httpx.Client, method: str, path: str, body: Any = None) -> httpx.Response:
        """A change as the page sends it: cookie, CSRF header and same-origin Origin."""
        headers = {"X-KBD-CSRF": self.csrf, "Origin": self.origin}
        return c.request(method, path, json=body, headers=headers)

    def _close_clients(self) -> None:
        for c in self._clients:
            c.close()
        self._clients.clear()

    def stop(self, timeout: float = STOP_TIMEOUT) -> int:
        """SIGTERM; assert exit 0 within ``timeout`` and no traceback; the exit status."""
        self._close_clients()
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"kbd ui did not exit within {timeout}s of SIGTERM\n{self.stderr}") from None
        self._reap()
        assert code == 0, f"kbd ui exited {code} after SIGTERM\n{self.stderr}"
        assert "Traceback" not in self.stderr, self.stderr
        return code

    def kill(self) -> None:
        self._close_clients()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=STOP_TIMEOUT)
        self._reap()

    def _reap(self) -> None:
        self._out.join(timeout=STOP_TIMEOUT)
        self._err.join(timeout=STOP_TIMEOUT)
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()


def start_ui(
    root: Path, *args: str, prefix: Sequence[str] = (), env: Mapping[str, str] | None = None,
    with_root: bool = True, cwd: str | None = None,
) -> Ui:  # fmt: skip
    """Start `kbd [--root ROOT] ui --no-browser ARGS…` and return once its URL is printed."""
    argv = [
        sys.executable,
        "-m",
        "kbd",
        *(["--root", str(root)] if with_root else []),
        "ui",
        "--no-browser",
        *args,
    ]
    full_env = dict(env) if env is not None and prefix else {**clean_env(), **(env or {})}
    proc = subprocess.Popen([*prefix, *argv], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=full_env, cwd=cwd)  # fmt: skip
    assert proc.stdout is not None and proc.stderr is not None
    lines: queue.Queue[bytes | None] = queue.Queue()
    out, err = _Pump(proc.stdout, lines), _Pump(proc.stderr, None)
    out.start()
    err.start()
    try:
        line = lines.get(timeout=START_TIMEOUT)
    except queue.Empty:
        line = None
    if line is None:
        with contextlib.suppress(Exception):
            proc.kill()
        proc.wait(timeout=STOP_TIMEOUT)
        err.join(timeout=STOP_TIMEOUT)
        raise AssertionError(
            f"kbd ui printed no URL (exit {proc.returncode})\n{err.data.decode(errors='replace')}"
        )
    m = URL.fullmatch(line.decode())
    assert m is not None, f"stdout's first line is not the one-time URL: {line!r}"
    return Ui(proc, int(m.group(1)), m.group(2), out, err)


@contextlib.contextmanager
def serving_ui(
    root: Path, *args: str, prefix: Sequence[str] = (), env: Mapping[str, str] | None = None,
    with_root: bool = True, cwd: str | None = None,
) -> Iterator[Ui]:  # fmt: skip
    """The page's server for the block; stopped (and checked) afterwards, killed if the block fails."""
    ui = start_ui(root, *args, prefix=prefix, env=env, with_root=with_root, cwd=cwd)
    try:
        yield ui
    except BaseException:
        ui.kill()
        raise
    ui.stop()

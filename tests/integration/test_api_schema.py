"""An outside property-based tester (Schemathesis, its own ``st run``) drives
the REAL daemon from the daemon's own ``/openapi.json`` with every check it
has, in every phase (examples, coverage, fuzzing, stateful): answers conform
to the documented schemas, statuses and headers, what the schema calls valid
is accepted, what it calls invalid is refused, credentials are required where
declared, undocumented methods answer 405 with ``Allow`` (docs/api.md "Malformed requests").

Schemathesis speaks TCP; the daemon listens only on its Unix socket. A small
relay in this test (:class:`Relay`) carries each connection's bytes to the
socket unchanged, so every request is the daemon's own, over its real socket
(the peer it authenticates is this test's process, as for any local client).
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.helpers import KbRoot
from tests.integration.daemon import issue_tokens, serving

#: Examples per operation and phase: 45 operations in well under 90 s on two cores.
EXAMPLES = 30


class Relay:
    """127.0.0.1:PORT → the daemon's Unix socket, one thread per direction and
    connection; stops (closing every socket it opened) when the test ends."""

    def __init__(self, sock: Path) -> None:
        self.sock = sock
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.open: list[socket.socket] = [self.listener]
        self.thread = threading.Thread(target=self._accept, daemon=True)

    def __enter__(self) -> Relay:
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        for s in self.open:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()
        self.thread.join(timeout=5)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return  # closed: the test is over
            # No Nagle: a request's headers and body go as they come (else each waits for a delayed ACK).
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            upstream.connect(str(self.sock))
            self.open += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)


@pytest.mark.timeout(180)
def test_the_daemon_does_what_its_schema_says(tmp_path: Path) -> None:
    """As the service principal ``svc``, on a root with two workflows and a
    session: admin routes and workflow creation answer 403, the rest is
    decided by what each request names. (Rules that depend on a named
    workflow's contents, such as a path inside its KB or a grant to itself,
    are checked once it is found, docs/api.md "Malformed requests"; OpenAPI cannot state
    them, and a tester that creates workflows would meet them as 400s.) This
    process's uid is no principal's: without the token a request is
    unauthenticated, as the schema says."""
    kb = KbRoot.create(tmp_path / "root")
    kb.workflow("src", access={"owners": ["bob"], "readers": ["alice"], "allowed_kb_writers": ["con"]})
    kb.workflow("con", access={"owners": ["alice"]}, sources=[{"workflow_id": "src", "alias": "src",
                                                                "access": "write"}])  # fmt: skip
    kb.open_session("con", kind="execution", kb_access="read-write", actor="alice")
    token = issue_tokens(kb.root, ["svc"])["svc"]
    config = tmp_path / "schemathesis.toml"
    config.write_text('hooks = "tests.integration.schemathesis_hooks"\n')
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")])}
    with serving(kb.root, home=tmp_path / "home") as daemon, Relay(daemon.sock) as relay:
        url = f"http://127.0.0.1:{relay.port}"
        run = subprocess.run(
            [sys.executable, "-m", "schemathesis.cli", "--config-file", str(config), "--no-color", "run",
             f"{url}/openapi.json", "--checks", "all", "--max-examples", str(EXAMPLES),
             "--continue-on-failure", "--request-timeout", "15", "--report-dir", str(tmp_path / "reports"),
             "-H", f"Authorization: Bearer {token}"],
            capture_output=True, text=True, cwd=tmp_path, env=env, timeout=150, check=False,
        )  # fmt: skip
        assert daemon.proc.poll() is None, daemon.stderr
    assert run.returncode == 0, run.stdout[-20000:] + run.stderr[-5000:]
    assert "No issues found" in run.stdout or " passed" in run.stdout, run.stdout[-5000:]

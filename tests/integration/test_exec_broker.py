"""The exec broker end to end (docs/daemon.md): the real daemon on its real socket,
the real thin client (`python -m kbd exec`), real sandboxes and real processes.

The sandbox suites run on both exec paths through the ``exec_mode`` fixture;
this module holds what only the broker has: refusals identical on both paths,
signal forwarding, the death of the client or of the daemon, the front door,
and the identity invariant with a real non-root user.
"""

from __future__ import annotations

import array
import contextlib
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kbd.core import wire
from kbd.core.knowledge import body_of
from tests.helpers import IN_PROCESS_ENV, CliResult, KbRoot, live_processes
from tests.integration import daemon
from tests.integration.hostusers import User, as_user, serving_for
from tests.waiting import wait_for

pytestmark = [pytest.mark.requires_bwrap, pytest.mark.requires_landlock(abi=2)]


@dataclass
class Broker:
    kb: KbRoot
    daemon: daemon.Daemon
    read_sid: str
    write_sid: str
    tokens: dict[str, str]

    def both(
        self, *args: str, input: bytes | None = None, env: dict[str, str] | None = None
    ) -> list[CliResult]:
        """``kbd ARGS`` in-process, then through the daemon."""
        inproc = self.kb.cli(*args, input=input, env={**IN_PROCESS_ENV, **(env or {})})
        brokered = self.kb.cli(*args, input=input, env={"KBD_SOCKET": str(self.daemon.sock), **(env or {})})
        return [inproc, brokered]


def _build(kb: KbRoot) -> tuple[str, str]:
    kb.workflow("src", access={"owners": ["bob"], "readers": ["alice"], "allowed_kb_writers": ["con"]})
    kb.workflow(
        "con",
        access={"owners": ["alice"]},
        sources=[{"workflow_id": "src", "alias": "src", "access": "write"}],
    )
    sids = []
    for access in ("read", "read-write"):
        r = kb.call(
            "session", "open", "con", "--kind", "execution", "--kb-access", access, "--as", "alice", "--json"
        )
        assert r.code == 0, r.err
        sids.append(str(r.json()["session_id"]))
    return sids[0], sids[1]


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker]:
    """A root with a read and a read-write session of ``con`` (opened by alice),
    served by the real daemon; uid 0 is mapped to the admin ``ops``."""
    kb = KbRoot.create(tmp_path_factory.mktemp("broker") / "root")
    read_sid, write_sid = _build(kb)
    daemon.map_uid(kb.root, "ops", os.getuid())
    kb.exec_env = {}  # each test says which path it takes
    tokens = daemon.issue_tokens(kb.root, ["alice", "bob"])
    with daemon.serving(kb.root) as served:
        yield Broker(kb, served, read_sid, write_sid, tokens)


# -- the same answers on both paths -----------------------------------------------------------


def test_a_command_gets_its_stdio_output_and_status_through_the_daemon(broker: Broker) -> None:
    script = 'read line; echo "out:$line"; echo "err:$KBD_SESSION" >&2; exit 7'
    results = broker.both("exec", broker.read_sid, "--", "sh", "-c", script, input=b"hello\n")
    for r in results:
        assert (r.code, r.out, r.err) == (7, "out:hello\n", f"err:{broker.read_sid}\n")


def test_a_write_plan_writes_notes_through_the_daemon(broker: Broker) -> None:
    notes = broker.kb.workflows / "src" / "knowledgebase" / "notes"
    for i, r in enumerate(
        broker.kb.cli(
            "exec",
            broker.write_sid,
            "--",
            "sh",
            "-c",
            f'echo {n} > "$WORKFLOW_KB_SRC/notes/b{n}.md"',
            env=env,
        )
        for n, env in ((0, IN_PROCESS_ENV), (1, {"KBD_SOCKET": str(broker.daemon.sock)}))
    ):
        assert r.code == 0, r.err
        assert body_of((notes / f"b{i}.md").read_text()) == f"{i}\n"  # committed at exit, with provenance


# What a brokered `kbd exec` may import once Python has started (site included):
# kbd's thin client, its wire codec and error tree, and two C modules. Not
# typing (≈7 ms of re, enum and collections), socket or signal (≈6 ms).
THIN_CLIENT_MODULES = {"kbd", "kbd.cli", "kbd.cli.entry", "kbd.cli.exec_grammar", "kbd.cli.exec_run", "kbd.errors",
                       "kbd.client", "kbd.client.brokered", "kbd.core", "kbd.core.wire",
                       "__future__", "errno", "_socket", "_signal"}  # fmt: skip


def test_a_brokered_exec_imports_only_the_thin_client(broker: Broker) -> None:
    """The real entry point, run as the console script runs it, through the
    daemon: every module imported after ``site`` (``-X importtime`` lists them
    in completion order) belongs to the thin client."""
    r = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "from kbd.cli.entry import main; main()",
         "--root", str(broker.kb.root), "exec", broker.read_sid, "--", "sh", "-c", "echo ran"],
        env={**daemon.clean_env(), "KBD_SOCKET": str(broker.daemon.sock)},
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert (r.returncode, r.stdout) == (0, "ran\n"), r.stderr
    lines = r.stderr.splitlines()
    assert all(line.startswith("import time:") for line in lines), r.stderr
    names = [line.rsplit("|", 1)[1].strip() for line in lines[1:]]  # past the header line
    after_site = names[len(names) - names[::-1].index("site") :]
    assert "kbd.client.brokered" in after_site, after_site
    assert set(after_site) <= THIN_CLIENT_MODULES, sorted(set(after_site) - THIN_CLIENT_MODULES)


REFUSALS = {
    "unknown session (66)": (["exec", "s_00000000000000000000", "--", "true"], 66),
    "cwd outside the workflow (65)": (["exec", "{read}", "--cwd", "/etc", "--", "true"], 65),
    "empty --as (2)": (["exec", "{read}", "--as", "", "--", "true"], 2),
    "no command (2)": (["exec", "{read}", "--"], 2),
    "unknown option (2)": (["exec", "{read}", "--bogus", "--", "true"], 2),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_refusals_are_identical_on_both_paths(broker: Broker, case: str) -> None:
    args, code = REFUSALS[case]
    argv = [a.replace("{read}", broker.read_sid) for a in args]
    inproc, brokered = broker.both(*argv)
    assert inproc.code == code, inproc
    assert (brokered.code, brokered.out, brokered.err) == (inproc.code, inproc.out, inproc.err)


def test_a_closed_session_is_refused_alike_on_both_paths(broker: Broker) -> None:
    r = broker.kb.call(
        "session", "open", "con", "--kind", "execution", "--kb-access", "read", "--as", "alice", "--json"
    )
    sid = str(r.json()["session_id"])
    assert broker.kb.call("session", "close", sid).code == 0
    inproc, brokered = broker.both("exec", sid, "--", "true")
    assert inproc.code == 77, inproc
    assert (brokered.code, brokered.out, brokered.err) == (inproc.code, inproc.out, inproc.err)


def test_an_unavailable_sandbox_is_69_on_both_paths(broker: Broker) -> None:
    """Landlock alone cannot keep notes/_index.json read-only inside a writable
    notes/: the write plan is refused before anything runs."""
    cfg = broker.kb.root / "kbd.yaml"
    original = cfg.read_text()
    cfg.write_text(original.replace("backend: auto", "backend: landlock"))
    try:
        inproc, brokered = broker.both("exec", broker.write_sid, "--", "true")
    finally:
        cfg.write_text(original)
    assert inproc.code == 69 and "Landlock alone cannot enforce" in inproc.err, inproc
    assert (brokered.code, brokered.out, brokered.err) == (inproc.code, inproc.out, inproc.err)


def test_as_must_name_the_authenticated_principal(broker: Broker) -> None:
    """uid 0 is mapped to ``ops`` here: --as alice through the daemon would act
    as someone the connection did not authenticate as."""
    r = broker.kb.cli(
        "exec", broker.read_sid, "--as", "alice", "--", "true", env={"KBD_SOCKET": str(broker.daemon.sock)}
    )
    assert r.code == 77, r
    assert r.err == (
        "error[permission-denied]: --as names 'alice' but this connection authenticates as 'ops'\n"
        "hint: leave --as out (the daemon acts as your uid's or token's principal), or run in-process with "
        "KBD_NO_DAEMON=1\n"
    )
    assert (
        broker.kb.cli(
            "exec", broker.read_sid, "--as", "ops", "--", "true", env={"KBD_SOCKET": str(broker.daemon.sock)}
        ).code
        == 0
    )


def test_an_explicit_socket_that_does_not_answer_is_69(broker: Broker, tmp_path: Path) -> None:
    r = broker.kb.cli("exec", broker.read_sid, "--", "true", env={"KBD_SOCKET": str(tmp_path / "none.sock")})
    assert r.code == 69, r
    assert r.err.startswith(f"error[unavailable]: cannot reach the kbd daemon at {tmp_path / 'none.sock'}: ")
    r = broker.kb.cli("exec", "--socket", str(tmp_path / "none.sock"), broker.read_sid, "--", "true", env={})
    assert r.code == 69, r


def test_the_default_socket_is_found_and_a_missing_one_means_in_process(
    broker: Broker, tmp_path: Path
) -> None:
    """Without KBD_SOCKET the root's own socket is used (uid 0 → ops, so --as
    alice is refused there), and a root without a daemon runs in-process."""
    r = broker.kb.cli("exec", broker.read_sid, "--as", "alice", "--", "true", env={})
    assert r.code == 77 and "authenticates as 'ops'" in r.err, r
    other = KbRoot.create(tmp_path / "other")
    other.exec_env = {}
    other.workflow("w")
    r = other.call("session", "open", "w", "--kind", "execution", "--as", "alice", "--json")
    r = other.cli("exec", str(r.json()["session_id"]), "--as", "alice", "--", "true", env={})
    assert r.code == 0, r


def test_a_socket_of_another_root_is_refused(broker: Broker, tmp_path: Path) -> None:
    other = KbRoot.create(tmp_path / "other")
    other.exec_env = {}
    r = other.cli("exec", broker.read_sid, "--", "true", env={"KBD_SOCKET": str(broker.daemon.sock)})
    assert r.code == 69, r
    assert f"serves {broker.kb.root}, not {other.root}" in r.err


def test_a_token_authenticates_and_the_session_rules_authorize(broker: Broker) -> None:
    """As through the API: KBD_TOKEN names the principal (over the uid's
    mapping), and only a principal who may use the session runs in it; bob is
    answered as for a session that does not exist."""
    env = {"KBD_SOCKET": str(broker.daemon.sock)}
    r = broker.kb.cli("exec", broker.read_sid, "--", "true", env={**env, "KBD_TOKEN": broker.tokens["alice"]})
    assert r.code == 0, r
    r = broker.kb.cli("exec", broker.read_sid, "--", "true", env={**env, "KBD_TOKEN": broker.tokens["bob"]})
    assert (r.code, r.err) == (
        66,
        f"error[not-found]: no session '{broker.read_sid}'\nhint: `kbd session list` shows the sessions you may use\n",
    )
    r = broker.kb.cli("exec", broker.read_sid, "--", "true", env={**env, "KBD_TOKEN": "not-a-token"})
    assert (r.code, r.err.splitlines()[0]) == (77, "error[unauthenticated]: unknown token")


# -- the front door -----------------------------------------------------------------------------


def test_http_still_works_beside_exec_and_an_exec_request_without_fds_is_400(broker: Broker) -> None:
    with broker.daemon.client() as c:
        assert c.get("/v1/health").status_code == 200
    body = wire.encode_request(wire.Request(broker.read_sid, [b"true"]))
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(str(broker.daemon.sock))
        s.sendall(wire.request_head(len(body)) + body)  # no SCM_RIGHTS
        answer = _read_all(s)
    assert answer.startswith(b"HTTP/1.1 400 "), answer
    assert b"x-kbd-exit: 65\r\n" in answer
    assert b"send exactly 3" in answer
    # A slow API client whose first bytes look like a prefix of an exec request.
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(str(broker.daemon.sock))
        s.sendall(b"POST /v1/")
        time.sleep(0.05)  # not a wait: the rest arrives as a separate read, as a slow client's would
        s.sendall(b"nothing HTTP/1.1\r\nHost: kbd\r\nContent-Length: 0\r\n\r\n")
        answer = _read_all(s, until=b"\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 404 "), answer


def _daemon_fds(broker: Broker) -> int:
    return len(os.listdir(f"/proc/{broker.daemon.proc.pid}/fd"))


def test_descriptors_after_the_first_bytes_are_refused_at_once(broker: Broker) -> None:
    """One connection must not fill the daemon's descriptor table: descriptors
    come with the request's first bytes, three at most, and anything else is
    refused (and closed) as soon as it arrives, not when the body is complete."""
    head = wire.request_head(4_000_000)  # a body that would take long to arrive
    null = os.open(os.devnull, os.O_RDONLY)
    try:
        before = _daemon_fds(broker)
        for first in ([null] * 3, []):  # with a legitimate first message, and without
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(10)
                s.connect(str(broker.daemon.sock))
                anc = (
                    [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", first).tobytes())]
                    if first
                    else []
                )
                s.sendmsg([head], anc)
                sent = 0
                with contextlib.suppress(OSError):  # the daemon closes the connection when it refuses
                    for _ in range(200):
                        s.sendmsg(
                            [b"\x01"],
                            [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [null] * 4).tobytes())],
                        )
                        sent += 4
                answer = b""
                with contextlib.suppress(ConnectionResetError):  # unread bytes make the close a reset
                    answer = _read_all(s)
            # The refusal, when the reset did not eat it, names the descriptors.
            assert answer == b"" or (answer.startswith(b"HTTP/1.1 400 ") and b"descriptors" in answer), answer
            assert sent < 200 * 4  # refused long before the client was done
        wait_for(lambda: _daemon_fds(broker) <= before + 2, 5, "every received descriptor to be closed",
                 detail=lambda: (before, _daemon_fds(broker)))  # fmt: skip
    finally:
        os.close(null)


def test_a_request_dripped_a_byte_at_a_time_is_refused_at_the_overall_deadline(broker: Broker) -> None:
    """REQUEST_TIMEOUT bounds the whole request, not each read: a client that
    sends one byte every second cannot hold a broker thread and a cap slot."""
    from kbd.daemon.broker import REQUEST_TIMEOUT

    head = wire.request_head(1_000)
    null = os.open(os.devnull, os.O_RDONLY)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(REQUEST_TIMEOUT + 10)
            s.connect(str(broker.daemon.sock))
            s.sendmsg(
                [head], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [null] * 3).tobytes())]
            )
            started = time.monotonic()
            with contextlib.suppress(OSError):
                # A byte a second, until the broker answers (or closes).
                while time.monotonic() - started < REQUEST_TIMEOUT + 5:
                    if select.select([s], [], [], 0)[0]:
                        break
                    s.send(b"\x01")
                    select.select([s], [], [], 1.0)
            took = time.monotonic() - started
            answer = _read_all(s)
        assert took < REQUEST_TIMEOUT + 2.5, took
        assert answer.startswith(b"HTTP/1.1 408 ") or b"did not arrive" in answer, answer
    finally:
        os.close(null)


def _read_all(s: socket.socket, until: bytes | None = None) -> bytes:
    data = b""
    while True:
        try:
            more = s.recv(65536)
        except ConnectionResetError:
            # The broker closed with bytes of ours unread (a refused request it
            # stopped reading): Linux delivers its answer first, then the reset.
            return data
        if not more:
            return data
        data += more
        if until is not None and until in data:
            return data


# -- signals, and the death of either end ---------------------------------------------------------


def _client(kb: KbRoot, sid: str, script: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "kbd", "--root", str(kb.root), "exec", sid, "--", "sh", "-c", script]
    full = {k: v for k, v in os.environ.items() if not k.startswith("KBD_")}
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**full, **env})


def _wait_line(proc: subprocess.Popen[bytes], expected: bytes) -> None:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line == expected, (line, proc.stderr.read() if proc.poll() is not None and proc.stderr else b"")


SIGNALS = ["SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGWINCH"]


@pytest.mark.parametrize("name", SIGNALS)
def test_signals_reach_the_command_alike_on_both_paths(broker: Broker, name: str) -> None:
    """The landlock backend runs the command itself as the group leader, so a
    trap in it sees exactly which signal kbd exec forwarded."""
    signum = getattr(signal, name)
    cfg = broker.kb.root / "kbd.yaml"
    original = cfg.read_text()
    landlock = original.replace("backend: auto", "backend: landlock")
    cfg.write_text(landlock.replace("unsafe_landlock_writes: false", "unsafe_landlock_writes: true"))
    script = f"trap 'echo got {name[3:]}; exit 5' {name[3:]}; echo ready; while :; do sleep 0.05; done"
    try:
        for env in (IN_PROCESS_ENV, {"KBD_SOCKET": str(broker.daemon.sock)}):
            proc = _client(broker.kb, broker.read_sid, script, env)
            try:
                _wait_line(proc, b"ready\n")
                proc.send_signal(signum)
                out, err = proc.communicate(timeout=20)
            finally:
                if proc.poll() is None:
                    proc.kill()
                proc.communicate(timeout=10)
            assert (proc.returncode, out) == (5, f"got {name[3:]}\n".encode()), (env, err)
    finally:
        cfg.write_text(original)


def _tree(marker: str) -> list[int]:
    """The ``sleep MARKER`` processes alive (the command and its setsid child)."""
    return [pid for pid, cmdline in live_processes() if cmdline[-1:] == [marker] and "sleep" in cmdline[0]]


def _ancestors(pid: int) -> list[int]:
    out = []
    while pid > 1:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
        pid = int(stat[stat.rindex(b")") + 2 :].split()[1])
        out.append(pid)
    return out


def _assert_brokered(marker: str, *, daemon_pid: int, client_pid: int) -> None:
    """The command runs under the daemon, not under its client."""
    for pid in _tree(marker):
        line = _ancestors(pid)
        assert daemon_pid in line and client_pid not in line, (pid, line)


def _gone_within(marker: str, seconds: float, what: str) -> None:
    wait_for(lambda: not _tree(marker), seconds, what, max_interval=0.02, detail=lambda: _tree(marker))


def test_killing_the_client_kills_the_whole_tree_within_a_second(broker: Broker) -> None:
    marker = f"300.{uuid.uuid4().int % 10**9:09d}"
    script = f"setsid sleep {marker} & sleep 0.1; echo ready; exec sleep {marker}"
    proc = _client(broker.kb, broker.read_sid, script, {"KBD_SOCKET": str(broker.daemon.sock)})
    try:
        _wait_line(proc, b"ready\n")
        # The shell execs its sleep right after "ready".
        wait_for(lambda: len(_tree(marker)) >= 2, 10, "the command and its setsid child both running")
        _assert_brokered(marker, daemon_pid=broker.daemon.proc.pid, client_pid=proc.pid)
        proc.kill()
        proc.communicate(timeout=10)
        _gone_within(marker, 1.0, "the command's tree to die with its client")
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=10)
    # The daemon is fine and serves the next command.
    r = broker.kb.cli("exec", broker.read_sid, "--", "true", env={"KBD_SOCKET": str(broker.daemon.sock)})
    assert r.code == 0, r


def test_a_dead_daemon_ends_the_client_with_69_and_takes_the_tree(tmp_path: Path) -> None:
    kb = KbRoot.create(tmp_path / "root")
    read_sid, _ = _build(kb)
    daemon.map_uid(kb.root, "ops", os.getuid())
    served = daemon.start(kb.root)
    try:
        marker = f"300.{uuid.uuid4().int % 10**9:09d}"
        script = f"setsid sleep {marker} & sleep 0.1; echo ready; exec sleep {marker}"
        proc = _client(kb, read_sid, script, {"KBD_SOCKET": str(served.sock)})
        try:
            _wait_line(proc, b"ready\n")
            _assert_brokered(marker, daemon_pid=served.proc.pid, client_pid=proc.pid)
            left = _cgroups_holding(marker)
            served.proc.kill()
            served.proc.wait(timeout=10)  # reaped, as its supervisor would: no zombie keeps its pid
            _out, err = proc.communicate(timeout=10)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.communicate(timeout=10)
        assert proc.returncode == 69, err
        assert err.decode() == (
            "error[unavailable]: the kbd daemon stopped while the command ran; the command was terminated\n"
            "hint: check the daemon's log; KBD_NO_DAEMON=1 runs the command in-process\n"
        )
        _gone_within(marker, 1.0, "the command's tree to die with the daemon")
        # Its empty cgroup may be left behind (named after the dead daemon's
        # launcher: a stub's cgroup, made before the session was known); the
        # next daemon sweeps it.
        assert left, "the brokered command had a cgroup"
        with daemon.serving(kb.root):
            assert [p for p in left if os.path.exists(p)] == []
    finally:
        served.kill()


def _cgroups_holding(marker: str) -> list[str]:
    """The command cgroups (v2 and v1) that hold the ``sleep MARKER`` processes."""
    from kbd.sandbox import cgroup

    hierarchy = cgroup.detect()
    names = {
        line.rsplit("/", 1)[1]
        for pid in _tree(marker)
        for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines()
        if "/kbd/" in line
    }
    subtrees = [hierarchy.v2, *(h.subtree for h in hierarchy.v1)]
    return [f"{s}/{n}" for s in subtrees if s is not None for n in os.listdir(s) if n in names]


def test_sigterm_lets_a_short_command_finish_and_the_daemon_exits_0(tmp_path: Path) -> None:
    kb = KbRoot.create(tmp_path / "root")
    read_sid, _ = _build(kb)
    daemon.map_uid(kb.root, "ops", os.getuid())
    served = daemon.start(kb.root)
    try:
        proc = _client(kb, read_sid, "echo ready; sleep 1; echo done", {"KBD_SOCKET": str(served.sock)})
        _wait_line(proc, b"ready\n")
        served.stop()  # SIGTERM; asserts exit 0 and the socket removed
        out, err = proc.communicate(timeout=20)
        assert (proc.returncode, out) == (0, b"done\n"), err
    finally:
        served.kill()


def test_sigterm_terminates_a_long_command_after_the_grace_period(tmp_path: Path) -> None:
    kb = KbRoot.create(tmp_path / "root")
    cfg = kb.root / "kbd.yaml"
    cfg.write_text(cfg.read_text().replace("  grace_seconds: 5", "  grace_seconds: 0.5"))
    read_sid, _ = _build(kb)
    daemon.map_uid(kb.root, "ops", os.getuid())
    served = daemon.start(kb.root)
    marker = f"300.{uuid.uuid4().int % 10**9:09d}"
    try:
        proc = _client(kb, read_sid, f"echo ready; exec sleep {marker}", {"KBD_SOCKET": str(served.sock)})
        _wait_line(proc, b"ready\n")
        started = time.monotonic()
        served.stop()  # SIGTERM; asserts exit 0 and the socket removed
        assert time.monotonic() - started < 5.0, "the daemon waited longer than the grace period"
        _out, err = proc.communicate(timeout=20)
        assert proc.returncode == 128 + signal.SIGKILL, err  # its tree killed when the grace ran out
        assert _tree(marker) == []
    finally:
        served.kill()


# -- the identity invariant -------------------------------------------------------------------------

IDENTITY = (
    "id -u; id -g; id -G; umask; ulimit -n; cat group-only.txt; "
    "grep -E '^(Cap(Inh|Prm|Eff|Bnd|Amb)|NoNewPrivs):' /proc/self/status"
)
# bubblewrap's user namespace maps only the caller's uid and gid: a
# supplementary group is still held (group-only.txt is readable only through
# it) but shows as the overflow gid inside, as it does for an in-process run.
OVERFLOW_GID = "65534"


@pytest.mark.requires_reachable_checkout
def test_a_brokered_command_runs_with_exactly_the_callers_identity(user: User) -> None:
    """The root is reachable for the user only through its supplementary group
    (0750 root:group), so the sandbox is built with exactly the caller's own
    rights; inside, id, umask and rlimits are the caller's and no capability
    is left."""
    base = Path(tempfile.mkdtemp(prefix="kbd-identity-", dir="/tmp"))
    try:
        os.chown(base, 0, user.group_gid)
        os.chmod(base, 0o750)  # noqa: S103 - the user's group is its only way in
        kb = KbRoot.create(base / "root")
        for folder in (kb.root, kb.workflows):  # the way to the user's grants (bwrap opens them as the user)
            os.chown(folder, 0, user.group_gid)
        kb.workflow("w", access={"owners": ["alice"]})
        daemon.map_uid(kb.root, "alice", user.uid)
        secret = kb.workflows / "w" / "group-only.txt"
        secret.write_text("group only\n")
        os.chown(secret, 0, user.group_gid)
        os.chmod(secret, 0o640)
        r = kb.call("session", "open", "w", "--kind", "execution", "--as", "alice", "--json")
        assert r.code == 0, r.err
        sid = str(r.json()["session_id"])
        env = {k: v for k, v in os.environ.items() if not k.startswith("KBD_")}
        env.update(HOME="/", PATH="/usr/bin:/bin")
        own = as_user(user, ["sh", "-c", f"cd {kb.workflows / 'w'} && {IDENTITY}"], env)
        with serving_for(kb, base, user) as served:
            env["KBD_SOCKET"] = str(served.sock)
            kbd = [
                sys.executable,
                "-m",
                "kbd",
                "--root",
                str(kb.root),
                "exec",
                sid,
                "--",
                "sh",
                "-c",
                IDENTITY,
            ]
            brokered = as_user(user, kbd, {**env, "PYTHONPATH": str(Path(__file__).parents[2])})
        assert brokered.returncode == 0, brokered.stderr.decode()
        lines = brokered.stdout.decode().splitlines()
        expected = own.stdout.decode().splitlines()
        assert expected[:5] == [str(user.uid), str(user.gid), f"{user.gid} {user.group_gid}", "0027", "777"]
        assert lines[:6] == [*expected[:2], f"{user.gid} {OVERFLOW_GID}", *expected[3:5], "group only"]
        caps = dict(line.split(":\t") for line in lines[6:])
        assert {k: v.strip("0") for k, v in caps.items() if k.startswith("Cap")} == {
            k: "" for k in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")
        }, caps
        assert caps["NoNewPrivs"] == "1"
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.requires_reachable_checkout
def test_an_unmapped_uid_is_refused_not_run_as_the_operator(user: User) -> None:
    base = Path(tempfile.mkdtemp(prefix="kbd-unmapped-", dir="/tmp"))
    try:
        os.chown(base, 0, user.group_gid)
        os.chmod(base, 0o750)  # noqa: S103 - the user's group is its only way in
        kb = KbRoot.create(base / "root")
        for folder in (kb.root, kb.workflows):  # the way to the user's grants (bwrap opens them as the user)
            os.chown(folder, 0, user.group_gid)
        kb.workflow("w", access={"owners": ["alice"]})
        r = kb.call("session", "open", "w", "--kind", "execution", "--as", "alice", "--json")
        sid = str(r.json()["session_id"])
        env = {k: v for k, v in os.environ.items() if not k.startswith("KBD_")}
        env.update(HOME="/", PATH="/usr/bin:/bin", PYTHONPATH=str(Path(__file__).parents[2]))
        with serving_for(kb, base, user) as served:
            env["KBD_SOCKET"] = str(served.sock)
            kbd = [sys.executable, "-m", "kbd", "--root", str(kb.root), "exec", sid, "--", "true"]
            r2 = as_user(user, kbd, env)
        assert r2.returncode == 77, r2.stderr
        assert r2.stderr.decode().startswith("error[unauthenticated]: no credentials")
        # The hint says what to ask the host's operator for, with this user's own login.
        assert f"hint: ask this host's operator to map you to a principal (`kbd principals add NAME --user " \
               f"{user.name}`)" in r2.stderr.decode(), r2.stderr  # fmt: skip
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(base)


# -- the library entry (for kbd.client): caller-provided descriptors --------------------------------


def test_a_running_process_runs_commands_with_its_own_pipes(broker: Broker) -> None:
    """`thin.call` from a long-running process: the command's stdio are the
    pipes the caller passes, its status comes back, and a refusal is raised."""
    from kbd.client import brokered as thin

    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    try:
        os.write(in_w, b"piped\n")
        os.close(in_w)
        notices: list[str] = []
        status = thin.call(str(broker.daemon.sock), broker.read_sid, ["sh", "-c", "cat; echo e >&2; exit 4"],
                           stdio=(in_r, out_w, err_w), notice=notices.append)  # fmt: skip
        os.close(out_w)
        os.close(err_w)
        assert status == 4
        assert os.read(out_r, 100) == b"piped\n"
        assert os.read(err_r, 100) == b"e\n"
        assert notices == []
        with pytest.raises(thin.Refused) as refused:
            thin.call(str(broker.daemon.sock), "s_00000000000000000000", ["true"], stdio=(in_r, out_r, err_r))
        assert (refused.value.exit_code, refused.value.code) == (66, "not-found")
    finally:
        for fd in (in_r, out_r, err_r, out_w, err_w):
            with contextlib.suppress(OSError):
                os.close(fd)


def test_the_client_library_runs_commands_with_the_hosts_own_descriptors(broker: Broker) -> None:
    """`kbd.client.Client.exec`: the host's pipes are the command's stdio, its
    status comes back, and kbd's refusal arrives as the kbd.errors class of its
    code with its exit code."""
    from kbd.client import Client
    from kbd.errors import KbdError

    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    try:
        os.write(in_w, b"from the host\n")
        os.close(in_w)
        with Client(broker.daemon.sock) as client:
            status = client.exec(broker.read_sid, ["sh", "-c", 'cat; echo "$WORKFLOW_KB_ACCESS" >&2; exit 7'],
                                 stdin=in_r, stdout=out_w, stderr=err_w)  # fmt: skip
            os.close(out_w)
            os.close(err_w)
            assert status == 7
            assert os.read(out_r, 100) == b"from the host\n"
            assert os.read(err_r, 100) == b"read\n"
            with pytest.raises(KbdError) as refused:
                client.exec("s_00000000000000000000", ["true"], stdin=in_r, stdout=out_r, stderr=err_r)
            assert (refused.value.code, refused.value.exit_code) == ("not-found", 66)
            assert type(refused.value).__name__ != "KbdError"  # the tree's class, not the base
    finally:
        for fd in (in_r, out_r, err_r, out_w, err_w):
            with contextlib.suppress(OSError):
                os.close(fd)

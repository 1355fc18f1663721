"""No host directory descriptor reaches a sandboxed command.

An inherited fd to a pinned KB folder would let `/proc/self/fd/N/..` walk out of
the sandbox into the host's filesystem. The command must see only
its standard streams, in every kind of plan."""

from __future__ import annotations

import pytest

from tests.helpers import KbRoot

# Real commands under bubblewrap (the read-write plan adds the inner Landlock helper).
# Every test runs on both exec paths: in-process and through the daemon's broker.
pytestmark = [
    pytest.mark.requires_bwrap,
    pytest.mark.requires_landlock(abi=2),
    pytest.mark.usefixtures("exec_mode"),
]


@pytest.fixture
def world(kb: KbRoot) -> KbRoot:
    kb.workflow("src", access={"owners": ["bob"], "readers": ["alice"], "allowed_kb_writers": ["con"]})
    kb.workflow("priv", access={"owners": ["carol"]})
    kb.workflow(
        "con",
        access={"owners": ["alice"]},
        sources=[
            {"workflow_id": "src", "alias": "src", "access": "write"},
            {"workflow_id": "priv", "alias": "priv"},
        ],
    )
    return kb


@pytest.mark.parametrize(
    ("kind", "mode"),
    [("execution", "read-write"), ("execution", "read"), ("reviewer_strategic", "read"), ("builder", "none")],
)
def test_only_standard_streams_reach_the_command(world: KbRoot, kind: str, mode: str) -> None:
    sid = world.call(
        "session", "open", "con", "--kind", kind, "--kb-access", mode, "--as", "alice", "--json"
    ).json()["session_id"]
    # The shell's descriptors, listed by a child (ls) so the listing opens nothing in the shell.
    r = world.cli("exec", sid, "--", "sh", "-c", "ls /proc/$$/fd")
    assert r.code == 0, r.err
    assert r.out.split() == ["0", "1", "2"], r.out
    # Every descriptor number a leak could take, tried by a child of one sandboxed
    # shell (each `cat` inherits exactly the descriptors the command got, as a
    # `kbd exec` per number would); `done` proves the loop ran in the sandbox.
    probe = (
        "n=3; while [ $n -lt 40 ]; do cat /proc/self/fd/$n/../credentials/token 2>/dev/null;"
        " n=$((n + 1)); done; echo done"
    )
    leak = world.cli("exec", sid, "--", "sh", "-c", probe)
    assert leak.code == 0, leak.err
    assert "secret-" not in leak.out
    assert leak.out.splitlines()[-1:] == ["done"], leak.out

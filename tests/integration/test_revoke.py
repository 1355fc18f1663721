"""Running commands and revocation (docs/sessions.md "Closing and revoking"): a command started under an
older plan is listed as stale, is never claimed revoked while it runs, and is
terminated (process group) only when asked."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import KbRoot, alive
from tests.waiting import wait_for


@pytest.mark.requires_bwrap
@pytest.mark.requires_landlock(abi=2)  # the inner helper of write plans
def test_stale_commands_are_listed_and_terminated_only_when_asked(kb: KbRoot) -> None:
    kb.workflow("src", access={"owners": ["bob"], "readers": ["alice"], "allowed_kb_writers": ["con"]})
    kb.workflow(
        "con",
        access={"owners": ["alice"]},
        sources=[{"workflow_id": "src", "alias": "src", "access": "write"}],
    )
    sid = kb.open_session("con", kind="execution", kb_access="read-write", actor="alice")
    runner = subprocess.Popen(
        [sys.executable, "-m", "kbd", "--root", str(kb.root), "exec", sid, "--", "sh", "-c", "sleep 60"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for(
            lambda: kb.cli("session", "show", sid, "--json").json()["running"], 15, "the command to be listed"
        )
        running = kb.cli("session", "show", sid, "--json").json()["running"]
        assert (
            len(running) == 1
            and running[0]["stale"] is False
            and running[0]["argv"] == ["sh", "-c", "sleep 60"]
        )
        pgid = running[0]["pgid"]
        # Nothing changed yet: nothing to revoke.
        assert kb.cli("session", "revoke", sid, "--json").json() == {
            "session_id": sid, "generation": running[0]["generation"], "terminated": [], "still_running": []
        }  # fmt: skip
        # The owner revokes the writer grant: the running command is now stale.
        assert kb.cli("writers", "revoke", "src", "con", "--as", "bob").code == 0
        show = kb.cli("session", "show", sid)
        assert "STALE" in show.out
        # Without --immediate, kbd says it is still running, and does not touch it.
        r = kb.cli("session", "revoke", sid, "--json").json()
        assert r["terminated"] == [] and r["still_running"] == [pgid]
        assert runner.poll() is None and alive(pgid)
        text = kb.cli("session", "revoke", sid)
        assert "STILL RUNNING" in text.out
        # --immediate terminates the whole process group and says so.
        r = kb.cli("session", "revoke", sid, "--immediate", "--json").json()
        assert r["terminated"] == [pgid] and r["still_running"] == []
        runner.wait(timeout=30)
        assert runner.returncode != 0
        wait_for(lambda: not alive(pgid), 15, "the revoked process group to be gone")
        assert kb.cli("session", "show", sid, "--json").json()["running"] == []
        events = [e for e in kb.cli("audit", "--json").json()["events"] if e["event"] == "session_revoke"]
        assert events[-1]["terminated"] == [pgid]
    finally:
        if runner.poll() is None:
            runner.kill()
            runner.wait(timeout=30)


@pytest.mark.requires_bwrap
def test_a_closed_session_refuses_new_commands_and_lists_old_ones_for_revocation(kb: KbRoot) -> None:
    kb.workflow("con", access={"owners": ["alice"]})
    sid = kb.cli("session", "open", "con", "--kind", "reviewer_strategic", "--as", "alice", "--json").json()[
        "session_id"
    ]
    runner = subprocess.Popen(
        [sys.executable, "-m", "kbd", "--root", str(kb.root), "exec", sid, "--", "sleep", "60"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for(
            lambda: kb.cli("session", "show", sid, "--json").json()["running"], 15, "the command to be listed"
        )
        assert kb.cli("session", "close", sid).code == 0
        assert kb.cli("exec", sid, "--", "true").code == 77
        # Contract (docs/sessions.md "Closing and revoking"): closing now terminates the session's
        # commands itself (it used to leave them for `revoke --immediate`).
        closes = [e for e in kb.cli("audit", "--json").json()["events"] if e["event"] == "session_closed"]
        assert len(closes[-1]["terminated"]) == 1
        runner.wait(timeout=30)
        r = kb.cli("session", "revoke", sid, "--immediate", "--json").json()
        assert r["terminated"] == [] and r["still_running"] == []
    finally:
        if runner.poll() is None:
            runner.kill()
            runner.wait(timeout=30)

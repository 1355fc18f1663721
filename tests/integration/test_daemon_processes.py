"""The daemon as a process among processes: its socket, restarts, and the CLI and
the daemon working on one root at the same time (docs/sessions.md, docs/cli.md, docs/notes.md)."""

from __future__ import annotations

import json
import os
import sqlite3
import stat
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tests.helpers import KbRoot
from tests.integration.daemon import clean_env, issue_tokens, serving, socket_path, start

TEAM = {"owners": ["alice"], "readers": ["bob"]}
WORKERS = 4
PER_WORKER = 15


def test_socket_is_private_and_sigterm_stops_cleanly(kb: KbRoot) -> None:
    token = issue_tokens(kb.root, ["alice"])["alice"]
    sock = socket_path(kb.root)
    with serving(kb.root) as daemon:
        st = os.lstat(sock)
        assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o660
        assert stat.S_IMODE(os.lstat(sock.parent).st_mode) == 0o750
        assert daemon.client(token).get("/v1/whoami").json()["id"] == "alice"
        # A second daemon on the same socket refuses to start and leaves the first alone.
        second = subprocess.run(
            [sys.executable, "-m", "kbd", "--root", str(kb.root), "serve", "--socket", str(sock)],
            capture_output=True,
            env=clean_env(),
            timeout=60,
            check=False,
        )
        assert second.returncode == 69, second.stderr
        err = second.stderr.decode()
        # It names the daemon that holds the socket and says what to do, not a generic hint.
        assert f"error[unavailable]: another kbd daemon (pid {daemon.proc.pid}, uid {os.getuid()}) is already " \
               f"serving {sock}" in err, err  # fmt: skip
        assert "hint: stop it first" in err and "--socket PATH" in err and "kbd doctor" not in err, err
        assert daemon.client(token).get("/v1/whoami").status_code == 200
    # serving() asserted exit status 0 and that the socket is gone.
    assert not os.path.lexists(sock)


def test_a_killed_daemons_stale_socket_is_replaced(kb: KbRoot) -> None:
    sock = socket_path(kb.root)
    crashed = start(kb.root)
    crashed.kill()  # SIGKILL: no cleanup
    assert stat.S_ISSOCK(os.lstat(sock).st_mode)
    with serving(kb.root) as daemon:
        assert daemon.client().get("/v1/health").json()["status"] == "ok"


def test_restart_loses_no_session(kb: KbRoot) -> None:
    kb.workflow("src", access=TEAM)
    con = kb.workflow("con", access=TEAM, sources=[{"workflow_id": "src", "alias": "rts"}])
    kb.workflow("other", access={"owners": ["carol"]})
    tokens = issue_tokens(kb.root, ["alice", "bob", "svc"])
    requests: list[tuple[str, dict[str, Any]]] = [
        ("alice", {"workflow_id": "con", "kind": "builder"}),
        ("alice", {"workflow_id": "con", "kind": "execution", "kb_access": "read-write"}),
        ("bob", {"workflow_id": "con", "kind": "reviewer_strategic"}),
        ("svc", {"workflow_id": "other", "kind": "kb_maintenance", "kb_access": "none"}),
        (
            "svc",
            {"workflow_id": "con", "kind": "message_sequence", "kb_access": "write", "item_kb_write": True},
        ),
    ]
    plans: dict[str, dict[str, Any]] = {}
    with serving(kb.root) as daemon:
        clients = {pid: daemon.client(t) for pid, t in tokens.items()}
        for pid, body in requests:
            r = clients[pid].post("/v1/sessions", json=body)
            assert r.status_code == 201, r.text
            plans[r.json()["session_id"]] = r.json()
        first = next(iter(plans))
        r = clients["alice"].post(f"/v1/sessions/{first}/children", json={})
        assert r.status_code == 201, r.text
        child = r.json()["session_id"]
        plans[child] = r.json()
        closed = clients["alice"].post("/v1/sessions", json={"workflow_id": "con", "kind": "builder"}).json()
        assert clients["alice"].delete(f"/v1/sessions/{closed['session_id']}").status_code == 200
        for sid in plans:  # what a GET says now is what must survive
            plans[sid] = clients["svc"].get(f"/v1/sessions/{sid}").json()
        listed = {x["session_id"] for x in clients["svc"].get("/v1/sessions").json()["sessions"]}
        assert listed == set(plans)

    with serving(kb.root) as daemon:
        svc = daemon.client(tokens["svc"])
        for sid, plan in plans.items():
            r = svc.get(f"/v1/sessions/{sid}")
            assert r.status_code == 200, r.text
            assert r.json() == plan, sid  # same plan, same generation
        assert {x["session_id"] for x in svc.get("/v1/sessions").json()["sessions"]} == set(plans)
        r = svc.get(f"/v1/sessions/{closed['session_id']}")
        assert r.status_code == 410 and r.json()["error"]["code"] == "session-closed"

    # Changed while no daemon ran: the next lookup rebuilds the plan with a higher generation.
    kb.edit(con, knowledgebase_sources=[])
    with serving(kb.root) as daemon:
        svc = daemon.client(tokens["svc"])
        for sid, plan in plans.items():
            now = svc.get(f"/v1/sessions/{sid}").json()
            assert "WORKFLOW_KB_RTS" not in now["env"]
            if "WORKFLOW_KB_RTS" in plan["env"]:  # its grants changed
                assert now["generation"] == plan["generation"] + 1, sid
                assert now["sources"] == []
            else:
                assert now["generation"] == plan["generation"], sid


def _concatenated_json(text: str) -> list[dict[str, Any]]:
    """The CLI prints one indented JSON document per call; split a loop's output into them."""
    decoder = json.JSONDecoder()
    out: list[dict[str, Any]] = []
    pos = 0
    while True:
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if pos == len(text):
            return out
        doc, pos = decoder.raw_decode(text, pos)
        out.append(doc)


CLI_LOOP = """
i=0
while [ "$i" -lt "$T_COUNT" ]; do
    "$T_PY" -m kbd --root "$T_ROOT" session open con --kind execution --as alice --json || exit $?
    i=$((i + 1))
done
"""


class Progress:
    """How many sessions the CLI loops have opened so far (and how many loops ended)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.opened = 0
        self.ended = 0

    def bump(self, *, ended: bool = False) -> None:
        with self.cond:
            if ended:
                self.ended += 1
            else:
                self.opened += 1
            self.cond.notify_all()

    def wait_for(self, n: int) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: self.opened >= n or self.ended == WORKERS, timeout=60)


class CliLoop:
    """One `sh` process running `kbd session open … --json` PER_WORKER times; its output is
    read as it comes, so progress is known while it runs."""

    def __init__(self, env: dict[str, str], progress: Progress) -> None:
        self.proc = subprocess.Popen(
            ["sh", "-c", CLI_LOOP], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
        )
        self.progress = progress
        self.out = bytearray()
        self.err = bytearray()
        self.threads = [threading.Thread(target=self._stdout), threading.Thread(target=self._stderr)]
        for th in self.threads:
            th.start()

    def _stdout(self) -> None:
        assert self.proc.stdout is not None
        try:
            for line in iter(self.proc.stdout.readline, b""):
                self.out += line
                if line == b"}\n":  # the end of one indented JSON document: one session opened
                    self.progress.bump()
        finally:
            self.progress.bump(ended=True)

    def _stderr(self) -> None:
        assert self.proc.stderr is not None
        self.err += self.proc.stderr.read()

    def finish(self) -> list[dict[str, Any]]:
        code = self.proc.wait(timeout=120)
        for th in self.threads:
            th.join(timeout=60)
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()
        err = self.err.decode()
        assert code == 0 and "Traceback" not in err, err
        return _concatenated_json(self.out.decode())


def test_cli_and_daemon_opening_sessions_at_once_corrupt_nothing(kb: KbRoot) -> None:
    kb.workflow("src", access=TEAM)
    kb.workflow("con", access=TEAM, sources=[{"workflow_id": "src", "alias": "rts"}])
    tokens = issue_tokens(kb.root, ["alice", "svc"])
    total_cli = WORKERS * PER_WORKER
    with serving(kb.root) as daemon:
        env = clean_env() | {"T_PY": sys.executable, "T_ROOT": str(kb.root), "T_COUNT": str(PER_WORKER)}
        progress = Progress()

        def api_worker(n: int) -> list[str]:
            pid = "alice" if n % 2 else "svc"
            client = daemon.client(tokens[pid])
            sids = []
            for i in range(PER_WORKER):
                # Spread the API calls over the CLI loops' run, so they really overlap.
                progress.wait_for(i * total_cli // PER_WORKER)
                r = client.post("/v1/sessions", json={"workflow_id": "con", "kind": "builder"})
                assert r.status_code == 201, r.text
                sids.append(r.json()["session_id"])
            return sids

        loops = [CliLoop(env, progress) for _ in range(WORKERS)]
        with ThreadPoolExecutor(WORKERS) as pool:
            futures = [pool.submit(api_worker, n) for n in range(WORKERS)]
            cli_plans = [plan for loop in loops for plan in loop.finish()]
            api_sids = [sid for f in futures for sid in f.result(timeout=120)]
        assert progress.opened == total_cli
        cli_sids = [plan["session_id"] for plan in cli_plans]
        assert len(cli_sids) == len(api_sids) == WORKERS * PER_WORKER
        everything = cli_sids + api_sids
        assert len(set(everything)) == 2 * WORKERS * PER_WORKER  # every ID distinct

        listed = kb.cli("session", "list", "--json")
        assert listed.code == 0, listed.err
        rows = listed.json()["sessions"]
        assert sorted(r["session_id"] for r in rows) == sorted(everything)
        by_id = {r["session_id"]: r for r in rows}
        assert all(
            by_id[sid]["opened_by"] == "alice" and by_id[sid]["kind"] == "execution" for sid in cli_sids
        )
        assert all(by_id[sid]["kind"] == "builder" for sid in api_sids)
        svc = daemon.client(tokens["svc"])
        served = svc.get("/v1/sessions").json()["sessions"]
        assert sorted(r["session_id"] for r in served) == sorted(everything)
        # Every session still yields its plan through the daemon.
        src_kb = str(kb.workflows.resolve() / "src" / "knowledgebase")
        for sid in everything:
            plan = svc.get(f"/v1/sessions/{sid}").json()
            assert plan["session_id"] == sid and plan["env"]["WORKFLOW_KB_RTS"] == src_kb

    db = sqlite3.connect(kb.root / "state" / "sessions.db")
    try:
        assert db.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        assert db.execute("SELECT COUNT(*), COUNT(DISTINCT id) FROM sessions").fetchone() == (120, 120)
    finally:
        db.close()
    # The audit log has one whole line for every opening, none torn.
    audit = kb.cli("audit", "--json")
    assert audit.code == 0, audit.err
    opened = [e["session"] for e in audit.json()["events"] if e["event"] == "session_opened"]
    assert sorted(opened) == sorted(everything)

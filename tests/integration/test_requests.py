"""Access requests through the real daemon, with real principals and their tokens
(docs/access.md "Access requests"): asked, listed only to the asker and the source's owners,
approved (the grant made by the operation `kbd writers grant` / `kbd readers grant` is, audited
with the request's ID), declined with a message, expired, never duplicated, and announced on the
change feed only to those who may see both workflows."""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import KbRoot
from tests.integration.daemon import Daemon, issue_tokens, serving
from tests.unit.service.test_why import _world

PIDS = ("alice", "bob", "carol", "dave", "ops")


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[KbRoot, Daemon, dict[str, str]]]:
    kb = _world(tmp_path / "root")
    tokens = issue_tokens(kb.root, PIDS)
    with serving(kb.root) as daemon:
        yield kb, daemon, tokens


@pytest.fixture(scope="module")
def refusing(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[KbRoot, Daemon, dict[str, str]]]:
    """One daemon for every refusal case: a refused request changes nothing (each case checks)."""
    kb = _world(tmp_path_factory.mktemp("requests") / "root")
    tokens = issue_tokens(kb.root, PIDS)
    with serving(kb.root) as daemon:
        yield kb, daemon, tokens


def _cli(kb: KbRoot, daemon: Daemon, tokens: dict[str, str], pid: str, *args: str) -> Any:
    """``kbd ARGS`` as principal ``pid`` through the daemon (its token, the daemon's socket), run
    by the real entry point in this process (tests/helpers.py run_in_process)."""
    return kb.call(*args, env={"KBD_SOCKET": str(daemon.sock), "KBD_TOKEN": tokens[pid]})


def _events(daemon: Daemon, token: str) -> list[dict[str, Any]]:
    r = daemon.client(token).get("/v1/events", params={"follow": "false"})
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]


def test_a_write_request_is_asked_listed_approved_and_audited(
    served: tuple[KbRoot, Daemon, dict[str, str]],
) -> None:
    kb, daemon, tokens = served
    asked = _cli(
        kb,
        daemon,
        tokens,
        "carol",
        "request",
        "write",
        "rts",
        "--for",
        "perf",
        "--message",
        "joins",
        "--json",
    )
    assert asked.code == 0, asked.err
    req = asked.json()
    assert (req["state"], req["kind"], req["source"], req["consumer"], req["requested_by"], req["can_decide"]) == (
        "pending", "write", "rts", "perf", "carol", False)  # fmt: skip
    rid = req["request_id"]
    # One open request per (source, consumer, kind): dave (perf's editor) asking again is refused.
    again = _cli(kb, daemon, tokens, "dave", "request", "write", "rts", "--for", "perf")
    assert again.code == 75 and f"request {rid} already asks" in again.err, again.err
    # Listed to carol (who asked) and alice (rts's owner, who decides); not to bob or dave.
    listed = {pid: [r["request_id"] for r in _cli(kb, daemon, tokens, pid, "requests", "list", "--json").json()["requests"]]
              for pid in PIDS}  # fmt: skip
    assert listed == {"alice": [rid], "bob": [], "carol": [rid], "dave": [], "ops": [rid]}, listed
    # carol may see it but not decide it; bob may not even see it.
    assert _cli(kb, daemon, tokens, "carol", "requests", "approve", str(rid)).code == 77
    assert _cli(kb, daemon, tokens, "bob", "requests", "approve", str(rid)).code == 66
    approved = _cli(kb, daemon, tokens, "alice", "requests", "approve", str(rid), "--json")
    assert approved.code == 0 and approved.json()["state"] == "approved", approved.err
    assert kb.read_manifest(kb.workflows / "rts")["access"]["allowed_kb_writers"] == ["perf"]
    (granted,) = kb.audit_events("writer_granted")
    assert (granted["actor"], granted["consumer"], granted["request_id"]) == ("alice", "perf", rid)
    (decided,) = kb.audit_events("request_decided")
    assert (decided["request_id"], decided["decision"]) == (rid, "approved")
    # The requester sees the outcome; deciding twice is refused.
    (mine,) = _cli(kb, daemon, tokens, "carol", "requests", "list", "--json").json()["requests"]
    assert (mine["state"], mine["decided_by"]) == ("approved", "alice")
    assert _cli(kb, daemon, tokens, "alice", "requests", "decline", str(rid)).code == 65
    # The feed: request.opened and .decided reach those who may see rts and perf; alice may not see perf.
    for pid, sees in (("carol", True), ("ops", True), ("alice", False), ("bob", True)):
        types = {e["type"] for e in _events(daemon, tokens[pid]) if e.get("request_id") == rid}
        assert types == ({"request.opened", "request.decided"} if sees else set()), (pid, types)


def test_a_read_request_admits_the_whole_audience_and_a_decline_says_why(
    served: tuple[KbRoot, Daemon, dict[str, str]],
) -> None:
    kb, daemon, tokens = served
    # carol may not see secret: asking about it gets the answer a missing workflow gets.
    hidden = _cli(kb, daemon, tokens, "carol", "request", "read", "secret", "--for", "perf")
    missing = _cli(kb, daemon, tokens, "carol", "request", "read", "no_such", "--for", "perf")
    assert hidden.code == missing.code == 66 and hidden.err.replace("secret", "X") == missing.err.replace(
        "no_such", "X"
    )
    # Let carol see secret (a reader), so she can ask; perf's audience (bob, dave) is still not admitted.
    kb.edit(kb.workflows / "secret", access={"owners": ["alice"], "readers": ["carol"]})
    r = _cli(kb, daemon, tokens, "carol", "request", "read", "secret", "--for", "perf", "--json")
    assert r.code == 0, r.err
    rid = r.json()["request_id"]
    declined = _cli(
        kb, daemon, tokens, "alice", "requests", "decline", str(rid), "--message", "not yet", "--json"
    )
    assert declined.code == 0 and (declined.json()["state"], declined.json()["decision_message"]) == (
        "declined", "not yet")  # fmt: skip
    assert kb.read_manifest(kb.workflows / "secret")["access"]["readers"] == ["carol"]
    r = _cli(kb, daemon, tokens, "carol", "request", "read", "secret", "--for", "perf", "--json")
    assert r.code == 0, r.err  # a decided request is not open: asking again is allowed
    approved = _cli(kb, daemon, tokens, "ops", "requests", "approve", str(r.json()["request_id"]))
    assert approved.code == 0, approved.err
    assert kb.read_manifest(kb.workflows / "secret")["access"]["readers"] == ["carol", "bob", "dave"]
    status = _cli(kb, daemon, tokens, "carol", "sources", "list", "perf", "--json").json()["sources"]
    assert [a["available"] for a in status if a["alias"] == "sec"] == [True]


def test_requests_expire(served: tuple[KbRoot, Daemon, dict[str, str]]) -> None:
    kb, daemon, tokens = served
    r = _cli(kb, daemon, tokens, "carol", "request", "write", "rts", "--for", "perf", "--json")
    rid = r.json()["request_id"]
    assert r.json()["expires_at"] > r.json()["opened_at"]
    # Its time runs out (14 days by default: the row's deadline is moved, not the clock).
    with sqlite3.connect(kb.root / "state" / "requests.sqlite") as con:
        con.execute("UPDATE requests SET expires_at = ? WHERE id = ?", (time.time() - 1, rid))
    (listed,) = _cli(kb, daemon, tokens, "alice", "requests", "list", "--json").json()["requests"]
    assert (listed["state"], listed["can_decide"]) == ("expired", False)
    assert _cli(kb, daemon, tokens, "alice", "requests", "approve", str(rid)).code == 65
    assert kb.read_manifest(kb.workflows / "rts")["access"].get("allowed_kb_writers", []) == []
    assert _cli(kb, daemon, tokens, "carol", "request", "write", "rts", "--for", "perf").code == 0


@pytest.mark.parametrize(
    ("pid", "args", "code", "words"),
    [
        ("bob", ["request", "write", "rts", "--for", "perf"], 77, "owners, editors and admins"),
        ("carol", ["request", "write", "perf", "--for", "perf"], 65, "the source itself"),
        ("carol", ["request", "write", "legacy", "--for", "perf"], 65, "no owner"),
        ("carol", ["request", "read", "cost", "--for", "perf"], 65, "already admits"),
        ("carol", ["request", "write", "rts", "--for", "perf", "--message", "x" * 501], 65, "at most 500"),
        (
            "carol",
            ["request", "write", "rts", "--for", "perf", "--message", "a\x1bb"],
            65,
            "control character",
        ),
        ("carol", ["request", "exec", "rts", "--for", "perf"], 2, "'read', 'write'"),
        ("carol", ["requests", "approve", "0"], 2, "ID"),
        ("carol", ["requests", "approve", "999"], 66, "no access request 999"),
    ],
)
def test_bad_requests_are_refused_with_their_reason(
    refusing: tuple[KbRoot, Daemon, dict[str, str]], pid: str, args: list[str], code: int, words: str
) -> None:
    kb, daemon, tokens = refusing
    r = _cli(kb, daemon, tokens, pid, *args)
    assert r.code == code and words in r.err, r.err
    assert (
        not (kb.root / "state" / "requests.sqlite").exists()
        or _cli(kb, daemon, tokens, "ops", "requests", "list", "--json").json()["requests"] == []
    )

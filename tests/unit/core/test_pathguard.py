"""The path guard's decision (kbd.core.pathguard), pure: grants in, an answer or
"allowed if no link stands below this grant" out. The file-system half is
tested through kbd.service.sessions.check in tests/unit/test_plans.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from kbd.core.pathguard import LinkCheckNeeded, PathCheck, decide
from kbd.core.plan import LOCAL_KB, OWN, Grant, Origin, Plan
from kbd.errors import InvalidInput

WF = Path("/w/con")
SRC = Path("/w/src/knowledgebase/notes")


def plan(*grants: Grant) -> Plan:
    return Plan(workflow_id="con", kind="execution", kb_access="read-write", effective="read-write",
                workflow_folder=WF, env={}, grants=grants, sources=(), folders=(), context="")  # fmt: skip


PLAN = plan(
    Grant(WF, "write", OWN),
    Grant(WF / "workflow.json", "read_only", OWN),
    Grant(WF / "credentials", "hidden", OWN),
    Grant(WF / "knowledgebase", "write", LOCAL_KB),
    Grant(Path("/w/rts/knowledgebase"), "read", Origin("kb", "rts")),
    Grant(SRC, "write", Origin("kb_write", "src")),
)


def test_a_path_the_grants_allow_still_needs_the_link_check() -> None:
    verdict = decide(PLAN, "/w/con/runs/out.txt", "write")
    assert verdict == LinkCheckNeeded(Grant(WF, "write", OWN), WF / "runs" / "out.txt", folder=False)
    assert isinstance(verdict, LinkCheckNeeded)
    assert verdict.allowed() == PathCheck(allowed=True, reason="write grant (own)")
    # The deepest grant decides: a read grant inside nothing wider.
    read = decide(PLAN, "/w/rts/knowledgebase/notes/fact.md", "read")
    assert isinstance(read, LinkCheckNeeded) and read.grant.origin == Origin("kb", "rts")
    assert isinstance(decide(PLAN, "/w/con/runs/", "read"), LinkCheckNeeded)
    assert decide(PLAN, "/w/con/runs/", "read") == LinkCheckNeeded(
        Grant(WF, "write", OWN), WF / "runs", folder=True
    )


@pytest.mark.parametrize(
    ("path", "mode", "reason"),
    [
        ("relative/x", "read", "path must be absolute"),
        ("/w/con/../src/x", "read", "path must not contain '..'"),
        ("/etc/passwd", "read", "not granted to this session"),
        ("/w/con/credentials/token", "read", "hidden in this session (own)"),
        ("/w/con/workflow.json", "write", "read-only (own)"),
        ("/w/rts/knowledgebase/notes/fact.md", "write", "read-only (kb:rts)"),
    ],
)
def test_refusals_name_the_reason(path: str, mode: str, reason: str) -> None:
    assert decide(PLAN, path, mode) == PathCheck(allowed=False, reason=reason)


def test_a_bad_name_is_refused_before_any_grant_is_looked_at() -> None:
    verdict = decide(PLAN, "/w/con/a\nb", "read")
    assert isinstance(verdict, PathCheck) and not verdict.allowed and verdict.reason.startswith("path ")


def test_writes_into_a_sources_notes_follow_the_note_name_rules() -> None:
    ok = decide(PLAN, f"{SRC}/sub/new.md", "write")
    assert isinstance(ok, LinkCheckNeeded) and ok.grant.origin == Origin("kb_write", "src")
    for bad in (f"{SRC}/_index.json", f"{SRC}//sub/./x.txt", f"{SRC}/"):
        verdict = decide(PLAN, bad, "write")
        assert isinstance(verdict, PathCheck) and not verdict.allowed, bad
    # Reading the same names is a plain grant question.
    assert isinstance(decide(PLAN, f"{SRC}/_index.json", "read"), LinkCheckNeeded)


def test_an_unknown_mode_is_bad_input() -> None:
    with pytest.raises(InvalidInput, match="mode 'exec' is not allowed; allowed: read, write"):
        decide(PLAN, "/w/con/x", "exec")


def test_the_answer_is_the_contract_shape() -> None:
    assert PathCheck(allowed=False, reason="r").to_json() == {"allowed": False, "reason": "r"}

"""``kbd why`` (docs/access.md "Why: explaining a decision"): every reason a path is refused,
each fix run as printed and then answered allowed, what a caller may learn, and the verdict
always the path guard's.

The world: perf (owners carol, editors dave, readers bob) attaches cost read-only, rts with write
access (not granted), secret (whose audience is alice only: audience_denied) and legacy (no
owner); other is not attached. The fixes are run through the real entry point as the
principal the fix names, so a fix that names the wrong command, the wrong principal or a
change that does not allow the path fails here.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kbd.core import pathguard
from kbd.core.pathguard import LinkCheckNeeded
from kbd.core.why import REASON_ORDER, locate
from kbd.service import why as why_service
from kbd.service.sessions import RootSessions, check_path
from tests.helpers import OPERATOR, KbRoot, snapshot

AUDIENCE = {"owners": ["alice"], "readers": ["carol", "dave", "bob"]}
SOURCES = [
    {"workflow_id": "cost", "alias": "cost"},
    {"workflow_id": "rts", "alias": "rts", "access": "write"},
    {"workflow_id": "secret", "alias": "sec"},
    {"workflow_id": "legacy", "alias": "leg"},
]


def _world(root: Path) -> KbRoot:
    kb = KbRoot.create(root)
    kb.workflow(
        "perf", access={"owners": ["carol"], "editors": ["dave"], "readers": ["bob"]}, sources=SOURCES
    )
    for wid in ("cost", "rts", "other"):
        kb.workflow(wid, access=AUDIENCE)
    kb.workflow("secret", access={"owners": ["alice"]})
    kb.workflow("legacy")
    return kb


@pytest.fixture
def kb(tmp_path: Path) -> KbRoot:
    return _world(tmp_path / "root")


def why(kb: KbRoot, sid: str, path: str, mode: str = "read", *, as_: str = "carol") -> dict[str, Any]:
    r = kb.call("why", sid, path, "--mode", mode, "--as", as_, "--json")
    assert r.code in (0, 77), r.err
    answer: dict[str, Any] = r.json()
    assert (r.code == 0) == answer["allowed"], answer
    return answer


def codes(answer: dict[str, Any]) -> list[str]:
    return [r["code"] for r in answer["reasons"]]


def run_fix(kb: KbRoot, answer: dict[str, Any]) -> str | None:
    """Run every step of the answer's fix as printed; the new session's ID when a step opens one."""
    assert answer["fix"] is not None, answer
    new_sid = None
    for step in answer["fix"]["steps"]:
        argv = shlex.split(step["command"])
        assert argv[0] == "kbd", step
        if step["by"]:
            assert argv[-2:] == ["--as", step["by"][0]], step
        r = kb.call(*argv[1:], "--json")
        assert r.code == 0, (step, r.err)
        if argv[1:3] == ["session", "open"]:
            new_sid = r.json()["session_id"]
    return new_sid


# -- each reason, and each fix run ------------------------------------------------------------


@pytest.mark.parametrize(
    ("kb_access", "path", "mode", "expected", "by"),
    [
        # Attached read-only, and the owner never granted perf: two people, two steps.
        (
            "read-write",
            "cost:notes/x.md",
            "write",
            ["read_only_attachment", "write_not_granted"],
            ["carol", "alice"],
        ),
        # Attached with write access, not granted by rts's owner.
        ("read-write", "rts:notes/x.md", "write", ["write_not_granted"], ["alice"]),
        # The session's --kb-access reads nothing: a new session would.
        ("write", "$WORKFLOW_KB_RTS/notes/fact.md", "read", ["kb_access"], ["carol"]),
        # audience_denied: the caller (carol, perf's owner) may not see secret, so no names;
        # alice (secret's owner, but not in perf's audience) may not even ask. The operator sees all.
    ],
)
def test_a_refusal_names_its_reasons_and_its_fix_allows_it(
    kb: KbRoot, kb_access: str, path: str, mode: str, expected: list[str], by: list[str]
) -> None:
    sid = kb.open_session("perf", kind="execution", kb_access=kb_access, actor="carol")
    answer = why(kb, sid, path, mode)
    assert (answer["allowed"], codes(answer)) == (False, expected), answer
    assert [s["by"][0] for s in answer["fix"]["steps"]] == by
    assert answer["fix"]["command"] == answer["fix"]["steps"][0]["command"]
    new_sid = run_fix(kb, answer)
    after = why(kb, new_sid or sid, path, mode)
    assert after["allowed"] and after["reasons"] == [] and after["fix"] is None, after
    assert after["granted_by"] == {"kind": "source", "alias": path.split(":")[0].lower().split("_")[-1].split("/")[0]
                                   if ":" in path else "rts", "workflow_id": "cost" if "cost" in path else "rts"}  # fmt: skip


def test_kb_access_and_write_grant_fixed_together(kb: KbRoot) -> None:
    """A read session writing a read-only attachment: the attachment, the grant and a new session."""
    sid = kb.open_session("perf", kind="execution", kb_access="read", actor="carol")
    answer = why(kb, sid, "$WORKFLOW_KB_COST/notes/x.md", "write")
    assert codes(answer) == ["kb_access", "read_only_attachment", "write_not_granted"], answer
    commands = [s["command"] for s in answer["fix"]["steps"]]
    assert commands == [
        "kbd sources access perf cost write --as carol",
        "kbd writers grant cost perf --as alice",
        "kbd session open perf --kind execution --kb-access read-write --as carol",
    ]
    new_sid = run_fix(kb, answer)
    assert new_sid is not None and why(kb, new_sid, "$WORKFLOW_KB_COST/notes/x.md", "write")["allowed"]


def test_audience_denied_names_the_missing_readers_to_those_who_may_see_them(kb: KbRoot) -> None:
    sid = kb.open_session("perf", kind="execution", kb_access="read", actor="carol")
    # carol owns perf but may not see secret: its owner and audience stay unnamed.
    hidden = why(kb, sid, "sec:notes/fact.md")
    assert codes(hidden) == ["attachment_unavailable"] and hidden["fix"] is None, hidden
    assert "alice" not in str(hidden) and "does not admit" not in str(hidden)
    assert hidden["no_fix"].startswith("only the source's owners")
    # The root's operator (the CLI on the root, no --as) sees everything: the fix names them.
    r = kb.call("why", sid, "sec:notes/fact.md", "--json")
    assert r.code == 77, r.err
    shown = r.json()
    assert "does not admit bob, carol, dave" in shown["reasons"][0]["message"], shown
    assert shown["fix"]["command"] == "kbd readers grant secret bob carol dave --as alice"
    run_fix(kb, shown)
    assert why(kb, sid, "sec:notes/fact.md")["allowed"]


def test_not_attached_workflow_is_named_only_to_those_who_may_see_it(kb: KbRoot) -> None:
    sid = kb.open_session("perf", kind="execution", kb_access="read", actor="carol")
    other = kb.workflows / "other" / "knowledgebase" / "notes" / "fact.md"
    answer = why(kb, sid, str(other))
    assert codes(answer) == ["not_attached"], answer
    assert answer["fix"]["command"] == "kbd sources attach perf other --alias other --as carol"
    run_fix(kb, answer)
    assert why(kb, sid, str(other))["allowed"]
    # secret's folder: carol may not see secret (attached as sec, unavailable), so a host path
    # into it is just outside every grant, its name not repeated; the operator learns whose it is.
    secret = kb.workflows / "secret" / "knowledgebase" / "notes" / "fact.md"
    outside = why(kb, sid, str(secret))
    assert codes(outside) == ["outside_grants"] and "secret" not in str(outside["reasons"]), outside
    r = kb.call("why", sid, str(secret), "--json")
    assert [x["code"] for x in r.json()["reasons"]] == ["attachment_unavailable"], r.out
    kb.call("sources", "detach", "perf", "sec", "--as", "carol")
    assert codes(why(kb, sid, str(secret))) == ["outside_grants"]
    r = kb.call("why", sid, str(secret), "--json")
    assert [x["code"] for x in r.json()["reasons"]] == ["not_attached", "attachment_unavailable"], r.out


@pytest.mark.parametrize(
    ("path", "mode", "code"),
    [
        ("rts:context/about.md", "write", "protected"),
        ("rts:notes/_index.json", "write", "protected"),
        ("rts:notes/_INDEX.json", "write", "protected"),
        ("rts:", "write", "protected"),
        ("workflow.json", "write", "protected"),
        ("$WORKFLOW_KB_COST/../soul/x", "read", "invalid_path"),
        ("/usr/bin/ls", "read", "outside_grants"),
        ("/", "read", "outside_grants"),
    ],
)
def test_paths_no_change_can_open(kb: KbRoot, path: str, mode: str, code: str) -> None:
    sid = kb.open_session("perf", kind="execution", kb_access="read-write", actor="carol")
    answer = why(kb, sid, path, mode)
    assert code in codes(answer) and answer["fix"] is None and answer["no_fix"], answer
    if code in ("protected", "outside_grants"):
        assert answer["no_fix"] == "nothing: this path is never granted"


def test_a_sources_private_folder_is_hidden_never_fixable(kb: KbRoot) -> None:
    sid = kb.open_session("perf", kind="execution", kb_access="read-write", actor="carol")
    for private in ("soul/x", "credentials/token", "workflow.json"):
        answer = why(kb, sid, str(kb.workflows / "cost" / private))
        assert codes(answer) == ["hidden"] and answer["no_fix"] == "nothing: this path is never granted", (
            answer
        )


def test_the_kind_decides_where_no_session_of_it_may(kb: KbRoot) -> None:
    """A reviewer never writes sources; an execution session never writes its own context/."""
    kb.call("writers", "grant", "rts", "perf", "--as", "alice")
    rev = kb.open_session("perf", kind="reviewer_strategic", kb_access="read", actor="carol")
    answer = why(kb, rev, "rts:notes/x.md", "write")
    assert codes(answer) == ["kind"] and answer["fix"] is None, answer
    ex = kb.open_session("perf", kind="execution", kb_access="read-write", actor="carol")
    own = why(kb, ex, "knowledgebase/context/a.md", "write")
    assert codes(own) == ["kind"] and answer["fix"] is None, own
    assert why(kb, ex, "knowledgebase/notes/a.md", "write")["granted_by"] == {
        "kind": "own",
        "workflow_id": "perf",
    }


def test_own_kb_hidden_by_kb_access_none_is_fixed_by_a_new_session(kb: KbRoot) -> None:
    sid = kb.open_session("perf", kind="execution", kb_access="none", actor="carol")
    answer = why(kb, sid, "knowledgebase/context/about.md")
    assert codes(answer) == ["kb_access"], answer
    new_sid = run_fix(kb, answer)
    assert new_sid and why(kb, new_sid, "knowledgebase/context/about.md")["allowed"]


def test_legacy_source_and_missing_notes_have_no_fix(kb: KbRoot) -> None:
    sid = kb.open_session("perf", kind="execution", kb_access="read-write", actor="carol")
    legacy = why(kb, sid, "leg:notes/x.md", "write")
    assert codes(legacy) == ["read_only_attachment", "write_not_granted"] and legacy["fix"] is None, legacy
    assert "no owner" in legacy["no_fix"]
    kb.call("writers", "grant", "rts", "perf", "--as", "alice")
    (kb.workflows / "rts" / "knowledgebase" / "notes" / "fact.md").unlink()
    (kb.workflows / "rts" / "knowledgebase" / "notes" / "_index.json").unlink()
    (kb.workflows / "rts" / "knowledgebase" / "notes").rmdir()
    gone = why(kb, sid, "rts:notes/x.md", "write")
    assert codes(gone) == ["notes_unavailable"] and gone["fix"] is None, gone


def test_names_and_links_the_guard_refuses(kb: KbRoot) -> None:
    kb.call("writers", "grant", "rts", "perf", "--as", "alice")
    sid = kb.open_session("perf", kind="execution", kb_access="read-write", actor="carol")
    assert why(kb, sid, "rts:notes/x.md", "write")["allowed"]
    bad = why(kb, sid, "rts:notes/x.bin", "write")
    assert codes(bad) == ["invalid_name"] and bad["fix"] is None, bad
    (kb.workflows / "rts" / "knowledgebase" / "notes" / "link").symlink_to(kb.workflows / "rts" / "soul")
    linked = why(kb, sid, "rts:notes/link/x.md", "write")
    assert codes(linked) == ["symlink"] and linked["fix"] is None, linked


def test_folder_grants(kb: KbRoot, tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    (shared / "ro").mkdir(parents=True)
    kb.set_config(folder_roots=[str(shared)])
    perf = kb.workflows / "perf"
    kb.edit(perf, folder_access=[{"alias": "ro", "path": str(shared / "ro")},
                                 {"alias": "gone", "path": str(shared / "gone")}])  # fmt: skip
    sid = kb.open_session("perf", kind="execution", kb_access="read", actor="carol")
    assert why(kb, sid, str(shared / "ro" / "a"))["granted_by"] == {"kind": "folder", "alias": "ro"}
    assert codes(why(kb, sid, str(shared / "ro" / "a"), "write")) == ["read_only_folder"]
    assert codes(why(kb, sid, "$WORKFLOW_FOLDER_RO/a", "write")) == ["read_only_folder"]
    assert codes(why(kb, sid, str(shared / "gone" / "a"))) == ["outside_grants"]


def test_unknown_alias_and_variable(kb: KbRoot) -> None:
    sid = kb.open_session("perf", kind="execution", kb_access="read", actor="carol")
    assert codes(why(kb, sid, "nope:x")) == ["not_attached"]
    assert codes(why(kb, sid, "$WORKFLOW_KB_NOPE/x")) == ["not_attached"]


# -- refusals of the question itself ----------------------------------------------------------


def test_bad_questions_are_refused_with_the_field_named(kb: KbRoot) -> None:
    sid = kb.open_session("perf", kind="execution", kb_access="read", actor="carol")
    r = kb.call("why", sid, "cost:x", "--mode", "exec")
    assert r.code == 2 and "--mode" in r.err, r.err
    r = kb.call("why", "s_nosuch", "cost:x", "--as", "carol")
    assert r.code == 66, r.err
    # bob (a reader of perf) may not ask about carol's session: the answer a missing one gets.
    r = kb.call("why", sid, "cost:x", "--as", "bob")
    assert r.code == 66 and sid in r.err, r.err
    r = kb.call("why", "attach", "perf", "cost", "--access", "admin")
    assert r.code == 2 and "--access" in r.err, r.err


def test_why_attach(kb: KbRoot) -> None:
    ok = kb.call("why", "attach", "perf", "other", "--as", "carol", "--json")
    assert ok.code == 0 and ok.json()["granted_by"] == {
        "kind": "source",
        "alias": "other",
        "workflow_id": "other",
    }
    write = kb.call("why", "attach", "perf", "other", "--access", "write", "--as", "carol", "--json")
    assert write.code == 77 and write.json()["fix"]["command"] == "kbd writers grant other perf --as alice"
    # An unattached source carol may not see answers as a missing one does, word for word.
    kb.workflow("hidden", access={"owners": ["alice"]})
    hidden = kb.call("why", "attach", "perf", "hidden", "--as", "carol", "--json")
    missing = kb.call("why", "attach", "perf", "no_such_wf", "--as", "carol", "--json")
    assert hidden.code == missing.code == 77 and hidden.out == missing.out, (hidden.out, missing.out)
    # An attached one answers with the status `kbd sources list` shows her, naming no one.
    attached = kb.call("why", "attach", "perf", "secret", "--as", "carol", "--json")
    assert (
        "audience_denied" in attached.out and "alice" not in attached.out and attached.json()["fix"] is None
    )
    # alice may see secret but not perf: perf is not found for her.
    assert kb.call("why", "attach", "perf", "secret", "--as", "alice").code == 66
    # An admin sees who is missing, and the fix works.
    shown = kb.call("why", "attach", "perf", "secret", "--as", "ops", "--json")
    assert (
        shown.code == 77
        and shown.json()["fix"]["command"] == "kbd readers grant secret bob carol dave --as alice"
    )
    run_fix(kb, shown.json())
    assert kb.call("why", "attach", "perf", "secret", "--as", "carol").code == 0


def test_asking_changes_nothing(kb: KbRoot) -> None:
    sid = kb.open_session("perf", kind="execution", kb_access="read", actor="carol")
    before = snapshot(kb.workflows)
    for path in ("cost:notes/x.md", "sec:x", str(kb.workflows / "other" / "knowledgebase")):
        why(kb, sid, path, "write")
    kb.call("why", "attach", "perf", "secret", "--access", "write", "--as", "ops")
    assert snapshot(kb.workflows) == before


def test_text_output(kb: KbRoot) -> None:
    sid = kb.open_session("perf", kind="execution", kb_access="read-write", actor="carol")
    r = kb.call("why", sid, "cost:notes/x.md", "--mode", "write", "--as", "carol")
    assert r.code == 77
    assert r.out.splitlines() == [
        "refused: write cost:notes/x.md",
        "  - read_only_attachment: cost (cost) is attached read-only in perf's workflow.json",
        "  - write_not_granted: the source's owner has not granted 'perf' write access "
        "(`kbd writers grant cost perf`)",
        "fix: kbd sources access perf cost write --as carol   (by carol, dave)",
        "  then: kbd writers grant cost perf --as alice   (by alice)",
    ]
    r = kb.call("why", "path", sid, "cost:notes/fact.md", "--as", "carol")
    assert (r.code, r.out) == (0, "allowed: read cost:notes/fact.md (granted by source cost, cost)\n")


# -- readers -----------------------------------------------------------------------------------


def test_readers_grant_and_revoke(kb: KbRoot) -> None:
    r = kb.call("readers", "grant", "secret", "bob", "--as", "carol")
    assert r.code == 66, r.err  # carol may not see secret: not found
    r = kb.call("readers", "grant", "cost", "erin", "--as", "carol")
    assert r.code == 77 and "only its owners or an admin" in r.err, r.err
    before = (kb.workflows / "cost" / "workflow.json").read_bytes()
    for bad in ("", " ", "a/b", "x\ny"):
        r = kb.call("readers", "grant", "cost", bad, "--as", "alice")
        assert r.code in (64, 65) and (kb.workflows / "cost" / "workflow.json").read_bytes() == before, (
            bad,
            r.err,
        )
    r = kb.call("readers", "grant", "legacy", "bob", "--as", "ops")
    assert r.code == 65 and "no owner" in r.err, r.err
    r = kb.call("readers", "grant", "cost", "erin", "bob", "--as", "alice", "--json")
    assert r.code == 0 and r.json()["readers"] == ["carol", "dave", "bob", "erin"] and r.json()["changed"]
    r = kb.call("readers", "revoke", "cost", "erin", "nobody", "--as", "alice", "--json")
    assert r.code == 0 and r.json()["readers"] == ["carol", "dave", "bob"], r.out
    assert kb.read_manifest(kb.workflows / "cost")["access"]["owners"] == ["alice"]
    assert [e["principals"] for e in kb.audit_events("readers_granted")] == [["erin", "bob"]]
    assert kb.audit_events("readers_refused")


# -- the verdict is the path guard's -----------------------------------------------------------

_WORLD: dict[str, Any] = {}


def _shared_world(tmp_path_factory: pytest.TempPathFactory) -> tuple[KbRoot, RootSessions, list[str]]:
    if not _WORLD:
        kb = _world(tmp_path_factory.mktemp("why") / "root")
        kb.call("writers", "grant", "rts", "perf", "--as", "alice")
        sessions = RootSessions(kb.host())
        sids = [kb.open_session("perf", kind=kind, kb_access=access, actor="carol")
                for kind in ("execution", "builder", "reviewer_strategic", "kb_maintenance")
                for access in ("none", "read", "write", "read-write")]  # fmt: skip
        _WORLD.update(kb=kb, sessions=sessions, sids=sids)
    return _WORLD["kb"], _WORLD["sessions"], _WORLD["sids"]


_PARTS = st.sampled_from(["knowledgebase", "notes", "context", "_index.json", "_INDEX.json", "x.md", "x.bin",
                          "soul", "workflow.json", "..", ".", "", "a b", "fact.md", "about.md", "credentials"])  # fmt: skip
_BASES = st.sampled_from(["perf", "cost", "rts", "secret", "legacy", "other", "", "..", "/usr", "/tmp", "/"])
_SPELLINGS = st.sampled_from(["host", "relative", "alias", "variable"])


@given(
    sid_index=st.integers(0, 15),
    base=_BASES,
    parts=st.lists(_PARTS, max_size=4),
    spelling=_SPELLINGS,
    alias=st.sampled_from(["cost", "rts", "sec", "leg", "nope"]),
    mode=st.sampled_from(["read", "write"]),
)
def test_why_verdict_is_check_verdict(
    tmp_path_factory: pytest.TempPathFactory, sid_index: int, base: str, parts: list[str], spelling: str,
    alias: str, mode: str,
) -> None:  # fmt: skip
    kb, sessions, sids = _shared_world(tmp_path_factory)
    sid = sids[sid_index]
    rel = "/".join(parts)
    if spelling == "host":
        asked = base if base.startswith("/") else f"{kb.workflows}/{base}"
        asked = f"{asked.rstrip('/')}/{rel}" if rel else asked
    elif spelling == "relative":
        asked = rel or "."
    elif spelling == "alias":
        asked = f"{alias}:{rel}"
    else:
        asked = f"$WORKFLOW_KB_{alias.upper()}/{rel}"
    answer = why_service.why_path(sessions, sid, asked, mode, actor=OPERATOR)
    plan = sessions.plan(sid, actor=OPERATOR)
    located = locate(plan, asked).path
    if located is None:
        assert not answer.allowed
    else:
        checked = check_path(plan, located, mode)
        assert answer.allowed == checked.allowed, (asked, answer, checked)
        # The grants' decision first; the file system's link check can only refuse more.
        if not isinstance(pathguard.decide(plan, located, mode), LinkCheckNeeded):
            assert not answer.allowed
    if answer.allowed:
        assert answer.granted_by is not None and not answer.reasons and answer.fix is None
    else:
        order = [REASON_ORDER.index(r.code) for r in answer.reasons]
        assert order and order == sorted(order), answer
        assert (answer.fix is None) != (answer.no_fix is None), answer
        for step in answer.fix.steps if answer.fix else ():
            assert step.command.startswith("kbd ") and "\n" not in step.command


def test_the_readme_examples_are_what_kbd_prints(kb: KbRoot) -> None:
    """README "When kbd says no", replayed on this module's world (perf, cost, secret)."""
    readme = (Path(__file__).resolve().parents[3] / "README.md").read_text()
    section = readme[readme.index("## When kbd says no") :]
    block = section[section.index("```console\n") + 11 : section.index("```\n", section.index("```console"))]
    sid = kb.open_session("perf", kind="execution", kb_access="read-write", actor="carol")
    commands = block.split("$ ")[1:]
    assert len(commands) == 3
    for item in commands:
        line, _, expected = item.partition("\n")
        argv = [a.replace("$SID", sid) for a in shlex.split(line)]
        assert argv[0] == "kbd"
        r = kb.call(*argv[1:])
        assert r.code == 77 and r.out == expected, (line, r.out, r.err)


# -- what an attacker or an odd question gets ------------------------------------------------------


def test_fix_commands_are_quoted_and_never_carry_text_no_principal_could_be(kb: KbRoot) -> None:
    """An unknown access tier holds any text; it must never reach a command meant to be pasted."""
    perf = kb.workflows / "perf"
    doc = kb.read_manifest(perf)
    doc["access"]["viewers"] = ["x; touch /tmp/pwned #"]
    kb.write_manifest(perf, doc)
    sid = kb.open_session("perf", kind="execution", kb_access="read", actor="carol")
    r = kb.call("why", sid, "sec:notes/fact.md", "--json")
    answer = r.json()
    assert answer["fix"] is None and "touch" not in json.dumps(answer["fix"]), answer
    # Odd but valid IDs are quoted word by word.
    assert why_service.free_alias("WF-Big", set()) == "wf_big"
    from kbd.core.why import Facts, _step

    facts = Facts(policy=None, item_kb_write=False, managers=(), sources={})  # type: ignore[arg-type]
    assert _step(["writers", "grant", "wf:ü", "a$b"], ("o'k",), facts).command == (
        "kbd writers grant 'wf:ü' 'a$b' --as 'o'\"'\"'k'"
    )


def test_audience_denied_write_fix_covers_every_step(kb: KbRoot) -> None:
    sid = kb.open_session("perf", kind="execution", kb_access="read-write", actor="carol")
    r = kb.call("why", sid, "sec:notes/x.md", "--mode", "write", "--json")  # the operator sees secret
    answer = r.json()
    assert codes(answer) == ["attachment_unavailable", "read_only_attachment", "write_not_granted"], answer
    assert [s["command"].split(" --as")[0] for s in answer["fix"]["steps"]] == [
        "kbd readers grant secret bob carol dave",
        "kbd sources access perf sec write",
        "kbd writers grant secret perf",
    ]
    run_fix(kb, answer)
    assert why(kb, sid, "sec:notes/x.md", "write")["allowed"]


def test_no_fix_for_what_no_change_opens_even_behind_an_unavailable_attachment(kb: KbRoot) -> None:
    sid = kb.open_session("perf", kind="execution", kb_access="read-write", actor="carol")
    for path, mode, code in [("sec:../soul/x", "read", "invalid_path"), ("$WORKFLOW_KB_SEC/../soul", "read", "invalid_path"),
                             ("sec:notes/x.bin", "write", "invalid_name"), ("rts:notes/x.bin", "write", "invalid_name")]:  # fmt: skip
        r = kb.call("why", sid, path, "--mode", mode, "--json")
        assert r.code == 77 and codes(r.json()) == [code] and r.json()["fix"] is None, (path, r.out)
    other = kb.workflows / "other" / "knowledgebase" / "notes" / "x.bin"
    answer = why(kb, sid, str(other), "write")
    assert "invalid_name" in codes(answer) and answer["fix"] is None, answer


def test_a_fix_names_only_principals_who_could_run_it(kb: KbRoot) -> None:
    kb.edit(kb.workflows / "rts", access={**AUDIENCE, "owners": ["mallory", "ghost", "alice"]})
    sid = kb.open_session("perf", kind="execution", kb_access="read-write", actor="carol")
    answer = why(kb, sid, "rts:notes/x.md", "write")
    assert answer["fix"]["command"] == "kbd writers grant rts perf --as alice" and answer["fix"]["by"] == [
        "alice"
    ]


def test_the_item_flag_is_part_of_the_fix(kb: KbRoot) -> None:
    kb.call("writers", "grant", "rts", "perf", "--as", "alice")
    sid = kb.open_session("perf", kind="message_sequence", kb_access="read-write", actor="carol")
    answer = why(kb, sid, "rts:notes/x.md", "write")
    assert codes(answer) == ["kb_access"] and "--item-kb-write" in answer["fix"]["command"], answer
    new_sid = run_fix(kb, answer)
    assert new_sid and why(kb, new_sid, "rts:notes/x.md", "write")["allowed"]


def test_why_attach_refuses_what_attach_refuses(kb: KbRoot) -> None:
    r = kb.call("why", "attach", "perf", "perf", "--as", "carol")
    assert r.code == 65 and "itself" in r.err, r.err


def test_odd_paths_get_answers_not_internal_errors(kb: KbRoot) -> None:
    sid = kb.open_session("perf", kind="execution", kb_access="read", actor="carol")
    for path in (
        "x" * 5000,
        "cost:" + "y" * 300,
        f"{kb.workflows}/{'z' * 300}",
        "cost:\n",
        "${WORKFLOW_KB_}/x",
        "cost:",
    ):
        r = kb.call("why", sid, path, "--as", "carol")
        assert r.code in (0, 77), (path[:40], r.err)
        r = kb.call("check", sid, path if path.startswith("/") else f"/{path}", "--mode", "read")
        assert r.code in (0, 77), (path[:40], r.err)
    r = kb.call("why", sid, "\udcff", "--as", "carol")
    assert r.code in (64, 65) and "Traceback" not in r.err, r.err
    # A path spelled with '//' or '/./' is judged as the explainer reads it.
    other = f"{kb.workflows}//other/./knowledgebase/notes/fact.md"
    assert codes(why(kb, sid, other)) == ["not_attached"]

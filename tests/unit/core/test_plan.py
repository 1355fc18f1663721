"""``grants_shrunk`` (docs/daemon.md "Pushed revocation"): the pure decision behind pushed
revocation. Properties over random grant sets on a small tree, checked against
a brute-force oracle that compares access at *every* folder of the tree (the
function compares only at grant paths), plus plans built by ``build_plan``."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from kbd.core.plan import Grant, GrantMode, Origin, Plan, grants_shrunk

ROOT = Path("/r")
# Every folder of a small tree, and one below each leaf that no grant names.
TREE = [ROOT / p for p in ("", "a", "a/x", "a/x/deep", "a/y", "b", "b/z", "b/z/deep", "c")]
MODES: tuple[GrantMode, ...] = ("read", "write", "read_only", "hidden")
OWN = Origin("own")


def plan(grants: list[Grant], env: dict[str, str] | None = None) -> Plan:
    return Plan(workflow_id="w", kind="execution", kb_access="read", effective="read", workflow_folder=ROOT,
                env=env or {}, grants=tuple(grants), sources=(), folders=(), context="")  # fmt: skip


grant_lists = st.lists(
    st.builds(Grant, st.sampled_from(TREE[:-1]), st.sampled_from(MODES), st.just(OWN)), max_size=8
)
envs = st.dictionaries(
    st.sampled_from(["WORKFLOW_KB_A", "WORKFLOW_FOLDER_B", "OTHER"]), st.sampled_from(["/1", "/2"])
)


def oracle_access(grants: list[Grant] | tuple[Grant, ...], path: Path) -> int:
    """Access at ``path`` by the rule the sandbox applies, written out as sets."""
    above = [g for g in grants if path == g.path or path.is_relative_to(g.path)]
    if any(g.mode == "hidden" for g in above):
        return 0
    level = max([{"read": 1, "write": 2}[g.mode] for g in above if g.mode in ("read", "write")], default=0)
    return min(level, 1) if any(g.mode == "read_only" for g in above) else level


def oracle(old: Plan, new: Plan) -> bool:
    anywhere = any(oracle_access(new.grants, p) < oracle_access(old.grants, p) for p in TREE)
    pushed = {k: v for k, v in old.env.items() if k.startswith(("WORKFLOW_KB_", "WORKFLOW_FOLDER_"))}
    return anywhere or any(new.env.get(k) != v for k, v in pushed.items())


@given(grant_lists, grant_lists, envs, envs)
def test_shrunk_exactly_when_some_folder_lost_access_or_a_variable_was_lost(
    a: list[Grant], b: list[Grant], env_a: dict[str, str], env_b: dict[str, str]
) -> None:
    old, new = plan(a, env_a), plan(b, env_b)
    assert grants_shrunk(old, new) == oracle(old, new)


@given(grant_lists, envs)
def test_a_plan_never_shrinks_against_itself(a: list[Grant], env: dict[str, str]) -> None:
    assert not grants_shrunk(plan(a, env), plan(list(reversed(a)), env))


@given(
    grant_lists,
    st.lists(st.builds(Grant, st.sampled_from(TREE), st.sampled_from(("read", "write")), st.just(OWN))),
)
def test_adding_read_or_write_grants_never_shrinks(a: list[Grant], extra: list[Grant]) -> None:
    assert not grants_shrunk(plan(a), plan(a + extra))


@given(grant_lists, grant_lists, grant_lists)
def test_not_shrinking_is_transitive(a: list[Grant], b: list[Grant], c: list[Grant]) -> None:
    if not grants_shrunk(plan(a), plan(b)) and not grants_shrunk(plan(b), plan(c)):
        assert not grants_shrunk(plan(a), plan(c))


def test_the_cases_pushed_revocation_acts_on() -> None:
    kb, notes = ROOT / "b", ROOT / "b" / "z"
    attached = plan(
        [Grant(ROOT / "a", "write", OWN), Grant(kb, "read", Origin("kb", "s"))], {"WORKFLOW_KB_S": str(kb)}
    )
    detached = plan([Grant(ROOT / "a", "write", OWN)])
    assert grants_shrunk(attached, detached)  # a detach
    assert not grants_shrunk(detached, attached)  # an attach
    writer = replace(attached, grants=(*attached.grants, Grant(notes, "write", Origin("kb_write", "s"))))
    assert grants_shrunk(writer, attached)  # a revoked writer: notes/ write became read
    # A new overlay over something granted narrows it; over nothing it does not.
    assert grants_shrunk(
        attached, replace(attached, grants=(*attached.grants, Grant(ROOT / "a" / "x", "read_only", OWN)))
    )
    assert not grants_shrunk(
        attached, replace(attached, grants=(*attached.grants, Grant(ROOT / "c", "hidden", OWN)))
    )
    # The same grants, the variable moved to another folder: the command's variable is stale.
    assert grants_shrunk(attached, replace(attached, env={"WORKFLOW_KB_S": "/elsewhere"}))
    # A folder grant widened to its parent still covers the old path.
    assert not grants_shrunk(
        plan([Grant(ROOT / "a" / "x", "read", OWN)]), plan([Grant(ROOT / "a", "write", OWN)])
    )

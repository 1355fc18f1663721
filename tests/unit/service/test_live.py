"""The live state's decisions (kbd/service/live.py): which running commands a
re-plan acts on. (Which events a manifest change gives is the change feed's one
producer, tested in tests/unit/service/test_events.py.)"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from kbd.core.plan import Grant, Origin, Plan
from kbd.service.live import commands_to_act
from kbd.state.processes import ProcessRow

OWN = Origin("own")


def plan(generation: int, *paths: str) -> Plan:
    return Plan(workflow_id="w", kind="execution", kb_access="read", effective="read", workflow_folder=Path("/w"),
                env={}, grants=tuple(Grant(Path(p), "read", OWN) for p in paths), sources=(), folders=(),
                context="", generation=generation)  # fmt: skip


def proc(pid: int, generation: int) -> ProcessRow:
    return ProcessRow("s", pid, pid, generation, 0.0, ["sh"])


def test_only_commands_of_older_generations_whose_grants_shrank_are_acted_on() -> None:
    wide, narrow = plan(1, "/a", "/b"), plan(2, "/a")
    procs = [proc(10, 1), proc(11, 2)]
    assert commands_to_act(procs, new=narrow, history={1: wide}, acted=set()) == [procs[0]]
    # Widening: nothing.
    assert commands_to_act(procs[:1], new=plan(2, "/a", "/b", "/c"), history={1: wide}, acted=set()) == []
    # Already acted on (pid, generation): not twice.
    assert commands_to_act(procs, new=narrow, history={1: wide}, acted={(10, 1)}) == []
    # The plan of the command's generation is unknown (a restart): fail safe.
    assert commands_to_act(procs[:1], new=plan(2, "/a", "/b", "/c"), history={}, acted=set()) == procs[:1]
    # The session has no plan now (its workflow is gone): every command.
    assert commands_to_act(procs, new=None, history={1: wide}, acted=set()) == procs


def test_commands_of_a_principal_who_lost_the_session_are_acted_on_whatever_their_generation() -> None:
    """Disabling a principal (or taking its role) shrinks *its* grants to
    nothing even when the session's plan is unchanged: its commands end; the
    local operator's (principal None) and others' stay."""
    current = plan(3, "/a")
    alice, bob = replace(proc(10, 3), principal="alice"), replace(proc(11, 3), principal="bob")
    operator = proc(12, 3)
    lost = {"alice"}.__contains__
    assert commands_to_act([alice, bob, operator], new=current, history={3: current}, acted=set(),
                           lost=lost) == [alice]  # fmt: skip
    # Not twice.
    assert commands_to_act([alice], new=current, history={3: current}, acted={(10, 3)}, lost=lost) == []
    # Without a lost principal, an unchanged plan acts on nothing.
    assert commands_to_act([alice, bob, operator], new=current, history={3: current}, acted=set()) == []

"""Sessions: open (and copied children), show, environment, list, close, revoke, path checks.

Session operations take an :data:`kbd.core.principals.Actor`: a principal is
authorized by its roles; a :class:`kbd.core.principals.LocalOperator` (created only
by the CLI entry points) is the trusted operator of the root. Opening a session
always needs a principal.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kbd.core.plan import Plan
from kbd.core.policy import KINDS
from kbd.core.principals import Actor, Principal
from kbd.errors import InvalidInput
from kbd.service import JsonObject
from kbd.session_ops import Sessions, check_path
from kbd.state.store import ProcessRow, SessionRow


@dataclass(frozen=True)
class RunningCommand:
    """A command still running in a session; ``stale`` when it started under an
    older plan generation than the current one (its grants since changed)."""

    process: ProcessRow
    stale: bool

    def to_json(self) -> JsonObject:
        return {**self.process.to_json(), "stale": self.stale}


@dataclass(frozen=True)
class SessionView:
    """A session's plan, rebuilt from saved configuration now, and what runs in it."""

    plan: Plan
    running: tuple[RunningCommand, ...]

    def to_json(self) -> JsonObject:
        return {**self.plan.to_json(), "running": [r.to_json() for r in self.running]}


@dataclass(frozen=True)
class SessionList:
    sessions: tuple[SessionRow, ...]

    def to_json(self) -> JsonObject:
        return {"sessions": [s.to_json() for s in self.sessions]}


@dataclass(frozen=True)
class Closed:
    session_id: str
    closed: tuple[str, ...]  # the session and its open children, as closed now

    def to_json(self) -> JsonObject:
        return {"session_id": self.session_id, "closed": list(self.closed)}


@dataclass(frozen=True)
class Revoked:
    session_id: str
    generation: int
    terminated: tuple[int, ...]
    still_running: tuple[int, ...]

    def to_json(self) -> JsonObject:
        return {"session_id": self.session_id, "generation": self.generation,
                "terminated": list(self.terminated), "still_running": list(self.still_running)}  # fmt: skip


@dataclass(frozen=True)
class PathCheck:
    allowed: bool
    reason: str

    def to_json(self) -> JsonObject:
        return {"allowed": self.allowed, "reason": self.reason}


def open_session(
    sessions: Sessions,
    wid: str,
    *,
    actor: Principal,
    kind: str | None,
    kb_access: str | None = None,
    item_kb_write: bool | None = None,
    parent: str | None = None,
) -> Plan:
    """Open a session of ``kind`` for ``wid`` (a copied child of ``parent`` when
    given); its plan. ``kb_access`` defaults to read; a child's ``kind`` and
    ``kb_access`` default to its parent's (a different kind, a wider access or
    an item write its parent did not ask for are refused)."""
    if kind is None:
        if parent is None:
            raise InvalidInput(
                "kind is required unless a parent session is given", hint=f"kinds: {', '.join(KINDS)}"
            )
        kind = sessions.store.get(parent).kind
    return sessions.open(
        actor, wid, kind=kind, kb_access=kb_access, item_kb_write=item_kb_write, parent=parent
    )


def open_child(
    sessions: Sessions,
    parent: str,
    *,
    actor: Principal,
    kind: str | None = None,
    kb_access: str | None = None,
    item_kb_write: bool | None = None,
) -> Plan:
    """Open a copied child of ``parent``, in its parent's workflow (see
    :func:`open_session`); an empty ``kind`` means the parent's too."""
    wid = sessions.store.get(parent).workflow_id
    return open_session(sessions, wid, actor=actor, kind=kind or None, kb_access=kb_access,
                        item_kb_write=item_kb_write, parent=parent)  # fmt: skip


def running(sessions: Sessions, sid: str, plan: Plan) -> tuple[RunningCommand, ...]:
    return tuple(RunningCommand(p, p.generation < plan.generation) for p in sessions.store.processes(sid))


def show(sessions: Sessions, sid: str, *, actor: Actor) -> SessionView:
    """The plan as ``actor`` may use it, and the commands running in the session.
    Closed sessions grant nothing (SessionClosed)."""
    plan = sessions.plan(sid, actor=actor)
    return SessionView(plan, running(sessions, sid, plan))


def list_sessions(
    sessions: Sessions, *, actor: Actor, workflow_id: str | None = None, include_closed: bool = False
) -> SessionList:
    """The sessions ``actor`` may use."""
    rows = sessions.visible(actor=actor, workflow_id=workflow_id, include_closed=include_closed)
    return SessionList(tuple(rows))


def close(sessions: Sessions, sid: str, *, actor: Actor) -> Closed:
    """Close ``sid`` and its child sessions; what they left running ends now."""
    return Closed(sid, tuple(sessions.close(sid, actor=actor)))


def revoke(sessions: Sessions, sid: str, *, actor: Actor, immediate: bool = False) -> Revoked:
    """Commands running with grants the session no longer has: reported, or
    terminated with ``immediate`` — or when kbd.yaml's ``revoke_immediately``
    says so for every revoke (after its ``revoke_grace``)."""
    cfg = sessions.host.config
    r = sessions.revoke(
        sid, immediate=immediate or cfg.revoke_immediately, grace=cfg.revoke_grace, actor=actor
    )
    return Revoked(r["session_id"], r["generation"], tuple(r["terminated"]), tuple(r["still_running"]))


def check(sessions: Sessions, sid: str, path: str, mode: str, *, actor: Actor) -> PathCheck:
    """May the session read/write ``path`` now? (For file tools outside the sandbox.)"""
    r = check_path(sessions.plan(sid, actor=actor), path, mode)
    return PathCheck(allowed=r["allowed"], reason=r["reason"])


@dataclass(frozen=True)
class Environment:
    """The variables a command of the session gets from its current plan."""

    env: Mapping[str, str]

    def to_json(self) -> JsonObject:
        return dict(self.env)


def environment(sessions: Sessions, sid: str, *, actor: Actor) -> Environment:
    """The session's environment as ``actor`` may use it now (SessionClosed when closed)."""
    return Environment(sessions.plan(sid, actor=actor).env)

"""Managing the principals of a host (docs/multi-user.md "Principals"): add, disable, enable,
remove, and give a new token.

Each operation edits ``principals.yaml`` in place (:mod:`kbd.fs.principals_file`:
the operator's comments, blank lines, order and quoting are kept; a layout kbd
cannot edit safely is refused with nothing written), is audited (who, which
principal, which fields; never a token or its hash), and refuses what would
make the file wrong (a duplicate ID or uid) or leave the host without an
enabled admin (unless ``force``). A running daemon re-reads the file at its
next request, so a disabled principal is refused from then on and the commands
it started are ended by pushed revocation.

Who may manage principals: the local operator (whose file permissions on the
root are the trust boundary, as for git) and enabled admins (so the daemon can
offer the same operations later, through these same functions).
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeAlias

from kbd.core.identifiers import id_problem
from kbd.core.principals import (
    KINDS,
    MAX_UID,
    Actor,
    Principal,
    Principals,
    actor_fields,
    label_problem,
)
from kbd.core.principals_edit import AddEntry, Edit, RemoveEntry, Scalar, SetField
from kbd.core.records import Record, key
from kbd.errors import InvalidInput, KbdError, NotFound, PermissionDenied, UsageError
from kbd.service import JsonObject
from kbd.service.admin import PrincipalList, PrincipalRow
from kbd.service.root import Root

if TYPE_CHECKING:
    from kbd.fs.principals_file import Current

# Decides the edit from principals.yaml as it is under the lock (None: nothing to change).
Decide: TypeAlias = Callable[["Current"], "Edit | None"]

# -- results -------------------------------------------------------------------------------


@dataclass(frozen=True)
class PrincipalChanged(Record):
    """What one operation did to one principal (``changed`` False: it already
    was so, nothing was written or audited)."""

    action: str  # add | disable | enable | remove | token
    changed: bool
    principal: PrincipalRow  # as it is now (remove: as it was)
    user: str | None = None  # add: the login the uid belongs to, if the host knows one


@dataclass(frozen=True)
class TokenIssued(Record):
    """A new bearer token for ``principal``: shown this once, only its SHA-256 is stored."""

    principal: str = field(metadata=key(name="id"))
    token: str


# -- rules (pure) --------------------------------------------------------------------------


def _require_manager(actor: Actor) -> None:
    if isinstance(actor, Principal) and not actor.enabled_admin:
        raise PermissionDenied(
            f"principal {actor.id!r} may not manage principals",
            hint="only admins and the root's operator may",
        )


def listing(host: Root, *, actor: Actor) -> PrincipalList:
    """The host's principals (never their token hashes), for those who manage
    them: uids and labels say who uses the host."""
    _require_manager(actor)
    return PrincipalList(tuple(PrincipalRow.of(p) for p in host.principals))


def check_name(name: str) -> None:
    if (problem := id_problem(name)) is not None:
        raise InvalidInput(f"NAME {name!r} {problem}", hint="a principal ID, e.g. alice or exec-host")


def check_uid(uid: int) -> None:
    if not 0 <= uid <= MAX_UID:
        raise InvalidInput(f"--uid {uid} is out of range: a uid is from 0 to {MAX_UID}",
                           hint="pass the numeric uid of the account (id -u LOGIN)")  # fmt: skip


def _unique(principals: Principals, name: str, uid: int, *, where: str) -> None:
    if principals.get(name) is not None:
        err = InvalidInput(f"NAME {name!r} is already a principal",
                           hint="choose another ID, or change the existing one (disable, enable, token)")  # fmt: skip
        err.reason = "duplicate_id"
        raise err
    mapped = principals.by_uid(uid)
    if mapped is not None:
        err = InvalidInput(f"{where} is already mapped to principal {mapped.id!r}; a uid maps to one "
                           "principal", hint=f"remove {mapped.id!r} first, or map another uid")  # fmt: skip
        err.reason = "duplicate_uid"
        raise err


def _existing(principals: Principals, name: str) -> Principal:
    p = principals.get(name)
    if p is None:
        raise NotFound(f"unknown principal {name!r}", hint="`kbd principals list` shows them")
    return p


_DOING = {"disable": "disabling", "remove": "removing"}


def _keeps_an_admin(principals: Principals, target: Principal, *, action: str, force: bool) -> None:
    """Refuse to take away the last enabled admin (unless ``force``): without
    one, no principal may manage other people's workflows, grants or principals
    (through the daemon or with ``--as``), and only the root's own operator
    could bring one back."""
    if force or not target.enabled_admin:
        return
    if any(p.enabled_admin and p.id != target.id for p in principals):
        return
    err = InvalidInput(
        f"{target.id!r} is the last enabled admin; {_DOING[action]} it would leave this host without one",
        hint=f"add or enable another admin first, or pass --force to {action} it anyway",
    )
    err.reason = "last_admin"
    raise err


# -- operations ----------------------------------------------------------------------------


def _run(host: Root, action: str, name: str, actor: Actor, decide: Decide, *, fields: JsonObject,
         event: str) -> Principals:  # fmt: skip
    """Authorize, edit principals.yaml under its lock, audit the change before the
    file is replaced; every refusal is audited too, then raised."""
    from kbd.fs import principals_file  # filelock and YAML: only for writers

    def audit(_edit: Edit) -> None:
        host.audit(event, **actor_fields(actor), target=name, fields=fields)

    try:
        _require_manager(actor)
        after = principals_file.update(host.config.root, decide, timeout=host.config.lock_timeout,
                                       before_write=audit, dry_run=host.dry_run)  # fmt: skip
        host.keep_principals(after)  # a preview's draft keeps what the file would hold
        return after
    except KbdError as err:
        host.audit("principal_refused", **actor_fields(actor), action=action, target=name, code=err.code,
                   reason=err.reason or err.code, message=err.message[:300])  # fmt: skip
        raise


def add(
    host: Root,
    name: str,
    *,
    uid: int | None = None,
    login: str | None = None,
    kind: str = "user",
    admin: bool = False,
    label: str | None = None,
    actor: Actor,
) -> PrincipalChanged:
    """Add principal ``name`` mapped to ``uid``, or to the uid of ``login`` on
    this host (exactly one of them)."""
    audited: JsonObject = {}  # filled once decided: what the audit record says was added
    user: list[str | None] = []

    def decide(current: Current) -> Edit:
        check_name(name)
        if (uid is None) == (login is None):
            raise UsageError("pass exactly one of --uid N and --user LOGIN")
        if login is not None:
            mapped, where = uid_of_user(login), f"--user {login}"
            where += f" (uid {mapped})"
            user.append(login)
        else:
            assert uid is not None
            check_uid(uid)
            mapped, where = uid, f"--uid {uid}"
            user.append(login_of(uid))
        if kind not in KINDS:
            raise InvalidInput(f"kind {kind!r} is not one of {', '.join(KINDS)}")
        if admin and kind == "service":
            raise InvalidInput(
                "a service principal cannot be an admin: pass at most one of --admin and --service"
            )
        if label is not None and (problem := label_problem(label)) is not None:
            raise InvalidInput(f"--label {problem}")
        _unique(current.principals, name, mapped, where=where)
        fields: list[tuple[str, Scalar]] = [("id", name), ("kind", kind)]
        fields += [("admin", True)] if admin else []
        fields += [("uid", mapped)] + ([("label", label)] if label is not None else [])
        audited.update(fields)
        return AddEntry(tuple(fields))

    after = _run(host, "add", name, actor, decide, fields=audited, event="principal_added")
    return PrincipalChanged("add", True, PrincipalRow.of(_existing(after, name)), user[0])


def _set_disabled(host: Root, name: str, *, disabled: bool, force: bool, actor: Actor) -> PrincipalChanged:
    action = "disable" if disabled else "enable"
    before: list[Principal] = []

    def decide(current: Current) -> Edit | None:
        principals = current.principals
        target = _existing(principals, name)
        before.append(target)
        if target.disabled == disabled:
            return None
        if disabled:
            _keeps_an_admin(principals, target, action=action, force=force)
        return SetField(name, "disabled", disabled)

    after = _run(host, action, name, actor, decide, fields={"disabled": disabled},
                 event=f"principal_{action}d")  # fmt: skip
    now = _existing(after, name)
    return PrincipalChanged(action, now != before[0], PrincipalRow.of(now))


def disable(host: Root, name: str, *, force: bool = False, actor: Actor) -> PrincipalChanged:
    """Disable ``name``: refused everywhere from the daemon's next request on."""
    return _set_disabled(host, name, disabled=True, force=force, actor=actor)


def enable(host: Root, name: str, *, actor: Actor) -> PrincipalChanged:
    return _set_disabled(host, name, disabled=False, force=False, actor=actor)


def remove(host: Root, name: str, *, force: bool = False, actor: Actor) -> PrincipalChanged:
    """Remove ``name``'s entry (its lines; comments elsewhere stay). Workflows
    that still name it keep the ID, which then matches nobody."""
    before: list[Principal] = []

    def decide(current: Current) -> Edit:
        principals = current.principals
        target = _existing(principals, name)
        before.append(target)
        _keeps_an_admin(principals, target, action="remove", force=force)
        return RemoveEntry(name)

    _run(host, "remove", name, actor, decide, fields={}, event="principal_removed")
    return PrincipalChanged("remove", True, PrincipalRow.of(before[0]))


def rotate_token(host: Root, name: str, *, actor: Actor) -> TokenIssued:
    """A new API token for ``name``; only its SHA-256 is stored (the old token
    stops working at the daemon's next request). Audited without the token."""
    token = "kbd_" + secrets.token_urlsafe(32)

    def decide(current: Current) -> Edit:
        _existing(current.principals, name)
        return SetField(name, "token_sha256", hashlib.sha256(token.encode()).hexdigest())

    _run(
        host,
        "token",
        name,
        actor,
        decide,
        fields={"token_sha256": "rotated"},
        event="principal_token_rotated",
    )
    return TokenIssued(name, token)


def uid_of_user(login: str) -> int:
    """The uid of ``login`` on this host (``--user LOGIN``)."""
    import pwd

    try:
        return pwd.getpwnam(login).pw_uid
    except (KeyError, UnicodeEncodeError, ValueError):
        raise InvalidInput(f"--user {login!r} is not a user on this host",
                           hint="pass an existing login (getent passwd LOGIN), or --uid N") from None  # fmt: skip


def login_of(uid: int) -> str | None:
    """The login owning ``uid`` on this host, None when it has no passwd entry
    (a uid from a container or a directory service may still be mapped)."""
    import pwd

    try:
        return pwd.getpwuid(uid).pw_name
    except (KeyError, OverflowError):
        return None

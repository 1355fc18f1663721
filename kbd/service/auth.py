"""Who is acting: the one place that turns credentials into a principal.

The daemon authenticates every request here (a bearer token checked against
``token_sha256``, or the peer's uid mapped through principals.yaml); the CLI
names its principal here (``--as``, ``$KBD_AS``, else the caller's uid). A
future interface calls the same functions, so a disabled principal or a rotated
token is honoured the same way everywhere.
"""

from __future__ import annotations

import hashlib
import hmac
import pwd
from dataclasses import dataclass

from kbd.core.principals import Actor, LocalOperator, Principal, Principals, named_principal
from kbd.core.records import Record
from kbd.errors import PermissionDenied


@dataclass(frozen=True)
class NotAuthenticated:
    """No principal could be established; ``message`` says why. The interface
    answers it in its own way (the API: 401 ``unauthenticated``)."""

    message: str
    hint: str | None = None  # what the caller can do about it (None: the error's default)


@dataclass(frozen=True)
class Identity(Record):
    """Who a principal is, as it may be told about itself (never its token)."""

    id: str
    kind: str
    admin: bool  # an enabled admin

    @classmethod
    def of(cls, p: Principal) -> Identity:
        return cls(p.id, p.kind, p.enabled_admin)


def token_digest(token: str) -> str:
    """How a bearer token is stored in principals.yaml (``token_sha256``)."""
    return hashlib.sha256(token.strip().encode()).hexdigest()


def _enabled(p: Principal) -> Principal:
    if p.disabled:
        raise PermissionDenied(f"principal {p.id!r} is disabled")
    return p


def by_token(principals: Principals, authorization: str) -> Principal | NotAuthenticated:
    """The principal whose token an ``Authorization: Bearer <token>`` header
    carries. Compared in constant time; a disabled principal is refused
    (PermissionDenied), never treated as unknown."""
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token:
        return NotAuthenticated("malformed Authorization header (expected `Bearer <token>`)")
    digest = token_digest(token)
    for p in principals:
        if p.token_sha256 is not None and hmac.compare_digest(p.token_sha256, digest):
            return _enabled(p)
    return NotAuthenticated("unknown token")


def by_uid(principals: Principals, uid: int) -> Principal | None:
    """The enabled principal mapped to ``uid``; None when none is mapped;
    PermissionDenied when the mapped one is disabled."""
    mapped = principals.by_uid(uid)
    return _enabled(mapped) if mapped is not None else None


def authenticate(
    principals: Principals, *, authorization: str | None, peer_uid: int | None
) -> Principal | NotAuthenticated:
    """A request's principal: its bearer token when it sends one (a bad token
    never falls back to the uid), else its peer uid's mapping."""
    if authorization is not None:
        return by_token(principals, authorization)
    if peer_uid is not None:
        mapped = by_uid(principals, peer_uid)
        if mapped is not None:
            return mapped
    return NotAuthenticated("no credentials: this connection's uid is not mapped to a principal",
                            hint=_unmapped_hint(peer_uid))  # fmt: skip


def _unmapped_hint(uid: int | None) -> str | None:
    """What a person whose uid maps to no principal asks the host's operator for (docs/multi-user.md "Principals")."""
    if uid is None:
        return None
    try:
        login = pwd.getpwuid(uid).pw_name
    except KeyError:
        login = str(uid)
    return (f"ask this host's operator to map you to a principal (`kbd principals add NAME --user {login}`), "
            "or pass a principal's token (--token-file F, or KBD_TOKEN)")  # fmt: skip


def named_or_mapped(principals: Principals, *, flag: str | None, env: str | None, uid: int) -> Principal:
    """The CLI's principal: named by ``--as`` (``flag``), else by ``$KBD_AS``
    (``env``), else the one mapped to ``uid`` (the caller's). An empty name is a
    usage error; an unknown or disabled one, or no mapping, PermissionDenied."""
    pid = named_principal(flag, env)
    if pid is not None:
        return principals.actor(pid)
    mapped = principals.by_uid(uid)
    if mapped is None:
        raise PermissionDenied(
            f"no principal is mapped to uid {uid}",
            hint="pass --as PRINCIPAL (or set KBD_AS), or add uid: to your entry in principals.yaml",
        )
    return principals.actor(mapped.id)


def named_or_operator(
    principals: Principals, *, flag: str | None, env: str | None, operator: LocalOperator
) -> Actor:
    """Session commands on the root: the principal named by ``--as`` / ``$KBD_AS``
    (authorized as it would be through the API), else ``operator``, the trusted
    local operator the interface created (the root is the trust boundary)."""
    pid = named_principal(flag, env)
    return principals.actor(pid) if pid is not None else operator

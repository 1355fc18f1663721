"""Principals: the users and services known to this host (principals.yaml, read
by :mod:`kbd.fs.rootconfig`, validated by :func:`parse_principals`).

A principal acts for every management command (``--as``) and, in the daemon,
for every request. Unknown and disabled principals are refused everywhere.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TypeAlias

from kbd.core.identifiers import id_problem, unplain_problem
from kbd.core.layout import PRINCIPALS_NAME
from kbd.core.strict import check_keys, expect_bool, expect_choice, expect_mapping, expect_str
from kbd.errors import InvalidConfig, PermissionDenied, UsageError

KINDS = ("user", "service")
_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class Principal:
    id: str
    kind: str = "user"
    admin: bool = False
    disabled: bool = False
    token_sha256: str | None = None
    uid: int | None = None
    label: str | None = None  # for people only (``kbd principals list``); never used to decide

    @property
    def enabled_admin(self) -> bool:
        return self.admin and not self.disabled

    @property
    def is_service(self) -> bool:
        return self.kind == "service"


@dataclass(frozen=True)
class LocalOperator:
    """The trusted local operator: the person running the CLI on the root, whose
    file permissions on the root are the trust boundary (as for git).

    Only the CLI entry points (:mod:`kbd.cli.commands`, :mod:`kbd.cli.entry`) create one, and
    only when no principal was named; the daemon never does (a test checks every
    construction site). Library code never treats a missing actor as trusted:
    every operation takes an :data:`Actor` argument without a default.
    """

    uid: int
    user: str

    @classmethod
    def current(cls) -> LocalOperator:
        """The operator of this process: its real uid and that uid's user name."""
        import pwd

        uid = os.getuid()
        try:
            user = pwd.getpwuid(uid).pw_name
        except KeyError:
            user = str(uid)  # a uid without a passwd entry (containers) is still named
        return cls(uid=uid, user=user)

    @property
    def name(self) -> str:
        return f"local:{self.user}"


# Who acts. A Principal (named with --as / KBD_AS, uid-mapped, or authenticated
# by the daemon) is authorized by its roles; a LocalOperator is trusted.
Actor: TypeAlias = Principal | LocalOperator


def actor_fields(actor: Actor) -> dict[str, str | int]:
    """How an audit record names ``actor``: a principal by its ID, the local
    operator by user name and uid (never ``None``)."""
    if isinstance(actor, LocalOperator):
        return {"actor": actor.name, "actor_uid": actor.uid}
    return {"actor": actor.id}


def named_principal(flag: str | None, env: str | None) -> str | None:
    """The principal ID named by ``--as`` (``flag``), else by ``$KBD_AS`` (``env``);
    None when neither is given. An explicitly empty (or blank) name is a usage
    error, never a fallback: ``--as "$UNSET"`` must not act as anyone."""
    if flag is not None:
        if not flag.strip():
            raise UsageError(
                "--as was given an empty principal",
                hint="pass --as PRINCIPAL with a principal's ID, or leave --as out",
            )
        return flag
    if env is not None:
        if not env.strip():
            raise UsageError(
                "KBD_AS is set but empty",
                hint="set KBD_AS to a principal's ID, or unset it (`unset KBD_AS`)",
            )
        return env
    return None


@dataclass(frozen=True)
class Principals:
    by_id: Mapping[str, Principal]

    def __iter__(self) -> Iterator[Principal]:
        return iter(self.by_id.values())

    def get(self, pid: str) -> Principal | None:
        return self.by_id.get(pid)

    def is_enabled_admin(self, pid: str) -> bool:
        p = self.by_id.get(pid)
        return p is not None and p.enabled_admin

    def actor(self, pid: str) -> Principal:
        """The enabled principal ``pid``, or PermissionDenied naming why not.
        An empty ``pid`` is a usage error: it never falls back to anyone."""
        if not pid:
            raise UsageError(
                'the principal is empty (--as "" or KBD_AS set to nothing)',
                hint="name a principal with --as PRINCIPAL, or unset KBD_AS to act as the one mapped to your uid",
            )
        p = self.by_id.get(pid)
        if p is None:
            raise PermissionDenied(
                f"unknown principal {pid!r}",
                hint="principals are listed in principals.yaml; pass --as with one of them",
            )
        if p.disabled:
            raise PermissionDenied(f"principal {pid!r} is disabled", hint="ask an admin to re-enable it")
        return p

    def by_uid(self, uid: int) -> Principal | None:
        for p in self.by_id.values():
            if p.uid == uid:
                return p
        return None


_KEYS = ("id", "kind", "admin", "disabled", "token_sha256", "uid", "label")
#: A label is shown on one line beside the ID: printable text, spaces allowed.
MAX_LABEL_LEN = 200
#: The largest uid a principal may map: (uid_t)-1 means "no uid" to the kernel.
MAX_UID = 2**32 - 2


def label_problem(value: object) -> str | None:
    """Why ``value`` is not a principal label (a string of 1-200 characters
    without control, format or line-separator characters), or None if it is."""
    if not isinstance(value, str):
        return "must be a string"
    if not value.strip():
        return "must not be empty"
    if len(value) > MAX_LABEL_LEN:
        return f"must be at most {MAX_LABEL_LEN} characters (got {len(value)})"
    if (problem := unplain_problem(value.replace(" ", "x"))) is not None:
        return problem + " (a label is one line of text; spaces are allowed)"
    return None


def parse_principals(data: object, *, source: str = PRINCIPALS_NAME) -> Principals:
    doc = expect_mapping(data, where="", source=source)
    check_keys(doc, allowed=("principals",), where="", source=source)
    raw = doc.get("principals", [])
    if not isinstance(raw, list):
        raise InvalidConfig(f"{source}: principals must be a list")
    out: dict[str, Principal] = {}
    uids: dict[int, str] = {}
    for i, item in enumerate(raw):
        where = f"principals[{i}]"
        entry = expect_mapping(item, where=where, source=source)
        check_keys(entry, allowed=_KEYS, where=where, source=source)
        if "id" not in entry:
            raise InvalidConfig(f"{source}: {where}.id is required")
        pid = expect_str(entry["id"], where=f"{where}.id", source=source)
        if problem := id_problem(pid):
            raise InvalidConfig(f"{source}: {where}.id {problem}")
        if pid in out:
            raise InvalidConfig(f"{source}: {where}.id {pid!r} is listed twice")
        kind = expect_choice(entry.get("kind", "user"), KINDS, where=f"{where}.kind", source=source)
        token = entry.get("token_sha256")
        if token is not None and not (isinstance(token, str) and _SHA256.fullmatch(token)):
            raise InvalidConfig(f"{source}: {where}.token_sha256 must be 64 lowercase hex digits")
        uid = entry.get("uid")
        if uid is not None:
            if isinstance(uid, bool) or not isinstance(uid, int) or uid < 0:
                raise InvalidConfig(f"{source}: {where}.uid must be a non-negative integer")
            if uid in uids:
                raise InvalidConfig(f"{source}: {where}.uid {uid} is already mapped to {uids[uid]!r}")
            uids[uid] = pid
        label = entry.get("label")
        if label is not None and (problem := label_problem(label)) is not None:
            raise InvalidConfig(f"{source}: {where}.label {problem}")
        out[pid] = Principal(
            id=pid,
            kind=kind,
            admin=expect_bool(entry.get("admin", False), where=f"{where}.admin", source=source),
            disabled=expect_bool(entry.get("disabled", False), where=f"{where}.disabled", source=source),
            token_sha256=token,
            uid=uid,
            label=label,
        )
    return Principals(by_id=out)

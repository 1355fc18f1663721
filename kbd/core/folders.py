"""The folder-grant rules (``folder_access`` in workflow.json). Pure.

A folder grant is not KB-derived: it survives a KB detach, and kb_access does
not narrow it. Its path must lie under one of the operator-approved
``folder_roots`` of kbd.yaml. Entries are parsed leniently and reported with a
reason, like attachments: :func:`check_folders` turns each entry into either a
final :class:`FolderStatus` (invalid, or not under an approved root) or a
:class:`FolderRequest` — a valid grant that :mod:`kbd.fs.folders` still has to
open beneath its root before it is available.

Reasons: ``invalid_entry`` (the entry breaks a rule below),
``folder_not_approved`` (no approved root holds the path) and
``folder_unavailable`` (the probe could not open it beneath its root).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Literal

from kbd.core.identifiers import alias_problem
from kbd.core.records import JsonObject, Keys, Record
from kbd.core.strict import kind_of

FolderAccess = Literal["read_only", "read_write"]
FolderReason = Literal["invalid_entry", "folder_not_approved", "folder_unavailable"]
ACCESS: tuple[FolderAccess, ...] = ("read_only", "read_write")
KEYS = ("alias", "path", "access")
MAX_FOLDERS = 20


@dataclass(frozen=True)
class FolderStatus(Record):
    """One ``folder_access`` entry as resolved now.

    Its JSON is written by hand (docs/architecture.md "Typed operations"): ``path`` is a Path."""

    alias: str  # "" when the entry's alias is not a valid one
    access: FolderAccess
    available: bool
    reason: FolderReason | None
    message: str | None
    path: Path | None

    @property
    def env(self) -> str:
        return f"WORKFLOW_FOLDER_{self.alias.upper()}"

    def to_json(self) -> JsonObject:
        return {
            "alias": self.alias,
            "access": self.access,
            "available": self.available,
            "reason": self.reason,
            "message": self.message,
            "env": self.env,
            "path": None if self.path is None else str(self.path),
        }

    @classmethod
    def from_json(cls, data: object, where: str = "") -> FolderStatus:
        k = _FOLDER_STATUS.read(cls, data, where)
        return cls(k["alias"], k["access"], k["available"], k["reason"], k["message"],
                   None if k["path"] is None else Path(k["path"]))  # fmt: skip

    @classmethod
    def json_schema(cls, defs: dict[str, JsonObject] | None = None) -> JsonObject:
        return _FOLDER_STATUS.schema(cls, defs)


_FOLDER_STATUS = Keys(lambda: {"alias": str, "access": FolderAccess, "available": bool, "reason": FolderReason | None,
                               "message": str | None, "env": str, "path": str | None})  # fmt: skip


@dataclass(frozen=True)
class FolderRequest:
    """A valid grant whose path lies under the approved ``root``: ``rel``
    beneath it (``.`` for the root itself) is still to be opened there."""

    alias: str
    access: FolderAccess
    root: Path
    rel: PurePosixPath

    @property
    def path(self) -> Path:
        """The canonical path the session sees: the approved root joined with ``rel``."""
        return self.root / self.rel if str(self.rel) != "." else self.root

    def available(self) -> FolderStatus:
        return FolderStatus(
            self.alias, self.access, available=True, reason=None, message=None, path=self.path
        )

    def unavailable(self, message: str) -> FolderStatus:
        return unavailable(self.alias, self.access, "folder_unavailable", message)


def unavailable(alias: object, access: object, reason: FolderReason, message: str) -> FolderStatus:
    """An entry that grants nothing, keeping its alias and access only where
    they are valid (they are shown back to the user)."""
    return FolderStatus(
        alias=alias if isinstance(alias, str) and alias_problem(alias) is None else "",
        access=_access(access) or "read_only",
        available=False,
        reason=reason,
        message=message,
        path=None,
    )


def _access(value: object) -> FolderAccess | None:
    for known in ACCESS:
        if value == known:
            return known
    return None


def check_folders(raw: object, *, roots: tuple[Path, ...]) -> list[FolderStatus | FolderRequest]:
    """Check a manifest's ``folder_access`` value against the rules and the
    approved ``roots``, in entry order. Never raises for a bad entry."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        return [unavailable(None, None, "invalid_entry", f"folder_access must be a list, got {kind_of(raw)}")]
    out: list[FolderStatus | FolderRequest] = []
    seen: set[str] = set()
    for i, item in enumerate(raw):
        if i >= MAX_FOLDERS:
            out.append(unavailable(None, None, "invalid_entry", f"more than {MAX_FOLDERS} folder grants"))
            continue
        out.append(_check_one(item, roots=roots, seen=seen))
    return out


def _check_one(item: object, *, roots: tuple[Path, ...], seen: set[str]) -> FolderStatus | FolderRequest:
    if not isinstance(item, dict):
        return unavailable(None, None, "invalid_entry", f"entry must be an object, got {kind_of(item)}")
    alias: object = item.get("alias")
    path: object = item.get("path")
    raw_access: object = item.get("access", "read_only")
    unknown = sorted(set(item) - set(KEYS))
    if unknown:
        return unavailable(
            alias, raw_access, "invalid_entry", f"unknown key {unknown[0]!r}; allowed: {', '.join(KEYS)}"
        )
    if (problem := alias_problem(alias)) is not None or not isinstance(alias, str):
        return unavailable(alias, raw_access, "invalid_entry", f"alias {problem}")
    if alias in seen:
        return unavailable(None, raw_access, "invalid_entry", f"alias {alias!r} is used twice")
    seen.add(alias)
    access = _access(raw_access)
    if access is None:
        return unavailable(
            alias, raw_access, "invalid_entry", f"access {raw_access!r}; allowed: {', '.join(ACCESS)}"
        )
    if not isinstance(path, str) or not path.startswith("/") or "\x00" in path:
        return unavailable(alias, access, "invalid_entry", "path must be an absolute path")
    pure = PurePosixPath(path)
    if ".." in pure.parts:
        return unavailable(alias, access, "invalid_entry", "path must not contain '..'")
    for root in roots:
        try:
            rel = pure.relative_to(PurePosixPath(root))
        except ValueError:
            continue
        return FolderRequest(alias, access, root, rel)
    return unavailable(
        alias,
        access,
        "folder_not_approved",
        "the path is not under an operator-approved folder root (kbd.yaml folder_roots)",
    )

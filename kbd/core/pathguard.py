"""The path guard's decision (docs/access.md "The path layer"): may a session's plan touch a
path for read or write? For file tools that run outside the sandbox.

Pure: it judges the path as spelled against the plan's grants. Whether a
symbolic link stands anywhere below the deciding grant is a question for the
file system; :func:`decide` answers it with :class:`LinkCheckNeeded`, and the
caller (:func:`kbd.service.sessions.check_path`) asks
:func:`kbd.fs.confined.link_below` before it allows anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from kbd.core.plan import Grant, Plan
from kbd.core.records import Record
from kbd.core.relpaths import NAME_MAX, PATH_MAX, name_problem, names_folder, note_parts
from kbd.errors import InvalidInput, KbdError

# The deepest grant decides; of equally deep ones, the narrowest.
_PRIORITY = {"hidden": 3, "read_only": 2, "write": 1, "read": 0}


@dataclass(frozen=True)
class PathCheck(Record):
    """The answer: allowed or not, and why (docs/access.md "The path layer")."""

    allowed: bool
    reason: str


@dataclass(frozen=True)
class LinkCheckNeeded:
    """The grants allow the path; it is allowed only if no symbolic link stands
    between ``grant.path`` and ``target`` (and, with ``folder``, ``target`` is a
    folder when it exists)."""

    grant: Grant
    target: Path
    folder: bool

    def allowed(self) -> PathCheck:
        return PathCheck(allowed=True, reason=f"{self.grant.mode} grant ({self.grant.origin})")


def decide(plan: Plan, path: str, mode: str) -> PathCheck | LinkCheckNeeded:
    """May ``plan`` touch ``path`` for ``mode`` (read|write), as far as its grants say?

    The deepest grant containing the path decides (an overlay beats its parent).
    The path must be absolute and free of ``..``; a write into a source's notes/
    must be a name ``kbd notes write`` accepts. Raises InvalidInput for any other
    ``mode``. Never allows by itself: a path the grants allow still needs the
    link check (:class:`LinkCheckNeeded`).
    """
    if mode not in ("read", "write"):
        raise InvalidInput(f"mode {mode!r} is not allowed; allowed: read, write")
    if not path.startswith("/"):
        return PathCheck(allowed=False, reason="path must be absolute")
    try:
        size = len(path.encode("utf-8"))
    except UnicodeEncodeError:
        return PathCheck(allowed=False, reason="path is not valid Unicode (it contains a lone surrogate)")
    if size > PATH_MAX:
        # The kernel's limits, judged here: no file system call ever sees such a path.
        return PathCheck(allowed=False, reason=f"path is longer than {PATH_MAX} bytes")
    for comp in path.split("/"):
        if (problem := name_problem(comp)) is not None:
            return PathCheck(allowed=False, reason=f"path {problem}")
        if len(comp.encode("utf-8")) > NAME_MAX:
            return PathCheck(allowed=False, reason=f"a path component is longer than {NAME_MAX} bytes")
    pure = PurePosixPath(path)
    if ".." in pure.parts:
        return PathCheck(allowed=False, reason="path must not contain '..'")
    target = Path(pure)
    best = None
    for g in plan.grants:
        if target == g.path or g.path in target.parents:
            key = (len(g.path.parts), _PRIORITY[g.mode])
            if best is None or key > best[0]:
                best = (key, g)
    if best is None:
        return PathCheck(allowed=False, reason="not granted to this session")
    grant = best[1]
    if grant.mode == "hidden":
        return PathCheck(allowed=False, reason=f"hidden in this session ({grant.origin})")
    if mode == "write" and grant.mode != "write":
        return PathCheck(allowed=False, reason=f"read-only ({grant.origin})")
    if mode == "write" and grant.origin.kind == "kb_write":
        # A source's notes/: exactly the names `kbd notes write` accepts.
        try:
            note_parts(_spelled_below(grant.path, path))
        except KbdError as err:
            return PathCheck(allowed=False, reason=err.message)
    return LinkCheckNeeded(grant, target, folder=names_folder(path))


def _spelled_below(root: Path, path: str) -> str:
    """The caller's own spelling of ``path`` below the grant ``root`` (empty and
    ``.`` components, which PurePosixPath dropped, and a trailing ``/`` kept),
    so the note-name rule judges exactly what was asked."""
    want = list(root.parts[1:])
    raw = path.split("/")[1:]
    i = 0
    while want and i < len(raw):
        if raw[i] not in ("", "."):
            want.pop(0)
        i += 1
    return "/".join(raw[i:])

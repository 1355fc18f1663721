"""What a registry lookup answers, as pure data (docs/on-disk.md, docs/access.md).

Split from :mod:`kbd.fs.registry` (the I/O side: walks, caches, ``statx`` probes)
so the pure core — :mod:`kbd.core.resolve` and everything that plans from it — can
name these types without loading the path layer. :mod:`kbd.fs.registry` re-exports
every name.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from kbd.core.layout import KB_DIR
from kbd.core.manifest import Manifest

Sig = tuple[int, int, int, int, int]  # dev, ino, size, mtime_ns, ctime_ns


@dataclass(frozen=True)
class Folder:
    """One discovered workflow folder."""

    path: Path
    manifest: Manifest | None
    problem: str | None  # why the manifest is unreadable
    known_id: str | None  # manifest ID, or the ID it last had / still declares
    sig: Sig | None  # None: do not trust from cache (unreadable or racy)
    # A known workflow folder hidden by a workflow.json that appeared above it:
    # the folder that now holds that manifest. Never usable while set.
    nested_in: Path | None = None

    @property
    def readable(self) -> bool:
        return self.manifest is not None

    @cached_property
    def kb_path(self) -> Path:
        """``<folder>/knowledgebase``, built once per folder (every plan lookup names it)."""
        return self.path / KB_DIR


@dataclass(frozen=True)
class Found:
    folder: Folder

    @property
    def manifest(self) -> Manifest:
        assert self.folder.manifest is not None
        return self.folder.manifest


@dataclass(frozen=True)
class Missing:
    workflow_id: str


@dataclass(frozen=True)
class Ambiguous:
    workflow_id: str
    folders: tuple[Folder, ...]
    # True when the ID's folder lies inside another workflow folder (or holds
    # one): which workflow owns those files is ambiguous even with one claimant.
    nested: bool = False

    def describe(self) -> str:
        """Why the ID resolves to nothing, without host paths."""
        if self.nested:
            return (
                f"the folder of workflow ID {self.workflow_id!r} is nested with another workflow folder "
                "(a workflow.json appeared above a known workflow, or inside this one)"
            )
        return f"{len(self.folders)} workflow folders claim ID {self.workflow_id!r}"


@dataclass(frozen=True)
class Unreadable:
    folder: Folder


Lookup = Found | Missing | Ambiguous | Unreadable


@dataclass(frozen=True)
class KbProblem:
    reason: str
    message: str


@dataclass(frozen=True)
class KbProbe:
    """The KB folder as seen now: a problem, or its identity for later pinning."""

    problem: KbProblem | None
    identity: tuple[int, int] | None = None  # (st_dev, st_ino) of knowledgebase/
    # Why knowledgebase/notes/ cannot take contributions (missing, a link, not a
    # folder, another mount), or None when it can.
    notes_problem: str | None = None

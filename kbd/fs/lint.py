"""Checks ``kbd doctor`` runs over the registry and over knowledge bases.

Both walk folders other people control, so both are bounded (entries visited
and depth) and go through the confined path layer (:mod:`kbd.fs.confined`): a
folder is pinned without following links, every subfolder is opened beneath
it with no link, magic link or mount crossing, and every entry is ``lstat``ed
relative to its opened folder. A walk that hits its bound says so ("truncated")
instead of claiming "all ok".

* Nesting (docs/on-disk.md "Registry"): a workflow folder holding another ``workflow.json``
  below it. The registry fails closed on the nesting it can see cheaply (a known
  workflow hidden by a manifest that appeared above it); doctor also looks
  inside every workflow folder for manifests that were never discovered.
* Multi-link files: ``kbd read`` and the API refuse a regular file with
  ``st_nlink > 1`` in a KB, but a sandboxed shell reads it like any other file.
  Whoever can plant such a link could also have copied the file, so this is not
  an escalation; doctor lists them so an operator knows what shells can read
  and what kbd read refuses.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kbd.core.layout import MANIFEST
from kbd.errors import KbdError, NotFound
from kbd.fs.confined import open_beneath, pin_dir
from kbd.fs.registry import MAX_DEPTH, Folder, Registry

MAX_ENTRIES = 200_000  # per doctor run and per KB: bounded on attacker-shaped trees
MAX_SHOWN = 10


@dataclass(frozen=True)
class Check:
    """One doctor line: name, whether it passed, and what was found."""

    name: str
    ok: bool
    detail: str


class BoundedWalk:
    """Every entry beneath the folder ``top`` (not following links, not crossing
    mounts), as (path relative to ``top``, lstat result), at most ``limit``
    entries and ``max_depth`` folders deep; ``truncated`` tells whether a bound
    cut it short. Each subfolder is opened beneath its already opened parent
    (one component, :func:`kbd.fs.confined.open_beneath`), so at most ``max_depth``
    descriptors are open at once. Folders that cannot be opened (gone, a link
    swapped in, another mount, no permission, a name kbd refuses) are skipped and
    counted in ``skipped``."""

    def __init__(self, top: Path, *, limit: int, max_depth: int = MAX_DEPTH) -> None:
        self.top = top
        self.limit = limit
        self.max_depth = max_depth
        self.seen = 0
        self.truncated = False
        self.skipped = 0

    def __iter__(self) -> Iterator[tuple[str, os.stat_result]]:
        with pin_dir(self.top) as pinned:
            yield from self._folder(pinned.fd, "", 0)

    def _folder(self, fd: int, rel: str, depth: int) -> Iterator[tuple[str, os.stat_result]]:
        try:
            names = sorted(os.listdir(fd))
        except OSError:
            self.skipped += 1
            return
        for name in names:
            if self.seen >= self.limit:
                self.truncated = True
                return
            self.seen += 1
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except OSError:
                continue
            child = f"{rel}/{name}" if rel else name
            yield child, st
            if not stat.S_ISDIR(st.st_mode):
                continue
            if depth + 1 >= self.max_depth:
                self.truncated = True
                continue
            try:
                child_fd = open_beneath(fd, name, os.O_RDONLY | os.O_DIRECTORY)
            except KbdError:
                self.skipped += 1
                continue
            try:
                yield from self._folder(child_fd, child, depth + 1)
            finally:
                os.close(child_fd)
            if self.truncated and self.seen >= self.limit:
                return


@dataclass(frozen=True)
class Scan:
    """What a bounded scan found, how many entries it visited, whether it saw
    everything (``truncated``: a bound was hit; ``skipped``: folders it could not open)."""

    items: list[str]
    seen: int
    truncated: bool
    skipped: int = 0

    def incomplete(self, limit: int) -> str:
        """The detail suffix saying what was not checked, or ""."""
        out = ""
        if self.truncated:
            out += f"; scan stopped after {limit} entries or at depth {MAX_DEPTH}: not everything was checked"
        if self.skipped:
            out += f"; {self.skipped} folder(s) could not be opened and were not checked"
        return out


def multi_link_files(kb: Path, *, limit: int = MAX_ENTRIES) -> Scan:
    """KB-relative paths of regular files with more than one hard link in ``kb``.
    Raises KbdError when ``kb`` itself cannot be pinned."""
    walk = BoundedWalk(kb, limit=limit)
    items = [rel for rel, st in walk if stat.S_ISREG(st.st_mode) and st.st_nlink > 1]
    return Scan(items, walk.seen, walk.truncated, walk.skipped)


def nested_manifests(folder: Path, *, limit: int = MAX_ENTRIES) -> Scan:
    """Paths (relative to the workflow folder ``folder``) of every ``workflow.json``
    below its own: workflow folders nested inside it, which discovery never reaches.
    Raises KbdError when ``folder`` itself cannot be pinned."""
    walk = BoundedWalk(folder, limit=limit)
    items = [rel for rel, _ in walk if "/" in rel and rel.rsplit("/", 1)[1] == MANIFEST]
    return Scan(items, walk.seen, walk.truncated, walk.skipped)


def _shown(items: list[str]) -> str:
    more = f" (and {len(items) - MAX_SHOWN} more)" if len(items) > MAX_SHOWN else ""
    return ", ".join(items[:MAX_SHOWN]) + more


def nesting_check(registry: Registry, folders: list[Folder], *, limit: int = MAX_ENTRIES) -> Check:
    """Workflow folders inside other workflow folders: the ones the registry
    already fails closed on, and manifests below any workflow folder (one scan
    budget of ``limit`` entries for all of them). A cut-short scan is said in the
    detail; it does not fail the check by itself."""
    problems = [
        f"{f.path} (ID {f.known_id!r}) is hidden by the workflow.json in {f.nested_in}: "
        "both answer ambiguous_id until one is removed or moved"
        for f in folders
        if f.nested_in is not None
    ]
    budget = limit
    truncated = False
    skipped = 0
    for folder in folders:
        if folder.nested_in is not None:
            continue
        if budget <= 0:
            truncated = True
            break
        try:
            scan = nested_manifests(folder.path, limit=budget)
        except KbdError as err:
            problems.append(f"{folder.path}: cannot be inspected ({err.message})")
            continue
        budget -= scan.seen
        truncated = truncated or scan.truncated
        skipped += scan.skipped
        known = {str(p.relative_to(folder.path)) for p in registry.contained(folder)}
        problems += [
            f"{folder.path} holds another workflow.json at {rel} (never discovered: "
            "its sessions' own folder includes that workflow's files)"
            for rel in scan.items
            if rel.rsplit("/", 1)[0] not in known
        ]
    detail = _shown(problems) if problems else "no workflow folder inside another"
    detail += Scan([], limit - budget, truncated, skipped).incomplete(limit)
    return Check("registry-nesting", not problems, detail)


def kb_link_checks(kbs: list[tuple[str, Path]], *, limit: int = MAX_ENTRIES) -> list[Check]:
    """One check per KB in ``kbs`` (a label and the KB folder: the ones a
    workflow's sessions can read): regular files with more than one hard link."""
    checks: list[Check] = []
    for label, kb in kbs:
        try:
            scan = multi_link_files(kb, limit=limit)
        except NotFound:
            checks.append(Check("kb-hardlinks", True, f"{label}: no knowledgebase/ folder"))
            continue
        except KbdError as err:
            checks.append(Check("kb-hardlinks", False, f"{label}: cannot be inspected ({err.message})"))
            continue
        if scan.items:
            detail = (
                f"{label}: {len(scan.items)} file(s) with more than one hard link: {_shown(scan.items)}; "
                "`kbd read` refuses them, a sandboxed shell can still read them"
            )
        else:
            detail = f"{label}: no multi-link files"
        detail += scan.incomplete(limit)
        checks.append(Check("kb-hardlinks", not scan.items, detail))
    return checks

"""Workflow discovery: stable ID → canonical workflow folder (docs/on-disk.md, docs/daemon.md).

Discovery walks each configured workflow root recursively, stops at the first
folder holding ``workflow.json`` (nested workflows inside a workflow are not
discovered), and never follows a symlinked folder or a symlinked
``workflow.json``. Folders that share an ID are reported as ``ambiguous_id`` and
resolve to nothing (fail closed); unreadable manifests are reported as
``manifest_unreadable`` under the ID they last had (or still declare), never
silently dropped.

Nesting: a known workflow folder that stops being discovered because a
``workflow.json`` appeared in a folder above it (``workflows/team/rts`` hidden by
a new ``workflows/team/workflow.json``) is not forgotten: while its own manifest
is still there it stays in the index as *nested* (``Folder.nested_in``), and both
it and the folder containing it answer ``ambiguous_id`` (fail closed) until an
operator removes the extra manifest or moves a folder. So a manifest that copies
the hidden workflow's ID can never redirect its consumers. Only folders known
from the previous index (in memory or the cache file) are checked, so this costs
nothing per walk; a nested manifest that was never discovered is reported by
``kbd doctor`` (:func:`kbd.fs.lint.nested_manifests`).

Incremental maintenance (docs/daemon.md): a long-lived process that watches the
folders (the daemon, :mod:`kbd.fs.watch`) hands each reported change to
:meth:`Registry.apply`, which re-derives only what that path can affect with the
same walk and reuse rules as a rescan, and runs :meth:`Registry.verify_now`
periodically (and whenever the watcher may have lost events) to absorb what no
event reported. Both end exactly where a full rescan from the same index ends
(a property test drives real folders to check it), and neither is ever needed
for correctness: lookups verify their answers as described below.

Caching: the index is kept in memory and in ``state/cache/registry.json``.
It is revalidated by ``lstat`` of every walked non-workflow folder (a new,
removed or renamed child changes a folder's mtime/ctime) and of every manifest
at most once per ``sweep_interval`` (and at the first lookup of every process),
and, per lookup, of the matched ``workflow.json``. A miss is answered from the
index as it stands: it never forces a walk, so a lookup of a missing ID (or a
plan with many missing sources) costs a dictionary lookup, and nobody can make
the daemon walk the registry once per request. A one-shot process (every CLI
call) still sees a workflow created a moment ago, because its first lookup
revalidates the cache it loads. Like git's "racy clean" rule, a folder or manifest
modified within :data:`~kbd.core.layout.RACY_NS` of the moment it was read is never trusted from
cache, because coarse file timestamps could hide a second change in the same
tick. The cache is an optimisation only: a corrupt cache is ignored.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from kbd.core.layout import INDEX_NAME, KB_DIR, MANIFEST, NOTES_DIR, racy
from kbd.core.lookup import Ambiguous as Ambiguous
from kbd.core.lookup import Folder as Folder
from kbd.core.lookup import Found as Found
from kbd.core.lookup import KbProbe as KbProbe
from kbd.core.lookup import KbProblem as KbProblem
from kbd.core.lookup import Lookup as Lookup
from kbd.core.lookup import Missing as Missing
from kbd.core.lookup import Sig as Sig
from kbd.core.lookup import Unreadable as Unreadable
from kbd.core.manifest import MAX_MANIFEST_BYTES, Manifest, extract_id, parse_manifest
from kbd.core.watching import PathChange
from kbd.errors import KbdError, ManifestUnreadable
from kbd.fs.atomic import ensure_private_dir, write_atomic
from kbd.fs.confined import open_beneath, pin_dir, read_file_stat
from kbd.fs.libc import AT_EMPTY_PATH, MountInfo, mount_info

MAX_DEPTH = 32
_CACHE_FORMAT = 1  # entries may carry "nested_in" (absent in older caches: none was nested)


def _sig(st: os.stat_result) -> Sig:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def read_manifest_bytes(folder: Path) -> tuple[bytes, os.stat_result]:
    """``<folder>/workflow.json`` read through the path layer: the folder pinned
    without following links, the file opened beneath it (never a link, FIFO or
    device), bounded in size. Raises KbdError."""
    with pin_dir(folder) as pinned:
        return read_file_stat(pinned.fd, MANIFEST, limit=MAX_MANIFEST_BYTES, allow_hardlinks=True)


def _load_folder(path: Path, *, previous_id: str | None, now_ns: int) -> Folder:
    try:
        data, st = read_manifest_bytes(path)
    except KbdError as exc:
        return Folder(path, None, f"workflow.json cannot be read: {exc.message}", previous_id, None)
    except OSError as exc:
        return Folder(path, None, f"workflow.json cannot be read: {exc.strerror or exc}", previous_id, None)
    try:
        manifest = parse_manifest(data)
    except ManifestUnreadable as exc:
        return Folder(path, None, exc.message, extract_id(data) or previous_id, None)
    return Folder(path, manifest, None, manifest.id, None if racy(st, now_ns) else _sig(st))


def _gone(path: Path) -> bool:
    try:
        os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return True
    except OSError:
        return False  # e.g. no search permission: still there, just unreadable
    return False


DirRec = tuple[int, int, int]  # st_ino, st_mtime_ns, st_ctime_ns of a walked folder; -1s: re-check


def _walk_from(
    stack: list[tuple[Path, int]],
    found: list[Path],
    dirs: dict[str, DirRec],
    truncated: list[Path],
    now_ns: int,
) -> None:
    """Discovery below the folders on ``stack`` (path, depth): every walked
    folder into ``dirs``, every workflow folder into ``found``. One walk for the
    full scan and for :meth:`Registry.apply`'s bounded re-walks, so both find
    exactly the same folders."""
    while stack:
        path, depth = stack.pop()
        try:
            st = os.lstat(path)
        except OSError:
            # A missing root is recorded so its creation invalidates the cache.
            dirs[str(path)] = (-1, -1, -1)
            continue
        if not stat.S_ISDIR(st.st_mode):
            continue
        dirs[str(path)] = _dir_rec(st, now_ns)
        if depth >= MAX_DEPTH:
            truncated.append(path)
            continue
        for name in sorted(_child_dirs(path), reverse=True):
            child = path / name
            if _holds_manifest(child):
                found.append(child)
            else:
                stack.append((child, depth + 1))


def _dir_rec(st: os.stat_result, now_ns: int) -> DirRec:
    return (-1, -1, -1) if racy(st, now_ns) else (st.st_ino, st.st_mtime_ns, st.st_ctime_ns)


def _child_dirs(path: Path) -> list[str]:
    """Names of the real (not symlinked) folders in ``path``; none if unlistable."""
    try:
        with os.scandir(path) as it:
            return [e.name for e in it if e.is_dir(follow_symlinks=False)]
    except OSError:
        return []


def _holds_manifest(folder: Path) -> bool:
    """Discovery's test: anything named workflow.json (even unreadable) makes a
    workflow folder; only its certain absence makes a folder to walk into."""
    try:
        os.lstat(folder / MANIFEST)
    except FileNotFoundError:
        return False
    except OSError:
        return True
    return True


def hidden_beneath(found: Iterable[Path], previous: Iterable[Path]) -> dict[Path, Path]:
    """Known folders (``previous``) that a walk (``found``) no longer reaches because
    one of their ancestors is now a workflow folder: {hidden folder: that ancestor}.

    Discovery never yields a folder inside another, so at most one ancestor matches.
    Only folders missing from ``found`` are examined: cost is O(changes x depth).
    """
    found_set = set(found)
    out: dict[Path, Path] = {}
    for path in previous:
        if path in found_set:
            continue
        for ancestor in path.parents:
            if ancestor in found_set:
                out[path] = ancestor
                break
    return out


class Registry:
    """ID → workflow folder index over the configured roots.

    Not thread-safe by itself; the daemon guards it with a lock.
    """

    def __init__(
        self,
        roots: Sequence[Path],
        *,
        cache_path: Path | None = None,
        sweep_interval: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.roots = tuple(roots)
        self.cache_path = cache_path
        # How long a long-lived process answers from its index without re-checking
        # the walked folders and every manifest: a new or renamed folder, or a
        # manifest that changed its ID in place, is seen within this interval. A
        # hit is always verified against its own manifest; a miss never forces a
        # check (that would let any caller buy a registry walk per request). A
        # new process (every CLI call) checks once, at its first lookup.
        self.sweep_interval = sweep_interval
        self._clock = clock
        self._swept_at = float("-inf")
        self._folders: dict[Path, Folder] = {}
        self._by_id: dict[str, list[Path]] = {}
        self._dirs: dict[str, tuple[int, int, int]] = {}
        # Workflow folder -> the known workflow folders nested beneath it.
        self._containers: dict[Path, list[Path]] = {}
        # Walked folder (depth < MAX_DEPTH) -> names of its children that discovery
        # classified (walked folders and workflow folders). Built lazily for
        # apply() and verify_now(), then kept current by them.
        self._kids: dict[Path, set[str]] | None = None
        self._roots_overlap = any(a != b and a.is_relative_to(b) for a in self.roots for b in self.roots)
        self._tracker: _Tracker | None = None
        self._loaded = False
        self.scans = 0  # for tests and benchmarks: how many full walks happened
        self.verifications = 0  # full re-checks (walk or sweep of every manifest)
        self.truncated: list[Path] = []

    # -- discovery -------------------------------------------------------
    def _walk(self) -> tuple[list[Path], dict[str, tuple[int, int, int]]]:
        found: list[Path] = []
        dirs: dict[str, tuple[int, int, int]] = {}
        truncated: list[Path] = []
        now_ns = time.time_ns()
        for root in self.roots:
            _walk_from([(root, 0)], found, dirs, truncated, now_ns)
        self.truncated = truncated
        return found, dirs

    def rescan(self) -> None:
        previous = {p: f.known_id for p, f in self._folders.items()}
        paths, dirs = self._walk()
        now_ns = time.time_ns()
        folders: dict[Path, Folder] = {}
        for path in paths:
            old = self._folders.get(path)
            if old is not None and old.sig is not None and old.nested_in is None and self._still(old):
                folders[path] = old
            else:
                folders[path] = _load_folder(path, previous_id=previous.get(path), now_ns=now_ns)
        for path, container in hidden_beneath(paths, previous).items():
            hidden = self._hidden(path, container, previous_id=previous[path], now_ns=now_ns)
            if hidden is not None:
                folders[path] = hidden
        self._set(folders, dirs)
        self.scans += 1
        self._swept_at = self._clock()
        self._save_cache()

    def _hidden(
        self, path: Path, container: Path, *, previous_id: str | None, now_ns: int, old: Folder | None = None
    ) -> Folder | None:
        """The known workflow at ``path`` that discovery no longer reaches because
        ``container`` (above it) now holds a workflow.json; None once its own
        manifest is gone (then nothing is hidden: the workflow was removed)."""
        old = old if old is not None else self._folders.get(path)
        if old is not None and old.sig is not None and old.nested_in == container and self._still(old):
            return old
        try:
            os.lstat(path / MANIFEST)
        except FileNotFoundError:
            return None
        except OSError:
            pass  # unreadable or a folder turned into a file: keep it, fail closed
        loaded = _load_folder(path, previous_id=previous_id, now_ns=now_ns)
        return replace(loaded, nested_in=container)

    def _sweep(self) -> None:
        """Re-verify every known manifest by lstat; re-read the changed ones.

        A manifest that disappeared means a full walk: its folder may now hold
        workflows that discovery stopped at before (the operator resolving a
        nesting by removing the extra workflow.json), or it was removed."""
        now_ns = time.time_ns()
        folders = dict(self._folders)
        ids_changed = False
        for path, old in self._folders.items():
            if old.sig is not None and self._still(old):
                continue
            if _gone(path / MANIFEST):
                self.rescan()
                return
            new = _load_folder(path, previous_id=old.known_id, now_ns=now_ns)
            if old.nested_in is not None:
                new = replace(new, nested_in=old.nested_in)
            folders[path] = new
            ids_changed = ids_changed or new.known_id != old.known_id
        self._swept_at = self._clock()
        self._set(folders, self._dirs)
        if ids_changed:
            self._save_cache()

    def _set(self, folders: dict[Path, Folder], dirs: dict[str, tuple[int, int, int]]) -> None:
        if dirs is not self._dirs:
            self._kids = None  # new walk results: rebuilt when apply() next needs it
        self._folders = folders
        self._dirs = dirs
        by_id: dict[str, list[Path]] = {}
        containers: dict[Path, list[Path]] = {}
        for path, folder in folders.items():
            if folder.known_id is not None:
                by_id.setdefault(folder.known_id, []).append(path)
            if folder.nested_in is not None:
                containers.setdefault(folder.nested_in, []).append(path)
        self._by_id = by_id
        self._containers = containers
        self._loaded = True

    @staticmethod
    def _still(folder: Folder) -> bool:
        try:
            return _sig(os.lstat(folder.path / MANIFEST)) == folder.sig
        except OSError:
            return False

    def _dirs_fresh(self) -> bool:
        for path, rec in self._dirs.items():
            if rec[0] == -1:
                return False
            try:
                st = os.lstat(path)
            except OSError:
                return False
            if (st.st_ino, st.st_mtime_ns, st.st_ctime_ns) != rec:
                return False
        return True

    def _ensure(self) -> bool:
        """Make the index current enough; True when it was fully verified just now.

        The walked folders and every manifest are re-checked at most every
        ``sweep_interval`` seconds (always on the first call of a process); in
        between, a hit is verified against its own manifest and a miss is
        answered from the index as it stands (see :meth:`find`).
        """
        if not self._loaded:
            self._load_cache()
        if self._clock() - self._swept_at < self.sweep_interval and self._loaded:
            return False
        return self._verify()

    def _verify(self) -> bool:
        self.verifications += 1
        if not self._loaded or not self._dirs_fresh():
            self.rescan()
        else:
            self._sweep()
        return True

    # -- incremental maintenance (docs/daemon.md) ----------------------------------
    # The daemon's watcher reports paths; apply() re-derives only what those
    # paths can change, with the same walk and the same reuse rules as rescan(),
    # so the index ends exactly where a full rescan would put it. The watcher is
    # never trusted for *what* changed: every re-derivation reads the disk. What
    # cannot be placed (a root itself, a relative path, overlapping roots) costs
    # a full rescan, reported as ``full``.

    def apply(self, changes: Iterable[PathChange]) -> RegistryDelta:
        """Bring the index up to date with the reported ``changes``; returns what
        changed. Cost O(changes x depth) plus one listing of each touched folder's
        parent; never a walk of all folders unless ``delta.full`` is set.

        Unreported changes elsewhere stay as they were until :meth:`verify_now`
        (or the periodic re-check every lookup path already does)."""
        batch = list(changes)
        if not self._loaded or self._roots_overlap:
            # Nothing verified to build on (a cache file is not: it may be old).
            return self._full(_Tracker(self))
        targets: list[tuple[Path, str, Path]] = []
        for change in batch:
            path = Path(change.path)
            if not path.is_absolute() or ".." in path.parts:
                return self._full(_Tracker(self))
            root = self._root_of(path)
            if root is None:
                if any(r.is_relative_to(path) for r in self.roots):
                    return self._full(_Tracker(self))  # a folder above a root moved
                continue  # outside every root: nothing discovery could see
            if path == root and (change.kind != "modified" or not self._root_intact(root)):
                return self._full(_Tracker(self))
            targets.append((path, change.kind, root))
        tracker = self._begin()
        try:
            touched: set[Path] = set()
            for path, kind, root in targets:
                self._place(path, kind, root, touched)
            for parent in sorted(touched, key=lambda p: len(p.parts)):
                self._reconcile(parent)
        except _NeedFull:
            return self._full(tracker)
        finally:
            self._tracker = None
        return tracker.delta(full=False)

    def verify_now(self) -> RegistryDelta:
        """Re-check every walked folder and every manifest against the disk now
        (lstat each; re-list or re-read only what changed) and absorb whatever no
        event reported. The result equals a full rescan; the cost is a stat per
        folder and manifest plus the work for what actually changed."""
        if not self._loaded or self._roots_overlap:
            return self._full(_Tracker(self))
        if any(str(root) not in self._dirs and root.is_dir() for root in self.roots):
            return self._full(_Tracker(self))  # a root that was not a folder now is one
        tracker = self._begin()
        try:
            for path in self._stale_dirs():
                if str(path) in self._dirs:  # not already re-derived with its parent
                    self._recheck_dir(path)
            for path, folder in list(self._folders.items()):
                if self._folders.get(path) is not folder:
                    continue
                if folder.sig is None or not self._still(folder):
                    self._manifest_changed(path, set())
        except _NeedFull:
            return self._full(tracker)
        finally:
            self._tracker = None
        delta = tracker.delta(full=False)
        self.verifications += 1
        self._swept_at = self._clock()
        if delta:
            self._save_cache()
        return delta

    def watch_paths(self) -> dict[str, list[Path]]:
        """The folders a watcher should watch, non-recursively, by segment:
        ``discovery`` (every walked folder: children appearing and vanishing),
        ``workflows`` (every workflow folder: its workflow.json and knowledgebase
        entries) and ``kbs`` (the knowledgebase/ folder of every workflow some
        manifest attaches: its notes entry). Loads every manifest."""
        self._ensure()
        self._ensure_kids()
        assert self._kids is not None
        discovery = sorted(self._kids)
        workflows = sorted(self._folders)
        attached: set[str] = set()
        for path in workflows:
            folder = self._current(path)
            if folder.manifest is not None:
                attached.update(e.workflow_id for e in folder.manifest.entries)
        kbs: list[Path] = []
        for wid in sorted(attached):
            paths = self._by_id.get(wid, [])
            if len(paths) == 1:
                kbs.append(paths[0] / KB_DIR)
        return {"discovery": discovery, "workflows": workflows, "kbs": kbs}

    # Placement of one reported path.
    def _place(self, path: Path, kind: str, root: Path, touched: set[Path]) -> None:
        assert self._kids is not None
        parent = path.parent
        if path.name == MANIFEST and parent in self._folders:
            self._manifest_changed(parent, touched)
            return
        if path.name == MANIFEST and str(parent) in self._dirs:  # walked, or recorded at MAX_DEPTH
            if parent != root:  # a root's own workflow.json means nothing
                self._rederive(parent)
                touched.add(parent.parent)
            return
        if path == root or (parent in self._kids and path in self._kids and kind == "modified"):
            touched.add(path)  # its entries (maybe) changed: re-list it
            return
        if parent in self._kids:
            self._rederive(path)
            touched.add(parent)
            return
        child = path
        for ancestor in path.parents:
            folder = self._folders.get(ancestor)
            if folder is not None and folder.nested_in is None:
                self._recheck_hidden_under(ancestor, path)
                return
            if folder is None and ancestor in self._kids:
                self._rederive(child)
                touched.add(ancestor)
                return
            if folder is None and str(ancestor) in self._dirs:
                return  # below MAX_DEPTH: discovery never looks there
            if ancestor == root:
                raise _NeedFull  # a root that was never walked (it was missing)
            child = ancestor

    def _manifest_changed(self, folder: Path, touched: set[Path]) -> None:
        old = self._folders[folder]
        if old.nested_in is not None:
            self._recheck_hidden(folder)
            return
        self._rederive(folder)
        touched.add(folder.parent)

    def _recheck_hidden_under(self, container: Path, path: Path) -> None:
        for hidden in list(self._containers.get(container, ())):
            if hidden == path or hidden.is_relative_to(path):
                self._recheck_hidden(hidden)

    def _recheck_hidden(self, path: Path) -> None:
        old = self._folders[path]
        assert old.nested_in is not None
        new = self._hidden(path, old.nested_in, previous_id=old.known_id, now_ns=time.time_ns(), old=old)
        if new is not old:
            self._remove_folder(path)
            if new is not None:
                self._add_folder(new)

    def _rederive(self, child: Path) -> None:
        """Discovery of ``child`` (a child of a walked folder) and everything
        beneath it, as rescan() would find it now: the old entries below it are
        replaced; folders and manifests whose signatures still hold are reused."""
        assert self._kids is not None
        now_ns = time.time_ns()
        old_dirs, old_folders = self._subtree(child)
        for path in old_dirs:
            self._remove_dir(path)
        for path in old_folders:
            self._remove_folder(path)
        found: list[Path] = []
        dirs: dict[str, DirRec] = {}
        truncated: list[Path] = []
        try:
            st: os.stat_result | None = os.lstat(child)
        except OSError:
            st = None
        if st is not None and stat.S_ISDIR(st.st_mode):
            if _holds_manifest(child):
                found.append(child)
            else:
                _walk_from([(child, self._depth(child))], found, dirs, truncated, now_ns)
        for key, rec in dirs.items():
            self._add_dir(Path(key), rec)
        self.truncated.extend(truncated)
        for path in found:
            old = old_folders.get(path)
            if old is not None and old.sig is not None and old.nested_in is None and self._still(old):
                self._add_folder(old)
            else:
                previous_id = old.known_id if old is not None else None
                self._add_folder(_load_folder(path, previous_id=previous_id, now_ns=now_ns))
        for path, container in hidden_beneath(found, old_folders).items():
            previous = old_folders[path]
            hidden = self._hidden(path, container, previous_id=previous.known_id, now_ns=now_ns, old=previous)
            if hidden is not None:
                self._add_folder(hidden)

    def _reconcile(self, folder: Path) -> None:
        """Re-list a walked folder whose entries changed: re-derive the children
        that appeared or vanished, then record its new signature. A folder that is
        gone, was replaced or gained a workflow.json is re-derived whole."""
        assert self._kids is not None
        if folder not in self._kids:
            return  # re-derived away meanwhile
        is_root = folder in self.roots
        rec = self._dirs.get(str(folder), (-1, -1, -1))
        try:
            st = os.lstat(folder)
        except OSError:
            st = None
        if st is None or not stat.S_ISDIR(st.st_mode) or (rec[0] != -1 and rec[0] != st.st_ino):
            if is_root:
                raise _NeedFull
            self._rederive(folder)
            return
        if not is_root and _holds_manifest(folder):
            self._rederive(folder)
            return
        now_ns = time.time_ns()
        names = set(_child_dirs(folder))
        for name in sorted(names ^ self._kids[folder]):
            self._rederive(folder / name)
        self._dirs[str(folder)] = _dir_rec(st, now_ns)

    def _stale_dirs(self) -> list[Path]:
        """Walked folders whose signature no longer holds, parents first."""
        stale: list[Path] = []
        for key, rec in self._dirs.items():
            try:
                st = os.lstat(key)
            except OSError:
                if rec != (-1, -1, -1):
                    stale.append(Path(key))
                continue  # missing then, missing now
            if (
                rec[0] == -1
                or (st.st_ino, st.st_mtime_ns, st.st_ctime_ns) != rec
                or not stat.S_ISDIR(st.st_mode)
            ):
                stale.append(Path(key))
        return sorted(stale, key=lambda p: len(p.parts))

    def _recheck_dir(self, path: Path) -> None:
        assert self._kids is not None
        if path in self.roots:
            try:
                is_dir = stat.S_ISDIR(os.lstat(path).st_mode)
            except OSError:
                is_dir = False
            if not is_dir:
                raise _NeedFull  # a root vanished or turned into something else: rescan
            self._reconcile(path)  # listing a root is walking it, one level at a time
        elif path in self._kids:
            self._reconcile(path)
        else:  # below MAX_DEPTH: recorded, never listed
            self._rederive(path)

    # Index primitives: every change to the index goes through these, so the ID
    # index, the containers and the children stay consistent and the tracker
    # sees the state before each change.
    def _begin(self) -> _Tracker:
        self._ensure_kids()
        tracker = _Tracker(self)
        self._tracker = tracker
        return tracker

    def _ensure_kids(self) -> None:
        if self._kids is not None:
            return
        kids: dict[Path, set[str]] = {}
        for key in self._dirs:
            path = Path(key)
            if self._depth(path) < MAX_DEPTH:
                kids[path] = set()
        for key in self._dirs:
            path = Path(key)
            if path not in self.roots and path.parent in kids:
                kids[path.parent].add(path.name)
        for path, folder in self._folders.items():
            if folder.nested_in is None and path.parent in kids:
                kids[path.parent].add(path.name)
        self._kids = kids

    def _subtree(self, top: Path) -> tuple[list[Path], dict[Path, Folder]]:
        assert self._kids is not None
        dirs: list[Path] = []
        folders: dict[Path, Folder] = {}

        def take(path: Path) -> None:
            folders[path] = self._folders[path]
            for hidden in self._containers.get(path, ()):
                folders[hidden] = self._folders[hidden]

        if top in self._folders and self._folders[top].nested_in is None:
            take(top)
        stack = [top] if str(top) in self._dirs else []
        while stack:
            path = stack.pop()
            dirs.append(path)
            for name in self._kids.get(path, ()):
                child = path / name
                if str(child) in self._dirs:
                    stack.append(child)
                elif child in self._folders:
                    take(child)
        return dirs, folders

    def _add_dir(self, path: Path, rec: DirRec) -> None:
        assert self._kids is not None
        self._dirs[str(path)] = rec
        if self._tracker is not None:
            self._tracker.added(path)
        if self._depth(path) < MAX_DEPTH:
            self._kids.setdefault(path, set())
        if path not in self.roots and path.parent in self._kids:
            self._kids[path.parent].add(path.name)

    def _remove_dir(self, path: Path) -> None:
        assert self._kids is not None
        del self._dirs[str(path)]
        if self._tracker is not None:
            self._tracker.removed(path)
        self._kids.pop(path, None)
        if path.parent in self._kids:
            self._kids[path.parent].discard(path.name)
        if path in self.truncated:
            self.truncated.remove(path)

    def _add_folder(self, folder: Folder) -> None:
        assert self._kids is not None
        path = folder.path
        if self._tracker is not None:
            self._tracker.touch(folder.known_id)
            self._tracker.added(path)
            if folder.nested_in is not None and folder.nested_in in self._folders:
                self._tracker.touch(self._folders[folder.nested_in].known_id)
        self._folders[path] = folder
        self._index_id(folder.known_id, path)
        if folder.nested_in is not None:
            self._containers[folder.nested_in] = [*self._containers.get(folder.nested_in, ()), path]
        elif path.parent in self._kids:
            self._kids[path.parent].add(path.name)

    def _remove_folder(self, path: Path) -> None:
        assert self._kids is not None
        folder = self._folders[path]
        if self._tracker is not None:
            self._tracker.touch(folder.known_id)
            self._tracker.removed(path)
            if folder.nested_in is not None and folder.nested_in in self._folders:
                self._tracker.touch(self._folders[folder.nested_in].known_id)
        del self._folders[path]
        self._unindex_id(folder.known_id, path)
        if folder.nested_in is not None:
            rest = [p for p in self._containers.get(folder.nested_in, ()) if p != path]
            if rest:
                self._containers[folder.nested_in] = rest
            else:
                self._containers.pop(folder.nested_in, None)
        elif path.parent in self._kids:
            self._kids[path.parent].discard(path.name)

    def _index_id(self, workflow_id: str | None, path: Path) -> None:
        if workflow_id is not None:
            self._by_id[workflow_id] = [*self._by_id.get(workflow_id, ()), path]

    def _unindex_id(self, workflow_id: str | None, path: Path) -> None:
        if workflow_id is None or workflow_id not in self._by_id:
            return
        rest = [p for p in self._by_id[workflow_id] if p != path]
        if rest:
            self._by_id[workflow_id] = rest
        else:
            del self._by_id[workflow_id]

    def _view(self, workflow_id: str) -> _View:
        return tuple(
            sorted(
                ((p, self._folders[p], p in self._containers) for p in self._by_id.get(workflow_id, ())),
                key=lambda item: item[0],
            )
        )

    def _full(self, tracker: _Tracker) -> RegistryDelta:
        """A full rescan, reported as a delta against the index as it was before
        the current operation began (``tracker`` holds what that operation had
        already changed)."""
        self._tracker = None
        before = {wid: self._view(wid) for wid in self._by_id}
        before.update(tracker.before)
        paths_before = (self._index_paths() - tracker.added_paths) | tracker.removed_paths
        self.rescan()
        self._ensure_kids()
        delta = RegistryDelta(full=True)
        for wid in set(before) | set(self._by_id):
            old, new = before.get(wid, ()), self._view(wid)
            if old != new:
                delta.changed[wid] = (_single(old), _single(new))
        paths_after = self._index_paths()
        delta.folders_added = paths_after - paths_before
        delta.folders_removed = paths_before - paths_after
        return delta

    def _index_paths(self) -> set[Path]:
        return {Path(k) for k in self._dirs} | set(self._folders)

    def _root_of(self, path: Path) -> Path | None:
        text = str(path)
        for root in self.roots:
            prefix = str(root)
            if text == prefix or text.startswith(prefix.rstrip("/") + "/"):
                return root
        return None

    def _root_intact(self, root: Path) -> bool:
        rec = self._dirs.get(str(root))
        try:
            st = os.lstat(root)
        except OSError:
            return False
        return rec is not None and stat.S_ISDIR(st.st_mode) and rec[0] in (-1, st.st_ino)

    def _depth(self, path: Path) -> int:
        root = self._root_of(path)
        return len(path.parts) - len(root.parts) if root is not None else 0

    # -- persistent cache -------------------------------------------------
    def _load_cache(self) -> None:
        if self.cache_path is None:
            return
        try:
            with open(self.cache_path, "rb") as fh:
                doc = json.loads(fh.read())
            if doc.get("format") != _CACHE_FORMAT or doc.get("roots") != [str(r) for r in self.roots]:
                return
            dirs = {str(k): (int(v[0]), int(v[1]), int(v[2])) for k, v in doc["dirs"].items()}
            folders: dict[Path, Folder] = {}
            for item in doc["folders"]:
                path = Path(item["path"])
                raw_sig = item.get("sig")
                sig: Sig | None = None
                if isinstance(raw_sig, list) and len(raw_sig) == 5:
                    sig = (
                        int(raw_sig[0]),
                        int(raw_sig[1]),
                        int(raw_sig[2]),
                        int(raw_sig[3]),
                        int(raw_sig[4]),
                    )
                kid = item.get("id")
                nested_in = item.get("nested_in")
                # Manifests are parsed lazily; a cached entry only remembers the ID
                # and the stat signature it had when parsed.
                folders[path] = Folder(
                    path,
                    None,
                    "not loaded",
                    kid if isinstance(kid, str) else None,
                    sig,
                    Path(nested_in) if isinstance(nested_in, str) else None,
                )
        except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError):
            return
        self._set(folders, dirs)

    def _save_cache(self) -> None:
        if self.cache_path is None:
            return
        doc = {
            "format": _CACHE_FORMAT,
            "roots": [str(r) for r in self.roots],
            "dirs": self._dirs,
            "folders": [
                {
                    "path": str(f.path),
                    "id": f.known_id,
                    "sig": list(f.sig) if f.sig else None,
                    "nested_in": str(f.nested_in) if f.nested_in else None,
                }
                for f in self._folders.values()
            ],
        }
        with contextlib.suppress(OSError):
            ensure_private_dir(self.cache_path.parent)
            write_atomic(self.cache_path, json.dumps(doc, separators=(",", ":")).encode(), mode=0o640)

    # -- lookups -----------------------------------------------------------
    def _current(self, path: Path, st: os.stat_result | None = None) -> Folder:
        """The folder at ``path`` with its manifest verified against the disk now
        (``st``: an lstat of its workflow.json the caller just took)."""
        folder = self._folders[path]
        if folder.manifest is not None and folder.sig is not None:
            if st is not None and _sig(st) == folder.sig:
                return folder
            if st is None and self._still(folder):
                return folder
        fresh = _load_folder(path, previous_id=folder.known_id, now_ns=time.time_ns())
        if folder.nested_in is not None:
            fresh = replace(fresh, nested_in=folder.nested_in)
        self._folders[path] = fresh
        if fresh.known_id != folder.known_id:
            # Copy-on-write: find() may be iterating the old list right now.
            self._unindex_id(folder.known_id, path)
            self._index_id(fresh.known_id, path)
        return fresh

    def index(self) -> dict[Path, Folder]:
        """A copy of the index as it stands, verifying nothing: for a consumer
        that diffs it against an earlier copy (the daemon's change events). A
        folder object is replaced, never changed, when its entry changes."""
        return dict(self._folders)

    def folders(self) -> list[Folder]:
        """Every discovered folder, manifests verified now, sorted by path."""
        self._ensure()
        out = [self._current(p) for p in sorted(self._folders)]
        self._set({f.path: f for f in out}, self._dirs)
        return out

    def find(self, workflow_id: str) -> Lookup:
        """Resolve a workflow ID from the index.

        The index is re-checked at most every ``sweep_interval`` (and at the first
        lookup of a process); a miss never forces a check, so its cost does not
        grow with the registry and is never multiplied per source. Every folder
        the index names for the ID is verified against its manifest now: one
        that no longer holds the ID (removed, renamed, changed in place) is not an
        answer, and the next re-check finds where it went. A folder nested with
        another workflow folder answers ``Ambiguous`` (fail closed).
        """
        self._ensure()
        current: list[Folder] = []
        for path in self._by_id.get(workflow_id, ()):
            try:
                st = os.lstat(f"{path}/{MANIFEST}")
            except OSError:
                continue
            folder = self._current(path, st)
            if folder.known_id == workflow_id:
                current.append(folder)
        if not current:
            return Missing(workflow_id)
        # is_nested() inline: a lookup asks this for every source (no generator per call).
        nested = False
        for f in current:
            if f.nested_in is not None or f.path in self._containers:
                nested = True
        if nested or len(current) > 1:
            return Ambiguous(workflow_id, tuple(current), nested=nested)
        only = current[0]
        if only.manifest is None:
            return Unreadable(only)
        return Found(only)

    def is_nested(self, folder: Folder) -> bool:
        """True when ``folder`` is hidden inside another workflow folder or holds one."""
        return folder.nested_in is not None or folder.path in self._containers

    def contained(self, folder: Folder) -> list[Path]:
        """The known workflow folders hidden inside ``folder`` (sorted)."""
        return sorted(self._containers.get(folder.path, ()))

    def status_of(self, folder: Folder) -> str:
        if self.is_nested(folder):
            return "ambiguous_id"
        if folder.known_id is not None and len(self._by_id.get(folder.known_id, [])) > 1:
            return "ambiguous_id"
        return "ok" if folder.manifest is not None else "manifest_unreadable"

    def ids(self) -> Iterable[str]:
        self._ensure()
        return list(self._by_id)

    def known_ids(self) -> list[str]:
        """The IDs of the index as last saved, verifying nothing (one walk when
        there is no cache yet): for shell completion, where a stale hint costs
        nothing and verifying 10,000 manifests per TAB would."""
        if not self._loaded:
            self._load_cache()
        if not self._loaded:
            return list(self.ids())
        return list(self._by_id)


@dataclass
class RegistryDelta:
    """What :meth:`Registry.apply` or :meth:`Registry.verify_now` changed.

    ``changed``: every workflow ID whose folders, manifests or nesting changed,
    as (manifest before, manifest after); a side is None unless the ID resolved
    to exactly one readable, un-nested folder (missing, ambiguous, unreadable
    or not yet loaded). ``folders_added`` / ``folders_removed``: walked and
    workflow folders that entered or left the index (what a watcher should start
    or stop watching). ``full``: the change could not be placed and the whole
    registry was rescanned; every consumer of the registry should re-check.
    """

    changed: dict[str, tuple[Manifest | None, Manifest | None]] = field(default_factory=dict)
    folders_added: set[Path] = field(default_factory=set)
    folders_removed: set[Path] = field(default_factory=set)
    full: bool = False

    def __bool__(self) -> bool:
        return self.full or bool(self.changed or self.folders_added or self.folders_removed)


# One ID's entries: (folder path, folder, holds hidden folders), sorted by path.
_View = tuple[tuple[Path, Folder, bool], ...]


def _single(view: _View) -> Manifest | None:
    if len(view) == 1 and view[0][1].nested_in is None and not view[0][2]:
        return view[0][1].manifest
    return None


class _NeedFull(Exception):
    """apply()/verify_now() met something only a full rescan can settle."""


class _Tracker:
    """The index as it was before one apply()/verify_now(), for the delta:
    the entries of every ID touched, and the paths that came and went."""

    def __init__(self, registry: Registry) -> None:
        self._registry = registry
        self.before: dict[str, _View] = {}
        self.added_paths: set[Path] = set()
        self.removed_paths: set[Path] = set()

    def touch(self, workflow_id: str | None) -> None:
        if workflow_id is not None and workflow_id not in self.before:
            self.before[workflow_id] = self._registry._view(workflow_id)

    def added(self, path: Path) -> None:
        if path in self.removed_paths:
            self.removed_paths.discard(path)
        else:
            self.added_paths.add(path)

    def removed(self, path: Path) -> None:
        if path in self.added_paths:
            self.added_paths.discard(path)
        else:
            self.removed_paths.add(path)

    def delta(self, *, full: bool) -> RegistryDelta:
        out = RegistryDelta(full=full)
        for wid, old in self.before.items():
            new = self._registry._view(wid)
            if new != old:
                out.changed[wid] = (_single(old), _single(new))
        out.folders_added = set(self.added_paths)
        out.folders_removed = set(self.removed_paths)
        return out


# The answers a probe gives without a KB identity: built once (a policy lookup
# probes every source's KB, and the memo compares answers by value).
_FOLDER_GONE = KbProbe(KbProblem("kb_missing", "the source workflow folder is gone or was replaced"))
_NO_KB = KbProbe(KbProblem("kb_missing", "the source has no knowledgebase/ folder"))
_KB_SYMLINK = KbProbe(
    KbProblem("kb_symlinked", "the source's knowledgebase/ is a symbolic link, not a folder")
)
_KB_NOT_DIR = KbProbe(KbProblem("kb_not_dir", "the source's knowledgebase is not a folder"))
_KB_MOUNT = KbProbe(
    KbProblem(
        "kb_mountpoint", "the source's knowledgebase/ is a mount point, not part of the workflow's own folder"
    )
)
_KB_NAME, _NOTES_NAME, _INDEX_NAME = os.fsencode(KB_DIR), os.fsencode(NOTES_DIR), os.fsencode(INDEX_NAME)


def probe_kb(workflow_folder: Path, *, notes: bool = False) -> KbProbe:
    """Why ``<workflow>/knowledgebase`` cannot be attached right now, or its identity
    (and, with ``notes``, whether its ``notes/`` can take contributions).

    Checked at every lookup: missing, not a folder, a symlink (even one pointing
    inside the same workflow: the attached folder must be the folder itself), or
    a mount point (e.g. a bind mount of someone else's KB on the same
    filesystem, caught by statx mount IDs). The workflow folder is pinned
    without following links first, so the answer is about the real folder.
    Every open here is ``O_PATH`` (looking only): it makes no inotify event, so
    a daemon's lookups never wake its own watcher of these folders.
    """
    try:
        pinned = pin_dir(workflow_folder, path_only=True)
    except KbdError:
        return _FOLDER_GONE
    try:
        info = mount_info(_KB_NAME, dir_fd=pinned.fd)
        # STATX_ATTR_MOUNT_ROOT answers "is it a mount point" in one call; only
        # kernels without it need the parent's mount ID for comparison.
        parent = mount_info(b"", dir_fd=pinned.fd, flags=AT_EMPTY_PATH) if info.mount_root is None else None
        notes_problem = _notes_problem(pinned.fd, info) if notes and stat.S_ISDIR(info.mode) else None
    except FileNotFoundError:
        return _NO_KB
    except OSError as exc:
        return KbProbe(
            KbProblem("kb_missing", f"the source's knowledgebase/ cannot be inspected: {exc.strerror}")
        )
    finally:
        pinned.close()
    if stat.S_ISLNK(info.mode):
        return _KB_SYMLINK
    if not stat.S_ISDIR(info.mode):
        return _KB_NOT_DIR
    if (
        info.mount_root
        or info.dev != pinned.dev  # fstat-ed by pin_dir: the same open folder
        or (
            parent is not None
            and info.mnt_id is not None
            and parent.mnt_id is not None
            and info.mnt_id != parent.mnt_id
        )
    ):
        return _KB_MOUNT
    return KbProbe(None, (info.dev, info.ino), notes_problem)


def _notes_problem(workflow_fd: int, kb: MountInfo) -> str | None:
    """Why the KB's notes/ (seen beneath the already pinned workflow folder) cannot
    take contributions, or None. Only asked for write attachments."""
    try:
        kb_fd = open_beneath(workflow_fd, KB_DIR, os.O_PATH | os.O_DIRECTORY)
    except KbdError:
        return "the source's knowledgebase/ changed while it was inspected"
    try:
        st = os.fstat(kb_fd)
        if (st.st_dev, st.st_ino) != (kb.dev, kb.ino):
            return "the source's knowledgebase/ changed while it was inspected"
        try:
            notes = mount_info(_NOTES_NAME, dir_fd=kb_fd)
        except FileNotFoundError:
            return "the source has no notes/ folder"
        if stat.S_ISLNK(notes.mode):
            return "the source's notes/ is a symbolic link"
        if not stat.S_ISDIR(notes.mode):
            return "the source's notes is not a folder"
        if notes.mount_root or notes.dev != kb.dev:
            return "the source's notes/ is a mount point"
        notes_fd = open_beneath(kb_fd, NOTES_DIR, os.O_PATH | os.O_DIRECTORY)
        try:
            index = mount_info(_INDEX_NAME, dir_fd=notes_fd)
        except FileNotFoundError:
            return None  # kbd creates a missing index before a write command
        finally:
            os.close(notes_fd)
    except (OSError, KbdError):
        return "the source's notes/ cannot be inspected"
    finally:
        os.close(kb_fd)
    if not stat.S_ISREG(index.mode):
        # It is bound read-only over itself: anything but a regular file would
        # break every command of every contributor.
        return "the source's notes/_index.json is not a regular file"
    return None

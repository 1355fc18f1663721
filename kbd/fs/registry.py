"""Workflow discovery: stable ID → canonical workflow folder (DESIGN §2, §9).

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
from dataclasses import replace
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
from kbd.core.manifest import MAX_MANIFEST_BYTES, extract_id, parse_manifest
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
        self._loaded = False
        self.scans = 0  # for tests and benchmarks: how many full walks happened
        self.verifications = 0  # full re-checks (walk or sweep of every manifest)
        self.truncated: list[Path] = []

    # -- discovery -------------------------------------------------------
    def _walk(self) -> tuple[list[Path], dict[str, tuple[int, int, int]]]:
        found: list[Path] = []
        dirs: dict[str, tuple[int, int, int]] = {}
        self.truncated = []
        now_ns = time.time_ns()
        for root in self.roots:
            stack: list[tuple[Path, int]] = [(root, 0)]
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
                dirs[str(path)] = (
                    (-1, -1, -1) if racy(st, now_ns) else (st.st_ino, st.st_mtime_ns, st.st_ctime_ns)
                )
                if depth >= MAX_DEPTH:
                    self.truncated.append(path)
                    continue
                try:
                    with os.scandir(path) as it:
                        children = [e.name for e in it if e.is_dir(follow_symlinks=False)]
                except OSError:
                    continue
                for name in sorted(children, reverse=True):
                    child = path / name
                    try:
                        os.lstat(child / MANIFEST)
                    except FileNotFoundError:
                        stack.append((child, depth + 1))
                        continue
                    except OSError:
                        pass
                    found.append(child)
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

    def _hidden(self, path: Path, container: Path, *, previous_id: str | None, now_ns: int) -> Folder | None:
        """The known workflow at ``path`` that discovery no longer reaches because
        ``container`` (above it) now holds a workflow.json; None once its own
        manifest is gone (then nothing is hidden: the workflow was removed)."""
        old = self._folders.get(path)
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
        return fresh

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
        nested = any(self.is_nested(f) for f in current)
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


def probe_kb(workflow_folder: Path, *, notes: bool = False) -> KbProbe:
    """Why ``<workflow>/knowledgebase`` cannot be attached right now, or its identity
    (and, with ``notes``, whether its ``notes/`` can take contributions).

    Checked at every lookup: missing, not a folder, a symlink (even one pointing
    inside the same workflow: the attached folder must be the folder itself), or
    a mount point (e.g. a bind mount of someone else's KB on the same
    filesystem, caught by statx mount IDs). The workflow folder is pinned
    without following links first, so the answer is about the real folder.
    """
    try:
        pinned = pin_dir(workflow_folder)
    except KbdError:
        return KbProbe(KbProblem("kb_missing", "the source workflow folder is gone or was replaced"))
    with pinned:
        try:
            info = mount_info(KB_DIR, dir_fd=pinned.fd)
            # STATX_ATTR_MOUNT_ROOT answers "is it a mount point" in one call; only
            # kernels without it need the parent's mount ID for comparison.
            parent = (
                mount_info("", dir_fd=pinned.fd, flags=AT_EMPTY_PATH) if info.mount_root is None else None
            )
            parent_dev = os.fstat(pinned.fd).st_dev
            notes_problem = _notes_problem(pinned.fd, info) if notes and stat.S_ISDIR(info.mode) else None
        except FileNotFoundError:
            return KbProbe(KbProblem("kb_missing", "the source has no knowledgebase/ folder"))
        except OSError as exc:
            return KbProbe(
                KbProblem("kb_missing", f"the source's knowledgebase/ cannot be inspected: {exc.strerror}")
            )
    if stat.S_ISLNK(info.mode):
        return KbProbe(
            KbProblem("kb_symlinked", "the source's knowledgebase/ is a symbolic link, not a folder")
        )
    if not stat.S_ISDIR(info.mode):
        return KbProbe(KbProblem("kb_not_dir", "the source's knowledgebase is not a folder"))
    if (
        info.mount_root
        or info.dev != parent_dev
        or (
            parent is not None
            and info.mnt_id is not None
            and parent.mnt_id is not None
            and info.mnt_id != parent.mnt_id
        )
    ):
        return KbProbe(
            KbProblem(
                "kb_mountpoint",
                "the source's knowledgebase/ is a mount point, not part of the workflow's own folder",
            )
        )
    return KbProbe(None, (info.dev, info.ino), notes_problem)


def _notes_problem(workflow_fd: int, kb: MountInfo) -> str | None:
    """Why the KB's notes/ (seen beneath the already pinned workflow folder) cannot
    take contributions, or None. Only asked for write attachments."""
    try:
        kb_fd = open_beneath(workflow_fd, KB_DIR, os.O_RDONLY | os.O_DIRECTORY)
    except KbdError:
        return "the source's knowledgebase/ changed while it was inspected"
    try:
        st = os.fstat(kb_fd)
        if (st.st_dev, st.st_ino) != (kb.dev, kb.ino):
            return "the source's knowledgebase/ changed while it was inspected"
        try:
            notes = mount_info(NOTES_DIR, dir_fd=kb_fd)
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
            index = mount_info(INDEX_NAME, dir_fd=notes_fd)
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

"""What the file watcher reports, and the decisions about its health, as pure data
(docs/daemon.md: the watcher accelerates and pushes; it is never the source of truth).

The I/O side is :mod:`kbd.fs.watch` (watchfiles threads, ``/proc`` reads); the
registry consumes :class:`PathChange` without loading it, so nothing on the
``kbd exec`` path imports watchfiles. Every function here takes what was read and
returns a decision, so each failure rule is testable without a watcher.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

ChangeKind = Literal["added", "modified", "deleted"]
Ident = tuple[int, int]  # (st_dev, st_ino) of a watched folder

# watchfiles.Change values (1 added, 2 modified, 3 deleted), named here so the
# pure core never imports watchfiles.
_KINDS: dict[int, ChangeKind] = {1: "added", 2: "modified", 3: "deleted"}

# Health reasons (stable strings: the daemon shows them in metrics and events).
QUEUE_OVERFLOW = "queue_overflow"  # a batch so large that the kernel queue likely overflowed
WATCH_LIMIT = "watch_limit"  # folders left without an inotify watch (max_user_watches)
FOLDER_REPLACED = "folder_replaced"  # a watched path now names another folder
WATCHER_DIED = "watcher_died"  # watch() raised, or the thread exited
STALLED = "stalled"  # the thread is alive but has not come back from watch() in time
BUILD_FAILED = "build_failed"  # the notifier could not be created at all


@dataclass(frozen=True)
class PathChange:
    """One reported change: a path whose directory entry appeared, vanished or
    changed. Only a hint of where to look: consumers re-read the disk."""

    kind: ChangeKind
    path: str


@dataclass(frozen=True)
class WatchBatch:
    segment: str
    changes: tuple[PathChange, ...]
    # True when events were probably lost (kernel queue overflow): the consumer
    # must verify everything, not just these paths.
    lossy: bool


@dataclass(frozen=True)
class WatchHealth:
    """The watcher's state after a change of health. ``ok`` is False while any
    segment is broken; ``reason`` names the failure (one of the constants above)."""

    ok: bool
    reason: str | None
    watches: int  # inotify watches held (all segments)
    expected: int  # folders that should be watched (all segments)
    segment: str | None = None
    detail: str = ""


def to_changes(raw: Iterable[tuple[int, str]]) -> tuple[PathChange, ...]:
    """watchfiles' ``{(change, path)}`` as sorted PathChanges (unknown codes: "modified")."""
    return tuple(sorted((PathChange(_KINDS.get(code, "modified"), path) for code, path in raw), key=_order))


def _order(change: PathChange) -> tuple[str, str]:
    return (change.path, change.kind)


def lossy_threshold(max_queued_events: int) -> int:
    """How many changes in one burst mean the inotify queue may have overflowed.

    watchfiles drops the kernel's overflow notice (a path-less ``Rescan`` event,
    watchfiles issue #348), so the only sign left is the size of the burst. A file
    creation costs several queued events (create, open, close-write), so a full
    queue of ``max_queued_events`` shows as a fraction of that many paths; an
    eighth errs towards false alarms, which cost only a verification pass.
    """
    return max(64, max_queued_events // 8)


def is_lossy(burst: int, *, threshold: int) -> bool:
    return burst >= threshold


def burst_size(history: Iterable[tuple[float, int]], *, now: float, window: float = 1.0) -> int:
    """Changes reported within ``window`` seconds of ``now`` (batches of one burst
    may be split by the debounce)."""
    return sum(n for at, n in history if 0 <= now - at <= window)


def backoff(failures: int, *, initial: float = 1.0, maximum: float = 30.0) -> float:
    """Delay before restart number ``failures`` (1-based): initial, doubled each
    time, capped at ``maximum``."""
    if failures <= 0:
        return 0.0
    return float(min(maximum, initial * (2 ** min(failures - 1, 30))))


def kernel_dev_to_st_dev(sdev: int) -> int:
    """The ``sdev`` of /proc/<pid>/fdinfo (kernel ``MKDEV``: major << 20 | minor)
    as ``st_dev`` (the userspace encoding of the same device)."""
    major, minor = sdev >> 20, sdev & 0xFFFFF
    # glibc's makedev()
    return (
        ((major & 0xFFFFF000) << 32) | ((major & 0xFFF) << 8) | ((minor & 0xFFFFFF00) << 12) | (minor & 0xFF)
    )


def parse_inotify_fdinfo(text: str) -> set[Ident]:
    """The (st_dev, st_ino) of every inode an inotify fd watches, from the text of
    ``/proc/<pid>/fdinfo/<fd>`` (lines ``inotify wd:N ino:HEX sdev:HEX ...``)."""
    out: set[Ident] = set()
    for line in text.splitlines():
        if not line.startswith("inotify wd:"):
            continue
        fields = dict(part.split(":", 1) for part in line.split()[1:] if ":" in part)
        try:
            out.add((kernel_dev_to_st_dev(int(fields["sdev"], 16)), int(fields["ino"], 16)))
        except (KeyError, ValueError):
            continue
    return out


@dataclass(frozen=True)
class Coverage:
    """Which watched paths are not covered by a live watch on the right folder."""

    replaced: tuple[str, ...]  # the path now names another folder than the one watched
    unwatched: tuple[str, ...]  # the path's folder never got (or lost) its watch

    @property
    def ok(self) -> bool:
        return not self.replaced and not self.unwatched

    def reason(self) -> str | None:
        if self.replaced:
            return FOLDER_REPLACED
        if self.unwatched:
            return WATCH_LIMIT
        return None


def coverage(
    recorded: Mapping[str, Ident], current: Mapping[str, Ident | None], watched: set[Ident]
) -> Coverage:
    """Compare what a segment watched at build (``recorded``: path → identity then)
    with the folders at those paths now (``current``; None: gone) and the inodes
    its inotify fd holds (``watched``).

    A path that is gone is no failure (its removal was reported by the parent's
    watch); a path naming another folder means the watch sits on the old one;
    a path whose folder holds no watch was left out (the watch limit; watchfiles
    ignores that error silently) or lost its watch.
    """
    replaced: list[str] = []
    unwatched: list[str] = []
    for path, ident in sorted(recorded.items()):
        now = current.get(path)
        if now is None:
            continue
        if now != ident:
            replaced.append(path)
        elif ident not in watched:
            unwatched.append(path)
    return Coverage(tuple(replaced), tuple(unwatched))


def touched_watched(changes: Iterable[PathChange], watched_paths: Iterable[str]) -> list[str]:
    """Watched paths that a batch names themselves (not a child of them): the only
    way a watch on a folder reports that the folder itself was moved or removed."""
    names = {c.path for c in changes}
    return sorted(p for p in watched_paths if p in names)

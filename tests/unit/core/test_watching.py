"""The watcher's pure decisions (kbd.core.watching): what counts as lossy, how
coverage is judged, how /proc fdinfo is read, the restart backoff."""

from __future__ import annotations

import os

from kbd.core import watching
from kbd.core.watching import PathChange, coverage


def test_fdinfo_lines_become_device_and_inode() -> None:
    text = (
        "pos:\t0\nflags:\t02004000\nmnt_id:\t17\nino:\t26\n"
        "inotify wd:2 ino:234adb sdev:fe00000 mask:fee ignored_mask:0 fhandle-bytes:8 fhandle-type:1 f_handle:db\n"
        "inotify wd:1 ino:ff sdev:800001 mask:fee ignored_mask:0\n"
        "inotify wd:3 garbage\n"
    )
    assert watching.parse_inotify_fdinfo(text) == {(os.makedev(0xFE, 0), 0x234ADB), (os.makedev(8, 1), 0xFF)}
    for major, minor in [(0, 45), (259, 70000), (4095, 1 << 19)]:
        assert watching.kernel_dev_to_st_dev((major << 20) | minor) == os.makedev(major, minor)


def test_coverage_tells_replaced_from_unwatched_and_ignores_gone() -> None:
    recorded = {"/a": (1, 10), "/b": (1, 11), "/c": (1, 12)}
    assert coverage(recorded, {"/a": (1, 10), "/b": (1, 11), "/c": (1, 12)}, {(1, 10), (1, 11), (1, 12)}).ok
    gone = coverage(recorded, {"/a": (1, 10), "/b": None, "/c": (1, 12)}, {(1, 10), (1, 12)})
    assert gone.ok  # a removal is reported by the parent's watch, not a failure
    limit = coverage(recorded, {"/a": (1, 10), "/b": (1, 11), "/c": (1, 12)}, {(1, 10)})
    assert limit.unwatched == ("/b", "/c") and limit.reason() == watching.WATCH_LIMIT
    moved = coverage(recorded, {"/a": (1, 99), "/b": (1, 11), "/c": (1, 12)}, {(1, 10), (1, 11)})
    assert (
        moved.replaced == ("/a",)
        and moved.unwatched == ("/c",)
        and moved.reason() == watching.FOLDER_REPLACED
    )


def test_bursts_and_backoff() -> None:
    assert watching.lossy_threshold(16384) == 2048
    assert watching.lossy_threshold(100) == 64
    history = [(0.0, 1500), (0.5, 600), (3.0, 10)]
    assert watching.burst_size(history, now=0.9) == 2100
    assert watching.is_lossy(watching.burst_size(history, now=0.9), threshold=2048)
    assert not watching.is_lossy(watching.burst_size(history, now=3.0), threshold=2048)
    assert [watching.backoff(n) for n in range(8)] == [0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    assert watching.backoff(10_000, initial=0.05, maximum=0.2) == 0.2


def test_changes_and_self_events() -> None:
    changes = watching.to_changes({(3, "/w/b"), (1, "/w/a"), (2, "/w/a"), (9, "/w/c")})
    assert changes == (
        PathChange("added", "/w/a"),
        PathChange("modified", "/w/a"),
        PathChange("deleted", "/w/b"),
        PathChange("modified", "/w/c"),
    )
    assert watching.touched_watched(changes, ["/w/b", "/w/x", "/w"]) == ["/w/b"]

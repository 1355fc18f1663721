"""Golden tests of the sandbox specification derived from a plan (pure)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kbd.core.folders import FolderStatus
from kbd.core.plan import build_plan
from kbd.core.resolve import Attachment, WriteStatus
from kbd.fs.datafiles import consumer_kind
from kbd.sandbox.spec import Mount, inner_landlock, mounts, submounts

R = Path("/tmp/r/workflows")


def att(alias: str, *, writable: bool = False) -> Attachment:
    return Attachment(
        alias=alias, workflow_id=f"wf_{alias}", label=alias, access="write" if writable else "read",
        available=True, reason=None, message=None,
        write=WriteStatus(True, None) if writable else None,
        path=R / alias / "knowledgebase", kb_identity=(1, 2),
    )  # fmt: skip


def test_write_plan_mount_order_is_parents_first_overlays_after() -> None:
    plan = build_plan(
        workflow_id="wf_con", workflow_folder=R / "con", policy=consumer_kind("execution"),
        kb_access="read-write", item_kb_write=False,
        attachments=[att("rts"), att("sec", writable=True)],
        folders=[FolderStatus("shared", "read_write", True, None, None, R / "rts" / "knowledgebase")],
    )  # fmt: skip
    # Sorted by depth; at one depth read-write binds before read-only ones, so at
    # the same path (the shared folder grant and the rts KB) the overlay wins.
    assert mounts(plan) == [
        Mount("/tmp/r/workflows/con", "bind", "own"),
        Mount("/tmp/r/workflows/rts/knowledgebase", "bind", "folder:shared"),
        Mount("/tmp/r/workflows/con/knowledgebase", "ro-bind", "local_kb"),
        Mount("/tmp/r/workflows/con/workflow.json", "ro-bind", "own"),
        Mount("/tmp/r/workflows/rts/knowledgebase", "ro-bind", "kb:rts"),
        Mount("/tmp/r/workflows/sec/knowledgebase", "ro-bind", "kb:sec"),
        Mount("/tmp/r/workflows/con/knowledgebase/notes", "bind", "local_kb"),
        Mount("/tmp/r/workflows/sec/knowledgebase/notes", "bind", "kb_write:sec"),
        Mount("/tmp/r/workflows/sec/knowledgebase/notes/_index.json", "ro-bind", "kb_write:sec"),
    ]
    inner = inner_landlock(plan)
    assert inner is not None
    # The withheld rights come back on the consumer's other writable grants
    # (its workspace, the shared folder), never on an ancestor of the
    # contributed notes/ (here /tmp, where the test root lives).
    assert [r["path"] for r in inner["rules"]] == [
        "/tmp/r/workflows/con",
        "/tmp/r/workflows/con/knowledgebase/notes",
        "/tmp/r/workflows/rts/knowledgebase",
    ]
    assert set(inner["handled"]) == {"make_sym", "make_fifo", "make_sock", "make_char", "make_block", "refer"}


def test_every_mount_comes_after_its_ancestors() -> None:
    plan = build_plan(
        workflow_id="wf_con", workflow_folder=R / "con", policy=consumer_kind("execution"),
        kb_access="read-write", item_kb_write=False, attachments=[att("a", writable=True), att("b")], folders=[],
    )  # fmt: skip
    order = mounts(plan)
    for i, m in enumerate(order):
        for later in order[i + 1 :]:
            assert not Path(m.dest).is_relative_to(later.dest) or (m.dest == later.dest and m.op == "bind")


def test_read_and_none_plans() -> None:
    read = build_plan(
        workflow_id="wf_con", workflow_folder=R / "con", policy=consumer_kind("reviewer_strategic"),
        kb_access="read", item_kb_write=False, attachments=[att("rts")], folders=[],
    )  # fmt: skip
    assert mounts(read) == [
        Mount("/tmp/r/workflows/con", "ro-bind", "own"),
        Mount("/tmp/r/workflows/rts/knowledgebase", "ro-bind", "kb:rts"),
    ]
    assert inner_landlock(read) is None
    none = build_plan(
        workflow_id="wf_con", workflow_folder=R / "con", policy=consumer_kind("builder"),
        kb_access="none", item_kb_write=False, attachments=[att("rts")], folders=[],
    )  # fmt: skip
    assert mounts(none) == [
        Mount("/tmp/r/workflows/con", "bind", "own"),
        Mount("/tmp/r/workflows/con/workflow.json", "ro-bind", "own"),
        Mount("/tmp/r/workflows/con/knowledgebase", "hidden", "local_kb"),
    ]


# -- typed bwrap options ---------------------------------------------------------


def test_each_bwrap_option_yields_its_exact_words() -> None:
    from kbd.sandbox.spec import (
        BindFd,
        CapDrop,
        Chdir,
        Dev,
        Flag,
        Proc,
        RemountRo,
        RoBind,
        SeccompFd,
        StatusFd,
        Symlink,
        Tmpfs,
        argv_of,
    )  # fmt: skip

    opts = [
        Flag("--die-with-parent"), CapDrop("ALL"), StatusFd(5), SeccompFd(6), Chdir("/w"), RemountRo("/"),
        Symlink("usr/bin", "/bin"), RoBind("/usr", "/usr"), BindFd(7, "/kb", rw=True), BindFd(8, "/ro", rw=False),
        Tmpfs("/tmp"), Tmpfs("/dev/shm", size=1024), Proc("/proc"), Dev("/dev"),
    ]  # fmt: skip
    assert argv_of(opts) == [
        "--die-with-parent", "--cap-drop", "ALL", "--json-status-fd", "5", "--seccomp", "6", "--chdir", "/w",
        "--remount-ro", "/", "--symlink", "usr/bin", "/bin", "--ro-bind", "/usr", "/usr", "--bind-fd", "7", "/kb",
        "--ro-bind-fd", "8", "/ro", "--tmpfs", "/tmp", "--size", "1024", "--tmpfs", "/dev/shm", "--proc", "/proc",
        "--dev", "/dev",
    ]  # fmt: skip


@pytest.mark.parametrize(
    "build",
    [
        lambda s: s.RoBind("usr", "/usr"),  # relative source
        lambda s: s.RoBind("/usr", "usr"),  # relative destination
        lambda s: s.BindFd(-1, "/kb", rw=True),
        lambda s: s.BindFd(True, "/kb", rw=True),  # a bool is not a descriptor
        lambda s: s.Tmpfs("/tmp", size=0),
        lambda s: s.Tmpfs("/tmp\0x"),
        lambda s: s.Chdir("w"),
        lambda s: s.StatusFd(-3),
        lambda s: s.Symlink("", "/bin"),
    ],
)
def test_a_malformed_bwrap_option_cannot_be_built(build: Any) -> None:
    """Ordering code can only arrange whole, checked options: a value cannot go
    missing or be relative, and --size cannot be separated from its --tmpfs."""
    from kbd.sandbox import spec

    with pytest.raises(ValueError):
        build(spec)


def test_a_file_copy_carries_its_permissions_and_refuses_bad_values() -> None:
    from kbd.sandbox.spec import File, MountOpt

    assert File(7, "/etc/passwd", 0o644).argv() == ("--perms", "0644", "--file", "7", "/etc/passwd")
    assert not isinstance(File(7, "/etc/passwd", 0o644), MountOpt)  # no mount point for the helper to expect
    for bad in ({"fd": -1}, {"dest": "etc/passwd"}, {"perms": 0o4755}, {"perms": True}):
        with pytest.raises(ValueError):
            File(**{"fd": 7, "dest": "/etc/passwd", "perms": 0o644, **bad})  # type: ignore[arg-type]


MOUNTINFO = """\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/vda rw
30 22 0:26 / /usr/local rw shared:9 - tmpfs t rw
31 30 0:27 / /usr/local/my\\040games rw shared:10 - tmpfs t rw
32 22 0:28 / /usrx rw shared:11 - tmpfs t rw
33 22 0:29 / /usr rw shared:12 - tmpfs t rw
34 22 0:30 / /etc/ssl/certs ro shared:13 - tmpfs t ro
35 22 0:31 / /etc/ssl-other rw shared:14 - tmpfs t rw
"""


def test_submounts_are_strictly_beneath_and_unescaped() -> None:
    # /usr itself is kbd's own bind (expected already); /usrx and /etc/ssl-other are not beneath.
    assert submounts(MOUNTINFO, ["/usr", "/etc/ssl/"]) == [
        "/usr/local",
        "/usr/local/my games",
        "/etc/ssl/certs",
    ]
    assert submounts(MOUNTINFO, []) == [] and submounts("garbage\n\n", ["/usr"]) == []

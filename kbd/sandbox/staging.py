"""Staging layers: a per-command overlay over each source ``notes/`` a command
may write (docs/notes.md "Staged contributions").

A command with a write grant never holds a writable descriptor to a real file in
a source's ``notes/``. For each such folder kbd (as root) makes, under
``state/staging/<command>/<n>/``, an ``upper`` folder with the real ``notes/``
folder's owner, group and mode and an overlayfs ``work`` folder, and an overlay
mount built *detached* (``fsopen``/``fsconfig``/``fsmount``): lower = the pinned
real ``notes/`` (read through, never written), upper = the staging folder. The
mount's descriptor replaces the real folder in the bubblewrap argv; the
launcher step attaches it over the ``notes/`` path in a private mount namespace
of its own (:func:`kbd.sandbox.launcher.attach_overlays`: bubblewrap binds by
path), checking that the path is still the pinned folder. The command reads
other writers' committed notes through the lower layer and writes into the
upper one; at exit :mod:`kbd.service.contributions` commits each changed path
through the notes write path, and the staging folder goes.

Why this shape: Debian's bubblewrap 0.8 has no overlay options; an overlay
mounted by the command's own (unprivileged) user namespace could not copy up a
note whose owner that namespace does not map; and a detached mount never
appears in the host's mount table. The mount is ``nosuid,nodev``; metacopy and
redirect_dir are off, so every changed file is whole in the upper layer and a
folder renamed across layers fails with EXDEV (programs fall back to a copy).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import shutil
import stat
from dataclasses import dataclass, field
from pathlib import Path

from kbd.core.layout import INDEX_NAME
from kbd.core.plan import Plan
from kbd.errors import PathNotFound, SandboxSetupError, Unavailable
from kbd.fs.confined import open_beneath, pin_dir
from kbd.fs.libc import libc
from kbd.fs.notes import open_notes

# The new mount API (the same numbers on every architecture since 5.2).
SYS_MOVE_MOUNT = 429
SYS_FSOPEN = 430
SYS_FSCONFIG = 431
SYS_FSMOUNT = 432
FSOPEN_CLOEXEC = 1
FSCONFIG_SET_STRING = 1
FSCONFIG_CMD_CREATE = 6
FSMOUNT_CLOEXEC = 1
MOUNT_ATTR_NOSUID = 0x2
MOUNT_ATTR_NODEV = 0x4
# Every overlay option kbd relies on, spelled out: a host default (a kernel
# built with metacopy on) must never leave a changed file's bytes in the lower
# layer, where the commit would not find them.
OVERLAY_OPTIONS = (("metacopy", "off"), ("redirect_dir", "off"), ("index", "off"), ("xino", "off"))
STAGING_DIR = "staging"


def _sys(*args: object) -> int:
    result = libc.syscall(*args)
    if result < 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))
    return int(result)


def overlay_mount(lower_fd: int, upper_fd: int, work_fd: int) -> int:
    """A detached overlay mount (its descriptor, close-on-exec) of the three
    folders open at ``lower_fd``, ``upper_fd`` and ``work_fd``. Layers are named
    by their ``/proc/self/fd`` links, so no path is looked up again."""
    fs = _sys(SYS_FSOPEN, b"overlay", FSOPEN_CLOEXEC)
    try:
        layers = (("lowerdir", lower_fd), ("upperdir", upper_fd), ("workdir", work_fd))
        for key, fd in layers:
            _sys(SYS_FSCONFIG, fs, FSCONFIG_SET_STRING, key.encode(), f"/proc/self/fd/{fd}".encode(), 0)
        for key, value in OVERLAY_OPTIONS:
            _sys(SYS_FSCONFIG, fs, FSCONFIG_SET_STRING, key.encode(), value.encode(), 0)
        _sys(SYS_FSCONFIG, fs, FSCONFIG_CMD_CREATE, None, None, 0)
        return _sys(SYS_FSMOUNT, fs, FSMOUNT_CLOEXEC, MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV)
    finally:
        os.close(fs)


@dataclass
class Area:
    """One staged ``notes/``: where the command's writes land."""

    alias: str
    source: str  # the source workflow's ID
    kb_path: Path
    kb_identity: tuple[int, int] | None
    notes: Path  # the real notes/ folder (its canonical path)
    identity: tuple[int, int]  # (st_dev, st_ino) of the real notes/
    folder: Path  # state/staging/<command>/<n>
    mount_fd: int = -1
    index_fd: int = -1  # O_PATH of _index.json beneath the overlay (bound read-only)

    @property
    def upper(self) -> Path:
        return self.folder / "upper"

    def attach(self) -> dict[str, object]:
        """What the launcher step needs to attach this overlay over the real path."""
        return {
            "fd": self.mount_fd,
            "path": str(self.notes),
            "dev": self.identity[0],
            "ino": self.identity[1],
        }


@dataclass
class Staging:
    """The staging layers of one command (see the module docstring)."""

    folder: Path
    areas: list[Area] = field(default_factory=list)

    def close_fds(self) -> None:
        """The mount descriptors (the sandbox holds its own references once set up)."""
        for area in self.areas:
            for fd in (area.mount_fd, area.index_fd):
                if fd >= 0:
                    with contextlib.suppress(OSError):
                        os.close(fd)
            area.mount_fd = area.index_fd = -1

    def remove(self) -> None:
        self.close_fds()
        shutil.rmtree(self.folder, ignore_errors=True)


def staged_sources(plan: Plan) -> list[tuple[str, str, Path, tuple[int, int] | None]]:
    """(alias, source ID, KB path, KB identity) of every source ``notes/`` the plan writes."""
    return [
        (att.alias, att.workflow_id, att.path, att.kb_identity)
        for att in plan.sources
        if att.available and att.path is not None and plan.writes_source(att.alias)
    ]


def _mkdir_like(parent_fd: int, name: str, like: os.stat_result) -> int:
    """``name`` beneath ``parent_fd`` with ``like``'s owner, group and mode (set on
    the open folder, so the umask does not matter); its O_PATH descriptor."""
    os.mkdir(name, 0o700, dir_fd=parent_fd)
    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent_fd)
    try:
        os.fchown(fd, like.st_uid, like.st_gid)
        os.fchmod(fd, stat.S_IMODE(like.st_mode))
        return os.open(".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=fd)
    finally:
        os.close(fd)


def create(state_dir: Path, plan: Plan, *, label: str) -> Staging | None:
    """The staging layers for every source ``notes/`` ``plan`` writes (None:
    none). Needs root: the overlay is kbd's, not the command's (see the module
    docstring). Raises Unavailable when this process cannot stage, and
    SandboxSetupError when a folder is not what its resolution recorded;
    nothing is left behind either way."""
    sources = staged_sources(plan)
    if not sources:
        return None
    if os.geteuid() != 0:
        raise Unavailable(
            "a command that writes into a source's notes/ is staged by kbd as root, and this kbd is not root",
            hint="run the command through the kbd daemon (kbd serve as root), or write with `kbd notes write`",
        )
    base = state_dir / STAGING_DIR
    base.mkdir(mode=0o700, exist_ok=True)
    sweep(state_dir)  # what a killed kbd exec left (usually nothing: one listing)
    # The owner's pid in the name: :func:`sweep` removes only the folders of
    # processes that are gone.
    folder = base / f"{label}.{os.getpid()}.{secrets.token_hex(6)}"
    folder.mkdir(mode=0o700)
    staging = Staging(folder)
    try:
        for n, (alias, source, kb_path, kb_identity) in enumerate(sources):
            _stage_one(staging, n, alias, source, kb_path, kb_identity)
    except BaseException:
        staging.remove()
        raise
    return staging


def _stage_one(
    staging: Staging, n: int, alias: str, source: str, kb_path: Path, kb_identity: tuple[int, int] | None
) -> None:
    area_dir = staging.folder / str(n)
    area_dir.mkdir(mode=0o700)
    holder = os.open(area_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        with pin_dir(kb_path, expect=kb_identity) as kb, open_notes(kb.fd) as notes_fd:
            real = os.fstat(notes_fd)
            upper = _mkdir_like(holder, "upper", real)
            os.mkdir("work", 0o700, dir_fd=holder)
            work = os.open("work", os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=holder)
            area = Area(alias, source, kb_path, kb_identity, kb_path / "notes", (real.st_dev, real.st_ino),
                        area_dir)  # fmt: skip
            staging.areas.append(area)
            try:
                area.mount_fd = overlay_mount(notes_fd, upper, work)
            except OSError as exc:
                raise SandboxSetupError(
                    f"cannot stage the notes/ of {source!r} (overlayfs: {exc.strerror or exc}); nothing was run"
                ) from None
            finally:
                os.close(upper)
                os.close(work)
            # The index stays read-only inside the overlay too: bound over it
            # by this descriptor (its path, once attached, is the real one).
            with contextlib.suppress(PathNotFound):
                area.index_fd = open_beneath(area.mount_fd, INDEX_NAME, os.O_PATH)
    finally:
        os.close(holder)


def sweep(state_dir: Path) -> None:
    """Remove staging folders left by commands that never finished (a killed
    daemon): their contributions were never committed, and never will be."""
    base = state_dir / STAGING_DIR
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(base):
            owner = entry.name.split(".")[-2] if entry.name.count(".") >= 2 else ""
            if owner.isdigit() and os.path.exists(f"/proc/{owner}"):
                continue  # a running command's (in-process kbd exec, or this daemon's)
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)

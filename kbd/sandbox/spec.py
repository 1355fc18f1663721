"""From a plan to sandbox specifications. Pure: no I/O, no processes.

* :func:`mounts` orders the plan's grants as bubblewrap mounts: parents before
  children, and at the same path a read-write bind before the read-only overlay
  that must win over it (golden-tested in tests/unit/sandbox/test_spec.py).
* :func:`inner_landlock` is the rule set applied inside bubblewrap when the plan
  lets a command write into a source's ``notes/``: nothing there may become a
  symlink, FIFO, socket, device node or a link from another folder.
* bwrap options are tiny typed objects that yield argv words, never strings
  for a shell.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from kbd.core.plan import Plan

# Rights the inner layer withholds inside contributed notes/ folders.
INNER_HANDLED = ["make_sym", "make_fifo", "make_sock", "make_char", "make_block", "refer"]
# System folders every sandbox sees read-only (those that exist on the host).
SYSTEM_RO = ("/usr",)  # not /opt: a kbd root there would be covered by it
SYSTEM_LINKS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
ETC_FILES = (
    "/etc/passwd", "/etc/group", "/etc/nsswitch.conf", "/etc/ld.so.cache", "/etc/ld.so.conf",
    "/etc/ld.so.conf.d", "/etc/localtime", "/etc/alternatives", "/etc/hosts", "/etc/resolv.conf",
    "/etc/ssl", "/etc/ca-certificates", "/etc/mime.types", "/etc/magic", "/etc/inputrc", "/etc/profile",
    "/etc/bash.bashrc", "/etc/environment", "/etc/os-release", "/etc/debian_version",
)  # fmt: skip
HELPER_DEST = "/.kbd/landlock_helper.py"
HELPER_PYC_DEST = "/.kbd/landlock_helper.pyc"  # its bytecode, when kbd runs the sandbox's python
# Parts of procfs that reach the host kernel rather than the sandbox's own processes.
PROC_READ_ONLY = (
    "/proc/sys", "/proc/sysrq-trigger", "/proc/irq", "/proc/bus", "/proc/fs", "/proc/acpi", "/proc/scsi",
    "/proc/kcore", "/proc/keys", "/proc/timer_list", "/proc/sched_debug", "/proc/latency_stats",
)  # fmt: skip
# Masked with /dev/null (as Docker masks them): keyrings are not namespaced, so
# /proc/keys would list the description (up to 4 KiB of data) of every key the
# host's uid 0 may view, and /proc/key-users every uid's key usage.
PROC_MASKED = ("/proc/keys", "/proc/key-users")
_RANK = {"bind": 0, "ro-bind": 1, "hidden": 2}


@dataclass(frozen=True)
class Mount:
    dest: str
    op: str  # bind | ro-bind | hidden
    origin: str


def unescape_mountinfo(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as ``\\ooo``."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def submounts(mountinfo: str, folders: Sequence[str]) -> list[str]:
    """The host's mount points strictly beneath ``folders``, from mountinfo
    text. bubblewrap binds a folder with its submounts (a separate /usr/local,
    a certificate bind under /etc/ssl), so they are mount points in the sandbox
    too: the ones the inner helper expects besides kbd's own
    (docs/sandbox.md "Mount points")."""
    out = []
    for line in mountinfo.splitlines():
        fields = line.split(" ", 5)
        if len(fields) < 5:
            continue
        point = unescape_mountinfo(fields[4])
        if any(point.startswith(f.rstrip("/") + "/") for f in folders):
            out.append(point)
    return out


def mounts(plan: Plan) -> list[Mount]:
    """The plan's grants as mounts in the order bwrap must apply them."""
    out: dict[tuple[str, str], Mount] = {}
    for g in plan.grants:
        op = {"write": "bind", "read": "ro-bind", "read_only": "ro-bind", "hidden": "hidden"}[g.mode]
        out.setdefault((str(g.path), op), Mount(str(g.path), op, str(g.origin)))
    return sorted(out.values(), key=lambda m: (len(Path(m.dest).parts), _RANK[m.op], m.dest))


def contributed_notes(plan: Plan) -> list[Path]:
    """Source ``notes/`` folders this plan may write into."""
    return sorted({g.path for g in plan.grants if g.mode == "write" and g.origin.kind == "kb_write"})


def inner_landlock(plan: Plan) -> dict[str, Any] | None:
    """The inner Landlock spec for a plan that writes into a source's notes/, else None.

    The withheld rights are granted back on every other writable grant that is
    not an ancestor of a contributed ``notes/``: the consumer's own workspace
    keeps its normal rights. (Landlock rules only add rights beneath a folder,
    so an ancestor of a source's notes/ — e.g. /tmp when roots live there —
    cannot be granted without granting the notes/ too.)
    """
    notes = contributed_notes(plan)
    if not notes:
        return None
    rules = []
    candidates = [g.path for g in plan.grants if g.mode == "write" and g.origin.kind != "kb_write"]
    candidates.append(Path("/tmp"))  # noqa: S108 - the sandbox's private tmpfs
    for path in sorted(set(candidates)):
        if any(path == n or path in n.parents or n in path.parents for n in notes):
            continue
        rules.append({"path": str(path), "access": INNER_HANDLED})
    return {"handled": INNER_HANDLED, "rules": rules, "min_abi": 2}


# -- bwrap options as typed argv words --------------------------------------------
#
# One small class per bubblewrap option (as bubblejail does): each knows its own
# words, checks its values when it is built, and a mount keeps its destination as
# a field. Ordering code only arranges whole options, so it cannot drop a value,
# separate ``--size`` from its ``--tmpfs``, or hand bwrap a relative path.

FlagName = Literal[
    "--die-with-parent", "--new-session", "--unshare-pid", "--unshare-ipc", "--unshare-uts",
    "--unshare-cgroup-try", "--unshare-net", "--unshare-user", "--disable-userns", "--assert-userns-disabled",
]  # fmt: skip


def _path(value: str) -> str:
    if not value.startswith("/") or "\0" in value:
        raise ValueError(f"a bwrap path must be absolute and free of NUL: {value!r}")
    return value


def _fd(value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"a file descriptor must be a non-negative integer: {value!r}")
    return value


class Opt:
    """One bubblewrap option."""

    def argv(self) -> tuple[str, ...]:
        raise NotImplementedError


class MountOpt(Opt):
    """An option that creates a mount point at ``dest`` inside the sandbox."""

    dest: str


@dataclass(frozen=True)
class Flag(Opt):
    name: FlagName

    def argv(self) -> tuple[str, ...]:
        return (self.name,)


@dataclass(frozen=True)
class CapDrop(Opt):
    cap: Literal["ALL"]

    def argv(self) -> tuple[str, ...]:
        return ("--cap-drop", self.cap)


@dataclass(frozen=True)
class StatusFd(Opt):
    fd: int

    def __post_init__(self) -> None:
        _fd(self.fd)

    def argv(self) -> tuple[str, ...]:
        return ("--json-status-fd", str(self.fd))


@dataclass(frozen=True)
class BlockFd(Opt):
    """bubblewrap reads one byte from ``fd`` and closes it just before it execs
    the command: a byte still there once bwrap is gone says it never got that far."""

    fd: int

    def __post_init__(self) -> None:
        _fd(self.fd)

    def argv(self) -> tuple[str, ...]:
        return ("--block-fd", str(self.fd))


@dataclass(frozen=True)
class SeccompFd(Opt):
    fd: int

    def __post_init__(self) -> None:
        _fd(self.fd)

    def argv(self) -> tuple[str, ...]:
        return ("--seccomp", str(self.fd))


@dataclass(frozen=True)
class Chdir(Opt):
    path: str

    def __post_init__(self) -> None:
        _path(self.path)

    def argv(self) -> tuple[str, ...]:
        return ("--chdir", self.path)


@dataclass(frozen=True)
class RemountRo(Opt):
    dest: str

    def __post_init__(self) -> None:
        _path(self.dest)

    def argv(self) -> tuple[str, ...]:
        return ("--remount-ro", self.dest)


@dataclass(frozen=True)
class Symlink(Opt):
    target: str  # what the link says; may be relative (``usr/bin``)
    link: str

    def __post_init__(self) -> None:
        _path(self.link)
        if not self.target or "\0" in self.target:
            raise ValueError(f"a symlink target must be a non-empty string free of NUL: {self.target!r}")

    def argv(self) -> tuple[str, ...]:
        return ("--symlink", self.target, self.link)


@dataclass(frozen=True)
class File(Opt):
    """A file bwrap creates on the sandbox's own root (remounted read-only
    later) and fills with what ``fd`` reads, with exactly ``perms``: a copy of
    a small host file where a bind would cost bwrap a mount, a remount and a
    scan of the whole mount table. No mount point, so not a :class:`MountOpt`."""

    fd: int
    dest: str
    perms: int

    def __post_init__(self) -> None:
        _fd(self.fd)
        _path(self.dest)
        if isinstance(self.perms, bool) or not 0 <= self.perms <= 0o777:
            raise ValueError(f"file permissions must be within 0o777 (no set-id bits): {self.perms!r}")

    def argv(self) -> tuple[str, ...]:
        return ("--perms", f"{self.perms:04o}", "--file", str(self.fd), self.dest)


@dataclass(frozen=True)
class RoBind(MountOpt):
    src: str
    dest: str

    def __post_init__(self) -> None:
        _path(self.src)
        _path(self.dest)

    def argv(self) -> tuple[str, ...]:
        return ("--ro-bind", self.src, self.dest)


@dataclass(frozen=True)
class BindFd(MountOpt):
    """A grant, bound from a descriptor kbd opened beneath a pinned folder."""

    fd: int
    dest: str
    rw: bool

    def __post_init__(self) -> None:
        _fd(self.fd)
        _path(self.dest)

    def argv(self) -> tuple[str, ...]:
        return ("--bind-fd" if self.rw else "--ro-bind-fd", str(self.fd), self.dest)


@dataclass(frozen=True)
class Tmpfs(MountOpt):
    """A fresh tmpfs; ``size`` (bytes) travels with it, since bwrap applies
    ``--size`` to the next tmpfs only."""

    dest: str
    size: int | None = None

    def __post_init__(self) -> None:
        _path(self.dest)
        if self.size is not None and (isinstance(self.size, bool) or self.size <= 0):
            raise ValueError(f"a tmpfs size must be a positive number of bytes: {self.size!r}")

    def argv(self) -> tuple[str, ...]:
        sized = ("--size", str(self.size)) if self.size is not None else ()
        return (*sized, "--tmpfs", self.dest)


@dataclass(frozen=True)
class Proc(MountOpt):
    dest: str

    def __post_init__(self) -> None:
        _path(self.dest)

    def argv(self) -> tuple[str, ...]:
        return ("--proc", self.dest)


@dataclass(frozen=True)
class Dev(MountOpt):
    dest: str

    def __post_init__(self) -> None:
        _path(self.dest)

    def argv(self) -> tuple[str, ...]:
        return ("--dev", self.dest)


def argv_of(opts: Iterable[Opt]) -> list[str]:
    return [w for o in opts for w in o.argv()]

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

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


@dataclass(frozen=True)
class Opt:
    words: tuple[str, ...]

    def argv(self) -> Iterator[str]:
        yield from self.words


def bind_fd(fd: int, dest: str, *, rw: bool) -> Opt:
    return Opt(("--bind-fd" if rw else "--ro-bind-fd", str(fd), dest))


def flag(name: str) -> Opt:
    return Opt((name,))


def arg(name: str, *values: str) -> Opt:
    return Opt((name, *values))


def argv_of(opts: Iterable[Opt]) -> list[str]:
    return [w for o in opts for w in o.argv()]

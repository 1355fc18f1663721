"""Per-command cgroups: contain a sandboxed command's whole process tree, and
bound it (DESIGN §5, issue 9 items 5 and 6).

Each ``kbd exec`` creates ``<cgroup2 mount>/kbd/<sid>.<pid>.<rand>`` and starts
its command inside it, so everything the command forks — ``setsid``, double
forks and all — stays in that cgroup, and ``cgroup.kill`` (Linux >= 5.14) ends
all of it at once: on exec exit, ``session close`` and ``session revoke
--immediate``, from any process that knows the name.

Python 3.11 has no ``clone3(CLONE_INTO_CGROUP)`` and kbd uses no
``preexec_fn``, so ``kbd exec`` moves *itself* into the cgroup, forks and execs
the command (which inherits the cgroup at fork: no window in which it runs
outside), and moves itself back before it records or waits for anything.

The v2 hierarchy is found in ``/proc/self/mountinfo``, never assumed: pure-v2
hosts mount it at /sys/fs/cgroup, hybrid ones at /sys/fs/cgroup/unified beside
v1 controllers. Controllers (pids, memory, cpu) are used only where the v2
parent already delegates them; a v1 ``pids`` hierarchy (hybrid hosts) still
bounds the number of processes. kbd never changes a host-wide setting.

Pure parsing and decision functions first; the file I/O is in ``Hierarchy`` and
``Box``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kbd.config import LimitsConfig

SUBTREE = "kbd"
WANTED = ("pids", "memory", "cpu")
# <session id>.<kbd exec pid>.<random>: a record naming anything else is ignored.
NAME = re.compile(r"s_[0-9a-f]{20}\.[0-9]{1,10}\.[0-9a-f]{8}")
CPU_PERIOD = 100_000


# -- pure ------------------------------------------------------------------------
def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as ``\\ooo``."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def parse_mounts(mountinfo: str) -> tuple[str | None, str | None]:
    """(cgroup2 mount point, cgroup v1 ``pids`` mount point) from mountinfo text;
    only writable mounts of a hierarchy's root count (a bind of a sub-cgroup, as
    in some containers, would not match the paths in /proc/self/cgroup)."""
    v2 = v1_pids = None
    for line in mountinfo.splitlines():
        pre, sep, post = line.partition(" - ")
        f, p = pre.split(), post.split()
        if not sep or len(f) < 6 or len(p) < 3 or f[3] != "/" or "rw" not in f[5].split(","):
            continue
        if p[0] == "cgroup2" and v2 is None:
            v2 = _unescape(f[4])
        elif p[0] == "cgroup" and "pids" in p[2].split(",") and v1_pids is None:
            v1_pids = _unescape(f[4])
    return v2, v1_pids


def parse_own(proc_cgroup: str) -> tuple[str | None, str | None]:
    """(v2 path, v1 pids path) of a process from its /proc/PID/cgroup text."""
    v2 = v1_pids = None
    for line in proc_cgroup.splitlines():
        hid, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hid == "0" and controllers == "":
            v2 = path
        elif "pids" in controllers.split(","):
            v1_pids = path
    return v2, v1_pids


def v2_files(limits: LimitsConfig, controllers: frozenset[str]) -> dict[str, str]:
    """The limit files to write into a command's v2 cgroup, for the controllers it has."""
    out: dict[str, str] = {}
    if "pids" in controllers and limits.pids_max is not None:
        out["pids.max"] = str(limits.pids_max)
    if "memory" in controllers and limits.memory_max is not None:
        out["memory.max"] = str(limits.memory_max)
    if "cpu" in controllers:
        if limits.cpu_weight is not None:
            out["cpu.weight"] = str(limits.cpu_weight)
        if limits.cpu_max is not None:
            out["cpu.max"] = f"{max(1000, round(limits.cpu_max * CPU_PERIOD))} {CPU_PERIOD}"
    return out


def v1_pids_max(limits: LimitsConfig, controllers: frozenset[str], *, v1_pids: bool) -> str | None:
    """pids.max for the v1 pids hierarchy: only when v2 cannot bound processes."""
    if limits.pids_max is None or "pids" in controllers or not v1_pids:
        return None
    return str(limits.pids_max)


def enforcement(limits: LimitsConfig, hierarchy: Hierarchy) -> dict[str, str]:
    """What each ``limits:`` key does on this host, for ``kbd doctor``."""
    ctl = hierarchy.controllers
    where = "not enforceable here: no writable cgroup v2 hierarchy" if hierarchy.v2 is None else ""

    def by_cgroup(controller: str, value: object) -> str:
        if value is None:
            return "off (null in kbd.yaml)"
        if controller in ctl:
            return f"enforced: cgroup v2 {controller} controller ({value})"
        # The v1 pids cgroup sits beside the v2 one: without v2 there is no command cgroup.
        if controller == "pids" and hierarchy.v1_pids is not None and hierarchy.v2 is not None:
            return f"enforced: cgroup v1 pids hierarchy at {os.path.dirname(hierarchy.v1_pids)} ({value})"
        return where or (
            f"not enforceable here: the {controller} controller is not available in the cgroup v2 "
            f"hierarchy at {os.path.dirname(hierarchy.v2 or '')} (bound to cgroup v1 or not delegated)"
        )

    def rlimit(name: str, value: object) -> str:
        return "off (null in kbd.yaml)" if value is None else f"enforced: {name} ({value})"

    return {
        "pids_max": by_cgroup("pids", limits.pids_max),
        "memory_max": by_cgroup("memory", limits.memory_max),
        "cpu_weight": by_cgroup("cpu", limits.cpu_weight),
        "cpu_max": by_cgroup("cpu", limits.cpu_max),
        "file_size_max": rlimit("RLIMIT_FSIZE", limits.file_size_max),
        "open_files_max": rlimit("RLIMIT_NOFILE", limits.open_files_max),
        "address_space_max": rlimit("RLIMIT_AS", limits.address_space_max),
        "cpu_time_max": rlimit("RLIMIT_CPU", limits.cpu_time_max),
        "core_dumps": "always off: RLIMIT_CORE 0",
        "tmpfs_size": (
            "off (null in kbd.yaml)"
            if limits.tmpfs_size is None
            else f"enforced on /tmp and /dev/shm under bubblewrap ({limits.tmpfs_size}); "
            "the Landlock-only scratch folder is bounded by file_size_max only"
        ),
    }


# -- I/O ---------------------------------------------------------------------------
def _read(path: str) -> str:
    with open(path, encoding="ascii") as fh:
        return fh.read()


def _write(path: str, text: str) -> None:
    # Plain open(2) + write(2): cgroupfs files take one value per write.
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Hierarchy:
    """Where this host lets kbd put per-command cgroups. ``v2`` is kbd's own
    subtree (``<mount>/kbd``), None when containment is unavailable (``problem``
    says why); ``home``/``v1_home`` are this process's own cgroups, to step back
    into after starting a command."""

    v2: str | None
    home: str | None
    controllers: frozenset[str]
    v1_pids: str | None
    v1_home: str | None
    problem: str | None

    def path(self, name: str) -> str | None:
        """The v2 folder of the command cgroup ``name`` (None for a malformed name)."""
        if self.v2 is None or not NAME.fullmatch(name):
            return None
        return f"{self.v2}/{name}"


_detected: Hierarchy | None = None


def detect() -> Hierarchy:
    """Find (and on first use create) kbd's subtree; cached for the process."""
    global _detected  # one probe per process: it sits on the exec path
    if _detected is None:
        _detected = _probe()
    return _detected


def _probe() -> Hierarchy:
    try:
        v2_mount, v1_mount = parse_mounts(_read("/proc/self/mountinfo"))
        own_v2, own_v1 = parse_own(_read("/proc/self/cgroup"))
    except OSError as exc:
        return Hierarchy(None, None, frozenset(), None, None, f"cannot read /proc: {exc.strerror}")
    v1_sub, v1_home = _v1_pids(v1_mount, own_v1)
    if v2_mount is None or own_v2 is None:
        return Hierarchy(
            None, None, frozenset(), v1_sub, v1_home, "no writable cgroup v2 hierarchy is mounted"
        )
    home = v2_mount.rstrip("/") + own_v2.rstrip("/") if own_v2 != "/" else v2_mount
    sub = f"{v2_mount.rstrip('/')}/{SUBTREE}"
    try:
        _ensure_dir(sub)
        if not os.path.exists(f"{sub}/cgroup.kill"):
            return Hierarchy(
                None, None, frozenset(), v1_sub, v1_home, "the kernel has no cgroup.kill (Linux < 5.14)"
            )
        if not os.path.isdir(home):
            return Hierarchy(
                None, None, frozenset(), v1_sub, v1_home, f"this process's cgroup {home} is not visible"
            )
        controllers = _delegate(sub)
    except OSError as exc:
        return Hierarchy(
            None, None, frozenset(), v1_sub, v1_home, f"cannot create {sub}: {exc.strerror or exc}"
        )
    return Hierarchy(sub, home, controllers, v1_sub, v1_home, None)


def _ensure_dir(path: str) -> None:
    # stat first: mkdir on cgroupfs takes the global cgroup mutex even for EEXIST.
    if not os.path.isdir(path):
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o755)
    if not os.path.isdir(path) or os.path.islink(path):
        raise NotADirectoryError(20, "not a folder", path)


def _delegate(sub: str) -> frozenset[str]:
    """Enable in kbd's subtree the wanted controllers its parent already offers."""
    offered = set(_read(f"{sub}/cgroup.controllers").split())
    enabled = set(_read(f"{sub}/cgroup.subtree_control").split())
    missing = [c for c in WANTED if c in offered and c not in enabled]
    if missing:
        try:
            _write(f"{sub}/cgroup.subtree_control", " ".join(f"+{c}" for c in missing))
            enabled |= set(missing)
        except OSError:
            enabled = set(_read(f"{sub}/cgroup.subtree_control").split())
    return frozenset(c for c in WANTED if c in enabled)


def _v1_pids(mount: str | None, own: str | None) -> tuple[str | None, str | None]:
    if mount is None or own is None:
        return None, None
    home = mount.rstrip("/") + own.rstrip("/") if own != "/" else mount
    sub = f"{mount.rstrip('/')}/{SUBTREE}"
    try:
        _ensure_dir(sub)
    except OSError:
        return None, None
    return (sub, home) if os.path.isdir(home) else (None, None)


@dataclass
class Box:
    """One command's cgroup (and its v1 pids sibling)."""

    hierarchy: Hierarchy
    name: str
    path: str
    v1: str | None = None
    inside: bool = False  # whether this process is in the cgroup now
    _leaving: threading.Thread | None = field(default=None, repr=False)
    _leave_error: OSError | None = field(default=None, repr=False)

    @classmethod
    def create(cls, hierarchy: Hierarchy, sid: str) -> Box:
        """Make the (still unlimited) cgroups; :meth:`limit` bounds them."""
        name = f"{sid}.{os.getpid()}.{os.urandom(4).hex()}"
        path = hierarchy.path(name)
        if path is None:
            raise ValueError(f"cannot name a cgroup for session {sid!r}")
        os.mkdir(path, 0o755)
        box = cls(hierarchy, name, path)
        if hierarchy.v1_pids is not None and "pids" not in hierarchy.controllers:
            try:
                box.v1 = f"{hierarchy.v1_pids}/{name}"
                os.mkdir(box.v1, 0o755)
            except BaseException:
                box.v1 = None
                box.remove()
                raise
        return box

    def limit(self, limits: LimitsConfig) -> None:
        """Write the limit files; before the command is started, never after."""
        for fname, value in v2_files(limits, self.hierarchy.controllers).items():
            _write(f"{self.path}/{fname}", value)
        v1_max = v1_pids_max(limits, self.hierarchy.controllers, v1_pids=self.v1 is not None)
        if v1_max is not None and self.v1 is not None:
            _write(f"{self.v1}/pids.max", v1_max)

    def enter(self) -> None:
        """Move this process in: whatever it forks from now on starts inside."""
        me = str(os.getpid())
        _write(f"{self.path}/cgroup.procs", me)
        self.inside = True
        if self.v1 is not None:
            try:
                _write(f"{self.v1}/cgroup.procs", me)
            except BaseException:
                self.leave()
                raise

    def leave(self) -> None:
        me = str(os.getpid())
        if self.v1 is not None and self.hierarchy.v1_home is not None:
            _write(f"{self.hierarchy.v1_home}/cgroup.procs", me)
        _write(f"{self.hierarchy.home or self.hierarchy.v2}/cgroup.procs", me)
        self.inside = False

    def leave_soon(self) -> None:
        """:meth:`leave` on a helper thread; :meth:`settle` waits for it."""
        self._leaving = threading.Thread(target=self._leave_quietly, name="kbd-cgroup-leave", daemon=True)
        self._leaving.start()

    def _leave_quietly(self) -> None:
        try:
            self.leave()
        except OSError as exc:
            self._leave_error = exc

    def settle(self) -> None:
        """Wait until this process is out of the cgroup (retrying a failed move once,
        here, so that its OSError reaches the caller)."""
        if self._leaving is not None:
            self._leaving.join()
            self._leaving = None
        if self._leave_error is not None:
            self._leave_error = None
            self.leave()

    def kill(self, *, timeout: float = 5.0) -> bool:
        return kill_tree(self.path, timeout=timeout)

    def remove(self) -> None:
        for path in (self.v1, self.path):
            if path is not None:
                _rmdir(path)


# A cgroup removed meanwhile (another kbd process ended the same command): its
# files are gone (ENOENT) or, when already open, answer ENODEV.
_GONE = (errno.ENOENT, errno.ENODEV)


class Preparation(threading.Thread):
    """Create a command's cgroup and step this process into it on a helper thread,
    while ``kbd exec`` imports, loads its config and looks the plan up: the move
    waits for an RCU grace period (~10-15 ms on a busy host) that would otherwise
    add to every command's latency. Limits are written (``Box.limit``) after
    :meth:`result`, before the command starts."""

    def __init__(self, sid: str) -> None:
        super().__init__(name="kbd-cgroup", daemon=True)
        self.sid = sid
        self.box: Box | None = None
        self.error: str | None = None

    @classmethod
    def start_for(cls, sid: str) -> Preparation:
        prep = cls(sid)
        prep.start()
        return prep

    def run(self) -> None:
        try:
            hierarchy = detect()
            if hierarchy.v2 is not None:
                box = Box.create(hierarchy, self.sid)
                try:
                    box.enter()
                except BaseException:
                    box.remove()
                    raise
                self.box = box
                sweep(hierarchy)  # what killed execs left: off the critical path
        except (OSError, ValueError) as exc:  # ValueError: not a session ID (the lookup says so)
            self.error = getattr(exc, "strerror", None) or str(exc)

    def result(self) -> tuple[Box | None, str | None]:
        self.join()
        return self.box, self.error


def populated(path: str) -> bool:
    """Whether any process is left in the cgroup at ``path`` (False when it is gone)."""
    try:
        return "populated 1" in _read(f"{path}/cgroup.events")
    except OSError as exc:
        if exc.errno in _GONE:
            return False
        raise


def kill_tree(path: str, *, timeout: float = 5.0) -> bool:
    """SIGKILL every process in the cgroup at once (``cgroup.kill`` also catches
    processes forked during the kill) and wait until it is empty. True when it is."""
    try:
        _write(f"{path}/cgroup.kill", "1")
    except OSError as exc:
        if exc.errno in _GONE:
            return True
        raise
    deadline = time.monotonic() + timeout
    while populated(path):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def _rmdir(path: str, *, timeout: float = 1.0) -> None:
    """Remove an emptied cgroup. EBUSY is retried briefly: killed processes that
    were reparented to init stay attached until init reaps them. Anything else
    (ENOENT: already gone) is left alone; a folder that stays is empty and harmless."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            os.rmdir(path)  # noqa: PTH106 - cgroupfs paths stay plain strings
        except OSError as exc:
            if exc.errno == errno.EBUSY and time.monotonic() < deadline:
                time.sleep(0.01)
                continue
        return


def sweep(hierarchy: Hierarchy) -> None:
    """Remove the empty cgroups of ``kbd exec`` processes that were killed before
    they could (a killed exec's tree, if any is left, keeps its cgroup populated
    for close and revoke). A name whose exec PID is alive — maybe reused — stays."""
    if hierarchy.v2 is None:
        return
    for name in os.listdir(hierarchy.v2):
        dead = NAME.fullmatch(name) and not os.path.exists(f"/proc/{name.split('.')[1]}")
        if dead and not populated(f"{hierarchy.v2}/{name}"):
            remove(hierarchy, name)


def remove(hierarchy: Hierarchy, name: str) -> None:
    """Remove the (empty) cgroups named ``name`` in both hierarchies."""
    path = hierarchy.path(name)
    if path is None:
        return
    if hierarchy.v1_pids is not None:
        _rmdir(f"{hierarchy.v1_pids}/{name}")
    _rmdir(path)


def uncontained_problem(backend: str, problem: str | None, *, subreaper: bool) -> str | None:
    """Why ``backend`` must refuse to run without a per-command cgroup, or None.

    bubblewrap holds the tree in its PID namespace (``--unshare-pid``,
    ``--die-with-parent``): killing it kills everything. The Landlock-only
    backend has only the subreaper fallback (kbd.sandbox.reaper); without it, it
    refuses rather than run uncontained. ``none`` is already the operator's
    explicit unsafe choice (it warns)."""
    if backend != "landlock" or subreaper:
        return None
    return (
        "the Landlock-only backend cannot contain the command's processes: no per-command "
        f"cgroup ({problem or 'unavailable'}) and no subreaper; refusing to run it uncontained"
    )

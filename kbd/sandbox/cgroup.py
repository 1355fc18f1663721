"""Per-command cgroups: contain a sandboxed command's whole process tree, and
bound it (docs/sandbox.md "Process containment" and "Resource limits").

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
v1 controllers. Controllers (pids, memory, cpu) are used in v2 where its parent
already delegates them; each one v2 lacks but a v1 hierarchy has (hybrid hosts)
gets a per-command cgroup of the same name there, under kbd's subtree *inside
this process's own v1 cgroup* (so whatever bounds kbd also bounds the command),
and the same move puts the command into all of them (``V1_FILES`` says which
files each takes). The kill path stays ``cgroup.kill`` on v2: the v1 cgroups
hold the same processes. kbd never changes a host-wide setting.

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

from kbd.core.layout import BROKER_NAME, SESSION_NAME
from kbd.sandbox.spec import unescape_mountinfo

if TYPE_CHECKING:
    from kbd.core.config import LimitsConfig

SUBTREE = "kbd"
WANTED = ("pids", "memory", "cpu")
# Which ``limits:`` keys each controller enforces: a configured one whose v1
# hierarchy exists but cannot hold kbd's cgroups refuses the command.
LIMIT_KEYS = {"pids": ("pids_max",), "memory": ("memory_max",), "cpu": ("cpu_weight", "cpu_max")}
# Written only where the kernel has them (memsw: swap accounting is on).
OPTIONAL_FILES = frozenset({"memory.memsw.limit_in_bytes"})
NAME = re.compile(f"{SESSION_NAME.pattern}|{BROKER_NAME.pattern}")
CPU_PERIOD = 100_000


# -- pure ------------------------------------------------------------------------
def parse_mounts(mountinfo: str) -> tuple[str | None, dict[str, str]]:
    """(cgroup2 mount point, {wanted controller: its cgroup v1 mount point}) from
    mountinfo text; only writable mounts of a hierarchy's root count (a bind of a
    sub-cgroup, as in some containers, would not match the paths in
    /proc/self/cgroup). Co-mounted controllers (``cpu,cpuacct``) share a mount."""
    v2: str | None = None
    v1: dict[str, str] = {}
    for line in mountinfo.splitlines():
        pre, sep, post = line.partition(" - ")
        f, p = pre.split(), post.split()
        if not sep or len(f) < 6 or len(p) < 3 or f[3] != "/" or "rw" not in f[5].split(","):
            continue
        if p[0] == "cgroup2" and v2 is None:
            v2 = unescape_mountinfo(f[4])
        elif p[0] == "cgroup":
            for controller in p[2].split(","):
                if controller in WANTED:
                    v1.setdefault(controller, unescape_mountinfo(f[4]))
    return v2, v1


def parse_own(proc_cgroup: str) -> tuple[str | None, dict[str, str]]:
    """(v2 path, {wanted v1 controller: path}) of a process from its /proc/PID/cgroup text."""
    v2: str | None = None
    v1: dict[str, str] = {}
    for line in proc_cgroup.splitlines():
        hid, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hid == "0" and controllers == "":
            v2 = path
        else:
            v1.update((c, path) for c in controllers.split(",") if c in WANTED)
    return v2, v1


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


def v1_files(limits: LimitsConfig, controllers: tuple[str, ...]) -> list[tuple[str, str]]:
    """(file, value) to write, in order, into a command's cgroup in a v1 hierarchy
    binding ``controllers`` (only those v2 lacks: see ``_v1_hierarchies``)."""
    out: list[tuple[str, str]] = []
    if "pids" in controllers and limits.pids_max is not None:
        out.append(("pids.max", str(limits.pids_max)))
    if "memory" in controllers and limits.memory_max is not None:
        value = str(limits.memory_max)
        # memsw (memory + swap) after the memory limit, which it may not undercut:
        # swap must not be a way around the bound. oom_control 0: a child cgroup
        # inherits its parent's oom_kill_disable, and a command stopped at its
        # limit must be OOM-killed (inside its own cgroup), never left hanging.
        out += [("memory.limit_in_bytes", value), ("memory.memsw.limit_in_bytes", value)]
        out.append(("memory.oom_control", "0"))
    if "cpu" in controllers:
        if limits.cpu_weight is not None:
            # cpu.shares: 1024 is an ordinary process, as cpu.weight 100 is (kernel range 2..262144).
            out.append(("cpu.shares", str(max(2, round(limits.cpu_weight * 1024 / 100)))))
        if limits.cpu_max is not None:
            out.append(("cpu.cfs_period_us", str(CPU_PERIOD)))
            out.append(("cpu.cfs_quota_us", str(max(1000, round(limits.cpu_max * CPU_PERIOD)))))
    return out


def v1_problem(limits: LimitsConfig, hierarchy: Hierarchy) -> str | None:
    """Why a command must be refused: a limit is configured whose controller has a
    v1 hierarchy here that cannot hold kbd's cgroups (fail closed), or None."""
    for h in hierarchy.v1:
        if h.subtree is not None:
            continue
        for controller in h.controllers:
            for key in LIMIT_KEYS[controller]:
                if getattr(limits, key) is not None:
                    return (
                        f"limits.{key} is set but the cgroup v1 {controller} hierarchy at {h.mount} "
                        f"cannot hold the command's cgroup: {h.problem}"
                    )
    return None


def enforcement(limits: LimitsConfig, hierarchy: Hierarchy) -> dict[str, str]:
    """What each ``limits:`` key does on this host, for ``kbd doctor``."""
    ctl = hierarchy.controllers
    where = "not enforceable here: no writable cgroup v2 hierarchy" if hierarchy.v2 is None else ""

    def by_cgroup(controller: str, value: object) -> str:
        if value is None:
            return "off (null in kbd.yaml)"
        if controller in ctl:
            return f"enforced: cgroup v2 {controller} controller ({value})"
        # The v1 cgroups sit beside the v2 one: without v2 there is no command cgroup.
        v1 = hierarchy.v1_for(controller)
        if v1 is not None and hierarchy.v2 is not None:
            if v1.subtree is not None:
                return f"enforced: cgroup v1 {controller} hierarchy at {v1.mount} ({value})"
            return (
                f"REFUSED: the cgroup v1 {controller} hierarchy at {v1.mount} cannot hold the command's "
                f"cgroup ({v1.problem}); kbd exec refuses to run while this limit is set"
            )
        return where or (
            f"not enforceable here: the {controller} controller is not available in the cgroup v2 "
            f"hierarchy at {os.path.dirname(hierarchy.v2 or '')} (not delegated) and no cgroup v1 "
            f"{controller} hierarchy is mounted"
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
    except OSError as exc:  # name the file: the error reaches the user
        raise OSError(exc.errno, exc.strerror, path) from None
    finally:
        os.close(fd)


@dataclass(frozen=True)
class V1:
    """A cgroup v1 hierarchy binding wanted controllers that v2 does not offer here.
    ``subtree`` is kbd's folder in it (``<mount><this process's cgroup>/kbd``),
    None when it cannot hold kbd's cgroups (``problem`` says why); ``home`` is
    this process's own cgroup there, to step back into."""

    controllers: tuple[str, ...]
    mount: str
    subtree: str | None
    home: str | None
    problem: str | None = None


@dataclass(frozen=True)
class Hierarchy:
    """Where this host lets kbd put per-command cgroups. ``v2`` is kbd's own
    subtree (``<mount>/kbd``), None when containment is unavailable (``problem``
    says why); ``home`` is this process's own v2 cgroup, to step back into after
    starting a command; ``v1``: the v1 hierarchies for what v2 cannot bound."""

    v2: str | None
    home: str | None
    controllers: frozenset[str]
    v1: tuple[V1, ...]
    problem: str | None

    def path(self, name: str) -> str | None:
        """The v2 folder of the command cgroup ``name`` (None for a malformed name)."""
        if self.v2 is None or not NAME.fullmatch(name):
            return None
        return f"{self.v2}/{name}"

    def v1_for(self, controller: str) -> V1 | None:
        return next((h for h in self.v1 if controller in h.controllers), None)


_detected: Hierarchy | None = None


def detect() -> Hierarchy:
    """Find (and on first use create) kbd's subtree; cached for the process."""
    global _detected  # one probe per process: it sits on the exec path
    if _detected is None:
        _detected = _probe()
    return _detected


def _probe() -> Hierarchy:
    try:
        v2_mount, v1_mounts = parse_mounts(_read("/proc/self/mountinfo"))
        own_v2, own_v1 = parse_own(_read("/proc/self/cgroup"))
    except OSError as exc:
        return Hierarchy(None, None, frozenset(), (), f"cannot read /proc: {exc.strerror}")
    if v2_mount is None or own_v2 is None:
        return Hierarchy(None, None, frozenset(), (), "no writable cgroup v2 hierarchy is mounted")
    home = _join(v2_mount, own_v2)
    sub = f"{v2_mount.rstrip('/')}/{SUBTREE}"
    try:
        _ensure_dir(sub)
        if not os.path.exists(f"{sub}/cgroup.kill"):
            return Hierarchy(None, None, frozenset(), (), "the kernel has no cgroup.kill (Linux < 5.14)")
        if home is None or not os.path.isdir(home):
            return Hierarchy(None, None, frozenset(), (), f"this process's cgroup {home} is not visible")
        controllers = _delegate(sub)
    except OSError as exc:
        return Hierarchy(None, None, frozenset(), (), f"cannot create {sub}: {exc.strerror or exc}")
    return Hierarchy(sub, home, controllers, _v1_hierarchies(v1_mounts, own_v1, controllers), None)


def _join(mount: str, own: str) -> str | None:
    """``mount`` + a cgroup path from /proc/self/cgroup; None for a path that is not
    plain (outside our cgroup namespace the kernel shows ``/../..``)."""
    if not own.startswith("/") or ".." in own.split("/"):
        return None
    return mount if own == "/" else mount.rstrip("/") + own.rstrip("/")


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


def _v1_hierarchies(mounts: dict[str, str], own: dict[str, str], v2: frozenset[str]) -> tuple[V1, ...]:
    """One entry per v1 mount binding a wanted controller that v2 lacks."""
    by_mount: dict[str, list[str]] = {}
    for controller in WANTED:
        if controller not in v2 and controller in mounts:
            by_mount.setdefault(mounts[controller], []).append(controller)
    return tuple(_v1_subtree(m, tuple(cs), own.get(cs[0])) for m, cs in by_mount.items())


def _v1_subtree(mount: str, controllers: tuple[str, ...], own: str | None) -> V1:
    # Inside this process's own cgroup, not at the hierarchy's root: a command
    # must stay under whatever limit the operator put on kbd (never widen).
    home = None if own is None else _join(mount, own)
    if home is None:
        return V1(controllers, mount, None, None, f"this process's cgroup in it is unknown ({own!r})")
    sub = f"{home.rstrip('/')}/{SUBTREE}"
    try:
        if not os.path.isdir(home):
            raise FileNotFoundError(errno.ENOENT, "this process's cgroup is not visible", home)
        _ensure_dir(sub)
        if not os.access(f"{sub}/cgroup.procs", os.W_OK):  # a read-only mount, or not ours
            raise PermissionError(errno.EACCES, "not writable", sub)
    except OSError as exc:
        return V1(controllers, mount, None, None, f"cannot use {sub}: {exc.strerror or exc}")
    return V1(controllers, mount, sub, home)


@dataclass
class Box:
    """One command's cgroup, and its siblings in the v1 hierarchies (hybrid hosts)."""

    hierarchy: Hierarchy
    name: str
    path: str
    v1: list[tuple[V1, str]] = field(default_factory=list)  # (hierarchy, this command's cgroup there)
    inside: bool = False  # whether this process is in the cgroups now
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
        try:
            for h in hierarchy.v1:
                if h.subtree is not None:
                    os.mkdir(f"{h.subtree}/{name}", 0o755)
                    box.v1.append((h, f"{h.subtree}/{name}"))
        except BaseException:
            box.remove()
            raise
        return box

    def limit(self, limits: LimitsConfig) -> None:
        """Write the limit files; before the command is started, never after."""
        for fname, value in v2_files(limits, self.hierarchy.controllers).items():
            _write(f"{self.path}/{fname}", value)
        for h, path in self.v1:
            for fname, value in v1_files(limits, h.controllers):
                if fname in OPTIONAL_FILES and not os.path.exists(f"{path}/{fname}"):
                    continue
                _write(f"{path}/{fname}", value)

    def enter(self) -> None:
        """Move this process in, v2 then every v1 sibling, back to back (on the
        preparing thread): whatever it forks from now on starts inside all of them."""
        me = str(os.getpid())
        _write(f"{self.path}/cgroup.procs", me)
        self.inside = True
        try:
            for _, path in self.v1:
                _write(f"{path}/cgroup.procs", me)
        except BaseException:
            self.leave()
            raise

    def adopt(self, pid: int) -> None:
        """Move another process (the broker's stopped command, never the daemon:
        a ``cgroup.kill`` must not take it along) into the cgroup, v2 then every
        v1 sibling."""
        _write(f"{self.path}/cgroup.procs", str(pid))
        for _, path in self.v1:
            _write(f"{path}/cgroup.procs", str(pid))

    def leave(self) -> None:
        me = str(os.getpid())
        for h, _ in self.v1:
            _write(f"{h.home}/cgroup.procs", me)
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

    @classmethod
    def existing(cls, hierarchy: Hierarchy, name: str) -> Box:
        """The cgroups ``name`` someone else made (the launcher's stubs)."""
        path = hierarchy.path(name)
        if path is None:
            raise ValueError(f"not a command cgroup: {name!r}")
        v1 = [(h, f"{h.subtree}/{name}") for h in hierarchy.v1 if h.subtree is not None]
        return cls(hierarchy, name, path, v1)

    def kill(self, *, timeout: float = 5.0) -> bool:
        return kill_tree(self.path, timeout=timeout)

    def remove(self) -> None:
        for _, path in self.v1:
            _rmdir(path)
        _rmdir(self.path)


# A cgroup removed meanwhile (another kbd process ended the same command): its
# files are gone (ENOENT) or, when already open, answer ENODEV.
_GONE = (errno.ENOENT, errno.ENODEV)


class Preparation(threading.Thread):
    """Create a command's cgroups and step this process into them on a helper thread,
    while ``kbd exec`` imports, loads its config and looks the plan up: the first
    move waits for an RCU grace period (~10-15 ms on a busy host) that would
    otherwise add to every command's latency; the v1 moves right behind it find
    the grace period passed and cost ~1 ms more, still off the critical path. Limits are written (``Box.limit``) after
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
    return wait_empty(path, timeout=timeout)


def wait_empty(path: str, *, timeout: float) -> bool:
    """Wait until the cgroup at ``path`` holds no process (True) or ``timeout``
    seconds passed (False). The kernel wakes a ``poll`` on ``cgroup.events``
    when ``populated`` changes: no sleep granularity on every command's path
    (a sandbox's PID 1 is often still exiting when bubblewrap has returned)."""
    import select

    try:
        fd = os.open(f"{path}/cgroup.events", os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in _GONE:
            return True
        raise
    try:
        watch = select.poll()
        watch.register(fd, select.POLLPRI | select.POLLERR)
        deadline = time.monotonic() + timeout
        while True:
            try:
                if b"populated 1" not in os.pread(fd, 256, 0):
                    return True
            except OSError as exc:
                if exc.errno in _GONE:
                    return True
                raise
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            # Bounded: a notification is never the only way to see the change.
            watch.poll(min(left, 0.05) * 1000)
    finally:
        os.close(fd)


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


def stub_dirs(hierarchy: Hierarchy, limits: LimitsConfig) -> list[tuple[str, list[tuple[str, str, bool]]]]:
    """Where the launcher makes a stub's cgroups and what it writes there:
    (subtree, [(file, value, optional)]), v2 first. Pure: the same limits give
    the same answer, so it also says whether a pooled stub is still current."""
    assert hierarchy.v2 is not None
    out = [(hierarchy.v2, [(f, v, False) for f, v in v2_files(limits, hierarchy.controllers).items()])]
    for h in hierarchy.v1:
        if h.subtree is not None:
            out.append((h.subtree, [(f, v, f in OPTIONAL_FILES) for f, v in v1_files(limits, h.controllers)]))
    return out


def _pid_of(name: str) -> str:
    return name.split(".")[1]


def _gone(pid: str) -> bool:
    """Process ``pid`` no longer runs: absent, or a zombie (its parent died
    too and nobody reaped it yet: it can do nothing, and its pid cannot be
    reused until it is reaped)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except OSError:
        return True
    return stat[stat.rindex(b")") + 2 : stat.rindex(b")") + 3] in (b"Z", b"X")


def sweep(hierarchy: Hierarchy) -> None:
    """Remove the empty cgroups of ``kbd exec`` processes that were killed before
    they could (a killed exec's tree, if any is left, keeps its cgroup populated
    for close and revoke). A name whose exec PID is alive — maybe reused — stays.
    The v1 subtrees are listed too: a v1 sibling outlives its v2 cgroup when
    another kbd process (in another v1 cgroup) removed that one."""
    if hierarchy.v2 is None:
        return
    for name in _names(hierarchy, hierarchy.v2):
        dead = NAME.fullmatch(name) and _gone(_pid_of(name))
        if not dead:
            continue
        if BROKER_NAME.fullmatch(name):
            # Its launcher is gone, and with it the daemon: whatever still runs
            # there (a tree that lost its parent-death signal in a race) must not
            # outlive them. Its record, if any, is dropped by the next reader.
            kill_tree(f"{hierarchy.v2}/{name}", timeout=1.0)
        if not populated(f"{hierarchy.v2}/{name}"):
            remove(hierarchy, name)


def _names(hierarchy: Hierarchy, v2: str) -> set[str]:
    """Every cgroup name under kbd's subtrees: v2 and each v1 (a v1 sibling
    outlives its v2 cgroup when another kbd process removed that one)."""
    names = set(os.listdir(v2))
    for h in hierarchy.v1:
        if h.subtree is not None:
            with contextlib.suppress(OSError):
                names.update(os.listdir(h.subtree))
    return names


def sweep_launcher(hierarchy: Hierarchy, launcher: int) -> None:
    """Kill and remove every stub cgroup of the (ended) launcher ``launcher``."""
    if hierarchy.v2 is None:
        return
    for name in _names(hierarchy, hierarchy.v2):
        if BROKER_NAME.fullmatch(name) and _pid_of(name) == str(launcher):
            kill_tree(f"{hierarchy.v2}/{name}", timeout=1.0)
            remove(hierarchy, name)


def of_session(hierarchy: Hierarchy, sid: str) -> list[str]:
    """The names of every command cgroup of session ``sid`` now present, recorded
    or not: a ``kbd exec`` killed between starting its command and recording it
    leaves a tree that only its cgroup's name ties to the session."""
    if hierarchy.v2 is None:
        return []
    try:
        names = os.listdir(hierarchy.v2)
    except OSError:
        return []
    return sorted(n for n in names if SESSION_NAME.fullmatch(n) and n.startswith(f"{sid}."))


def remove(hierarchy: Hierarchy, name: str) -> None:
    """Remove the (empty) cgroups named ``name`` in every hierarchy (the v1 ones
    under this process's own v1 cgroups)."""
    path = hierarchy.path(name)
    if path is None:
        return
    for h in hierarchy.v1:
        if h.subtree is not None:
            _rmdir(f"{h.subtree}/{name}")
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

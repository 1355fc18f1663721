"""The bubblewrap backend: turn a plan into a running sandbox (DESIGN §5).

Every grant is opened here, once, without following links (``pin_dir`` walks
from ``/`` with ``RESOLVE_NO_SYMLINKS``; files are opened ``O_PATH`` beneath
their pinned folder) and handed to bwrap as a file descriptor
(``--bind-fd``/``--ro-bind-fd``): a symlink swapped in after planning cannot
redirect a bind. KB-derived grants are opened beneath the KB folder pinned
against the identity its resolution recorded.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from kbd.core.layout import INDEX_NAME as INDEX
from kbd.core.layout import KB_DIR
from kbd.core.layout import NOTES_DIR as NOTES
from kbd.core.plan import Plan
from kbd.errors import SandboxSetupError, Unavailable
from kbd.fs.confined import open_beneath, pin_dir
from kbd.sandbox import limits as rlimits
from kbd.sandbox import seccomp, spec
from kbd.sandbox.spec import (
    HELPER_DEST,
    BindFd,
    CapDrop,
    Chdir,
    Dev,
    Flag,
    MountOpt,
    Opt,
    Proc,
    RemountRo,
    RoBind,
    SeccompFd,
    StatusFd,
    Symlink,
    Tmpfs,
)

if TYPE_CHECKING:
    from collections.abc import Mapping

    from kbd.core.config import LimitsConfig

HELPER_SOURCE = Path(__file__).with_name("landlock_helper.py")
PYTHON = "/usr/bin/python3"
USERNS_LIMIT = Path("/proc/sys/user/max_user_namespaces")


def bwrap_path() -> str | None:
    """bwrap on the fixed system PATH (not the caller's: a PATH entry must not
    choose which binary builds the sandbox). shutil.which is avoided only for
    import cost on the exec path."""
    for d in ("/usr/bin", "/bin", "/usr/local/bin"):
        p = f"{d}/bwrap"
        if os.access(p, os.X_OK):
            return p
    return None


@dataclass
class Fds:
    """File descriptors opened for one launch; all closed afterwards.

    Only ``handed`` ones — each named in a ``--bind-fd``/``--ro-bind-fd``
    argument, which bwrap consumes and closes before running the command — may
    be passed to bwrap. Any other inherited directory fd would reach the
    sandboxed command and let it walk (``/proc/self/fd/N/..``) out of the
    sandbox into the host's filesystem.
    """

    fds: list[int] = field(default_factory=list)
    handed: list[int] = field(default_factory=list)

    def add(self, fd: int, *, hand: bool = True) -> int:
        self.fds.append(fd)
        if hand:
            self.handed.append(fd)
        return fd

    def close(self) -> None:
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds.clear()
        self.handed.clear()


def _open_path(path: Path, fds: Fds, *, kb_roots: dict[Path, int]) -> int:
    """An ``O_PATH`` fd for the grant ``path`` (a folder or a regular file), opened
    beneath its pinned KB when it lies in one, else beneath its pinned parent."""
    for kb, kb_fd in kb_roots.items():
        if path == kb:
            return fds.add(os.dup(kb_fd))
        if kb in path.parents:
            fd = fds.add(open_beneath(kb_fd, str(path.relative_to(kb)), os.O_PATH))
            break
    else:
        with pin_dir(path.parent) as parent:
            fd = fds.add(open_beneath(parent.fd, path.name, os.O_PATH))
    mode = os.fstat(fd).st_mode
    if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
        raise SandboxSetupError(f"grant {path.name!r} is neither a folder nor a regular file")
    return fd


def prepare(plan: Plan) -> None:
    """Create what bwrap needs as mount points inside writable trees, so bwrap
    itself never creates files there: each contributed ``notes/_index.json``
    (empty index) and the session's own ``knowledgebase/`` when it is overlaid."""
    for g in plan.grants:
        if g.mode == "read_only" and g.path.name == INDEX and g.origin.kind == "kb_write":
            notes = g.path.parent
            with pin_dir(notes) as pinned:
                try:
                    fd = os.open(INDEX, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                                 0o644, dir_fd=pinned.fd)  # fmt: skip
                except FileExistsError:
                    continue
                try:
                    os.write(fd, b"{}\n")
                    os.fsync(fd)
                finally:
                    os.close(fd)
                os.fsync(pinned.fd)
        if g.origin.kind == "local_kb" and g.mode in ("read_only", "hidden", "write"):
            # The session's own KB is its own to create; a missing one would make
            # bwrap create the mount point itself.
            with pin_dir(plan.workflow_folder) as own:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(KB_DIR, 0o755, dir_fd=own.fd)
                kb_fd = open_beneath(own.fd, KB_DIR, os.O_RDONLY | os.O_DIRECTORY)
                try:
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(NOTES, 0o755, dir_fd=kb_fd)
                finally:
                    os.close(kb_fd)


def userns_opts(limit: str | None) -> list[Opt]:
    """No nested user namespaces (the seccomp filter refuses CLONE_NEWUSER too).

    bwrap's --disable-userns needs a user namespace of bwrap's own, also when kbd
    runs as root (then only uid/gid 0 are mapped: the command is still uid 0 on
    the host, and files of other owners show as nobody), and bwrap itself checks
    that it took hold. A host whose ``user.max_user_namespaces`` (``limit``) is 0
    allows no user namespace to anyone, so the flags are both redundant and
    impossible there: root's bubblewrap keeps working without them. An
    unreadable limit (None) keeps the flags: fail closed.
    """
    if limit is not None and limit.strip() == "0":
        return []
    return [Flag("--unshare-user"), Flag("--disable-userns"), Flag("--assert-userns-disabled")]


def host_userns_limit() -> str | None:
    try:
        return USERNS_LIMIT.read_text()
    except OSError:
        return None


def system_opts() -> Iterator[Opt]:
    for d in spec.SYSTEM_RO:
        if os.path.isdir(d):
            yield RoBind(d, d)
    for link in spec.SYSTEM_LINKS:
        if os.path.islink(link):
            yield Symlink(os.readlink(link), link)
        elif os.path.isdir(link):
            yield RoBind(link, link)
    for f in spec.ETC_FILES:
        if os.path.exists(f):  # only what exists: never --ro-bind-try, never an empty stand-in
            yield RoBind(f, f)


def build_argv(
    plan: Plan,
    command: list[str],
    *,
    cwd: Path,
    network: str,
    status_fd: int,
    fds: Fds,
    limits: LimitsConfig | None = None,
    hard: Mapping[int, int] | None = None,
) -> list[str]:
    """The complete bwrap argv for ``command`` under ``plan``; opens (and records in
    ``fds``) every grant's descriptor. ``limits`` bounds the private tmpfs mounts
    and sets the command's rlimits (``kbd.yaml`` ``limits:``), never above the
    ``hard`` limits the command starts with (default: this process's)."""
    bwrap = bwrap_path()
    if bwrap is None:
        raise Unavailable(
            "bubblewrap (bwrap) is not installed", hint="apt-get install bubblewrap; see `kbd doctor`"
        )
    kb_roots: dict[Path, int] = {}
    for att in plan.sources:
        if att.available and att.path is not None and att.kb_identity is not None:
            pinned = pin_dir(att.path, expect=att.kb_identity)
            # Kept in kbd only, to open grants beneath it: never handed to bwrap.
            kb_roots[att.path] = fds.add(pinned.fd, hand=False)
    opts: list[Opt] = [
        Flag("--die-with-parent"),
        Flag("--new-session"),
        Flag("--unshare-pid"),
        Flag("--unshare-ipc"),
        Flag("--unshare-uts"),
        Flag("--unshare-cgroup-try"),
        *userns_opts(host_userns_limit()),
        CapDrop("ALL"),
        StatusFd(status_fd),
    ]
    if network == "none":
        opts.append(Flag("--unshare-net"))
    # A tmpfs is memory: each one the command can write into gets a size.
    tmpfs_size = limits.tmpfs_size if limits and limits.tmpfs_size else None
    # Private /tmp first: roots under /tmp (as in tests) are bound beneath it.
    opts.append(Tmpfs("/tmp", size=tmpfs_size))  # noqa: S108
    dests: list[str] = ["/", "/tmp"]  # noqa: S108
    for m in spec.mounts(plan):
        dests.append(m.dest)
        if m.op == "hidden":
            opts += [Tmpfs(m.dest), RemountRo(m.dest)]
            continue
        fd = _open_path(Path(m.dest), fds, kb_roots=kb_roots)
        opts.append(BindFd(fd, m.dest, rw=m.op == "bind"))
    # Everything the command executes comes AFTER the grants: a destination inside a
    # source-controlled folder (a contributed notes/ and its _index.json) is looked
    # up by path, and a source that swaps it for a symlink could otherwise land its
    # own file on, say, /usr/bin/python3. Later mounts cover anything such a
    # redirect put beneath them; the inner helper then checks every mount point.
    system: list[Opt] = [Proc("/proc"), Dev("/dev")]
    system += [RoBind(p, p) for p in spec.PROC_READ_ONLY if os.path.exists(p)]
    system += list(system_opts())
    opts += system
    dests += [o.dest for o in system if isinstance(o, MountOpt)]
    masked = [p for p in spec.PROC_MASKED if os.path.exists(p)]
    opts += [RoBind("/dev/null", p) for p in masked]
    dests += masked
    # bwrap's /dev is an unbounded tmpfs (--size cannot apply to --dev): make it
    # read-only and give shared memory its own bounded tmpfs.
    shm = "/dev/shm"  # noqa: S108 - the sandbox's own, fresh tmpfs
    opts += [Tmpfs(shm, size=tmpfs_size), RemountRo("/dev")]
    dests.append(shm)
    # The seccomp filter (no set-id bits, keyrings, user namespaces, io_uring/openat2;
    # socket families by allow-list), read by bwrap from a memfd.
    filt = fds.add(os.memfd_create("kbd-seccomp", os.MFD_CLOEXEC))
    os.write(filt, seccomp.program(block_network=network != "host"))
    os.lseek(filt, 0, os.SEEK_SET)
    opts.append(SeccompFd(filt))
    inner = spec.inner_landlock(plan)
    if inner is not None:
        helper_fd = fds.add(os.open(HELPER_SOURCE, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW))
        opts.append(BindFd(helper_fd, HELPER_DEST, rw=False))
        dests.append(HELPER_DEST)
        # The helper refuses to run the command unless the mount points are exactly
        # these (plus what --dev and --proc create beneath /dev and /proc).
        inner = {**inner, "mounts": sorted(set(dests)), "mount_prefixes": ["/dev/", "/proc/"]}
    opts += [RemountRo("/"), Chdir(str(cwd))]
    # bwrap reports a failed execvp as exit 1; a POSIX shell's `exec` gives the
    # conventional 127 (not found) / 126 (not executable) instead. The same
    # step sets the rlimits, inside the sandbox, before anything untrusted runs.
    argv = [bwrap, *spec.argv_of(opts), "--", *rlimits.shell_prefix(limits, hard)]
    if inner is not None:
        # The helper applies Landlock, then execs the command (127/126 on failure).
        argv += [PYTHON, "-I", "-S", HELPER_DEST, json.dumps(inner), "--"]
    return argv + command


def read_status(fd: int) -> tuple[int | None, int | None]:
    """(child pid, exit code) from bwrap's --json-status-fd stream (read to EOF)."""
    data = b""
    while chunk := os.read(fd, 4096):
        data += chunk
    child = code = None
    for doc in data.replace(b"}{", b"}\n{").splitlines():
        with contextlib.suppress(ValueError):
            obj = json.loads(doc)
            child = obj.get("child-pid", child)
            code = obj.get("exit-code", code)
    return child, code

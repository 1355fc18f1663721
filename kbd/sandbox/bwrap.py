"""The bubblewrap backend: turn a plan into a running sandbox (docs/sandbox.md).

Every grant is opened here, once, without following links (``pin_dir`` walks
from ``/`` with ``RESOLVE_NO_SYMLINKS``; files are opened ``O_PATH`` beneath
their pinned folder) and handed to bwrap as a file descriptor
(``--bind-fd``/``--ro-bind-fd``): a symlink swapped in after planning cannot
redirect a bind. KB-derived grants are opened beneath the KB folder pinned
against the identity its resolution recorded.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import stat
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kbd.core.layout import INDEX_NAME as INDEX
from kbd.core.layout import KB_DIR
from kbd.core.layout import NOTES_DIR as NOTES
from kbd.core.plan import Plan
from kbd.errors import SandboxSetupError, Unavailable
from kbd.fs.confined import open_beneath, pin_dir
from kbd.sandbox import limits as rlimits
from kbd.sandbox import seccomp, spec
from kbd.sandbox.landlock_helper import confine_layer
from kbd.sandbox.spec import (
    HELPER_DEST,
    HELPER_PYC_DEST,
    BindFd,
    BlockFd,
    CapDrop,
    Chdir,
    Dev,
    File,
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
    from kbd.sandbox.staging import Staging

HELPER_SOURCE = Path(__file__).with_name("landlock_helper.py")
PYTHON = "/usr/bin/python3"
USERNS_LIMIT = Path("/proc/sys/user/max_user_namespaces")
# /etc files up to this size are copied into the sandbox, larger ones bound.
ETC_COPY_MAX = 1 << 20
SEALS = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE


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
    # Staged notes/ overlays the launcher step attaches before bwrap runs
    # (kbd.sandbox.staging.Area.attach, with the handed descriptor's number).
    attach: list[dict[str, object]] = field(default_factory=list)

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
        self.attach.clear()


def _open_path(path: Path, fds: Fds, *, kb_roots: dict[Path, int]) -> int:
    """An ``O_PATH`` fd for the grant ``path`` (a folder or a regular file), opened
    beneath its pinned KB when it lies in one, else beneath its pinned parent."""
    for kb, kb_fd in kb_roots.items():
        if path == kb:
            return fds.add(os.dup(kb_fd))
        # Pure path prefix (as `kb in path.parents`, without building a Path
        # per parent on every command).
        if path.parts[: len(kb.parts)] == kb.parts:
            fd = fds.add(open_beneath(kb_fd, str(path.relative_to(kb)), os.O_PATH))
            break
    else:
        with pin_dir(path.parent) as parent:
            fd = fds.add(open_beneath(parent.fd, path.name, os.O_PATH))
    mode = os.fstat(fd).st_mode
    if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
        raise SandboxSetupError(f"grant {path.name!r} is neither a folder nor a regular file")
    return fd


def _staged_fd(dest: str, op: str, staging: Staging | None, fds: Fds) -> int | None:
    """The descriptor a staged ``notes/`` (its overlay) or its ``_index.json``
    (beneath the overlay) is bound from; None for any other grant."""
    if staging is None:
        return None
    for area in staging.areas:
        notes = str(area.notes)
        if dest == notes and op == "bind":
            fd = fds.add(os.dup(area.mount_fd))
            fds.attach.append({**area.attach(), "fd": fd})
            return fd
        if dest == f"{notes}/{INDEX}" and op == "ro-bind":
            if area.index_fd < 0:
                raise SandboxSetupError(
                    f"the staged notes/ of {area.source!r} has no {INDEX}; nothing was run"
                )
            return fds.add(os.dup(area.index_fd))
        if dest.startswith(notes + "/"):
            raise SandboxSetupError(
                f"a grant inside a staged notes/ ({dest}) cannot be bound; nothing was run"
            )
    return None


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


def _covered(path: str, grants: Sequence[str]) -> bool:
    """``path`` is a grant or lies beneath one."""
    return any(g == "/" or path == g or path.startswith(g + "/") for g in grants)


def _etc_copy(path: str, fds: Fds) -> File | None:
    """A copy of the small regular file ``path`` (links followed, as a bind
    follows them), read by bwrap from a descriptor opened here; None for
    anything else. FileNotFoundError: nothing there (nor at a link's end).

    Only a file anyone may read is copied: the daemon opens it as root, and the
    copy belongs to the command's user, so a root-only file (``/etc/environment``
    with a proxy password, say) would become readable to every broker client.
    Anything else stays a bind, which bwrap opens as the command's user: a
    refusal on the host stays a refusal in the sandbox."""
    if not _world_readable(path):
        return None
    try:
        # No FIFO wait; no link either (checked above: O_NOFOLLOW keeps it so at the open).
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise
    except OSError:
        return None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_size > ETC_COPY_MAX or not st.st_mode & stat.S_IROTH:
        os.close(fd)
        return None
    return File(fds.add(fd), path, stat.S_IMODE(st.st_mode) & 0o777)


def _world_readable(path: str) -> bool:
    """``path`` is no link, and every folder above it lets anyone search it (the
    file's own read bit is checked on the open descriptor)."""
    if os.path.realpath(path) != path:
        return False
    folder = os.path.dirname(path)
    while True:
        try:
            if not os.stat(folder).st_mode & stat.S_IXOTH:
                return False
        except OSError:
            return False
        if folder == "/":
            return True
        folder = os.path.dirname(folder)


def system_opts(fds: Fds | None = None, grants: Sequence[str] = ()) -> Iterator[Opt]:
    """The system folders, links and /etc files every sandbox sees read-only.

    With ``fds``, each small regular /etc file is a copy (:class:`File`) on the
    sandbox's root, which ``--remount-ro /`` makes read-only: the same bytes,
    read-only, at a fraction of a bind's cost (each bind makes bwrap mount,
    remount and parse the whole mount table: 0.1 ms, 15 of them 1.5 ms). A
    copy is only made where no grant covers the path: bwrap creates the file
    with ``creat``, which must land in the sandbox's own root, never in a bound
    host folder."""
    for d in spec.SYSTEM_RO:
        if os.path.isdir(d):
            yield RoBind(d, d)
    for link in spec.SYSTEM_LINKS:
        if os.path.islink(link):
            yield Symlink(os.readlink(link), link)
        elif os.path.isdir(link):
            yield RoBind(link, link)
    for f in spec.ETC_FILES:
        if fds is not None and not _covered(f, grants):
            try:
                copy = _etc_copy(f, fds)
            except FileNotFoundError:
                continue
            if copy is not None:
                yield copy
                continue
        if os.path.exists(f):  # only what exists: never --ro-bind-try, never an empty stand-in
            yield RoBind(f, f)


def host_submounts(folders: Sequence[str]) -> list[str]:
    """The host's mount points beneath the system ``folders`` bound into every
    sandbox (bubblewrap binds them recursively): expected mount points, not
    redirects. Read each time: mounts come and go. Fails closed: an unreadable
    table expects nothing more, and the inner helper then refuses a sandbox
    that has any."""
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as fh:
            return spec.submounts(fh.read(), folders)
    except OSError:
        return []


def sealed_memfd(name: str, data: bytes) -> int:
    """A memfd holding ``data``, sealed against any write, growth, shrinking
    and further sealing: immutable for as long as it exists."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


class Sealed:
    """Bytes every command needs (the seccomp programs, the Landlock helper's
    bytecode), built once per process into a :func:`sealed_memfd`. Each
    command gets its own read-only open of it (:meth:`open`): a fresh file
    offset for bwrap to read from (it reads to EOF, then closes it), so no
    command ever holds it, and nothing can change it (tests/security/
    test_sandbox_copies.py). Thread-safe: the daemon builds argvs on many threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fds: dict[str, int] = {}

    def open(self, name: str, build: Callable[[], bytes]) -> int:
        """A new read-only descriptor of the memfd ``name`` (``build()`` fills it once)."""
        try:
            with self._lock:
                fd = self._fds.get(name)
                if fd is None:
                    fd = self._fds[name] = sealed_memfd(name, build())
            return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:  # no /proc, no descriptor left: nothing runs
            raise SandboxSetupError(f"cannot hand bubblewrap its {name}: {exc.strerror or exc}") from None


SEALED = Sealed()


def seccomp_fd(block_network: bool, *, confine: bool = False) -> int:
    """The seccomp filter (no set-id bits, keyrings, user namespaces,
    io_uring/openat2; socket families by allow-list) for bwrap's --seccomp.
    ``confine`` (the command carries the grant group): no ``socket(AF_UNIX)``,
    stream and seqpacket pairs only (docs/multi-user.md "Threat model")."""
    name = ("kbd-seccomp-no-net" if block_network else "kbd-seccomp-net") + ("-pairs" if confine else "")
    return SEALED.open(name, lambda: seccomp.program(block_network=block_network, unix_pairs_only=confine))


def _same_interpreter() -> bool:
    """This process runs the interpreter the sandbox runs the helper with
    (a venv's python is a link to it), so bytecode compiled here is its own."""
    return os.path.realpath(sys.executable) == os.path.realpath(PYTHON)


def current_pyc(data: bytes, *, source_size: int, source_mtime: float) -> bool:
    """``data`` is a .pyc of this interpreter for a source of that size and
    mtime: the import system's own check of a timestamp pyc (a hash-based
    one, flags != 0, is not trusted here)."""
    from _frozen_importlib_external import MAGIC_NUMBER  # loaded at startup: no import cost

    fields = [int.from_bytes(data[i : i + 4], "little") for i in (4, 8, 12)]
    expected = [0, int(source_mtime) & 0xFFFFFFFF, source_size & 0xFFFFFFFF]
    return len(data) > 16 and data[:4] == MAGIC_NUMBER and fields == expected


@functools.cache
def _helper_bytecode() -> bytes:
    """The helper as a .pyc (magic number, 12 header bytes the interpreter
    skips when it runs a .pyc file, then the code): compiling its source costs
    every command 1.5 ms of the helper's start. The .pyc that importing it
    (kbd.sandbox.landlock does) or installing kbd left in ``__pycache__`` when
    it is current, else compiled here. Once per process, and cached: marshal's
    bytes depend on the interpreter's state (which strings are interned, which
    objects are shared), so two compiles of one source need not be byte-equal,
    and the sealed copy every command gets must be the one this answers."""
    import marshal
    from _frozen_importlib_external import MAGIC_NUMBER, cache_from_source  # loaded at startup

    source = HELPER_SOURCE.read_bytes()
    try:
        mtime = os.stat(HELPER_SOURCE).st_mtime
        with open(cache_from_source(str(HELPER_SOURCE)), "rb") as fh:
            cached = fh.read()
    except (OSError, NotImplementedError):  # no cache (PYTHONDONTWRITEBYTECODE, read-only install)
        cached, mtime = b"", 0.0
    if current_pyc(cached, source_size=len(source), source_mtime=mtime):
        return cached
    code = compile(source, HELPER_PYC_DEST, "exec", dont_inherit=True)
    return MAGIC_NUMBER + bytes(12) + marshal.dumps(code)


def helper_opt(fds: Fds, grants: Sequence[str]) -> File | BindFd:
    """The inner Landlock helper inside the sandbox: its bytecode as a file
    copied onto the sandbox's (read-only) root when this process runs the
    sandbox's interpreter (and no grant covers the path: see
    :func:`system_opts`), else its source, bound read-only."""
    if _same_interpreter() and not _covered(HELPER_PYC_DEST, grants):
        return File(fds.add(SEALED.open("kbd-landlock-helper", _helper_bytecode)), HELPER_PYC_DEST, 0o444)
    source = fds.add(os.open(HELPER_SOURCE, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW))
    return BindFd(source, HELPER_DEST, rw=False)


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
    ready_fd: int | None = None,
    confine: bool = False,
    staging: Staging | None = None,
    report_fd: int | None = None,
) -> list[str]:
    """The complete bwrap argv for ``command`` under ``plan``; opens (and records in
    ``fds``) every grant's descriptor. ``limits`` bounds the private tmpfs mounts
    and sets the command's rlimits (``kbd.yaml`` ``limits:``), never above the
    ``hard`` limits the command starts with (default: this process's).
    ``ready_fd``: a pipe's read end holding one byte (handed to bwrap by the
    caller): bwrap consumes it once the sandbox is set up, right before it execs
    the command's first step (:func:`kbd.sandbox.start.sandbox_was_set_up`).
    ``confine``: the command carries the host's grant group, so the inner
    helper runs for every plan and first confines all file access to this
    sandbox's own mount tree (see kbd.sandbox.landlock_helper).
    ``staging``: the command's staging layers (kbd.sandbox.staging): each
    staged ``notes/`` is bound from its overlay, never from the real folder, and
    ``fds.attach`` says what the launcher step attaches first.
    ``report_fd``: the inner helper asks Landlock to report the command's refusals
    and tells this descriptor's reader its pid (kbd.sandbox.denials; handed to bwrap
    by the caller, and only when :func:`helper_layers` is not empty)."""
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
    grants = spec.mounts(plan)
    for m in grants:
        dests.append(m.dest)
        if m.op == "hidden":
            opts += [Tmpfs(m.dest), RemountRo(m.dest)]
            continue
        fd = _staged_fd(m.dest, m.op, staging, fds)
        if fd is None:
            fd = _open_path(Path(m.dest), fds, kb_roots=kb_roots)
        opts.append(BindFd(fd, m.dest, rw=m.op == "bind"))
    # Everything the command executes comes AFTER the grants: a destination inside a
    # source-controlled folder (a contributed notes/ and its _index.json) is looked
    # up by path, and a source that swaps it for a symlink could otherwise land its
    # own file on, say, /usr/bin/python3. Later mounts cover anything such a
    # redirect put beneath them; the inner helper then checks every mount point.
    masked = [p for p in spec.PROC_MASKED if os.path.exists(p)]
    system: list[Opt] = [Proc("/proc"), Dev("/dev")]
    # A masked path is not bound read-only first: the mask covers it either way.
    system += [RoBind(p, p) for p in spec.PROC_READ_ONLY if os.path.exists(p) and p not in masked]
    system += list(system_opts(fds, grants=[m.dest for m in grants]))
    opts += system
    dests += [o.dest for o in system if isinstance(o, MountOpt)]
    opts += [RoBind("/dev/null", p) for p in masked]
    dests += masked
    # bwrap's /dev is an unbounded tmpfs (--size cannot apply to --dev): make it
    # read-only and give shared memory its own bounded tmpfs.
    shm = "/dev/shm"  # noqa: S108 - the sandbox's own, fresh tmpfs
    opts += [Tmpfs(shm, size=tmpfs_size), RemountRo("/dev")]
    dests.append(shm)
    opts.append(SeccompFd(fds.add(seccomp_fd(network != "host", confine=confine))))
    inner = spec.inner_landlock(plan)
    if confine:
        inner = {**(inner or {}), "confine": True}
    helper: File | BindFd | None = None
    if inner is not None:
        helper = helper_opt(fds, [m.dest for m in grants])
        opts.append(helper)
        if isinstance(helper, MountOpt):
            dests.append(helper.dest)
        # The helper refuses to run the command unless the mount points are exactly
        # these (plus what --dev and --proc create beneath /dev and /proc), the host's
        # own beneath the system folders included: the mount table is read only here.
        dests += host_submounts([o.dest for o in system if isinstance(o, RoBind) and o.src == o.dest])
        inner = {**inner, "mounts": sorted(set(dests)), "mount_prefixes": ["/dev/", "/proc/"]}
        if report_fd is not None:
            inner.update(log=True, report_fd=report_fd)
    opts += [RemountRo("/"), Chdir(str(cwd))]
    if ready_fd is not None:
        opts.append(BlockFd(ready_fd))
    argv = [bwrap, *spec.argv_of(opts), "--"]
    if inner is not None and helper is not None:
        # The helper sets the rlimits, applies Landlock, then execs the command
        # (127/126 on failure): no shell step before it, one exec less.
        inner["rlimits"] = [list(pair) for pair in rlimits.command_rlimits(limits, hard)]
        return [*argv, PYTHON, "-I", "-S", helper.dest, json.dumps(inner), "--", *command]
    # bwrap reports a failed execvp as exit 1; a POSIX shell's `exec` gives the
    # conventional 127 (not found) / 126 (not executable) instead. The same
    # step sets the rlimits, inside the sandbox, before anything untrusted runs.
    return [*argv, *rlimits.shell_prefix(limits, hard), *command]


def helper_layers(plan: Plan, *, confine: bool) -> list[dict[str, Any]]:
    """The Landlock layers the inner helper applies in this plan's sandbox, oldest first
    (:func:`build_argv`; empty: no helper runs)."""
    layers = [confine_layer()] if confine else []
    inner = spec.inner_landlock(plan)
    if inner is not None:
        layers.append(inner)
    return layers


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

"""What kbd hands bubblewrap once per process or as copies, under real sandboxes.

* The seccomp filters and the Landlock helper's bytecode are built once per
  process into sealed memfds: nobody can change them, and each command's bwrap
  gets its own read-only descriptor, which it closes (no command holds one:
  tests/security/test_sandbox_fds.py lists what reaches the command).
* Small regular /etc files are copies on the sandbox's read-only root instead of
  binds: the same bytes and modes, read-only, and never written through a grant.
* A write plan's rlimits are set by the Landlock helper (no ``sh -c ulimit``
  step): the same limits as a read plan's, soft and hard.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import py_compile
import shutil
import stat
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kbd.sandbox import bwrap, seccomp, spec
from tests.helpers import KbRoot, exec_mode_for

pytestmark = [pytest.mark.requires_bwrap, pytest.mark.requires_landlock(abi=2)]

ALL_SEALS = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE
ETC_REGULAR = [
    f for f in spec.ETC_FILES
    if os.path.isfile(f) and os.path.getsize(f) <= bwrap.ETC_COPY_MAX and not os.path.islink(f)
    and os.stat(f).st_mode & stat.S_IROTH
]  # fmt: skip


def _sealed_fds() -> dict[str, tuple[int, bytes]]:
    """name -> (a command's descriptor, the bytes it must read)."""
    out = {}
    for block in (True, False):
        out[f"seccomp block_network={block}"] = (
            bwrap.seccomp_fd(block),
            seccomp.program(block_network=block),
        )
    fds = bwrap.Fds()
    helper = bwrap.helper_opt(fds, grants=[])
    if isinstance(helper, spec.File):  # this interpreter is the sandbox's
        out["helper bytecode"] = (helper.fd, bwrap._helper_bytecode())
    else:
        fds.close()
    return out


@pytest.mark.parametrize("name", sorted(_sealed_fds()))
def test_a_cached_memfd_is_sealed_and_each_command_gets_a_read_only_fresh_descriptor(name: str) -> None:
    fd, expected = _sealed_fds()[name]
    try:
        assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) == ALL_SEALS
        assert os.get_inheritable(fd) is False
        assert fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY
        assert os.read(fd, len(expected) + 1) == expected  # from offset 0, all of it
        with pytest.raises(OSError) as wrote:
            os.write(fd, b"\0" * 8)
        assert wrote.value.errno == errno.EBADF
        # Not even a writable open of the same memfd may change it (the kernel
        # may let the open itself succeed: every change then fails).
        rw = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
        try:
            for change in (lambda: os.write(rw, b"\0" * 8), lambda: os.ftruncate(rw, 0),
                           lambda: os.ftruncate(rw, 1 << 20), lambda: os.posix_fallocate(rw, 0, 1 << 20)):  # fmt: skip
                with pytest.raises(PermissionError):
                    change()
        finally:
            os.close(rw)
        assert os.pread(fd, len(expected) + 1, 0) == expected
        again, _ = _sealed_fds()[name]
        try:
            assert os.fstat(again).st_ino == os.fstat(fd).st_ino  # built once per process
            assert os.lseek(again, 0, os.SEEK_CUR) == 0  # its own offset
        finally:
            os.close(again)
    finally:
        os.close(fd)


def test_the_helpers_cached_bytecode_is_used_only_when_current(tmp_path: Path) -> None:
    src = tmp_path / "helper.py"
    src.write_bytes(bwrap.HELPER_SOURCE.read_bytes())
    pyc = tmp_path / "helper.pyc"
    py_compile.compile(str(src), cfile=str(pyc), doraise=True)
    data, st = pyc.read_bytes(), src.stat()
    assert bwrap.current_pyc(data, source_size=st.st_size, source_mtime=st.st_mtime)
    assert not bwrap.current_pyc(data, source_size=st.st_size + 1, source_mtime=st.st_mtime)
    assert not bwrap.current_pyc(data, source_size=st.st_size, source_mtime=st.st_mtime + 1)
    assert not bwrap.current_pyc(b"\0\0\0\0" + data[4:], source_size=st.st_size, source_mtime=st.st_mtime)
    assert not bwrap.current_pyc(data[:16], source_size=st.st_size, source_mtime=st.st_mtime)
    hashed = py_compile.PycInvalidationMode.CHECKED_HASH
    py_compile.compile(str(src), cfile=str(pyc), doraise=True, invalidation_mode=hashed)
    assert not bwrap.current_pyc(pyc.read_bytes(), source_size=st.st_size, source_mtime=st.st_mtime)


def test_the_helper_bytecode_kbd_hands_the_sandbox_runs_as_the_helper(tmp_path: Path) -> None:
    fds = bwrap.Fds()
    try:
        helper = bwrap.helper_opt(fds, grants=[])
        covered = bwrap.helper_opt(fds, grants=["/.kbd"])  # never created through a grant
    finally:
        fds.close()
    assert isinstance(covered, spec.BindFd) and covered.dest == spec.HELPER_DEST
    if not bwrap._same_interpreter():  # bytecode of another interpreter would not run: the source
        assert isinstance(helper, spec.BindFd) and helper.dest == spec.HELPER_DEST
        return
    assert isinstance(helper, spec.File) and helper.dest == spec.HELPER_PYC_DEST
    pyc = tmp_path / "landlock_helper.pyc"
    pyc.write_bytes(bwrap._helper_bytecode())
    spec_json = '{"handled": ["make_sym"], "rules": [], "mounts": ["/"], "mount_prefixes": []}'
    r = subprocess.run(
        [bwrap.PYTHON, "-I", "-S", str(pyc), spec_json, "--", "true"], capture_output=True, check=False
    )
    assert r.returncode == 69 and b"unexpected mount point" in r.stderr  # the helper's own check ran
    ok = '{"handled": ["make_sym"], "rules": [], "rlimits": [[4, 0], [7, 123]]}'
    r = subprocess.run(
        [bwrap.PYTHON, "-I", "-S", str(pyc), ok, "--", "sh", "-c", "ulimit -Hn"],
        capture_output=True,
        check=False,
    )
    assert (r.returncode, r.stdout) == (0, b"123\n"), r.stderr


def test_threads_share_one_sealed_filter() -> None:
    inodes: list[int] = []

    def take() -> None:
        fd = bwrap.seccomp_fd(True)
        inodes.append(os.fstat(fd).st_ino)
        os.close(fd)

    threads = [threading.Thread(target=take) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(inodes) == 8 and len(set(inodes)) == 1


def test_etc_files_are_copies_only_where_no_grant_covers_them() -> None:
    fds = bwrap.Fds()
    try:
        copies = {o.dest: o for o in bwrap.system_opts(fds) if isinstance(o, spec.File)}
        assert sorted(copies) == sorted(ETC_REGULAR)
        for path, opt in copies.items():
            assert opt.perms == stat.S_IMODE(os.stat(path).st_mode) & 0o777
            assert opt.fd in fds.handed
        for grants in (["/etc"], ["/"], ["/etc/passwd"]):
            covered = [o for o in bwrap.system_opts(fds, grants=grants) if isinstance(o, spec.File)]
            if grants == ["/etc/passwd"]:
                assert "/etc/passwd" not in [o.dest for o in covered]
            else:
                assert covered == []
        # Without descriptors (the probe), everything is bound as before.
        assert not any(isinstance(o, spec.File) for o in bwrap.system_opts())
    finally:
        fds.close()


@pytest.fixture(scope="module", params=["in_process", "brokered"])
def world(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[tuple[KbRoot, dict[str, str]]]:
    kb = KbRoot.create(tmp_path_factory.mktemp("sandbox-copies") / "root")
    kb.workflow("src", access={"owners": ["bob"], "readers": ["alice"], "allowed_kb_writers": ["con"]})
    kb.workflow(
        "con",
        access={"owners": ["alice"]},
        sources=[{"workflow_id": "src", "alias": "src", "access": "write"}],
    )
    sids = {}
    for mode in ("read", "read-write"):
        r = kb.call(
            "session", "open", "con", "--kind", "execution", "--kb-access", mode, "--as", "alice", "--json"
        )
        assert r.code == 0, r.err
        sids[mode] = str(r.json()["session_id"])
    with exec_mode_for(kb, str(request.param)):
        yield kb, sids


@pytest.mark.parametrize("mode", ["read", "read-write"])
def test_etc_copies_hold_the_hosts_bytes_and_modes_and_are_read_only(
    world: tuple[KbRoot, dict[str, str]], mode: str
) -> None:
    kb, sids = world
    assert ETC_REGULAR, "no /etc file to check on this host"
    r = kb.cli("exec", sids[mode], "--", "sha256sum", *ETC_REGULAR)  # ld.so.cache is binary
    assert r.code == 0, r.err
    assert r.out.splitlines() == [
        f"{hashlib.sha256(Path(p).read_bytes()).hexdigest()}  {p}" for p in ETC_REGULAR
    ]
    script = (
        f"stat -c %a {' '.join(ETC_REGULAR)}; "
        "echo x >> /etc/passwd || echo refused; "
        "grep -c ' /etc/passwd ' /proc/self/mountinfo || true"
    )
    r = kb.cli("exec", sids[mode], "--", "sh", "-c", script)
    lines = r.out.split("\n")
    assert lines[: len(ETC_REGULAR)] == [f"{stat.S_IMODE(os.stat(p).st_mode):o}" for p in ETC_REGULAR]
    assert lines[len(ETC_REGULAR) :] == ["refused", "0", ""], (r.out, r.err)
    assert "Read-only file system" in r.err


def test_the_helper_bytecode_in_the_sandbox_is_read_only(world: tuple[KbRoot, dict[str, str]]) -> None:
    kb, sids = world
    r = kb.cli("exec", sids["read-write"], "--", "sh", "-c", "ls /.kbd; echo x >> /.kbd/* || echo refused")
    helper = spec.HELPER_PYC_DEST if bwrap._same_interpreter() else spec.HELPER_DEST
    assert r.out.split() == [os.path.basename(helper), "refused"], (r.out, r.err)


def test_a_write_plans_rlimits_equal_a_read_plans(world: tuple[KbRoot, dict[str, str]]) -> None:
    """The write plan's helper sets what the read plan's `sh -c ulimit` step
    sets: every limit soft and hard, core dumps off; none can be raised."""
    kb, sids = world
    script = "for f in n f c v t; do ulimit -S$f; ulimit -H$f; done; ulimit -n 65536 2>/dev/null || echo raise-refused"
    read = kb.cli("exec", sids["read"], "--", "sh", "-c", script)
    write = kb.cli("exec", sids["read-write"], "--", "sh", "-c", script)
    assert read.code == write.code == 0, (read.err, write.err)
    assert write.out == read.out
    assert write.out.split()[:6] == ["4096", "4096", "2097152", "2097152", "0", "0"]  # kbd.yaml's defaults
    assert write.out.split()[-1] == "raise-refused"


@pytest.fixture
def open_folder() -> Iterator[Path]:
    """A folder every user may search (/tmp's pytest folders are 0700)."""
    folder = Path(tempfile.mkdtemp(prefix="kbd-etc-", dir="/tmp"))
    folder.chmod(0o755)
    try:
        yield folder
    finally:
        shutil.rmtree(folder)


@pytest.mark.parametrize(
    ("mode", "folder_mode", "copied"),
    [
        pytest.param(0o644, 0o755, True, id="world-readable"),
        pytest.param(0o600, 0o755, False, id="root-only-file"),
        pytest.param(0o640, 0o755, False, id="group-only-file"),
        pytest.param(0o644, 0o750, False, id="folder-closed-to-others"),
    ],
)
def test_only_files_anyone_may_read_are_copied(
    open_folder: Path, mode: int, folder_mode: int, copied: bool
) -> None:
    """The daemon opens a copy's source as root and the copy belongs to the
    command's user: a file its caller may not read must stay a bind, which
    bwrap opens as the caller (review finding: a 0600 /etc/environment became
    readable to every broker client)."""
    inner = open_folder / "etc"
    inner.mkdir()
    f = inner / "environment"
    f.write_text("API_TOKEN=secret\n")
    f.chmod(mode)
    inner.chmod(folder_mode)
    fds = bwrap.Fds()
    try:
        opt = bwrap._etc_copy(str(f), fds)
        assert (opt is not None) == copied
    finally:
        fds.close()


def test_a_linked_file_is_bound_not_copied(open_folder: Path) -> None:
    """Following a link may pass folders its caller could not search: a link is
    left to bwrap, which follows it as the caller."""
    target = open_folder / "target"
    target.write_text("x\n")
    target.chmod(0o644)
    link = open_folder / "link"
    link.symlink_to(target)
    fds = bwrap.Fds()
    try:
        assert bwrap._etc_copy(str(link), fds) is None
        assert bwrap._etc_copy(str(target), fds) is not None
    finally:
        fds.close()


def test_the_helper_bytecode_is_built_once_so_every_copy_is_the_same_bytes() -> None:
    # marshal's bytes depend on the interpreter's interning state: a second
    # compile of the same source can differ (seen on a fresh clone in CI), so
    # the sealed copy and every later answer must come from one build.
    assert bwrap._helper_bytecode() is bwrap._helper_bytecode()

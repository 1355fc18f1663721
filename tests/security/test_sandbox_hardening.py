"""Sandbox hardening with real shells: no set-id bits can be
planted from a sandbox (both backends), and the Landlock-only backend drops
capabilities, confines signals, hides /etc/shadow, /proc and the network."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import pytest

from kbd.sandbox import seccomp
from tests.features import BACKEND_MARKS, backends
from tests.helpers import KbRoot


def world(kb: KbRoot, backend: str, *, read_only: bool = False, network: str = "none") -> str:
    cfg = kb.root / "kbd.yaml"
    text = cfg.read_text().replace("backend: auto", f"backend: {backend}")
    cfg.write_text(text.replace("network: none", f"network: {network}"))
    kb.workflow("src", access={"owners": ["bob"], "readers": ["alice"], "allowed_kb_writers": ["con"]})
    kb.workflow(
        "con",
        access={"owners": ["alice"]},
        sources=[{"workflow_id": "src", "alias": "src", "access": "write"}],
    )
    kind, mode = ("execution", "read-write") if backend == "bwrap" else ("reviewer_strategic", "read")
    if read_only:
        mode = "read"
    r = kb.call("session", "open", "con", "--kind", kind, "--kb-access", mode, "--as", "alice", "--json")
    assert r.code == 0, r.err
    return str(r.json()["session_id"])


SETID = (
    'cp /bin/true "$T/x"; chmod 755 "$T/x" && echo plain-ok; '
    'chmod 4755 "$T/x" || echo suid-refused; chmod g+s "$T/x" || echo sgid-refused; '
    'python3 -c "import os,sys; os.open(sys.argv[1], os.O_CREAT|os.O_WRONLY, 0o4755)" "$T/y" 2>/dev/null || echo create-refused'
)


@pytest.mark.parametrize("backend", backends("bwrap", "landlock"))
def test_no_setid_bits_from_a_sandbox(kb: KbRoot, backend: str) -> None:
    sid = world(kb, backend)
    target = '"$WORKFLOW_KB_SRC/notes"' if backend == "bwrap" else '"$TMPDIR"'
    r = kb.cli("exec", sid, "--", "sh", "-c", f"T={target}; {SETID}")
    # Under Landlock alone every mode change is refused (uid 0 owns the host's files).
    plain = ["plain-ok"] if backend == "bwrap" else []
    assert r.out.split() == [*plain, "suid-refused", "sgid-refused", "create-refused"], (r.out, r.err)
    folder = (
        kb.workflows / "src" / "knowledgebase" / "notes"
        if backend == "bwrap"
        else kb.root / "state" / "tmp" / sid
    )
    for name in ("x", "y"):
        p = folder / name
        if p.exists():
            assert not os.stat(p).st_mode & 0o6000, name


@pytest.mark.requires_landlock
def test_landlock_only_is_not_root_in_disguise(kb: KbRoot) -> None:
    sid = world(kb, "landlock")
    victim = kb.workflows / "src" / "credentials" / "token"
    sock = kb.root / "state" / "victim.sock"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(sock))
    listener.listen(1)
    bystander = subprocess.Popen(["sleep", "60"])
    try:
        script = (
            f"kill -9 {bystander.pid} 2>/dev/null || echo signal-refused; "
            "cat /etc/shadow >/dev/null 2>&1 || echo shadow-refused; "
            f"cat /proc/{os.getpid()}/environ >/dev/null 2>&1 || echo proc-refused; "
            "python3 -c 'import socket; socket.socket()' 2>/dev/null || echo network-refused; "
            f"chmod 0666 {victim} 2>/dev/null || echo chmod-refused; "
            f"touch -d 2000-01-01 {victim} 2>/dev/null || echo utime-refused; "
            f'python3 -c \'import os; os.setxattr("{victim}", "user.x", b"1")\' 2>/dev/null || echo xattr-refused; '
            f"python3 -c 'import socket; socket.socket(socket.AF_UNIX).connect(\"{sock}\")' 2>/dev/null || echo unix-refused; "
            'cat "$WORKFLOW_KB_SRC/notes/fact.md"'
        )
        before = os.stat(victim)
        r = kb.cli("exec", sid, "--", "sh", "-c", script)
        assert r.out.split() == [
            "signal-refused", "shadow-refused", "proc-refused", "network-refused",
            "chmod-refused", "utime-refused", "xattr-refused", "unix-refused", "src",
        ], r  # fmt: skip
        after = os.stat(victim)
        assert (after.st_mode, after.st_mtime_ns) == (before.st_mode, before.st_mtime_ns)
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()
        listener.close()


@pytest.mark.parametrize("machine", sorted(seccomp.ARCHES))
def test_the_filter_is_well_formed(machine: str) -> None:
    prog = seccomp.program(block_network=True, machine=machine)
    assert len(prog) % 8 == 0 and 0 < len(prog) // 8 < 256
    # Every jump lands inside the program.
    n = len(prog) // 8
    for i in range(n):
        code, jt, jf = prog[8 * i] | prog[8 * i + 1] << 8, prog[8 * i + 2], prog[8 * i + 3]
        if code & 0x07 == 0x05:  # BPF_JMP
            assert i + 1 + max(jt, jf) < n
    with pytest.raises(ValueError, match="architecture"):
        seccomp.program(block_network=False, machine="sparc")


def run_bpf(prog: bytes, *, arch: int, nr: int, args: tuple[int, ...] = ()) -> int:
    """A tiny classic-BPF interpreter for the instructions the filter uses."""
    import struct

    data = struct.pack("<iIQ6Q", nr, arch, 0, *(list(args) + [0] * (6 - len(args))))
    insns = [struct.unpack("<HBBI", prog[i : i + 8]) for i in range(0, len(prog), 8)]
    a, pc = 0, 0
    while True:
        code, jt, jf, k = insns[pc]
        if code == seccomp.LD_W_ABS:
            a = int(struct.unpack_from("<I", data, k)[0])
        elif code == seccomp.RET_K:
            return int(k)
        elif code == seccomp.ALU_AND_K:
            a &= k
        else:
            cond = {seccomp.JEQ_K: a == k, seccomp.JGE_K: a >= k, seccomp.JSET_K: bool(a & k)}[code]
            pc += jt if cond else jf
        pc += 1


@pytest.mark.parametrize("machine", sorted(seccomp.ARCHES))
@pytest.mark.parametrize(("net", "meta"), [(False, False), (True, False), (False, True), (True, True)])
def test_the_filter_decides_what_it_says(machine: str, net: bool, meta: bool) -> None:
    arch = seccomp.ARCHES[machine]
    prog = seccomp.program(block_network=net, block_metadata=meta, machine=machine)
    allow, eperm = seccomp.RET_ALLOW, seccomp.ret_errno(seccomp.EPERM)

    def verdict(nr: int, *args: int) -> int:
        return run_bpf(prog, arch=arch.audit, nr=nr, args=args)

    # Ordinary syscalls pass (read=0/63, write=1/64 on x86_64/aarch64).
    for nr in (0, 1, 3, 63, 64, 57):
        if nr not in arch.metadata and nr not in arch.mode_arg and nr not in arch.deny and nr != arch.socket:
            assert verdict(nr) == allow, nr
    for nr, idx in arch.mode_arg.items():
        args = [0] * 6
        args[idx] = 0o755
        plain = verdict(nr, *args)
        args[idx] = 0o4755
        assert verdict(nr, *args) == eperm, nr
        assert plain == (eperm if meta and nr in arch.metadata else allow), nr
    for nr, err in arch.deny.items():
        assert verdict(nr) == seccomp.ret_errno(err)
    # docs/sandbox.md "seccomp", from numbers written out here (not the filter's own tables):
    # keyrings (EPERM), clone3 (ENOSYS so libc falls back to clone), CLONE_NEWUSER.
    add_key, request_key, keyctl = KEYRING_NR[machine]
    clone, unshare, socketpair = {"x86_64": (56, 272, 53), "aarch64": (220, 97, 199)}[machine]
    for nr in (add_key, request_key, keyctl):
        assert verdict(nr) == eperm, nr
    assert verdict(435) == seccomp.ret_errno(seccomp.ENOSYS)
    sigchld, clone_vm_vfork, clone_newns, newuser = 17, 0x4100, 0x20000, 0x10000000
    for nr in (clone, unshare):
        assert verdict(nr, newuser) == eperm, nr
        assert verdict(nr, newuser | clone_newns | sigchld) == eperm, nr
        assert verdict(nr, sigchld) == allow, nr
        assert verdict(nr, clone_vm_vfork | sigchld) == allow, nr
        assert verdict(nr, clone_newns) == allow, nr  # needs CAP_SYS_ADMIN, which no command has
    # Socket families: an allow-list over every family number (AF_MAX is 46 today).
    allowed = ({seccomp.AF_UNIX} if not meta else set()) | ({2, 10} if not net else set())
    afnosupport = seccomp.ret_errno(seccomp.EAFNOSUPPORT)
    for family in [*range(64), 0x100 | 16, 0xFFFFFFFF]:
        assert verdict(arch.socket, family) == (allow if family in allowed else afnosupport), family
        assert verdict(socketpair, family) == (allow if family == seccomp.AF_UNIX else afnosupport), family
    assert run_bpf(prog, arch=0x40000003, nr=5) == seccomp.RET_KILL_PROCESS  # i386
    if arch.x32:
        assert verdict(seccomp.X32_BIT | 1) == seccomp.RET_KILL_PROCESS


@pytest.mark.parametrize("machine", sorted(seccomp.ARCHES))
def test_the_filter_tables_do_not_overlap(machine: str) -> None:
    """A syscall listed twice would be decided by whichever block comes first."""
    arch = seccomp.ARCHES[machine]
    groups = [set(arch.deny), set(arch.mode_arg), set(arch.clone_flags), {arch.socket}, {arch.socketpair}]
    seen: set[int] = set()
    for g in groups:
        assert not seen & g, seen & g
        seen |= g


@pytest.mark.requires_bwrap
def test_host_kernel_knobs_are_read_only_under_bubblewrap(kb: KbRoot) -> None:
    """/proc/sys is host-wide: uid 0 without capabilities could still write, e.g.,
    kernel.core_pattern (a program run as root on the host)."""
    sid = world(kb, "bwrap")
    knob = Path("/proc/sys/kernel/core_uses_pid")
    before = knob.read_text()
    r = kb.cli(
        "exec", sid, "--", "sh", "-c",
        "echo 1 > /proc/sys/kernel/core_uses_pid 2>/dev/null || echo sysctl-refused; "
        "echo h > /proc/sysrq-trigger 2>/dev/null || echo sysrq-refused; "
        "cat /proc/sys/kernel/core_uses_pid >/dev/null && echo readable",
    )  # fmt: skip
    assert r.out.split() == ["sysctl-refused", "sysrq-refused", "readable"], r
    assert knob.read_text() == before


# -- docs/sandbox.md "seccomp": keyrings, socket families, user namespaces (real commands, real sandboxes) -------------

# Every sandbox shape: bubblewrap with a write plan (inner Landlock helper), bubblewrap
# with a read-only plan (no helper: the filter comes from bwrap's --seccomp alone), and
# the Landlock-only backend (the helper installs it).
SHAPES = [
    pytest.param(backend, read_only, marks=BACKEND_MARKS[backend], id=name)
    for backend, read_only, name in (
        ("bwrap", False, "bwrap-write"), ("bwrap", True, "bwrap-read"), ("landlock", True, "landlock")
    )
]  # fmt: skip
KEYRING_NR = {"x86_64": (248, 249, 250), "aarch64": (217, 218, 219)}  # add_key, request_key, keyctl
KEY_SPEC_USER_KEYRING, KEYCTL_READ, KEYCTL_INVALIDATE = -4, 11, 21

KEYS = """
import ctypes, errno, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
add, req, ctl = {nr}[os.uname().machine]
desc, serial = sys.argv[1].encode(), int(sys.argv[2])
def show(name, rc, data=b""):
    print(name + ":" + (data.decode() or "ok" if rc >= 0 else errno.errorcode[ctypes.get_errno()]))
buf = ctypes.create_string_buffer(256)
show("read", libc.syscall(ctl, ctypes.c_long(KEYCTL_READ), ctypes.c_long(serial), buf, ctypes.c_long(256)), buf.value)
show("request", libc.syscall(req, b"user", desc, None, ctypes.c_long(0)))
show("add", libc.syscall(add, b"user", desc + b"-from-sandbox", b"x", ctypes.c_long(1), ctypes.c_long(-4)))
""".replace("{nr}", repr(KEYRING_NR)).replace("KEYCTL_READ", str(KEYCTL_READ))


def _keyring(libc: object, nr: int, *args: object) -> int:
    import ctypes

    fn = libc.syscall  # type: ignore[attr-defined]
    fn.restype = ctypes.c_long
    rc = int(fn(nr, *args))
    return rc if rc >= 0 else -ctypes.get_errno()


@pytest.mark.parametrize(("backend", "read_only"), SHAPES)
def test_kernel_keyrings_are_closed(kb: KbRoot, backend: str, read_only: bool) -> None:
    """docs/sandbox.md "seccomp": keyrings are not namespaced. A key planted in the host
    user's keyring must not be readable from a sandbox, nor may a sandbox add one
    (a channel between sessions)."""
    import ctypes
    import secrets

    sid = world(kb, backend, read_only=read_only)
    libc = ctypes.CDLL(None, use_errno=True)
    add, req, ctl = KEYRING_NR[os.uname().machine]
    desc = f"kbd-test-{secrets.token_hex(6)}"
    secret = secrets.token_hex(8).encode()
    serial = _keyring(libc, add, b"user", desc.encode(), secret, ctypes.c_long(len(secret)),
                      ctypes.c_long(KEY_SPEC_USER_KEYRING))  # fmt: skip
    assert serial > 0, f"cannot plant a test key on the host: {os.strerror(-serial)}"
    try:
        r = kb.cli("exec", sid, "--", "python3", "-I", "-S", "-c", KEYS, desc, str(serial))
        assert r.code == 0, r
        assert secret.decode() not in r.out
        assert r.out.split() == ["read:EPERM", "request:EPERM", "add:EPERM"], r
        # Nothing was added to the host's keyring either.
        probe = _keyring(libc, req, b"user", f"{desc}-from-sandbox".encode(), None, ctypes.c_long(0))
        assert probe < 0, probe
    finally:
        _keyring(libc, ctl, ctypes.c_long(KEYCTL_INVALIDATE), ctypes.c_long(serial))


FAMILIES = """
import errno, socket
for name, fam, kind, proto in [
    ("unix", 1, 1, 0), ("inet", 2, 2, 0), ("inet6", 10, 2, 0), ("netlink", 16, 2, 0),
    ("packet", 17, 2, 0), ("key", 15, 3, 2), ("alg", 38, 5, 0), ("vsock", 40, 1, 0),
]:
    try:
        socket.socket(fam, kind, proto).close()
        print(name + ":ok")
    except OSError as e:
        print(name + ":" + errno.errorcode[e.errno])
for name, fam in [("pair-unix", 1), ("pair-inet", 2)]:
    try:
        for s in socket.socketpair(fam):
            s.close()
        print(name + ":ok")
    except OSError as e:
        print(name + ":" + errno.errorcode[e.errno])
"""


@pytest.mark.parametrize("network", ["none", "host"])
@pytest.mark.parametrize(("backend", "read_only"), SHAPES)
def test_socket_families_are_an_allow_list(kb: KbRoot, backend: str, read_only: bool, network: str) -> None:
    """docs/sandbox.md "seccomp": AF_UNIX (not on the Landlock-only backend, which cannot
    confine a connect), IPv4/IPv6 only with network: host; netlink (host
    interfaces, `ss -xl`), packet, PF_KEY, AF_ALG and vsock never."""
    sid = world(kb, backend, read_only=read_only, network=network)
    assert f"network: {network}" in (kb.root / "kbd.yaml").read_text()
    r = kb.cli("exec", sid, "--", "python3", "-I", "-S", "-c", FAMILIES)
    assert r.code == 0, r
    got = dict(line.split(":", 1) for line in r.out.split())
    refused = "EAFNOSUPPORT"
    inet = "ok" if network == "host" else refused
    assert got == {
        "unix": "ok" if backend == "bwrap" else refused,
        "inet": inet, "inet6": inet,
        "netlink": refused, "packet": refused, "key": refused, "alg": refused, "vsock": refused,
        "pair-unix": "ok", "pair-inet": refused,
    }, r  # fmt: skip


USERNS = (
    "unshare -U true 2>/dev/null && echo unshare-ran || echo unshare-refused; "
    "unshare -Ur true 2>/dev/null && echo unshare-root-ran || echo unshare-root-refused; "
    "python3 -I -S -c '"
    "import ctypes, errno, os, subprocess, threading\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "pid = os.fork()\n"
    "if pid == 0:\n"
    "    rc = libc.unshare(0x10000000)\n"  # CLONE_NEWUSER
    '    print("unshare:" + ("ok" if rc == 0 else errno.errorcode[ctypes.get_errno()]), flush=True)\n'
    "    os._exit(0)\n"
    "os.waitpid(pid, 0)\n"
    "rc = libc.syscall(435, None, 0)\n"  # clone3: refused so that libc falls back to clone
    'print("clone3:" + errno.errorcode[ctypes.get_errno()])\n'
    't = threading.Thread(target=print, args=("thread-ok",)); t.start(); t.join()\n'
    'print(subprocess.run(["echo", "spawn-ok"], capture_output=True, text=True).stdout.strip())\n'
    "'; echo pipe-ok | cat"
)


@pytest.mark.requires_userns  # where the host has none, there is nothing to nest
@pytest.mark.parametrize(("backend", "read_only"), SHAPES)
def test_no_nested_user_namespaces(kb: KbRoot, backend: str, read_only: bool) -> None:
    """docs/sandbox.md "seccomp": no user namespace (and so no fresh capability set) inside a
    sandbox; forks, threads and spawns still work although clone3 is refused."""
    sid = world(kb, backend, read_only=read_only)
    r = kb.cli("exec", sid, "--", "sh", "-c", USERNS)
    assert r.code == 0, r
    assert r.out.split() == [
        "unshare-refused", "unshare-root-refused", "unshare:EPERM", "clone3:ENOSYS",
        "thread-ok", "spawn-ok", "pipe-ok",
    ], r  # fmt: skip


def test_bubblewrap_disables_nested_user_namespaces_where_the_host_has_them() -> None:
    """bwrap's own layer for item 4; dropped only where the host allows no user
    namespace at all (then root's bwrap could not create one for the flags)."""
    from kbd.sandbox import bwrap
    from kbd.sandbox.spec import argv_of

    flags = ["--unshare-user", "--disable-userns", "--assert-userns-disabled"]
    for limit in ("15000\n", "1", None):
        assert argv_of(bwrap.userns_opts(limit)) == flags, limit
    assert bwrap.userns_opts("0\n") == []


@pytest.mark.requires_landlock
def test_the_helper_refuses_to_run_without_bubblewrap_and_without_a_filter(tmp_path: Path) -> None:
    """Landlock alone (``drop_caps``) with no seccomp program would leave keyrings,
    user namespaces and every socket family open: the helper exits 69 first."""
    import json
    import sys

    from kbd.sandbox import bwrap
    from kbd.sandbox.landlock import LANDLOCK_ALL, system_rules

    rules = [*system_rules(), {"path": str(tmp_path), "access": list(LANDLOCK_ALL)}]
    spec: dict[str, object] = {
        "handled": list(LANDLOCK_ALL),
        "rules": rules,
        "drop_caps": True,
        "scope": True,
    }
    marker = tmp_path / "ran"

    def helper() -> subprocess.CompletedProcess[str]:
        argv = [
            sys.executable,
            "-I",
            "-S",
            str(bwrap.HELPER_SOURCE),
            json.dumps(spec),
            "--",
            "sh",
            "-c",
            'echo ran > "$1"',
            "sh",
            str(marker),
        ]
        return subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)

    r = helper()
    assert r.returncode == 69, r
    assert "seccomp" in r.stderr
    assert not marker.exists()
    spec["seccomp"] = seccomp.program(block_network=True, block_metadata=True).hex()
    r = helper()
    assert r.returncode == 0, r
    assert marker.exists()


@pytest.mark.parametrize("machine", sorted(seccomp.ARCHES))
def test_no_setid_folders_or_files_from_any_creating_call(machine: str) -> None:
    """docs/sandbox.md "seccomp": mkdir and mkdirat join the calls whose mode may not carry
    S_ISUID/S_ISGID (as systemd's RestrictSUIDSGID), numbers written out here."""
    arch = seccomp.ARCHES[machine]
    prog = seccomp.program(block_network=True, machine=machine)
    calls = {"x86_64": {83: 1, 258: 2, 85: 1, 2: 2, 257: 3}, "aarch64": {34: 2, 56: 3, 33: 2}}[machine]
    for nr, idx in calls.items():
        for mode, want in ((0o755, seccomp.RET_ALLOW), (0o2755, seccomp.ret_errno(seccomp.EPERM)),
                           (0o4700, seccomp.ret_errno(seccomp.EPERM))):  # fmt: skip
            args = [0] * 6
            args[idx] = mode
            assert run_bpf(prog, arch=arch.audit, nr=nr, args=tuple(args)) == want, (nr, oct(mode))

"""Review findings, as regressions with real shells: no set-id bits can be
planted from a sandbox (both backends), and the Landlock-only backend drops
capabilities, confines signals, hides /etc/shadow, /proc and the network."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import pytest

from kbd.sandbox import seccomp
from tests.helpers import KbRoot


def world(kb: KbRoot, backend: str) -> str:
    cfg = kb.root / "kbd.yaml"
    cfg.write_text(cfg.read_text().replace("backend: auto", f"backend: {backend}"))
    kb.workflow("src", access={"owners": ["bob"], "readers": ["alice"], "allowed_kb_writers": ["con"]})
    kb.workflow(
        "con",
        access={"owners": ["alice"]},
        sources=[{"workflow_id": "src", "alias": "src", "access": "write"}],
    )
    kind, mode = ("execution", "read-write") if backend == "bwrap" else ("reviewer_strategic", "read")
    r = kb.cli("session", "open", "con", "--kind", kind, "--kb-access", mode, "--as", "alice", "--json")
    assert r.code == 0, r.err
    return str(r.json()["session_id"])


SETID = (
    'cp /bin/true "$T/x"; chmod 755 "$T/x" && echo plain-ok; '
    'chmod 4755 "$T/x" || echo suid-refused; chmod g+s "$T/x" || echo sgid-refused; '
    'python3 -c "import os,sys; os.open(sys.argv[1], os.O_CREAT|os.O_WRONLY, 0o4755)" "$T/y" 2>/dev/null || echo create-refused'
)


@pytest.mark.parametrize("backend", ["bwrap", "landlock"])
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
    assert verdict(arch.socket, seccomp.AF_INET) == (eperm if net else allow)
    assert verdict(arch.socket, seccomp.AF_UNIX) == (eperm if meta else allow)
    assert run_bpf(prog, arch=0x40000003, nr=5) == seccomp.RET_KILL_PROCESS  # i386
    if arch.x32:
        assert verdict(seccomp.X32_BIT | 1) == seccomp.RET_KILL_PROCESS


def test_host_kernel_knobs_are_read_only_under_bubblewrap(kb: KbRoot) -> None:
    """/proc/sys is host-wide: uid 0 without capabilities could still write, e.g.,
    kernel.core_pattern (a program run as root on the host) — found by review."""
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

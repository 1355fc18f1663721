"""Review findings, as regressions with real shells: no set-id bits can be
planted from a sandbox (both backends), and the Landlock-only backend drops
capabilities, confines signals, hides /etc/shadow, /proc and the network."""

from __future__ import annotations

import os
import subprocess

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
    assert r.out.split() == ["plain-ok", "suid-refused", "sgid-refused", "create-refused"], (r.out, r.err)
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
    bystander = subprocess.Popen(["sleep", "60"])
    try:
        script = (
            f"kill -9 {bystander.pid} 2>/dev/null || echo signal-refused; "
            "cat /etc/shadow >/dev/null 2>&1 || echo shadow-refused; "
            f"cat /proc/{os.getpid()}/environ >/dev/null 2>&1 || echo proc-refused; "
            "python3 -c 'import socket; socket.socket()' 2>/dev/null || echo network-refused; "
            'cat "$WORKFLOW_KB_SRC/notes/fact.md"'
        )
        r = kb.cli("exec", sid, "--", "sh", "-c", script)
        assert r.out.split() == [
            "signal-refused",
            "shadow-refused",
            "proc-refused",
            "network-refused",
            "src",
        ], r
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()


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

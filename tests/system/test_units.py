"""The shipped units as systemd judges them (docs/multi-user.md "Service notes"): `systemd-analyze
verify` clean and `systemd-analyze security --offline=yes` at most 4.5, with the
hardening that would break bubblewrap kept out."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from tests.system.units import SYSTEMD, UNITS, directives, exec_start, rewrite, systemd_analyze

MAX_EXPOSURE = 4.5


def installed_copy(tmp_path: Path) -> Path:
    """The units with the install prefix pointed at a real binary (verify checks ExecStart exists)."""
    for name in UNITS:
        text = rewrite((SYSTEMD / name).read_text(), {"/opt/kbd/bin/kbd": "/bin/true"})
        (tmp_path / name).write_text(text)
    return tmp_path


def test_units_verify_clean(tmp_path: Path) -> None:
    where = installed_copy(tmp_path)
    proc = subprocess.run([systemd_analyze(), "verify", *(str(where / n) for n in UNITS)], cwd=where,
                          capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip() == "", proc.stderr


def exposure(tmp_path: Path) -> tuple[float, str]:
    where = installed_copy(tmp_path)
    proc = subprocess.run([systemd_analyze(), "security", "--offline=yes", str(where / "kbd.service")],
                          cwd=where, capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    found = re.search(r"Overall exposure level for kbd\.service: (\d+\.\d+)", proc.stdout)
    assert found is not None, proc.stdout + proc.stderr
    return float(found.group(1)), proc.stdout


def test_service_exposure_is_at_most_4_5(tmp_path: Path) -> None:
    level, report = exposure(tmp_path)
    assert level <= MAX_EXPOSURE, report


def test_the_security_check_can_fail(tmp_path: Path) -> None:
    """The same measure rates the unit without its hardening above the bar (7.6: systemd/README.md), so the
    test above measures the directives, not a constant."""
    svc = SYSTEMD / "kbd.service"
    kept = [ln for ln in svc.read_text().splitlines() if not re.match(
        r"(Protect|Restrict|Private|Capability|SystemCall|NoNew|Lock|IPAddress)\w*=", ln)]  # fmt: skip
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in UNITS:
        text = "\n".join(kept) + "\n" if name == "kbd.service" else (SYSTEMD / name).read_text()
        (bare / name).write_text(rewrite(text, {"/opt/kbd/bin/kbd": "/bin/true"}))
    proc = subprocess.run([systemd_analyze(), "security", "--offline=yes", str(bare / "kbd.service")],
                          cwd=bare, capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    found = re.search(r"Overall exposure level for kbd\.service: (\d+\.\d+)", proc.stdout)
    assert found is not None and float(found.group(1)) > MAX_EXPOSURE, proc.stdout


def test_requested_hardening_is_present_and_commented() -> None:
    svc = directives("kbd.service")
    for key in ("ProtectClock", "ProtectHostname", "RestrictSUIDSGID", "PrivateMounts", "PrivateDevices",
                "ProtectKernelModules", "NoNewPrivileges", "LockPersonality", "RestrictRealtime"):  # fmt: skip
        assert svc.get(key) == ["yes"], key
    (syscalls,) = svc["SystemCallFilter"]
    assert syscalls.startswith("~") and "@mount" not in syscalls, "a deny-list that keeps @mount"
    caps = set(svc["CapabilityBoundingSet"][0].split())
    assert "CAP_SYS_ADMIN" not in caps and {"CAP_SETUID", "CAP_SETGID", "CAP_KILL"} <= caps
    assert svc["Delegate"] == ["yes"]
    # Each hardening directive carries its own comment, just above it.
    lines = (SYSTEMD / "kbd.service").read_text().splitlines()
    hardening = re.compile(
        r"(Protect|Restrict|Private|Lock|NoNew|Capability|SystemCall|Delegate|IPAddress|UMask|DeviceAllow)\w*="
    )
    checked = [i for i, ln in enumerate(lines) if hardening.match(ln)]
    assert len(checked) >= 15
    for i in checked:
        assert lines[i - 1].startswith("#"), f"no comment above {lines[i]!r}"


def test_nothing_that_covers_proc_or_cgroupfs() -> None:
    """A covered /proc (ProtectKernelTunables, ProtectKernelLogs, ProtectProc,
    ProcSubset) makes the kernel refuse bwrap's new procfs in its user namespace;
    a read-only cgroupfs (ProtectControlGroups) leaves kbd no per-command cgroup."""
    svc = directives("kbd.service")
    for key in ("ProtectKernelTunables", "ProtectKernelLogs", "ProtectProc", "ProcSubset",
                "ProtectControlGroups", "RestrictNamespaces", "PrivateUsers", "MemoryDenyWriteExecute"):  # fmt: skip
        assert key not in svc, key


def test_empty_state_directory_is_refused_without_a_restart_loop() -> None:
    svc = directives("kbd.service")
    assert exec_start(svc)[-1] == "serve"
    assert "65" in svc["RestartPreventExitStatus"][0].split()
    assert svc["StateDirectory"] == ["kbd"] and svc["Environment"] == ["KBD_ROOT=/var/lib/kbd"]

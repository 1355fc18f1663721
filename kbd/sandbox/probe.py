"""What this host can enforce (``kbd doctor``): Landlock, bubblewrap, user namespaces,
process containment and resource limits."""

from __future__ import annotations

import subprocess
from typing import TYPE_CHECKING, Any

from kbd.sandbox import bwrap as bw
from kbd.sandbox import cgroup
from kbd.sandbox.landlock import landlock_abi, landlock_status
from kbd.sandbox.spec import argv_of

if TYPE_CHECKING:
    from kbd.config import LimitsConfig


def bwrap_probe() -> tuple[bool, str]:
    """Run a real, minimal sandbox: bwrap present, namespaces usable, binds work."""
    path = bw.bwrap_path()
    if path is None:
        return False, "bubblewrap is not installed"
    try:
        version = subprocess.run(  # noqa: S603 - fixed argv
            [path, "--version"], capture_output=True, text=True, timeout=10, check=False
        ).stdout.strip()
        argv = [path, "--die-with-parent", "--unshare-pid", "--unshare-net", "--cap-drop", "ALL", "--proc", "/proc",
                "--dev", "/dev", *argv_of(bw.system_opts()), "--", "/usr/bin/true"]  # fmt: skip
        run = subprocess.run(argv, capture_output=True, text=True, timeout=20, check=False)  # noqa: S603
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"bubblewrap probe failed: {exc}"
    if run.returncode != 0:
        return False, f"{version} at {path} cannot create a sandbox here: {run.stderr.strip()[:200]}"
    return True, f"{version} at {path}; probe sandbox ran"


def layers(*, backend: str) -> dict[str, Any]:
    bw_ok, bw_detail = bwrap_probe()
    abi = landlock_abi()
    inner_ok = abi >= 2
    if backend in ("auto", "bwrap") and bw_ok:
        reads = "enforced by bubblewrap (explicit binds, private /tmp, PID namespace)"
        writes = (
            "enforced by bubblewrap, with the inner Landlock layer for contributed notes/"
            if inner_ok
            else "REFUSED: contributed notes/ need the inner Landlock layer (ABI >= 2)"
        )
        usable = True
    elif backend in ("auto", "landlock") and abi > 0:
        reads = "enforced by Landlock alone (no capabilities, private scratch; only plans without overlays)"
        writes = "REFUSED unless sandbox.unsafe_landlock_writes (Landlock cannot protect _index.json)"
        usable = True
    else:
        reads = writes = "REFUSED: no usable sandbox layer (kbd exec exits 69)"
        usable = False
    return {
        "usable": usable,
        "backend": backend,
        "bwrap": {"ok": bw_ok, "detail": bw_detail},
        "landlock": {"abi": abi, "detail": landlock_status()},
        "read_sessions": reads,
        "write_sessions": writes,
    }


def containment(*, bwrap_ok: bool, backend: str) -> tuple[bool, str]:
    """Whether every command's whole process tree can be killed on this host."""
    h = cgroup.detect()
    if h.v2 is not None:
        return True, f"per-command cgroups under {h.v2} (cgroup.kill ends each command's whole tree)"
    if bwrap_ok and backend in ("auto", "bwrap"):
        return True, (
            f"no per-command cgroup ({h.problem}); bubblewrap's PID namespace holds each tree, "
            "the Landlock-only backend would refuse (exit 69)"
        )
    return (
        False,
        f"no per-command cgroup ({h.problem}): the Landlock-only backend refuses to run commands (exit 69)",
    )


def limits(config: LimitsConfig) -> dict[str, str]:
    """Each ``limits:`` key and whether this host enforces it."""
    return cgroup.enforcement(config, cgroup.detect())

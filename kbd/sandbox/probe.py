"""What this host can enforce (``kbd doctor``): Landlock, bubblewrap, user namespaces,
process containment and resource limits."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kbd.core import policy
from kbd.core.layout import KB_DIR
from kbd.core.plan import build_plan
from kbd.core.resolve import Attachment, WriteStatus
from kbd.fs import datafiles
from kbd.sandbox import bwrap as bw
from kbd.sandbox import cgroup
from kbd.sandbox.landlock import landlock_abi, landlock_status
from kbd.sandbox.spec import argv_of

if TYPE_CHECKING:
    from kbd.core.config import LimitsConfig


def bwrap_probe() -> tuple[bool, str]:
    """Run a real, minimal sandbox: bwrap present, namespaces usable, binds work."""
    path = bw.bwrap_path()
    if path is None:
        return False, "bubblewrap is not installed"
    try:
        version = subprocess.run(  # noqa: S603 - fixed argv
            [path, "--version"], capture_output=True, text=True, timeout=10, check=False
        ).stdout.strip()
        argv = [path, "--die-with-parent", "--unshare-pid", "--unshare-net",
                *argv_of(bw.userns_opts(bw.host_userns_limit())), "--cap-drop", "ALL", "--proc", "/proc",
                "--dev", "/dev", *argv_of(bw.system_opts()), "--", "/usr/bin/true"]  # fmt: skip
        run = subprocess.run(argv, capture_output=True, text=True, timeout=20, check=False)  # noqa: S603
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"bubblewrap probe failed: {exc}"
    if run.returncode != 0:
        return False, f"{version} at {path} cannot create a sandbox here: {run.stderr.strip()[:200]}"
    return True, f"{version} at {path}; probe sandbox ran"


def _overlays(kind: policy.KindPolicy, kb_access: str, *, item: bool) -> bool:
    source = Attachment(
        alias="src", workflow_id="wf_src", label=None, access="write", available=True, reason=None,
        message=None, write=WriteStatus(True, None), path=Path("/kbd-doctor/source") / KB_DIR,
    )  # fmt: skip
    plan = build_plan(
        workflow_id="wf_doctor",
        workflow_folder=Path("/kbd-doctor/workflow"),
        policy=kind,
        kb_access=kb_access,
        item_kb_write=item,
        attachments=[source],
        folders=[],
    )
    return bool(plan.overlays())


def landlock_only_kinds() -> dict[str, list[str]]:
    """Each consumer kind with the kb_access modes the Landlock-only backend runs.

    Derived, not listed: every kind of ``policies/consumer_kinds.yaml`` and every
    kb_access is planned against a sample workflow with one write-granted
    source attached, and the runner's own rule decides (a plan with any
    overlay — a read-only or hidden path inside a granted folder — is refused).
    A mode counts only when it runs whatever the message_sequence item asks."""
    runs: dict[str, list[str]] = {}
    for name, kind in datafiles.consumer_kinds().items():
        modes = [m for m in policy.KB_ACCESS if not any(_overlays(kind, m, item=i) for i in (False, True))]
        if modes:
            runs[name] = modes
    return runs


def landlock_only_summary() -> str:
    """One line for people: which kinds (and kb_access modes) run under Landlock alone."""
    runs = landlock_only_kinds()
    refused = [k for k in datafiles.consumer_kinds() if k not in runs]
    shown = "; ".join(f"{k} (kb_access {', '.join(m)})" for k, m in runs.items()) or "none"
    return (
        f"under Landlock alone only these kinds run: {shown}. Refused: {', '.join(refused) or 'none'} "
        "(their plans keep read-only or hidden paths inside writable folders, which needs bubblewrap)"
    )


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
        reads = f"enforced by Landlock alone (no capabilities, private scratch); {landlock_only_summary()}"
        writes = "REFUSED unless sandbox.unsafe_landlock_writes (Landlock cannot protect _index.json)"
        usable = True
    else:
        reads = writes = "REFUSED: no usable sandbox layer (kbd exec exits 69)"
        usable = False
    return {
        "usable": usable,
        "landlock_only_kinds": landlock_only_kinds(),
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

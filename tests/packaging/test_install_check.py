"""scripts/install-check.sh (docs/multi-user.md "Service notes"): pip into an /opt/kbd-like
prefix, pipx and uv offline from a wheelhouse, the units installed for that
prefix by its own `kbd units install` and verified, and `kbd init` + `kbd doctor` with each
installed kbd. Needs the package index once (the wheelhouse) and systemd-analyze."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.system.units import systemd_analyze

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(900)
def test_install_check_script_passes(tmp_path: Path) -> None:
    systemd_analyze()  # a missing tool fails here with the install hint, not deep in the script
    had_build = (REPO / "build").exists()
    proc = subprocess.run(["bash", str(REPO / "scripts" / "install-check.sh")], cwd=tmp_path,
                          capture_output=True, text=True, timeout=880, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    out = proc.stdout
    for kbd in ("/opt/kbd/bin/kbd", "/pipx-bin/kbd", "/uv-bin/kbd"):
        assert any(line.startswith("ok ") and line.endswith(kbd) for line in out.splitlines()), out
    assert "Overall exposure level for kbd.service: " in out
    assert out.rstrip().endswith("install-check: all installs work")
    # The checkout is left as it was: the builds ran on a copy.
    assert (REPO / "build").exists() == had_build

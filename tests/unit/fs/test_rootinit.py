"""``kbd init``'s config files (:mod:`kbd.fs.rootinit`)."""

from __future__ import annotations

from pathlib import Path

from kbd.fs.rootconfig import load_config
from kbd.fs.rootinit import init_root


def test_a_service_root_ends_the_commands_of_a_revoked_grant(tmp_path: Path) -> None:
    """``kbd init --system`` (a grant group) writes ``revocation.immediate: true``:
    on a host of many users a revoked writer must stop writing now, not be left
    running marked stale (docs/daemon.md "Pushed revocation")."""
    system, personal = tmp_path / "system", tmp_path / "personal"
    init_root(system, host="h", force=False, demo=False, grant_group="kbd-grant")
    init_root(personal, host="h", force=False, demo=False)
    assert load_config(system).revoke_immediately is True
    assert "  immediate: true            # terminate running commands" in (system / "kbd.yaml").read_text()
    # A personal root is its operator's own: commands are marked stale, as before.
    assert load_config(personal).revoke_immediately is False
    assert "  immediate: false           # terminate running commands" in (personal / "kbd.yaml").read_text()

"""The parse cache of kbd.yaml, principals.yaml and policies (kbd/fs/datafiles.py)."""

from __future__ import annotations

from pathlib import Path

import pytest


def test_a_rejected_config_is_never_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Refusing a bad kbd.yaml or principals.yaml leaves the root byte-identical: the
    parse cache under state/ is written only for a document that validated. (The
    racy-clean window is closed so the file counts as settled at once; under load
    the old code wrote the cache of a rejected file, and a refused command changed
    the root.)"""
    from kbd.core import layout
    from kbd.errors import InvalidConfig
    from kbd.fs import rootconfig
    from kbd.fs.rootinit import init_root

    monkeypatch.setattr(layout, "RACY_NS", 0)
    root = tmp_path / "root"
    init_root(root, host="h", force=False, demo=False)
    (root / "kbd.yaml").write_text((root / "kbd.yaml").read_text() + "bogus: 1\n")
    (root / "principals.yaml").write_text("principals:\n- id: alice\n  admn: true\n")
    before = {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}
    with pytest.raises(InvalidConfig, match="bogus"):
        rootconfig.load_config(root)
    with pytest.raises(InvalidConfig, match="admn"):
        rootconfig.load_principals(root)
    assert {p: p.read_bytes() for p in root.rglob("*") if p.is_file()} == before


def test_sandbox_grant_group_is_a_group_name_kept_as_text(tmp_path: Path) -> None:
    """Issue 12: ``sandbox.grant_group`` is parsed (purely: the gid is looked
    up when a command starts); a bad name is refused naming the field."""
    from kbd.errors import InvalidConfig
    from kbd.fs import rootconfig
    from kbd.fs.rootinit import init_root

    root = tmp_path / "root"
    init_root(root, host="h", force=False, demo=False)
    assert rootconfig.load_config(root).sandbox.grant_group is None
    text = (root / "kbd.yaml").read_text()
    (root / "kbd.yaml").write_text(
        text.replace("  unsafe_no_sandbox: false\n", "  unsafe_no_sandbox: false\n  grant_group: kbd-grant\n")
    )
    assert rootconfig.load_config(root).sandbox.grant_group == "kbd-grant"
    for bad in ("Kbd", "1kbd", "a b", "x" * 33, "''", "[kbd]"):
        (root / "kbd.yaml").write_text(
            text.replace(
                "  unsafe_no_sandbox: false\n", f"  unsafe_no_sandbox: false\n  grant_group: {bad}\n"
            )
        )
        with pytest.raises(InvalidConfig, match=r"sandbox\.grant_group"):
            rootconfig.load_config(root)

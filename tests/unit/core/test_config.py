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
    """docs/multi-user.md "The permission model": ``sandbox.grant_group`` is parsed (purely: the gid is looked
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


# -- note_history: per note, per source (docs/notes.md "Note history") -------------------------------


def test_a_sources_history_budget_defaults_to_twice_its_notes_quota(tmp_path: Path) -> None:
    from kbd.core.config import parse_config

    config = parse_config(
        {"host": "h", "notes_quota": {"max_bytes": 5 << 20, "max_files": 300}}, root=tmp_path
    )
    assert config.note_history.source_caps(config.notes_quota) == (600, 10 << 20)
    assert config.note_history.deleted_days == 30
    set_ = parse_config(
        {
            "host": "h",
            "note_history": {"source_max_versions": 7, "source_max_bytes": 4096, "deleted_days": 0},
        },
        root=tmp_path,
    )
    assert set_.note_history.source_caps(set_.notes_quota) == (7, 4096)
    assert set_.note_history.deleted_days == 0


@pytest.mark.parametrize(
    ("section", "says"),
    [
        ({"source_max_bytes": 0}, "note_history.source_max_bytes must be a whole number from 1 to 1099511627776 "
                                  "(default: twice notes_quota.max_bytes), not 0"),
        ({"source_max_bytes": "10M"}, "note_history.source_max_bytes must be a whole number"),
        ({"source_max_bytes": None}, "note_history.source_max_bytes must be a whole number"),
        ({"source_max_versions": True}, "note_history.source_max_versions must be a whole number from 1 to "
                                        "1000000 (default: twice notes_quota.max_files), not True"),
        ({"source_max_versions": 1_000_001}, "not 1000001"),
        ({"deleted_days": -1}, "note_history.deleted_days must be a whole number from 0 to 3650"),
        ({"deleted_days": 1.5}, "note_history.deleted_days must be a whole number"),
        ({"source_bytes": 1}, "source_bytes"),
    ],
)  # fmt: skip
def test_bad_history_budget_settings_are_refused_naming_the_field(
    tmp_path: Path, section: dict[str, object], says: str
) -> None:
    from kbd.core.config import parse_config
    from kbd.errors import InvalidConfig

    with pytest.raises(InvalidConfig) as err:
        parse_config({"host": "h", "note_history": section}, root=tmp_path)
    assert says in err.value.message, err.value.message

"""Doctor's bounded scans (docs/on-disk.md "Registry"): multi-link files in a KB and
workflow.json files below a workflow folder, never following links, bounded."""

from __future__ import annotations

import os
from pathlib import Path

from kbd.fs import lint
from kbd.fs.registry import MAX_DEPTH


def test_multi_link_files_are_found_at_any_depth_and_links_are_not_followed(tmp_path: Path) -> None:
    kb = tmp_path / "kb"
    (kb / "a" / "b" / "c").mkdir(parents=True)
    (kb / "single.md").write_text("one link\n")
    secret = tmp_path / "secret"
    secret.write_text("s\n")
    os.link(secret, kb / "a" / "b" / "c" / "deep.md")
    outside = tmp_path / "outside"
    outside.mkdir()
    os.link(secret, outside / "also")
    (kb / "a" / "via-link").symlink_to(outside)  # not followed: not reported
    (kb / "a" / "file-link").symlink_to(secret)  # a symlink is not a multi-link file
    scan = lint.multi_link_files(kb)
    assert scan.items == ["a/b/c/deep.md"]
    assert not scan.truncated and scan.skipped == 0


def test_scans_are_bounded_and_say_so(tmp_path: Path) -> None:
    kb = tmp_path / "kb"
    kb.mkdir()
    for i in range(50):
        (kb / f"f{i}").write_text("")
    scan = lint.multi_link_files(kb, limit=10)
    assert scan.truncated and scan.seen == 10
    assert "not everything was checked" in scan.incomplete(10)
    deep = tmp_path / "deep"
    path = deep
    for i in range(MAX_DEPTH + 3):
        path = path / f"d{i}"
    path.mkdir(parents=True)
    (path / "workflow.json").write_text("{}")
    scan = lint.nested_manifests(deep)
    assert scan.truncated and scan.items == []

"""Folder grants (``folder_access``): the pure rules of :mod:`kbd.core.folders`
on data alone, and the probe of :mod:`kbd.fs.folders` on real folders."""

from __future__ import annotations

from pathlib import Path, PurePosixPath

import pytest

from kbd.core.folders import MAX_FOLDERS, FolderRequest, FolderStatus, check_folders
from kbd.fs.folders import resolve_folders

# Never created: the rules decide without touching the filesystem.
APPROVED = (Path("/nowhere/approved"), Path("/nowhere/other"))


def only_status(raw: object) -> FolderStatus:
    [status] = check_folders(raw, roots=APPROVED)
    assert isinstance(status, FolderStatus), status
    return status


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ("x", "folder_access must be a list, got a string"),
        ([3], "entry must be an object, got int"),
        ([{"alias": "a", "path": "/nowhere/approved", "mode": "rw"}], "unknown key 'mode'; allowed: alias, path, access"),
        ([{"alias": "Bad", "path": "/nowhere/approved"}], "alias "),
        ([{"alias": "a", "path": "/nowhere/approved", "access": "rw"}], "access 'rw'; allowed: read_only, read_write"),
        ([{"alias": "a", "path": "rel"}], "path must be an absolute path"),
        ([{"alias": "a", "path": "/nowhere/approved/\x00"}], "path must be an absolute path"),
        ([{"alias": "a", "path": "/nowhere/approved/../x"}], "path must not contain '..'"),
    ],
)  # fmt: skip
def test_a_broken_entry_is_an_invalid_entry_naming_the_rule(raw: object, message: str) -> None:
    status = only_status(raw)
    assert (status.available, status.reason, status.path) == (False, "invalid_entry", None)
    assert (status.message or "").startswith(message), status.message


def test_a_bad_alias_or_access_is_never_shown_back() -> None:
    status = only_status([{"alias": "Bad", "path": "/nowhere/approved", "access": ["read_write"]}])
    assert (status.alias, status.access) == ("", "read_only")
    assert status.to_json()["env"] == "WORKFLOW_FOLDER_"


def test_an_alias_is_used_once_and_the_list_is_bounded() -> None:
    entry = {"alias": "a", "path": "/nowhere/approved/a"}
    first, second = check_folders([entry, entry], roots=APPROVED)
    assert isinstance(first, FolderRequest)
    assert (
        isinstance(second, FolderStatus)
        and second.message == "alias 'a' is used twice"
        and second.alias == ""
    )
    many = check_folders([{"alias": f"a{i}", "path": f"/nowhere/approved/{i}"} for i in range(MAX_FOLDERS + 2)],
                         roots=APPROVED)  # fmt: skip
    assert all(isinstance(c, FolderRequest) for c in many[:MAX_FOLDERS])
    assert [c.message for c in many[MAX_FOLDERS:] if isinstance(c, FolderStatus)] == [
        f"more than {MAX_FOLDERS} folder grants"
    ] * 2


def test_a_path_outside_every_approved_root_is_not_approved() -> None:
    for path in ("/etc", "/nowhere/approvedx", "/nowhere"):
        status = only_status([{"alias": "a", "path": path, "access": "read_write"}])
        assert (status.alias, status.access, status.reason) == ("a", "read_write", "folder_not_approved")
    # No approved roots at all (`kbd validate`): every valid entry is not approved.
    [unapproved] = check_folders([{"alias": "a", "path": "/nowhere/approved"}], roots=())
    assert isinstance(unapproved, FolderStatus) and unapproved.reason == "folder_not_approved"


def test_a_valid_entry_names_its_root_and_what_lies_beneath() -> None:
    deep, top = check_folders(
        [{"alias": "deep", "path": "/nowhere/other/a/b", "access": "read_write"}, {"alias": "top", "path": "/nowhere/approved"}],
        roots=APPROVED,
    )  # fmt: skip
    assert deep == FolderRequest("deep", "read_write", APPROVED[1], PurePosixPath("a/b"))
    assert deep.path == Path("/nowhere/other/a/b")
    assert top == FolderRequest("top", "read_only", APPROVED[0], PurePosixPath("."))
    assert top.path == APPROVED[0]
    assert top.available().to_json() == {"alias": "top", "access": "read_only", "available": True, "reason": None,
                                         "message": None, "env": "WORKFLOW_FOLDER_TOP", "path": str(APPROVED[0])}  # fmt: skip


def test_no_entries_means_no_grants() -> None:
    assert check_folders(None, roots=APPROVED) == [] and check_folders([], roots=APPROVED) == []


# -- the probe: opened beneath the approved root, for real --------------------------------------


def test_the_probe_opens_beneath_the_root_and_never_follows_a_link(tmp_path: Path) -> None:
    root = tmp_path / "approved"
    (root / "shared").mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    (root / "link").symlink_to(outside)
    (root / "file").write_text("x")
    raw = [
        {"alias": "shared", "path": f"{root}/shared", "access": "read_write"},
        {"alias": "link", "path": f"{root}/link"},
        {"alias": "gone", "path": f"{root}/gone"},
        {"alias": "file", "path": f"{root}/file"},
        {"alias": "bad", "path": "relative"},
    ]
    shared, link, gone, file, bad = resolve_folders(raw, roots=(root,))
    assert (shared.available, shared.path, shared.access) == (True, root / "shared", "read_write")
    for refused in (link, gone, file):
        assert (refused.available, refused.reason, refused.path) == (False, "folder_unavailable", None), (
            refused
        )
        assert refused.message and str(tmp_path) not in refused.message
    assert bad.reason == "invalid_entry"

"""Folder grants opened for real (:mod:`kbd.fs.folders`), as the session's user."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kbd.fs.folders import UNAVAILABLE, User, resolve_folders

NOBODY = 65534


@pytest.mark.requires_root
def test_grants_opened_as_the_user_tell_nothing_of_another_users_private_folder(traversable: Path) -> None:
    """Another user's 0700 folder under an approved root: as the session's user
    (not root) a path inside it that exists and one that does not are both
    ``folder_unavailable`` with one message, the same as a missing folder's,
    worded for the folder; a folder the user may open is available."""
    approved = traversable / "shared"
    (approved / "pub").mkdir(parents=True)
    theirs = approved / "theirs"
    (theirs / "secret").mkdir(parents=True)
    os.chown(theirs, NOBODY - 1, NOBODY - 1)
    theirs.chmod(0o700)
    raw = [
        {"alias": "pub", "path": f"{approved}/pub"},
        {"alias": "peek", "path": f"{theirs}/secret"},
        {"alias": "guess", "path": f"{theirs}/missing"},
        {"alias": "gone", "path": f"{approved}/missing"},
    ]
    pub, peek, guess, gone = resolve_folders(raw, roots=(approved,), as_uid=NOBODY)
    assert (pub.available, pub.path) == (True, approved / "pub")
    answers = {(f.available, f.reason, f.message, f.path) for f in (peek, guess, gone)}
    assert answers == {(False, "folder_unavailable", UNAVAILABLE, None)}
    assert "knowledge base" not in UNAVAILABLE and "folder" in UNAVAILABLE
    # Root could open it: what the session's user must not learn.
    assert resolve_folders(raw, roots=(approved,))[1].available is True


def test_a_user_is_their_groups_from_the_user_database() -> None:
    nobody = User.of(NOBODY)
    assert (nobody.uid, nobody.gid) == (NOBODY, NOBODY) and NOBODY in nobody.groups
    assert User.of(4_000_000_000) == User(4_000_000_000, NOBODY, ())  # no passwd entry: no group

"""Known path-confinement bypasses stay closed: long symlink chains, O_CREAT through a
dangling link, writes through hard links, encoded names, index look-alikes and a KB
root swapped between two commands."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kbd.core.relpaths import is_index_name
from kbd.errors import InvalidPath, KbdError, PathNotFound, PathRefused
from kbd.fs.confined import pin_dir, read_file, replace_file
from kbd.service import browse
from tests.helpers import KbRoot


@pytest.fixture
def box(tmp_path: Path) -> tuple[Path, Path]:
    kb = tmp_path / "kb"
    outside = tmp_path / "outside"
    (kb / "notes").mkdir(parents=True)
    outside.mkdir()
    (outside / "secret").write_text("SECRET\n")
    (kb / "notes" / "a.md").write_text("a\n")
    return kb, outside


def test_path_max_symlink_chain(box: tuple[Path, Path]) -> None:
    """The 2025 tarfile-filter mechanism: a chain of links whose expansion exceeds
    PATH_MAX makes realpath give up and return an unresolved path."""
    kb, _ = box
    deep = kb / "notes"
    name = "d" * 200
    for _ in range(16):
        deep = deep / name
    deep.mkdir(parents=True)
    link_chain = kb / "notes" / "l0"
    target = "/".join([name] * 16)
    link_chain.symlink_to(target)
    prev = "l0"
    for i in range(1, 30):
        (kb / "notes" / f"l{i}").symlink_to(f"{prev}/" + "/".join([".."] * 16))
        prev = f"l{i}"
    (kb / "notes" / "escape").symlink_to(f"{prev}/../outside/secret")
    with pin_dir(kb) as p:
        for rel in ("notes/escape", f"notes/{prev}", "notes/l0"):
            with pytest.raises(PathRefused):
                read_file(p.fd, rel, limit=1 << 20)


def test_o_creat_through_dangling_link(box: tuple[Path, Path]) -> None:
    kb, outside = box
    (kb / "notes" / "new.md").symlink_to(outside / "created.md")
    with pin_dir(kb) as p, pytest.raises(PathRefused, match="link"):
        replace_file(p.fd, "notes/new.md", b"x")
    assert not (outside / "created.md").exists()
    assert os.readlink(kb / "notes" / "new.md") == str(outside / "created.md")


def test_write_never_goes_through_a_hardlink(box: tuple[Path, Path]) -> None:
    kb, outside = box
    os.link(outside / "secret", kb / "notes" / "h.md")
    with pin_dir(kb) as p:
        with pytest.raises(PathRefused, match="hard links"):
            read_file(p.fd, "notes/h.md", limit=100)
        replace_file(p.fd, "notes/h.md", b"replaced\n")
    assert (outside / "secret").read_text() == "SECRET\n"
    assert (kb / "notes" / "h.md").read_text() == "replaced\n"
    assert (kb / "notes" / "h.md").stat().st_nlink == 1


@pytest.mark.parametrize(
    "bad", ["notes/a\x00.md", "a" * 5000, "notes/" + "n" * 256, "/notes/a.md", "", ".", "notes/../notes/a.md"]
)
def test_invalid_names_refused_before_any_syscall(box: tuple[Path, Path], bad: str) -> None:
    kb, _ = box
    with pin_dir(kb) as p, pytest.raises(InvalidPath):
        read_file(p.fd, bad, limit=100)


def test_encoded_and_backslash_names_are_literal(box: tuple[Path, Path]) -> None:
    kb, _ = box
    with pin_dir(kb) as p:
        for rel in (
            "..%2foutside%2fsecret",
            "notes/..%2f..%2fsecret",
            "..\\outside\\secret",
            "notes\\..\\..\\x",
        ):
            with pytest.raises(PathNotFound):
                read_file(p.fd, rel, limit=100)
        (kb / "notes" / "..\\odd").write_text("literal\n")
        assert read_file(p.fd, "notes/..\\odd", limit=100) == b"literal\n"


@pytest.mark.parametrize(
    "name",
    [
        "_index.json",
        "_INDEX.json",
        "_Index.JSON",
        "\uff3findex.json",
        "_index.\uff4aso\uff4e",
        "_\u0131ndex.json",
    ],
)
def test_index_lookalikes_fold_to_the_index(name: str) -> None:
    # U+0131 (dotless i) does not casefold to "i": it is a different name and stays allowed.
    assert is_index_name(name) is (name != "_\u0131ndex.json")


@pytest.mark.parametrize("name", ["index.json", "_index.json.md", "_index_json", "notes.md"])
def test_ordinary_names_are_not_the_index(name: str) -> None:
    assert not is_index_name(name)


def test_kb_root_or_notes_swapped_between_two_commands(kb: KbRoot) -> None:
    src = kb.workflow("src", access={"owners": ["alice"]})
    kb.workflow("con", access={"owners": ["alice"]}, sources=[{"workflow_id": "src", "alias": "s"}])
    h = kb.host()
    alice = h.actor("alice")
    att = browse.attachment(h, "con", "s", actor=alice)
    # Between resolution and use, the KB folder is replaced by another real folder.
    (src / "knowledgebase").rename(src / "kb_old")
    (src / "knowledgebase").mkdir()
    assert att.path is not None
    with pytest.raises(PathRefused, match="changed since it was resolved"):
        pin_dir(att.path, expect=att.kb_identity)
    # ...or by a symlink: the next command's fresh resolution reports it.
    (src / "knowledgebase").rmdir()
    (src / "knowledgebase").symlink_to("kb_old")
    with pytest.raises(KbdError, match="kb_symlinked"):
        browse.read(h, "con", "s", "notes/fact.md", actor=alice)
    (src / "knowledgebase").unlink()
    (src / "kb_old").rename(src / "knowledgebase")
    # notes/ swapped for a link into the workflow's private folders.
    notes = src / "knowledgebase" / "notes"
    notes.rename(src / "notes_old")
    notes.symlink_to("../credentials")
    with pytest.raises(PathRefused, match="symbolic link"):
        browse.read(h, "con", "s", "notes/token", actor=alice)
    assert list(browse.ls(h, "con", "s", "", actor=alice).entries) == [
        {"name": "context", "type": "dir"},
        {"name": "notes", "type": "symlink"},
    ]


@pytest.mark.parametrize("use_openat2", [True, False])
def test_pin_dir_never_follows_a_link_on_either_code_path(
    box: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch, use_openat2: bool
) -> None:
    from kbd.fs import confined

    kb, outside = box
    monkeypatch.setattr(confined, "HAVE_OPENAT2", use_openat2)
    (kb / "link").symlink_to(outside)
    with pin_dir(kb / "notes") as p:
        assert os.fstat(p.fd).st_ino == (kb / "notes").stat().st_ino
    with pytest.raises(PathRefused):
        pin_dir(kb / "link")
    with pytest.raises(KbdError):
        pin_dir(kb / "link" / "deeper")
    with pin_dir(Path("/")) as root:
        assert os.fstat(root.fd).st_ino == os.stat("/").st_ino

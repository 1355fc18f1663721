"""Property tests for the path layer (kbd/fs/confined.py) over random hostile trees.

Every example materialises a fresh tree (tests/security/path_strategies.py) and
throws a hostile relative path at it. The oracles never ask kbd: they use

* an independent walk of the tree (``os.walk(followlinks=False)`` + ``os.lstat``),
  so only entries reachable through real folders count as "inside root";
* the module policy's lexical rules, restated here (:func:`lexical_parts`);
* :func:`physical`, which resolves a path through real folders only.

Every kbd call runs under a SIGALRM watchdog, so a blocking open (a FIFO) fails
the example instead of hanging the run. Exceptions other than the documented
path errors propagate unchanged, so hypothesis reports each distinct one.

``open_beneath`` is a primitive: like open(2), ``O_RDONLY`` on a FIFO waits for a
writer (``read_file`` is the FIFO-safe reader: it opens ``O_PATH`` first). The
tests therefore add ``O_NONBLOCK`` to ``O_RDONLY`` when the path physically names
a FIFO; ``read_file`` is always called as callers call it.
"""

from __future__ import annotations

import os
import signal
import stat
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from types import FrameType
from typing import TypeVar
from unittest import mock

from hypothesis import event, given, settings
from hypothesis import strategies as st

from kbd.errors import InvalidPath, KbdError, PathNotFound, PathRefused, PermissionDenied
from kbd.fs import confined
from kbd.fs.confined import (
    list_dir,
    open_beneath,
    read_file,
    read_file_stat,
    replace_file,
)
from tests.security.path_strategies import (
    MAX_CONTENT,
    NAMES,
    SECRET,
    Op,
    Tree,
    built_tree,
    hostile_paths,
    tree_ops,
)

#: The hypothesis settings of the loaded profile (tests/conftest.py: ci / dev / nightly).
PROFILE = settings()

EXPECTED_ERRORS = (InvalidPath, PathNotFound, PathRefused, PermissionDenied)
WATCHDOG_SECONDS = 5.0
# Restated from the policy rather than imported, so the oracle does not share kbd's constants.
PATH_MAX = 4096
NAME_MAX = 255

T = TypeVar("T")


# -- the independent view of a tree ------------------------------------------------


@dataclass(frozen=True)
class Node:
    kind: str  # "dir" | "file" | "link" | "fifo" | "other"
    dev: int
    ino: int
    nlink: int
    size: int

    @property
    def ident(self) -> tuple[int, int]:
        return self.dev, self.ino


def _node(st_: os.stat_result) -> Node:
    mode = st_.st_mode
    if stat.S_ISDIR(mode):
        kind = "dir"
    elif stat.S_ISREG(mode):
        kind = "file"
    elif stat.S_ISLNK(mode):
        kind = "link"
    elif stat.S_ISFIFO(mode):
        kind = "fifo"
    else:
        kind = "other"
    return Node(kind, st_.st_dev, st_.st_ino, st_.st_nlink, st_.st_size)


def _raise(exc: OSError) -> None:
    raise exc


def walk(top: str) -> dict[str, Node]:
    """Everything physically beneath ``top`` through real folders; ``""`` is ``top``."""
    out = {"": _node(os.lstat(top))}
    for dirpath, dirnames, filenames in os.walk(top, followlinks=False, onerror=_raise):
        rel_dir = os.path.relpath(dirpath, top)
        for name in (*dirnames, *filenames):
            rel = name if rel_dir == "." else f"{rel_dir}/{name}"
            out[rel] = _node(os.lstat(os.path.join(dirpath, name)))
    return out


def snapshot(top: str) -> dict[str, tuple[str, bytes]]:
    """Kind and bytes (file content, link target) of everything beneath ``top``."""
    out: dict[str, tuple[str, bytes]] = {}
    for rel, node in walk(top).items():
        path = os.path.join(top, rel) if rel else top
        payload = b""
        if node.kind == "file":
            with open(path, "rb") as fh:
                payload = fh.read()
        elif node.kind == "link":
            payload = os.fsencode(os.readlink(path))
        out[rel] = (node.kind, payload)
    return out


def lexical_parts(rel: str) -> list[str] | None:
    """The policy's lexical rules: the components, or None if ``rel`` must be refused."""
    if "\x00" in rel or rel.startswith("/"):
        return None
    try:
        # Policy: paths are text; names that are not valid UTF-8 (lone or
        # surrogate-escaped bytes) are refused, even if the filesystem has them.
        raw = rel.encode("utf-8")
    except UnicodeEncodeError:
        return None
    if len(raw) > PATH_MAX:
        return None
    parts = [p for p in rel.split("/") if p not in ("", ".")]
    if any(p == ".." or len(p.encode("utf-8")) > NAME_MAX for p in parts):
        return None
    return parts


def ends_as_folder(rel: str) -> bool:
    """POSIX: a path ending in ``/`` (or ``/.``) names a folder, never a file (docs/access.md "Names"; the
    policy once dropped the trailing slash and served the file)."""
    raw = rel.split("/")
    return len(raw) > 1 and raw[-1] in ("", ".") and any(p not in ("", ".") for p in raw)


def physical(
    nodes: dict[str, Node], parts: list[str] | None, *, folder: bool = False
) -> tuple[str, Node] | None:
    """What ``parts`` names when only real folders are walked through, else None
    (also None when ``folder`` is asked for and it is not a real folder)."""
    if parts is None:
        return None
    if folder and parts:
        found = physical(nodes, parts)
        return found if found is not None and found[1].kind == "dir" else None
    for i in range(1, len(parts)):
        node = nodes.get("/".join(parts[:i]))
        if node is None or node.kind != "dir":
            return None
    key = "/".join(parts)
    node = nodes.get(key)
    return None if node is None else (key, node)


# -- calling kbd ---------------------------------------------------------------------


class Hang(BaseException):
    """Raised by the watchdog; a BaseException so no ``except Exception`` swallows it."""


def attempt(call: Callable[[], T]) -> T | KbdError:
    """Run ``call`` under a watchdog; a documented path error is returned, not raised.

    Any other exception propagates unchanged (the property fails on it).
    """

    def fire(signum: int, frame: FrameType | None) -> None:
        raise Hang

    previous = signal.signal(signal.SIGALRM, fire)
    # The one real-time timer may already hold the test's own timeout (pytest-timeout):
    # keep what is left of it and re-arm it afterwards, so the watchdog never disarms it.
    outer, _ = signal.setitimer(signal.ITIMER_REAL, WATCHDOG_SECONDS)
    started = time.monotonic()
    try:
        return call()
    except EXPECTED_ERRORS as exc:
        return exc
    except Hang:
        raise AssertionError(f"the call blocked for more than {WATCHDOG_SECONDS}s") from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer > 0:  # an expired one still fires, a moment later
            signal.setitimer(signal.ITIMER_REAL, max(outer - (time.monotonic() - started), 0.001))


def outcome(result: object) -> str:
    if isinstance(result, PathRefused):
        return f"{result.code}:{result.why}"
    if isinstance(result, KbdError):
        return result.code
    return "ok"


def fd_node(fd: int) -> Node:
    """fstat an fd kbd returned, then close it."""
    try:
        return _node(os.fstat(fd))
    finally:
        os.close(fd)


@contextmanager
def pinned(tree: Tree) -> Iterator[int]:
    fd = os.open(tree.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield fd
    finally:
        os.close(fd)


def rdonly_flags(target: tuple[str, Node] | None) -> int:
    """O_RDONLY, plus O_NONBLOCK when the path physically names a FIFO (module docstring)."""
    if target is not None and target[1].kind == "fifo":
        return os.O_RDONLY | os.O_NONBLOCK
    return os.O_RDONLY


def _open(root_fd: int, rel: str, flags: int, use_openat2: bool | None) -> Node | KbdError:
    got = attempt(partial(open_beneath, root_fd, rel, flags, use_openat2=use_openat2))
    return got if isinstance(got, KbdError) else fd_node(got)


def _diff(before: dict[str, tuple[str, bytes]], after: dict[str, tuple[str, bytes]]) -> str:
    keys = sorted(set(before) | set(after))
    changed = [f"{k!r}: {before.get(k)!r} -> {after.get(k)!r}" for k in keys if before.get(k) != after.get(k)]
    return "; ".join(changed[:10])


# -- properties ------------------------------------------------------------------------


@PROFILE
@given(ops=tree_ops(), data=st.data())
def test_read_file_serves_only_singly_linked_regular_files_inside_root(
    ops: list[Op], data: st.DataObject
) -> None:
    with built_tree(ops) as tree, pinned(tree) as root_fd:
        rel = data.draw(hostile_paths(tree.entries, tree.files), label="rel")
        limit = data.draw(st.sampled_from((1 << 16, MAX_CONTENT, 8, 0)), label="limit")
        nodes = walk(tree.root)
        inside_files = {n.ident for n in nodes.values() if n.kind == "file"}
        secret = _node(os.lstat(tree.secret_path))
        parts = lexical_parts(rel)
        target = physical(nodes, parts, folder=ends_as_folder(rel)) if parts else None
        for use_openat2 in (None, False):
            got = attempt(partial(read_file_stat, root_fd, rel, limit=limit, use_openat2=use_openat2))
            body = attempt(partial(read_file, root_fd, rel, limit=limit, use_openat2=use_openat2))
            event(f"read_file(use_openat2={use_openat2}) -> {outcome(got)}")
            if isinstance(got, KbdError):
                assert isinstance(body, KbdError), f"read_file served {body!r}, read_file_stat refused"
                plain = target is not None and target[1].kind == "file" and target[1].nlink == 1
                assert not (plain and target is not None and target[1].size <= limit), (
                    f"a plain file inside root was refused: {got!r}"
                )
                continue
            content, st_ = got
            assert not isinstance(body, KbdError), f"read_file refused ({body!r}), read_file_stat served"
            assert content != SECRET and body != SECRET, "the outside secret was served"
            assert (st_.st_dev, st_.st_ino) != secret.ident, "the outside secret's inode was served"
            assert (st_.st_dev, st_.st_ino) in inside_files, "served a file not physically inside root"
            assert stat.S_ISREG(st_.st_mode) and not stat.S_ISFIFO(st_.st_mode)
            assert st_.st_nlink == 1
            assert len(content) <= limit
            assert target is not None and target[1].ident == (st_.st_dev, st_.st_ino), (
                f"served inode {st_.st_ino}, but {rel!r} physically names {target!r}"
            )
            with open(tree.abs(target[0]), "rb") as fh:
                assert fh.read() == content == body


@PROFILE
@given(ops=tree_ops(), data=st.data())
def test_open_beneath_rdonly_opens_only_what_is_physically_inside_root(
    ops: list[Op], data: st.DataObject
) -> None:
    with built_tree(ops) as tree, pinned(tree) as root_fd:
        rel = data.draw(hostile_paths(tree.entries, tree.dirs + tree.files), label="rel")
        nodes = walk(tree.root)
        inside = {n.ident for n in nodes.values() if n.kind != "link"}
        outside = {n.ident for n in walk(tree.outside).values()} - inside
        target = physical(nodes, lexical_parts(rel), folder=ends_as_folder(rel))
        flags = rdonly_flags(target)
        for use_openat2 in (None, False):
            got = _open(root_fd, rel, flags, use_openat2)
            event(f"open_beneath(O_RDONLY, use_openat2={use_openat2}) -> {outcome(got)}")
            if isinstance(got, KbdError):
                assert target is None or target[1].kind == "link", (
                    f"{rel!r} physically names {target!r} inside root, but was refused: {got!r}"
                )
                continue
            assert got.ident not in outside, "opened something outside root"
            assert got.ident in inside, f"opened {got!r}, which is not physically inside root"
            assert target is not None and target[1].ident == got.ident, (
                f"opened {got!r}, but {rel!r} physically names {target!r}"
            )


def _differential(ops: list[Op], data: st.DataObject, flags: int | None, name: str) -> None:
    with built_tree(ops) as tree, pinned(tree) as root_fd:
        rel = data.draw(hostile_paths(tree.entries, tree.dirs + tree.files), label="rel")
        target = physical(walk(tree.root), lexical_parts(rel), folder=ends_as_folder(rel))
        how = rdonly_flags(target) if flags is None else flags
        primary = _open(root_fd, rel, how, True)
        fallback = _open(root_fd, rel, how, False)
        event(f"{name}: openat2 -> {outcome(primary)}, walk -> {outcome(fallback)}")
        if isinstance(primary, Node) and isinstance(fallback, Node):
            assert primary.ident == fallback.ident, f"openat2 opened {primary!r}, the walk {fallback!r}"
        else:
            assert isinstance(primary, KbdError) and isinstance(fallback, KbdError), (
                f"{name} on {rel!r}: openat2 -> {primary!r}, walk -> {fallback!r}"
            )


@PROFILE
@given(ops=tree_ops(), data=st.data())
def test_openat2_and_walk_agree_o_rdonly(ops: list[Op], data: st.DataObject) -> None:
    _differential(ops, data, None, "O_RDONLY")


@PROFILE
@given(ops=tree_ops(), data=st.data())
def test_openat2_and_walk_agree_o_path(ops: list[Op], data: st.DataObject) -> None:
    _differential(ops, data, os.O_PATH, "O_PATH")


@PROFILE
@given(ops=tree_ops(), data=st.data())
def test_openat2_and_walk_agree_o_directory(ops: list[Op], data: st.DataObject) -> None:
    _differential(ops, data, os.O_RDONLY | os.O_DIRECTORY, "O_RDONLY|O_DIRECTORY")


_KIND_NAMES = {"dir": "dir", "file": "file", "link": "symlink", "fifo": "other", "other": "other"}


@PROFILE
@given(ops=tree_ops(), data=st.data())
def test_list_dir_lists_only_real_folders_inside_root(ops: list[Op], data: st.DataObject) -> None:
    with built_tree(ops) as tree, pinned(tree) as root_fd:
        rel = data.draw(hostile_paths(tree.entries, tree.dirs), label="rel")
        nodes = walk(tree.root)
        inside_dirs = {n.ident for n in nodes.values() if n.kind == "dir"}
        target = physical(nodes, lexical_parts(rel))
        opened: list[Node] = []
        real_open_beneath = confined.open_beneath

        def spy(dirfd: int, path: str, flags: int = os.O_RDONLY, mode: int = 0) -> int:
            fd = real_open_beneath(dirfd, path, flags, mode)
            opened.append(_node(os.fstat(fd)))
            return fd

        with mock.patch.object(confined, "open_beneath", spy):
            got = attempt(partial(list_dir, root_fd, rel))
        event(f"list_dir -> {outcome(got)}")
        if isinstance(got, KbdError):
            assert target is None or target[1].kind != "dir", (
                f"{rel!r} physically names a folder inside root, but was refused: {got!r}"
            )
            return
        assert target is not None and target[1].kind == "dir", f"listed {rel!r}, which is not a real folder"
        assert len(opened) == 1 and opened[0].ident in inside_dirs, "listed a folder not inside root"
        assert opened[0].ident == target[1].ident, f"listed {opened[0]!r}, {rel!r} names {target!r}"
        key = target[0]
        assert [e["name"] for e in got] == sorted(os.listdir(tree.abs(key)))
        for entry in got:
            child = nodes[f"{key}/{entry['name']}" if key else entry["name"]]
            assert entry["type"] == _KIND_NAMES[child.kind], (entry, child)


@PROFILE
@given(ops=tree_ops(), data=st.data())
def test_replace_file_writes_only_the_named_file_inside_root(ops: list[Op], data: st.DataObject) -> None:
    with built_tree(ops) as tree, pinned(tree) as root_fd:
        fresh = [f"{d}/{n}" if d else n for d in tree.dirs for n in NAMES]  # mostly not there yet
        rel = data.draw(hostile_paths(tree.entries, tree.files + fresh), label="rel")
        payload = data.draw(st.binary(max_size=MAX_CONTENT), label="payload")
        nodes = walk(tree.root)
        parts = lexical_parts(rel)
        parent = physical(nodes, parts[:-1]) if parts else None
        final = physical(nodes, parts) if parts else None
        replaceable = (
            parent is not None
            and parent[1].kind == "dir"
            and (final is None or final[1].kind == "file")
            and not ends_as_folder(rel)
        )
        before = snapshot(tree.base)
        idents_before = walk(tree.base)

        got = attempt(partial(replace_file, root_fd, rel, payload))
        event(f"replace_file -> {outcome(got)}")
        after = snapshot(tree.base)

        assert after["outside/secret"] == ("file", SECRET), "the outside secret changed"
        if isinstance(got, KbdError):
            assert after == before, f"refused ({got!r}) but the tree changed: {_diff(before, after)}"
            assert not replaceable, f"{rel!r} names a replaceable file inside root, but was refused: {got!r}"
            return
        assert parts is not None and replaceable, f"replaced {rel!r}, which policy refuses"
        key = "root/" + "/".join(parts)
        assert after[key] == ("file", payload)
        assert os.lstat(os.path.join(tree.base, key)).st_nlink == 1, "wrote through a hard link"
        if final is not None:
            twins = [
                k
                for k, n in idents_before.items()
                if n.ident == final[1].ident and k != key and n.kind == "file"
            ]
            for twin in twins:
                assert after[twin] == before[twin], f"hard-linked twin {twin!r} changed"
        expected = dict(before)
        expected[key] = ("file", payload)
        assert after == expected, f"unexpected changes: {_diff(expected, after)}"

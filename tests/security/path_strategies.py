"""Hypothesis strategies for fuzzing the path layer (kbd/fs/confined.py).

A generated *tree* is a list of operations (plain frozen dataclasses, so a
falsifying example prints as readable Python). :func:`materialise` replays them
inside a fresh temporary folder laid out as::

    base/
      root/            the folder kbd pins; every operation happens in here
      outside/         a sibling kbd must never reach
        secret         bytes that must never be served, written or linked to
        sub/note

Operations name their parent folder and their link / hardlink sources by an
integer that is taken modulo the list of things created so far, so every
operation list is valid and shrinks well; an operation whose name is already
taken (or whose path would grow too long for the independent checks) is skipped.

:func:`hostile_paths` builds caller-supplied relative paths from the names that
actually exist in a materialised tree plus ``..``, ``.``, empty components,
absolute prefixes, encoded and backslashed separators, NUL, over-long
components and paths, trailing slashes and NFC / NFD variants.

Nothing here imports kbd: the tests' oracles stay independent of the code under
test.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import unicodedata
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from hypothesis import strategies as st

# -- names ----------------------------------------------------------------------

E_NFC = unicodedata.normalize("NFC", "é")  # U+00E9, 2 bytes
E_NFD = unicodedata.normalize("NFD", "é")  # "e" + U+0301, 3 bytes
assert E_NFC != E_NFD

#: Names a tree is built from. Long names are at or just under NAME_MAX (255 bytes)
#: in 1-, 2-, 3- and 4-byte UTF-8 characters.
NAMES: tuple[str, ...] = (
    "a",
    "b",
    "c",
    "notes",
    ".hidden",
    "...",
    "..%2f",
    "a\\b",
    "..\\",
    " ",
    E_NFC,
    E_NFD,
    f"caf{E_NFC}",
    f"caf{E_NFD}",
    "L" * 255,
    E_NFC * 127,  # 254 bytes
    "日" * 85,  # 255 bytes
    "\U0001f600" * 63,  # 252 bytes, 63 characters
)

#: Components that are never valid (or never literal) in a kbd path, plus odd
#: but valid ones; mixed into hostile paths.
SPECIAL_COMPONENTS: tuple[str, ...] = (
    "..",
    ".",
    "",
    "..%2f",
    "%2e%2e",
    "..%2F..%2Foutside",
    "..\\..\\outside",
    "\\",
    "...",
    "\x00",
    "a\x00b",
    "x" * 256,  # one byte over NAME_MAX
    E_NFC * 128,  # 256 bytes
    "\U0001f600" * 64,  # 256 bytes
    "\udcff",  # surrogate-escaped byte 0xff, as from an undecodable argv
    "\ud800",  # lone surrogate, as from JSON "\\ud800"
    "~",
    "*",
    "\n",
    "outside",
    "secret",
    "root",
)

SECRET = b"TOP-SECRET: this content must never be served by kbd, nor overwritten by it. 0123456789"
#: Generated file contents (and replace_file payloads) are shorter than SECRET, so
#: equal bytes can only mean the secret itself was read.
MAX_CONTENT = 64
assert len(SECRET) > MAX_CONTENT

#: Trees whose absolute paths would exceed this are not built further, so the
#: independent walk (absolute paths, os.walk) never meets ENAMETOOLONG.
MAX_ABS_PATH = 3000


def swap_normalisation(name: str) -> str:
    """The NFD spelling of an NFC name and vice versa (identical if plain ASCII)."""
    nfc = unicodedata.normalize("NFC", name)
    return unicodedata.normalize("NFD", name) if name == nfc else nfc


# -- operations -------------------------------------------------------------------


@dataclass(frozen=True)
class MkDir:
    parent: int
    name: str


@dataclass(frozen=True)
class MkFile:
    parent: int
    name: str
    content: bytes


@dataclass(frozen=True)
class MkFifo:
    parent: int
    name: str


LINK_KINDS = (
    "entry",  # anything created so far (files, folders, links: chains), relative or absolute
    "root",  # the pinned root itself
    "outside",  # the outside folder
    "secret",  # the outside secret
    "parent",  # ".."
    "slash",  # "/"
    "proc",  # /proc/self/root/<secret>: a path through a magic link
    "dangling",  # a name that never exists
    "self",  # the link itself
    "forward",  # a pool name beside the link, which may be created later (chains, loops)
)


@dataclass(frozen=True)
class MkSymlink:
    parent: int
    name: str
    kind: str
    index: int
    absolute: bool


@dataclass(frozen=True)
class MkLoop:
    """Two links beside each other: ``first -> second -> first``."""

    parent: int
    first: str
    second: str


@dataclass(frozen=True)
class MkHardlink:
    """A hard link to a regular file already in root, or to the outside secret."""

    parent: int
    name: str
    index: int
    to_secret: bool


Op = MkDir | MkFile | MkFifo | MkSymlink | MkLoop | MkHardlink

_index = st.integers(min_value=0, max_value=63)
_name = st.sampled_from(NAMES)

op_strategy: st.SearchStrategy[Op] = st.one_of(
    st.builds(MkDir, parent=_index, name=_name),
    st.builds(MkFile, parent=_index, name=_name, content=st.binary(max_size=MAX_CONTENT)),
    st.builds(MkFifo, parent=_index, name=_name),
    st.builds(
        MkSymlink,
        parent=_index,
        name=_name,
        kind=st.sampled_from(LINK_KINDS),
        index=_index,
        absolute=st.booleans(),
    ),
    st.builds(MkLoop, parent=_index, first=_name, second=_name),
    st.builds(MkHardlink, parent=_index, name=_name, index=_index, to_secret=st.booleans()),
)


def tree_ops(max_size: int = 20) -> st.SearchStrategy[list[Op]]:
    """A list of tree-building operations (see module docstring)."""
    return st.lists(op_strategy, max_size=max_size)


# -- materialisation --------------------------------------------------------------


@dataclass
class Tree:
    """A materialised tree. Relative paths are relative to :attr:`root`, ``""`` is root."""

    base: str
    root: str
    outside: str
    secret_path: str
    dirs: list[str] = field(default_factory=lambda: [""])
    files: list[str] = field(default_factory=list)
    entries: list[str] = field(default_factory=list)  # everything created, in order

    def abs(self, rel: str) -> str:
        return os.path.join(self.root, rel) if rel else self.root


def _join(parent: str, name: str) -> str:
    return f"{parent}/{name}" if parent else name


def _link_target(tree: Tree, parent: str, op: MkSymlink) -> str:
    link_dir = tree.abs(parent)
    kind = op.kind
    if kind == "entry" and tree.entries:
        dest = tree.abs(tree.entries[op.index % len(tree.entries)])
    elif kind in ("entry", "root"):
        dest = tree.root
    elif kind == "outside":
        dest = tree.outside
    elif kind == "secret":
        dest = tree.secret_path
    elif kind == "parent":
        return ".."
    elif kind == "slash":
        return "/"
    elif kind == "proc":
        return "/proc/self/root" + tree.secret_path
    elif kind == "dangling":
        return f"does-not-exist-{op.index}"
    elif kind == "self":
        return op.name
    elif kind == "forward":
        return NAMES[op.index % len(NAMES)]
    else:  # pragma: no cover - LINK_KINDS is closed
        raise AssertionError(kind)
    return dest if op.absolute else os.path.relpath(dest, link_dir)


def _free(tree: Tree, rel: str) -> bool:
    path = tree.abs(rel)
    return len(os.fsencode(path)) <= MAX_ABS_PATH and not os.path.lexists(path)


def _apply(tree: Tree, op: Op) -> None:
    parent = tree.dirs[op.parent % len(tree.dirs)]
    if isinstance(op, MkLoop):
        first, second = _join(parent, op.first), _join(parent, op.second)
        if op.first == op.second or not (_free(tree, first) and _free(tree, second)):
            return
        Path(tree.abs(first)).symlink_to(op.second)
        Path(tree.abs(second)).symlink_to(op.first)
        tree.entries += [first, second]
        return
    rel = _join(parent, op.name)
    if not _free(tree, rel):
        return
    path = tree.abs(rel)
    if isinstance(op, MkDir):
        os.mkdir(path)
        tree.dirs.append(rel)
    elif isinstance(op, MkFile):
        with open(path, "xb") as fh:
            fh.write(op.content)
        tree.files.append(rel)
    elif isinstance(op, MkFifo):
        os.mkfifo(path)
    elif isinstance(op, MkSymlink):
        Path(path).symlink_to(_link_target(tree, parent, op))
    elif isinstance(op, MkHardlink):
        if op.to_secret or not tree.files:
            os.link(tree.secret_path, path)
        else:
            os.link(tree.abs(tree.files[op.index % len(tree.files)]), path)
        tree.files.append(rel)
    tree.entries.append(rel)


def materialise(base: str, ops: Sequence[Op]) -> Tree:
    """Build ``root``, ``outside`` (with the secret) and the operations under ``base``."""
    root = os.path.join(base, "root")
    outside = os.path.join(base, "outside")
    os.mkdir(root)
    os.mkdir(outside)
    os.mkdir(os.path.join(outside, "sub"))
    with open(os.path.join(outside, "sub", "note"), "xb") as fh:
        fh.write(b"outside note")
    secret_path = os.path.join(outside, "secret")
    with open(secret_path, "xb") as fh:
        fh.write(SECRET)
    tree = Tree(base=base, root=root, outside=outside, secret_path=secret_path)
    for op in ops:
        _apply(tree, op)
    return tree


@contextmanager
def built_tree(ops: Sequence[Op]) -> Iterator[Tree]:
    """Materialise ``ops`` in a fresh ``tempfile.mkdtemp`` folder, removed afterwards.

    (Per example, not per test: function-scoped pytest fixtures are shared by all
    of a hypothesis test's examples.)
    """
    base = tempfile.mkdtemp(prefix="kbd-fuzz-")
    try:
        yield materialise(base, ops)
    finally:
        shutil.rmtree(base)


# -- hostile relative paths --------------------------------------------------------

_SEPARATORS = ("/", "/", "/", "//", "/./", "/.//")
_PREFIXES = ("", "", "", "/", "./", "../", "//", "\\", "./../", "/proc/self/root/")
_SUFFIXES = ("", "", "", "/", "/.", "//", "/..", "\\", "\x00")


def _components_of(entries: Sequence[str]) -> list[str]:
    seen: dict[str, None] = {}
    for entry in entries:
        for part in entry.split("/"):
            seen[part] = None
    return list(seen)


@st.composite
def hostile_paths(draw: st.DrawFn, entries: Sequence[str], favoured: Sequence[str] = ()) -> str:
    """A caller-supplied relative path aimed at a tree whose paths are ``entries``.

    ``favoured`` entries (say, the regular files, for a reader) are picked more
    often, so the success path of a property is exercised, not only refusals.
    """
    known = list(entries)
    components = _components_of(known) + list(NAMES) + list(SPECIAL_COMPONENTS)
    component = st.sampled_from(components)
    shape = draw(
        st.sampled_from(
            (
                *("favoured",) * 3,
                *("entry",) * 3,
                *("entry+",) * 2,
                *("built",) * 2,
                "swapped",
                "text",
                "huge",
                "boundary",
            )
        ),
        label="shape",
    )
    if shape == "text":
        # Any code point, lone surrogates included (JSON can carry "\ud800").
        return draw(st.text(st.characters(exclude_categories=()), max_size=24), label="text")
    if shape == "favoured" and favoured:
        return draw(st.sampled_from(list(favoured)), label="favoured")
    entry = draw(st.sampled_from(known), label="entry") if known else draw(component)
    if shape == "favoured":
        return entry
    if shape == "entry":
        return entry
    if shape == "entry+":
        return entry + draw(st.sampled_from(_SEPARATORS)) + draw(component)
    if shape == "swapped":
        return "/".join(swap_normalisation(p) for p in entry.split("/"))
    if shape == "huge":
        # More than PATH_MAX (4096) bytes, in several spellings.
        how = draw(st.sampled_from(("dots", "names", "one", "entry")))
        if how == "dots":
            return "./" * 2100 + entry
        if how == "names":
            return "/".join(["a"] * 2100)
        if how == "one":
            return "x" * 5000
        return "/".join([entry] * (4200 // max(1, len(entry.encode("utf-8", "surrogatepass"))) + 1))
    if shape == "boundary":
        # Exactly PATH_MAX or PATH_MAX + 1 bytes, padded with "./" (or "/") before a real entry.
        over = draw(st.sampled_from((0, 1)))
        pad = 4096 + over - len(entry.encode("utf-8", "surrogatepass"))
        if pad < 0:
            return entry
        return "./" * (pad // 2) + "/" * (pad % 2) + entry
    # built: prefix + components joined by assorted separators + suffix
    parts = draw(st.lists(component, min_size=1, max_size=6), label="parts")
    out = draw(st.sampled_from(_PREFIXES), label="prefix")
    for i, part in enumerate(parts):
        if i:
            out += draw(st.sampled_from(_SEPARATORS))
        out += part
    return out + draw(st.sampled_from(_SUFFIXES), label="suffix")

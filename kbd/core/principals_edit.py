"""Editing principals.yaml without losing the operator's file. Pure: text in,
text out.

PyYAML cannot round-trip comments, and rewriting the file from its parsed
document drops every comment, blank line and quoting choice the operator made.
So kbd edits the file's lines instead, and only files of the one layout it
understands completely:

    # comments and blank lines anywhere
    principals:            # (or ``principals: []``)
      - id: alice          # a block list of block mappings,
        kind: user         # one ``key: scalar`` per line
        uid: 1000

(the ``- `` may also stand at column 0, as ``yaml.safe_dump`` writes it). A
scalar is plain, 'single-' or "double-quoted", on one line. Anything else —
flow collections, anchors, aliases, tags, block scalars, multi-line scalars,
several documents, directives, tabs, CR line ends — is refused with the line
it stopped at, and nothing is written: the operator makes that change by hand.

Every edit changes only the lines of one entry (or adds one), and is then
checked by parsing the new text with the real loader: the result must equal
the document before with exactly the intended change, in the same key order,
and must itself be a valid principals file. Anything else is a refusal.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, TypeAlias

from kbd.core.layout import PRINCIPALS_NAME
from kbd.core.principals import Principals, parse_principals
from kbd.core.strict import load_yaml
from kbd.errors import InvalidConfig

Scalar: TypeAlias = str | int | bool

_KEY_VALUE = re.compile(r"(?P<key>[A-Za-z_][A-Za-z0-9_]*):(?: +(?P<value>.*))?")
_TOP_KEY = re.compile(r"principals:(?P<rest>.*)")
_ITEM = re.compile(r"(?P<indent> *)-(?P<gap> +)(?P<body>.*)")
# Characters YAML may read as line breaks or byte-order marks: a line-level
# editor cannot know where such a file's lines are, so it refuses them.
_BREAKS = ("\r", "\x85", "\u2028", "\u2029", "\ufeff", "\x0b", "\x0c", "\x00")
# A value starting with one of these is not a plain one-line scalar: an anchor,
# alias, tag, flow collection, block scalar, directive or reserved indicator.
_NOT_PLAIN_START = "&*!{[|>%@`,#"
# Plain only when no YAML reader could take it for a number (``12e45`` is a
# string to PyYAML but a float to YAML 1.2 tools): it starts with a letter or _.
_SIMPLE_PLAIN = re.compile(r"[A-Za-z_][A-Za-z0-9_.@+-]*")


@dataclass(frozen=True)
class KeyLine:
    """One ``key: value`` line of an entry; the value spans columns
    ``[start, end)`` (its quotes included, the trailing comment excluded)."""

    index: int
    key: str
    start: int
    end: int


@dataclass(frozen=True)
class Item:
    """One entry of the list: lines ``[start, end)``, from its ``- `` line to its
    last key line (comments after that belong to whatever follows)."""

    start: int
    end: int
    key_col: int
    keys: tuple[KeyLine, ...]


@dataclass(frozen=True)
class Layout:
    lines: tuple[str, ...]
    final_newline: bool
    key_line: int  # the ``principals:`` line
    empty_flow: bool  # ``principals: []``
    items: tuple[Item, ...]
    entries: tuple[dict[str, Any], ...]  # the real loader's entries, item by item

    def index_of(self, pid: str) -> int | None:
        for i, entry in enumerate(self.entries):
            if entry.get("id") == pid:
                return i
        return None


# -- the edits kbd makes ---------------------------------------------------------------


@dataclass(frozen=True)
class AddEntry:
    fields: tuple[tuple[str, Scalar], ...]


@dataclass(frozen=True)
class SetField:
    pid: str
    key: str
    value: Scalar


@dataclass(frozen=True)
class RemoveEntry:
    pid: str


Edit: TypeAlias = AddEntry | SetField | RemoveEntry


# -- reading the layout ----------------------------------------------------------------


def _refuse(source: str, line: int | None, why: str) -> InvalidConfig:
    where = f"{source} line {line + 1}" if line is not None else source
    return InvalidConfig(
        f"{where}: {why}; kbd edits only a block list of one-line `key: value` entries "
        "(no flow style, anchors, tags, block or multi-line scalars, tabs or extra documents), "
        "so nothing was written",
        hint="make this change by hand, or rewrite the file in the plain layout `kbd init` writes",
    )


def _value_span(line: str, start: int, *, source: str, index: int) -> int:
    """The end column of the one-line scalar at ``line[start:]``; refuses any
    other kind of value or anything but a comment after it."""
    text = line[start:]
    if not text or text[0] in _NOT_PLAIN_START or text[:2] in ("- ", "? ") or text in ("-", "?"):
        raise _refuse(source, index, "a value that is not a one-line scalar")
    if text[0] == "'":
        i = 1
        while True:
            j = text.find("'", i)
            if j < 0:
                raise _refuse(source, index, "a quoted value that does not end on its line")
            if text[j + 1 : j + 2] == "'":
                i = j + 2
                continue
            end = j + 1
            break
    elif text[0] == '"':
        i = 1
        while True:
            if i >= len(text):
                raise _refuse(source, index, "a quoted value that does not end on its line")
            if text[i] == "\\":
                i += 2
                continue
            if text[i] == '"':
                end = i + 1
                break
            i += 1
    else:
        cut = text.find(" #")
        plain = (text if cut < 0 else text[:cut]).rstrip(" ")
        if ": " in plain or plain.endswith(":") or "\t" in plain:
            raise _refuse(source, index, "a value that is not a one-line scalar")
        return start + len(plain)
    rest = text[end:]
    if rest.strip(" ") and not (rest.startswith(" ") and rest.lstrip(" ").startswith("#")):
        raise _refuse(source, index, "text after a quoted value")
    return start + end


def _key_line(line: str, col: int, *, source: str, index: int) -> KeyLine:
    m = _KEY_VALUE.fullmatch(line[col:])
    if m is None or m.group("value") is None:
        raise _refuse(source, index, "a line that is not a one-line `key: value`")
    start = col + m.start("value")
    return KeyLine(index, m.group("key"), start, _value_span(line, start, source=source, index=index))


def _is_noise(line: str) -> bool:
    """A blank or whole-line comment: kept verbatim, never parsed."""
    body = line.lstrip(" ")
    return not body or body.startswith("#")


def _check_characters(text: str, source: str) -> None:
    for bad in _BREAKS:
        if bad in text:
            raise _refuse(source, text[: text.index(bad)].count("\n"), f"character U+{ord(bad):04X}")
    for i, line in enumerate(text.split("\n")):
        if "\t" in line and not line.lstrip(" ").startswith("#"):
            raise _refuse(source, i, "a tab")


def parse_layout(text: str, *, source: str = PRINCIPALS_NAME) -> Layout:
    """The layout of a principals file, or InvalidConfig naming the first line
    kbd cannot edit safely (the real loader's own errors come first: a file
    that is not valid YAML is reported as such)."""
    doc = load_yaml(text, source=source)
    _check_characters(text, source)
    final_newline = text.endswith("\n")
    lines = tuple((text[:-1] if final_newline else text).split("\n")) if text else ()
    key_line: int | None = None
    empty_flow = False
    seen_start = False
    items: list[Item] = []
    current: list[KeyLine] = []
    start = key_col = seq_indent = -1

    def close() -> None:
        if current:
            items.append(Item(start, current[-1].index + 1, key_col, tuple(current)))
            current.clear()

    for i, line in enumerate(lines):
        if _is_noise(line):
            continue
        if key_line is None:
            if line.rstrip(" ") == "---" and not seen_start:
                seen_start = True
                continue
            m = _TOP_KEY.fullmatch(line)
            if m is None:
                raise _refuse(source, i, "expected `principals:` as the file's only top-level key")
            rest = m.group("rest")
            body = rest.split(" #", 1)[0].strip(" ") if not rest.lstrip(" ").startswith("#") else ""
            if rest and not rest.startswith(" "):
                raise _refuse(source, i, "expected `principals:` as the file's only top-level key")
            if body == "[]":
                empty_flow = True
            elif body:
                raise _refuse(source, i, "`principals:` must be followed by a block list (or `[]`)")
            key_line = i
            continue
        if empty_flow:
            raise _refuse(source, i, "text after `principals: []`")
        item = _ITEM.fullmatch(line)
        if item is not None and (seq_indent < 0 or len(item.group("indent")) == seq_indent):
            close()
            seq_indent = len(item.group("indent"))
            start, key_col = i, seq_indent + 1 + len(item.group("gap"))
            current.append(_key_line(line, key_col, source=source, index=i))
            continue
        indent = len(line) - len(line.lstrip(" "))
        if not current or indent != key_col:
            raise _refuse(source, i, "a line outside the list's entries, or indented unlike its entry")
        current.append(_key_line(line, key_col, source=source, index=i))
    close()
    if key_line is None:
        raise _refuse(source, None, "no `principals:` key")
    entries = _entries(doc, source)
    if len(entries) != len(items) or any(
        list(entry) != [k.key for k in item.keys] for entry, item in zip(entries, items, strict=False)
    ):
        raise _refuse(source, None, "its lines and its parsed entries disagree")
    return Layout(lines, final_newline, key_line, empty_flow, tuple(items), tuple(entries))


def _entries(doc: object, source: str) -> list[dict[str, Any]]:
    if not isinstance(doc, dict) or list(doc) != ["principals"] or not isinstance(doc["principals"], list):
        raise _refuse(source, None, "the document is not one `principals:` list")
    entries = doc["principals"]
    if not all(isinstance(e, dict) for e in entries):
        raise _refuse(source, None, "an entry that is not a mapping")
    return entries


# -- writing values ----------------------------------------------------------------------


def render_scalar(value: Scalar) -> str:
    """``value`` as YAML the real loader reads back as exactly ``value``: plain
    when that is unambiguous (``alice``, ``1000``, ``true``), else a JSON string
    (a valid YAML double-quoted scalar: ``"1e3"``, ``"yes"``, ``"Ops team"``)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if _SIMPLE_PLAIN.fullmatch(value) and load_yaml(f"k: {value}\n", source="value") == {"k": value}:
        return value
    return json.dumps(value, ensure_ascii=False)


def _entry_lines(fields: tuple[tuple[str, Scalar], ...], *, seq_indent: int, key_col: int) -> list[str]:
    head = " " * seq_indent + "-" + " " * (key_col - seq_indent - 1)
    return [
        (head if n == 0 else " " * key_col) + f"{key}: {render_scalar(value)}"
        for n, (key, value) in enumerate(fields)
    ]


def _with_key_line(line: str, rest: str) -> str:
    """The ``principals:`` line with another value, its comment kept."""
    m = _TOP_KEY.fullmatch(line)
    assert m is not None
    comment = m.group("rest").split("#", 1)
    return f"principals:{rest}" + (f"  #{comment[1]}" if len(comment) == 2 else "")


def _render(layout: Layout, edit: Edit) -> tuple[list[str], list[dict[str, Any]]]:
    """The new lines and the entries the loader must read from them."""
    lines = list(layout.lines)
    entries = [dict(e) for e in layout.entries]
    if isinstance(edit, AddEntry):
        entries.append(dict(edit.fields))
        if layout.items:
            first, last = layout.items[0], layout.items[-1]
            seq_indent = len(lines[first.start]) - len(lines[first.start].lstrip(" "))
            lines[last.end : last.end] = _entry_lines(
                edit.fields, seq_indent=seq_indent, key_col=first.key_col
            )
        else:
            lines[layout.key_line] = _with_key_line(lines[layout.key_line], "")
            at = layout.key_line + 1
            lines[at:at] = _entry_lines(edit.fields, seq_indent=0, key_col=2)
        return lines, entries
    index = layout.index_of(edit.pid)
    assert index is not None, edit
    item = layout.items[index]
    if isinstance(edit, RemoveEntry):
        del entries[index]
        del lines[item.start : item.end]
        if not entries:
            lines[layout.key_line] = _with_key_line(lines[layout.key_line], " []")
        return lines, entries
    entries[index][edit.key] = edit.value
    rendered = render_scalar(edit.value)
    for k in item.keys:
        if k.key == edit.key:
            lines[k.index] = lines[k.index][: k.start] + rendered + lines[k.index][k.end :]
            return lines, entries
    lines[item.end : item.end] = [" " * item.key_col + f"{edit.key}: {rendered}"]
    return lines, entries


def _plain(value: object) -> object:
    """A document with its mappings' key order made comparable."""
    if isinstance(value, dict):
        return [(k, _plain(v)) for k, v in value.items()]
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return (type(value).__name__, value)


def apply_edit(layout: Layout, edit: Edit, *, source: str = PRINCIPALS_NAME) -> tuple[str, Principals]:
    """The new file text for ``edit`` and the principals it holds, checked with
    the real loader: the new document must be exactly the old one with this
    change (same entries, keys, order and values elsewhere), a valid principals
    file, and again of the layout kbd can edit. InvalidConfig otherwise."""
    lines, expected = _render(layout, edit)
    text = "\n".join(lines) + ("\n" if layout.final_newline or not lines else "")
    try:
        after = parse_layout(text, source=source)
        principals = parse_principals({"principals": list(after.entries)}, source=source)
    except InvalidConfig as err:
        raise _refuse(
            source, None, f"the edited file would not read back as intended ({err.message})"
        ) from None
    if _plain(list(after.entries)) != _plain(expected):
        raise _refuse(source, None, "the edited file would not read back as intended")
    return text, principals

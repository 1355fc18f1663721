"""The principals.yaml line editor (docs/multi-user.md "Principals"): an edit changes only the
lines of its entry, every comment, blank line, key order and quoting elsewhere
stays byte-identical, the result reads back (with the real loader) as exactly
the intended change, and any layout the editor does not understand is refused."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from kbd.core.principals_edit import (
    AddEntry,
    Edit,
    Layout,
    RemoveEntry,
    SetField,
    apply_edit,
    parse_layout,
    render_scalar,
)
from kbd.errors import InvalidConfig

OPERATOR_FILE = """\
# Principals of this host (hand-kept; kbd edits it in place)

principals:
  # --- people ---
  - id: alice          # Alice Liddell
    kind: user
    uid: 1000

  - id: 'ops'
    admin: true        # on call
    uid: 0
    label: "Ops team"

  # --- services ---
  - id: exec-host
    kind: service
# end of list
"""
HASH = hashlib.sha256(b"t").hexdigest()
HASH2 = hashlib.sha256(b"u").hexdigest()


def _edit(text: str, edit: Edit) -> str:
    new_text, _ = apply_edit(parse_layout(text), edit)
    return new_text


def test_golden_every_edit_keeps_every_comment_blank_line_and_order() -> None:
    text = _edit(
        OPERATOR_FILE, AddEntry((("id", "carol"), ("kind", "user"), ("uid", 1002), ("label", "Carol C.")))
    )
    assert text == OPERATOR_FILE.replace(
        "    kind: service\n",
        '    kind: service\n  - id: carol\n    kind: user\n    uid: 1002\n    label: "Carol C."\n',
    )
    text = _edit(text, SetField("alice", "disabled", True))
    assert "    uid: 1000\n    disabled: true\n\n  - id: 'ops'" in text
    text = _edit(text, SetField("alice", "disabled", False))
    assert "    uid: 1000\n    disabled: false\n\n  - id: 'ops'" in text
    text = _edit(text, SetField("exec-host", "token_sha256", HASH))
    text = _edit(text, SetField("exec-host", "token_sha256", HASH2))  # rotated in place
    text = _edit(text, SetField("ops", "admin", False))  # the value changes, its comment stays
    text = _edit(text, RemoveEntry("alice"))
    assert (
        text
        == f"""\
# Principals of this host (hand-kept; kbd edits it in place)

principals:
  # --- people ---

  - id: 'ops'
    admin: false        # on call
    uid: 0
    label: "Ops team"

  # --- services ---
  - id: exec-host
    kind: service
    token_sha256: {render_scalar(HASH2)}
  - id: carol
    kind: user
    uid: 1002
    label: "Carol C."
# end of list
"""
    )


def test_the_layout_kbd_init_and_yaml_safe_dump_write_is_editable() -> None:
    text = yaml.safe_dump(
        {"principals": [{"id": "root", "kind": "user", "admin": True, "uid": 0}]}, sort_keys=False
    )
    text = _edit(text, AddEntry((("id", "bob"), ("kind", "user"), ("uid", 1001))))
    assert (
        text
        == "principals:\n- id: root\n  kind: user\n  admin: true\n  uid: 0\n- id: bob\n  kind: user\n  uid: 1001\n"
    )
    assert _edit(_edit(text, RemoveEntry("bob")), RemoveEntry("root")) == "principals: []\n"


def test_an_empty_list_gets_its_first_entry_and_keeps_its_comment() -> None:
    text = "# nobody yet\nprincipals: []   # add with kbd principals add\n"
    assert _edit(text, AddEntry((("id", "a"), ("uid", 5)))) == (
        "# nobody yet\nprincipals:  # add with kbd principals add\n- id: a\n  uid: 5\n"
    )


def test_a_file_without_a_final_newline_stays_without_one() -> None:
    assert (
        _edit("principals:\n- id: a", SetField("a", "disabled", True))
        == "principals:\n- id: a\n  disabled: true"
    )


@pytest.mark.parametrize(
    ("value", "rendered"),
    [("alice", "alice"), ("yes", '"yes"'), ("1000", '"1000"'), ("12e45", '"12e45"'), ("null", '"null"'),
     ("Ops team", '"Ops team"'), ('say "hi" # now', '"say \\"hi\\" # now"'), ("Zoë", '"Zoë"'), (True, "true"),
     (7, "7"), (HASH, HASH if HASH[0].isalpha() else f'"{HASH}"')],
)  # fmt: skip
def test_values_are_written_so_the_loader_reads_them_back_exactly(value: Any, rendered: str) -> None:
    assert render_scalar(value) == rendered
    assert yaml.safe_load(f"k: {rendered}") == {"k": value}


REFUSED = {
    "flow list": ("principals: [{id: a}]\n", 1),
    "flow mapping entry": ("principals:\n  - {id: a}\n", 2),
    "anchor": ("principals:\n  - &x id: a\n", 2),
    "alias value": ("principals:\n  - id: &x a\n    label: *x\n", 2),
    "tag": ("principals:\n  - id: a\n    kind: !!str user\n", 3),
    "block scalar": ("principals:\n  - id: a\n    label: |\n      x\n", 3),
    "folded multi-line plain": ("principals:\n  - id: a\n    label: one\n      two\n", 4),
    "multi-line quoted": ('principals:\n  - id: a\n    label: "one\n      two"\n', 3),
    "tab in indentation of a comment-free line": ("principals:\n  - id: a\n    label: x\ty\n", 3),
    "CRLF": ("principals:\r\n  - id: a\r\n", 1),
    "BOM": ("\ufeffprincipals:\n  - id: a\n", 1),
    "dash on its own line": ("principals:\n  -\n    id: a\n", 2),
    "quoted key": ('principals:\n  - "id": a\n', 2),
    "explicit document end": ("principals:\n  - id: a\n...\n", 3),
    "directive": ("%YAML 1.1\n---\nprincipals:\n  - id: a\n", 1),
    "uneven keys": ("principals:\n  - id: a\n     kind: user\n", None),
    "text after a quoted value": ("principals:\n  - id: 'a' b\n", None),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_layouts_it_cannot_edit_safely_are_refused_naming_the_line(case: str) -> None:
    text, line = REFUSED[case]
    with pytest.raises(InvalidConfig) as info:
        parse_layout(text)
    if line is not None and "not valid YAML" not in info.value.message:
        assert info.value.message.startswith(f"principals.yaml line {line}: "), info.value.message
        assert "nothing was written" in info.value.message


def test_a_valid_file_that_is_not_a_principals_list_is_refused() -> None:
    for text in ("principals:\n  - id: a\nother: 1\n", "principals:\n  - - a\n", "- id: a\n"):
        with pytest.raises(InvalidConfig):
            parse_layout(text)


def test_an_edit_that_would_make_the_file_invalid_is_refused() -> None:
    layout = parse_layout("principals:\n- id: a\n  uid: 1\n- id: b\n")
    with pytest.raises(InvalidConfig, match="would not read back as intended"):
        apply_edit(layout, SetField("b", "uid", 1))  # a duplicate uid: the real loader refuses it
    with pytest.raises(InvalidConfig, match="would not read back as intended"):
        apply_edit(layout, SetField("b", "kind", "robot"))


# -- the property: any file of the supported shape, any edit -------------------------------------

KEYS = ("kind", "admin", "disabled", "uid", "label", "token_sha256")
IDS = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-_.@", min_size=1, max_size=12).filter(
    lambda s: s not in (".", "..")
)
LABELS = st.text(
    alphabet=st.characters(
        codec="utf-8", categories=["L", "N", "P", "S", "Zs"], exclude_characters="\u00a0\u2028\u2029"
    ),
    min_size=1,
    max_size=30,
).filter(lambda s: s.strip() and not any(c.isspace() and c != " " for c in s))


def _scalar_text(value: str | int | bool, style: str) -> str:
    if isinstance(value, bool):
        return ("true", "True", "yes")[["plain", "single", "double"].index(style)] if value else "false"
    if isinstance(value, int):
        return str(value)
    if style == "plain":
        try:
            ok = yaml.safe_load(f"k: {value}") == {"k": value} and " #" not in value and ": " not in value
        except yaml.YAMLError:
            ok = False
        if ok and value[:1] not in "&*!{[|>%@`,#'\"-?" and value == value.strip():
            return value
    if style == "single":
        return "'" + value.replace("'", "''") + "'"
    return json.dumps(value, ensure_ascii=False)


@st.composite
def principal_files(draw: st.DrawFn) -> tuple[str, list[dict[str, Any]]]:
    ids = draw(st.lists(IDS, min_size=0, max_size=5, unique=True))
    uids = draw(st.lists(st.integers(0, 70000), min_size=len(ids), max_size=len(ids), unique=True))
    seq_indent = draw(st.sampled_from([0, 2, 4]))
    gap = draw(st.integers(1, 3))
    comment = st.sampled_from(["", "  # note", " # x: y", "   #"])
    noise = st.lists(st.sampled_from(["", "# c", "  # indented", "      # deep", "   "]), max_size=2)
    lines: list[str] = draw(noise)
    if draw(st.booleans()):
        lines.append("---")
    entries: list[dict[str, Any]] = []
    if not ids:
        lines.append("principals: []" + draw(comment))
    else:
        lines.append("principals:" + draw(comment))
    for pid, uid in zip(ids, uids, strict=True):
        keys = draw(st.lists(st.sampled_from(KEYS), unique=True, max_size=4))
        values: dict[str, Any] = {"id": pid}
        for k in keys:
            values[k] = {
                "kind": draw(st.sampled_from(["user", "service"])),
                "admin": draw(st.booleans()),
                "disabled": draw(st.booleans()),
                "uid": uid,
                "label": draw(LABELS),
                "token_sha256": hashlib.sha256(pid.encode()).hexdigest(),
            }[k]
        order = draw(st.permutations(list(values)))
        entry = {k: values[k] for k in order}
        entries.append(entry)
        key_col = seq_indent + 1 + gap
        for n, k in enumerate(order):
            head = " " * seq_indent + "-" + " " * gap if n == 0 else " " * key_col
            style = draw(st.sampled_from(["plain", "single", "double"]))
            lines.append(f"{head}{k}: {_scalar_text(entry[k], style)}{draw(comment)}")
            lines += draw(noise)
    text = "\n".join(lines) + ("\n" if draw(st.booleans()) else "")
    assert yaml.safe_load(text) == {"principals": entries}, text  # the generator writes what it means
    return text, entries


@st.composite
def edits(draw: st.DrawFn, entries: list[dict[str, Any]]) -> tuple[Edit, list[dict[str, Any]]]:
    expected = [dict(e) for e in entries]
    kinds = ["add"] + (["set", "remove"] if entries else [])
    kind = draw(st.sampled_from(kinds))
    if kind == "add":
        pid = draw(IDS.filter(lambda s: all(e["id"] != s for e in entries)))
        uid = draw(st.integers(70001, 80000))
        fields: list[tuple[str, Any]] = [
            ("id", pid),
            ("kind", draw(st.sampled_from(["user", "service"]))),
            ("uid", uid),
        ]
        if draw(st.booleans()):
            fields.append(("label", draw(LABELS)))
        expected.append(dict(fields))
        return AddEntry(tuple(fields)), expected
    index = draw(st.integers(0, len(entries) - 1))
    pid = entries[index]["id"]
    if kind == "remove":
        del expected[index]
        return RemoveEntry(pid), expected
    choices: list[tuple[str, str | int | bool]] = [
        ("disabled", True), ("disabled", False), ("admin", True), ("label", draw(LABELS)),
        ("token_sha256", hashlib.sha256(draw(IDS).encode()).hexdigest()),
    ]  # fmt: skip
    key, value = draw(st.sampled_from(choices))
    expected[index][key] = value
    return SetField(pid, key, value), expected


def _changed_span(layout: Layout, edit: Edit) -> tuple[int, int]:
    """The old lines an edit may touch: its entry (add: none but the list's key line)."""
    if isinstance(edit, AddEntry):
        at = layout.items[-1].end if layout.items else layout.key_line + 1
        return (at, at) if layout.items else (layout.key_line, at)
    index = layout.index_of(edit.pid)
    assert index is not None
    item = layout.items[index]
    touched_key = layout.key_line if isinstance(edit, RemoveEntry) and len(layout.items) == 1 else item.start
    return min(touched_key, item.start), item.end


def _only_the_value_changed(layout: Layout, edit: SetField, old: list[str], new: list[str]) -> None:
    """Inside the entry too: one value replaced (the key, spacing and comment
    around it kept), or one line added after the entry's last key."""
    index = layout.index_of(edit.pid)
    assert index is not None
    item = layout.items[index]
    found = [k for k in item.keys if k.key == edit.key]
    if not found:
        assert new[item.start : item.end] == old[item.start : item.end]
        assert new[item.end] == " " * item.key_col + f"{edit.key}: {render_scalar(edit.value)}"
        return
    key = found[0]
    for i in range(item.start, item.end):
        if i != key.index:
            assert new[i] == old[i]
    line = old[key.index]
    assert new[key.index] == line[: key.start] + render_scalar(edit.value) + line[key.end :]


@given(data=st.data(), file=principal_files())
def test_any_edit_of_any_supported_file_reads_back_as_exactly_that_edit(
    data: st.DataObject, file: tuple[str, list[dict[str, Any]]]
) -> None:
    text, entries = file
    layout = parse_layout(text)
    assert list(layout.entries) == entries
    edit, expected = data.draw(edits(entries))
    new_text, principals = apply_edit(layout, edit)
    after = yaml.safe_load(new_text)
    assert after == {"principals": expected}
    assert [list(e) for e in after["principals"]] == [list(e) for e in expected]  # key order too
    assert [p.id for p in principals] == [e["id"] for e in expected]
    # Byte-identical outside the changed entry.
    old, new = text.split("\n"), new_text.split("\n")
    lo, hi = _changed_span(layout, edit)
    assert new[:lo] == old[:lo]
    assert new[len(new) - (len(old) - hi) :] == old[hi:]
    if isinstance(edit, SetField):
        _only_the_value_changed(layout, edit, old, new)
    # And the result is again a file kbd can edit.
    assert list(parse_layout(new_text).entries) == expected

"""IDs are plain (docs/on-disk.md "IDs"): workflow and principal IDs hold no
control (Cc, C1 included), format (Cf), line/paragraph-separator (Zl, Zp) or
whitespace character anywhere; the error names the character by code point; an
on-disk manifest with such an ID is ``manifest_unreadable`` with that message;
and every ID kbd prints goes through the one-line escaper.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from kbd.core.identifiers import id_problem, one_line
from kbd.errors import InvalidConfig
from kbd.fs.rootconfig import load_principals
from tests.helpers import KbRoot

#: Each one looks like (or breaks a line next to) the plain ID ``wf_rts``.
BAD_IDS: dict[str, str] = {
    "zero-width-space": "wf_rts\u200b",
    "zero-width-joiner": "wf_\u200drts",
    "bom": "\ufeffwf_rts",
    "c1-nel": "wf_rts\u0085",
    "c1-csi": "wf\u009b31mrts",
    "line-separator": "wf_rts\u2028x",
    "paragraph-separator": "wf_rts\u2029x",
    "bidi-override": "wf_\u202erts",
    "bidi-isolate": "\u2066wf_rts\u2069",
    "tab": "wf\trts",
    "inner-space": "wf rts",
    "trailing-space": "wf_rts ",
    "no-break-space": "wf\u00a0rts",
    "ideographic-space": "wf\u3000rts",
    "newline": "wf_rts\nWORKFLOW_KB_X=1",
    "del": "wf_rts\x7f",
}


def first_bad(value: str) -> str:
    """``U+XXXX`` of the first character the rule refuses (what the error must name)."""
    import unicodedata

    for ch in value:
        if unicodedata.category(ch) in ("Cc", "Cf", "Zl", "Zp") or ch.isspace():
            return f"U+{ord(ch):04X}"
    raise AssertionError(f"{value!r} holds no refused character")


@pytest.mark.parametrize("case", sorted(BAD_IDS))
def test_id_rule_refuses_and_names_the_character(case: str) -> None:
    value = BAD_IDS[case]
    problem = id_problem(value)
    assert problem is not None
    assert first_bad(value) in problem, problem
    # The message itself is plain: it never carries the invisible character.
    assert one_line(problem, limit=10_000) == problem


@pytest.mark.parametrize("value", ["wf_rts", "Wf-RTS.2", "é😀", "a" * 128, "日本"])
def test_plain_ids_stay_valid(value: str) -> None:
    assert id_problem(value) is None


@pytest.mark.parametrize("case", ["zero-width-space", "c1-nel", "line-separator", "bidi-override", "tab"])
def test_principal_ids_follow_the_same_rule(tmp_path: Path, case: str) -> None:
    f = tmp_path / "principals.yaml"
    f.write_text(yaml.safe_dump({"principals": [{"id": "alice"}, {"id": BAD_IDS[case]}]}))
    with pytest.raises(InvalidConfig) as info:
        load_principals(tmp_path)
    assert "principals[1].id" in info.value.message and first_bad(BAD_IDS[case]) in info.value.message


# -- through the CLI -----------------------------------------------------------------------


@pytest.fixture
def world(kb: KbRoot) -> KbRoot:
    owners = {"owners": ["alice"]}
    kb.workflow("wf_rts", label="RTS platform", access=owners)
    kb.workflow("con", label="Consumer", access=owners, sources=[])
    return kb


def manifest_bytes(kb: KbRoot) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in sorted(kb.workflows.rglob("workflow.json"))}


@pytest.mark.parametrize(
    "case", ["zero-width-space", "c1-nel", "c1-csi", "line-separator", "bidi-override", "tab", "inner-space"]
)
def test_attach_refuses_an_unplain_id_naming_the_character(world: KbRoot, case: str) -> None:
    before = manifest_bytes(world)
    r = world.call("sources", "attach", "con", BAD_IDS[case], "--alias", "rts", "--as", "alice")
    assert r.code == 65, (r.code, r.err)
    first = r.err.splitlines()[0]
    assert first.startswith("error[") and first_bad(BAD_IDS[case]) in first, r.err
    assert manifest_bytes(world) == before


@pytest.mark.parametrize("case", ["zero-width-space", "c1-nel", "line-separator", "bidi-override", "tab"])
def test_validate_refuses_an_unplain_manifest_id(world: KbRoot, tmp_path: Path, case: str) -> None:
    f = tmp_path / "workflow.json"
    f.write_text(json.dumps({"id": BAD_IDS[case], "label": "RTS platform"}))
    r = world.call("validate", str(f))
    assert r.code == 65, (r.code, r.err)
    # A field's problem is one line of the list on stdout (every problem listed, not only the first).
    assert r.err.startswith("error[invalid-input]: ") and f"{f}: id " in r.out, (r.out, r.err)
    assert first_bad(BAD_IDS[case]) in r.out, r.out


@pytest.mark.parametrize("case", ["zero-width-space", "c1-nel", "line-separator", "bidi-override", "tab"])
def test_an_on_disk_manifest_with_an_unplain_id_is_unreadable_and_never_a_candidate(
    world: KbRoot, case: str
) -> None:
    bad = BAD_IDS[case]
    world.workflow(bad, folder="impostor", label="RTS platform", access={"owners": ["alice"]})
    r = world.call("workflows", "list", "--json", "--as", "ops")
    assert r.code == 0, r.err
    (row,) = [w for w in r.json()["workflows"] if w["path"].endswith("/impostor")]
    assert row["status"] == "manifest_unreadable"
    assert first_bad(bad) in row["problem"], row
    r = world.call("sources", "candidates", "con", "--as", "alice")
    assert r.code == 0, r.err
    assert [line.split()[0] for line in r.out.splitlines()] == ["wf_rts"], r.out
    r = world.call("sources", "attach", "con", bad, "--alias", "rts", "--as", "alice")
    assert r.code == 65, r.err


def test_one_line_escapes_exactly_control_format_and_line_separators() -> None:
    """The fast path (str.isprintable) and the per-character rule agree on every
    code point: Cc, Cf, Zl and Zp are escaped, everything else is shown as is."""
    import unicodedata

    from kbd.core.identifiers import one_line

    # The BMP and the supplementary multilingual plane, plus the tag characters
    # (format characters far up in plane 14) and the last code points.
    for cp in [*range(0x20000), *range(0xE0000, 0xE0080), *range(0x10FFF0, 0x110000)]:
        if 0xD800 <= cp <= 0xDFFF:
            continue
        ch = chr(cp)
        escaped = unicodedata.category(ch) in ("Cc", "Cf", "Zl", "Zp")
        expected = "a" + (ch.encode("unicode_escape").decode("ascii") if escaped else ch) + "b"
        assert one_line("a" + ch + "b") == expected, hex(cp)

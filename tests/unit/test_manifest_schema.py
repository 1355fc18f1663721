"""workflow.json's JSON Schema (kbd/core/manifest_schema.py) against `kbd validate`'s
own rules: the schema refuses nothing kbd accepts, and everything it refuses kbd
refuses too, for documents built to break each rule (hypothesis). The published
copy, docs/workflow.schema.json, is exactly what `kbd validate --schema` prints."""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kbd.core.manifest import field_problems, manifest_document, parse_manifest
from kbd.core.manifest_schema import ONLY_KBD, schema_text, workflow_schema
from kbd.service.admin import manifest_problems

REPO = Path(__file__).resolve().parents[2]
VALIDATOR = jsonschema.Draft202012Validator(workflow_schema())


def kbd_problems(doc: dict[str, Any]) -> list[str]:
    """What `kbd validate` says of ``doc`` (kbd/service/admin.py validate, without the file)."""
    data = json.dumps(doc).encode()
    parsed = manifest_document(data)
    if problems := field_problems(parsed):
        return problems
    return manifest_problems(parse_manifest(data))


def schema_problems(doc: dict[str, Any]) -> list[str]:
    return [e.message for e in VALIDATOR.iter_errors(doc)]


def test_the_schema_is_a_valid_2020_12_schema_and_published_as_printed() -> None:
    jsonschema.Draft202012Validator.check_schema(workflow_schema())
    assert (REPO / "docs" / "workflow.schema.json").read_text() == schema_text(), (
        "docs/workflow.schema.json is stale: kbd validate --schema > docs/workflow.schema.json"
    )
    assert all(rule in workflow_schema()["description"] for rule in ONLY_KBD)


def mostly(valid: st.SearchStrategy[Any], invalid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Valid four times in five: a document then breaks one rule or two, not all of them at once."""
    return st.one_of(valid, valid, valid, valid, invalid)


GOOD_IDS = st.sampled_from(["wf_a", "wf-b", "Team.Research", "écrits", "x" * 128, "w1", "w2", "w3"])
BAD_IDS = st.one_of(
    st.sampled_from(
        [
            "",
            " ",
            "a b",
            "a/b",
            "a\\b",
            ".",
            "..",
            "x" * 129,
            "a\tb",
            "a\u2028b",
            "a\x85b",
            "a\x1cb",
            "a\u200bb",
            "a\x07b",
        ]
    ),  # each rule, the ones only kbd checks too
    st.integers(),
    st.none(),
    st.lists(st.just("x"), max_size=1),
)
IDS = mostly(GOOD_IDS, BAD_IDS)
ALIASES = mostly(
    st.sampled_from(["rts", "a", "a_1", "z" * 48, "b", "c"]),
    st.one_of(st.sampled_from(["", "A", "1a", "a-b", "z" * 49, "access", "é"]), st.integers()),
)
ENTRY = mostly(
    st.fixed_dictionaries(
        {"workflow_id": GOOD_IDS, "alias": ALIASES},
        optional={"access": mostly(st.sampled_from(["read", "write"]), st.sampled_from(["admin", None]))},
    ),
    st.dictionaries(
        st.sampled_from(["workflow_id", "alias", "access", "path"]),
        st.one_of(IDS, ALIASES, st.sampled_from(["read", "write", "admin", None])),
        max_size=4,
    ),
)
FOLDER = mostly(
    st.fixed_dictionaries(
        {"alias": ALIASES, "path": st.sampled_from(["/srv/x", "/srv/y/z"])},
        optional={"access": st.sampled_from(["read_only", "read_write"])},
    ),
    st.dictionaries(
        st.sampled_from(["alias", "path", "access", "mode"]),
        st.one_of(
            ALIASES,
            st.sampled_from(
                ["/srv/x", "relative", "/a/../b", "/a\x00b", "read_only", "read_write", "rw", None]
            ),
        ),
        max_size=4,
    ),
)
MANY = [{"workflow_id": f"w{i}", "alias": f"a{i}"} for i in range(21)]
LISTS = mostly(
    st.lists(IDS, max_size=4, unique_by=lambda x: json.dumps(x)),
    st.one_of(
        st.none(),
        st.just("owner"),
        st.just([f"w{i}" for i in range(51)]),
        st.lists(GOOD_IDS, min_size=2, max_size=3),
    ),
)
ACCESS = mostly(
    st.fixed_dictionaries(
        {},
        optional={
            "owners": LISTS,
            "editors": LISTS,
            "readers": LISTS,
            "allowed_kb_writers": LISTS,
            "commenters": LISTS,
        },
    ),
    st.one_of(st.none(), st.just("public")),
)
DOCS = st.fixed_dictionaries(
    {"id": IDS},
    optional={
        "label": mostly(st.one_of(st.none(), st.text(max_size=5)), st.integers()),
        "host": mostly(st.one_of(st.none(), st.just("h1")), st.booleans()),
        "created_by": mostly(st.one_of(st.none(), st.just("alice")), st.integers()),
        "access": ACCESS,
        "knowledgebase_sources": mostly(
            st.lists(ENTRY, max_size=3), st.one_of(st.none(), st.just({}), st.just(MANY))
        ),
        "folder_access": mostly(st.lists(FOLDER, max_size=3), st.one_of(st.none(), st.just("x"))),
        "x_custom": st.just({"kept": True}),
    },
)


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(DOCS)
def test_the_schema_refuses_nothing_kbd_accepts_and_kbd_refuses_all_it_refuses(doc: dict[str, Any]) -> None:
    ours, theirs = kbd_problems(doc), schema_problems(doc)
    if not ours:
        assert not theirs, f"the schema refuses what kbd validate accepts: {theirs}"
    if theirs:
        assert ours, f"kbd validate accepts what the schema refuses: {theirs}"
    if not breaks_only_kbd_rules(doc):
        # Where the schema can say it, it says all of it: the same verdict.
        assert bool(ours) == bool(theirs), (ours, theirs)


def breaks_only_kbd_rules(doc: dict[str, Any]) -> bool:
    """Whether ``doc`` breaks one of the rules only kbd checks (ONLY_KBD)."""

    def ids(value: Any) -> list[Any]:
        return value if isinstance(value, list) else []

    strings = [doc.get("id")]
    access = doc.get("access")
    if isinstance(access, dict):
        strings += [x for tier in access.values() for x in ids(tier)]
        if doc.get("id") in ids(access.get("allowed_kb_writers")):
            return True
    entries = [e for e in ids(doc.get("knowledgebase_sources")) if isinstance(e, dict)]
    strings += [e.get("workflow_id") for e in entries]
    for key in ("alias", "workflow_id"):
        seen = [e[key] for e in entries if key in e]
        if len(seen) != len({json.dumps(v) for v in seen}):
            return True
    if any(e.get("workflow_id") == doc.get("id") for e in entries):
        return True
    folders = [f for f in ids(doc.get("folder_access")) if isinstance(f, dict)]
    aliases = [json.dumps(f.get("alias")) for f in folders if "alias" in f]
    if len(aliases) != len(set(aliases)) or any("/../" in f"{f.get('path')}/" for f in folders):
        return True
    # An ID character of a category the schema's pattern cannot name (control, format, separator).
    return any(
        isinstance(x, str)
        and any(unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp") and not c.isspace() for c in x)
        for x in strings
    )


def test_what_only_kbd_checks_is_refused_by_kbd_and_passed_by_the_schema() -> None:
    base = {"id": "wf", "access": {"owners": ["alice"]}}
    for extra in (
        {"knowledgebase_sources": [{"workflow_id": "a", "alias": "x"}, {"workflow_id": "b", "alias": "x"}]},
        {"knowledgebase_sources": [{"workflow_id": "a", "alias": "x"}, {"workflow_id": "a", "alias": "y"}]},
        {"knowledgebase_sources": [{"workflow_id": "wf", "alias": "me"}]},
        {"access": {"owners": ["alice"], "allowed_kb_writers": ["wf"]}},
        {"folder_access": [{"alias": "f", "path": "/srv/a/../b"}]},
        {"folder_access": [{"alias": "f", "path": "/srv/a"}, {"alias": "f", "path": "/srv/b"}]},
        {"id": "a\x07b"},  # a control character that is no whitespace
        {"id": "a\u200bb"},  # a zero-width space: a format character, no whitespace
    ):
        doc = {**base, **extra}
        assert kbd_problems(doc) and not schema_problems(doc), doc


VALID: dict[str, Any] = {
    "id": "wf_main",
    "label": "Main",
    "host": "h1",
    "created_by": "alice",
    "access": {
        "owners": ["alice"],
        "editors": ["carol"],
        "readers": ["bob"],
        "allowed_kb_writers": ["wf_x"],
        "commenters": ["dave"],
    },
    "knowledgebase_sources": [
        {"workflow_id": "wf_src", "alias": "src", "access": "write"},
        {"workflow_id": "wf_lib", "alias": "lib"},
    ],
    "folder_access": [{"alias": "data", "path": "/srv/data", "access": "read_write"}],
    "x_custom": {"kept": [1, 2]},
}


def _set(doc: dict[str, Any], path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(json.dumps(doc))
    cur = out
    for key in path[:-1]:
        cur = cur[key]
    if value is DELETE:
        del cur[path[-1]]
    else:
        cur[path[-1]] = value
    return out


DELETE = object()
SRC = ("knowledgebase_sources",)
# Each rule broken alone, as (where, bad value): both refuse it.
BOTH = [
    (("id",), DELETE),
    (("id",), ""),
    (("id",), 7),
    (("id",), "a b"),
    (("id",), "a/b"),
    (("id",), ".."),
    (("id",), "x" * 129),
    (("id",), "a\u2028b"),
    (("label",), 1),
    (("host",), False),
    (("created_by",), []),
    (("access",), "public"),
    (("access", "owners"), "alice"),
    (("access", "readers"), [1]),
    (("access", "editors"), ["a b"]),
    (("access", "allowed_kb_writers"), "wf_x"),
    (("access", "allowed_kb_writers"), ["wf_x", "wf_x"]),
    (("access", "allowed_kb_writers"), ["../x"]),
    (("access", "allowed_kb_writers"), [f"w{i}" for i in range(51)]),
    (SRC, {}),
    (SRC, "wf_src"),
    (SRC, [[]]),
    ((*SRC, 0, "alias"), "access"),
    ((*SRC, 0, "alias"), "Src"),
    ((*SRC, 0, "alias"), "z" * 49),
    ((*SRC, 0, "alias"), DELETE),
    ((*SRC, 0, "workflow_id"), DELETE),
    ((*SRC, 0, "workflow_id"), "../wf"),
    ((*SRC, 0, "access"), "admin"),
    ((*SRC, 0, "access"), None),
    ((*SRC, 0, "path"), "/srv"),
    (SRC, [{"workflow_id": f"w{i}", "alias": f"a{i}"} for i in range(21)]),
    (("folder_access",), "x"),
    (("folder_access", 0, "path"), "relative"),
    (("folder_access", 0, "path"), DELETE),
    (("folder_access", 0, "access"), "rw"),
    (("folder_access", 0, "mode"), "x"),
    (("folder_access", 0, "alias"), "A"),
    (("folder_access",), [{"alias": f"f{i}", "path": "/srv/x"} for i in range(21)]),
]
# Broken rules only kbd checks (ONLY_KBD): the schema lets them pass.
KBD_ONLY = [
    (("id",), "a\x07b"),
    (("id",), "a\u200bb"),
    ((*SRC, 1, "alias"), "src"),
    ((*SRC, 1, "workflow_id"), "wf_src"),
    ((*SRC, 0, "workflow_id"), "wf_main"),
    (("access", "allowed_kb_writers"), ["wf_main"]),
    (("folder_access", 0, "path"), "/srv/a/../b"),
    (("folder_access",), [{"alias": "d", "path": "/srv/a"}, {"alias": "d", "path": "/srv/b"}]),
]


def test_a_valid_document_passes_both() -> None:
    assert kbd_problems(VALID) == [] and schema_problems(VALID) == []


def _ids(cases: list[tuple[tuple[Any, ...], Any]]) -> list[str]:
    """Stable test IDs (the same in every xdist worker: no object address)."""
    return [f"{'.'.join(map(str, w))}={'<deleted>' if v is DELETE else repr(v)[:30]}" for w, v in cases]


@pytest.mark.parametrize(("where", "value"), BOTH, ids=_ids(BOTH))
def test_each_rule_the_schema_states_is_refused_by_both(where: tuple[Any, ...], value: Any) -> None:
    doc = _set(VALID, where, value)
    assert kbd_problems(doc), doc
    assert schema_problems(doc), f"the schema lets {where}={value!r} pass, which kbd validate refuses"


@pytest.mark.parametrize(("where", "value"), KBD_ONLY, ids=_ids(KBD_ONLY))
def test_each_rule_only_kbd_states_is_refused_by_kbd_alone(where: tuple[Any, ...], value: Any) -> None:
    doc = _set(VALID, where, value)
    assert kbd_problems(doc) and not schema_problems(doc), doc

"""kbd.core.records: a result's JSON, its reading back and its schema, from its fields alone."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import jsonschema
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kbd.core.records import REF_PREFIX, JsonValue, Record, key, refs_under
from kbd.errors import InvalidInput


@dataclass(frozen=True)
class Row(Record):
    """One row: a workflow and whether it exists."""

    workflow_id: str
    exists: bool


@dataclass(frozen=True)
class View(Record):
    """A view with every kind of field."""

    workflow_id: str
    rows: tuple[Row, ...]
    alias: str = field(metadata=key(name="detached"))
    hint: str | None = field(default=None, metadata=key(omit_none=True))
    kind: Literal["a", "b"] = "a"
    count: int = field(init=False, metadata=key(computed=True))
    env: dict[str, str] = field(default_factory=dict)
    score: float = 0.0
    parent: Row | None = None
    extra: JsonValue = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "count", len(self.rows))


rows = st.builds(Row, st.text(), st.booleans())
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
    max_leaves=8,
)
views = st.builds(
    View,
    workflow_id=st.text(),
    rows=st.lists(rows, max_size=3).map(tuple),
    alias=st.text(),
    hint=st.none() | st.text(),
    kind=st.sampled_from(["a", "b"]),
    env=st.dictionaries(st.text(), st.text(), max_size=3),
    score=st.floats(allow_nan=False, allow_infinity=False),
    parent=st.none() | rows,
    extra=json_values,
)


@given(views)
def test_a_record_reads_back_what_it_wrote(view: View) -> None:
    assert View.from_json(view.to_json()) == view


@given(views)
def test_what_a_record_writes_fits_its_schema(view: View) -> None:
    jsonschema.Draft202012Validator(View.json_schema()).validate(view.to_json())


def test_the_json_is_the_fields_in_order_with_what_each_field_says() -> None:
    v = View("wf", (Row("x", True),), "al", env={"A": "b"})
    assert list(v.to_json()) == ["workflow_id", "rows", "detached", "kind", "count", "env", "score",
                                 "parent", "extra"]  # fmt: skip
    assert v.to_json()["rows"] == [{"workflow_id": "x", "exists": True}]
    assert View("wf", (), "al", hint="h").to_json()["hint"] == "h"


def test_a_computed_field_is_written_and_documented_but_never_read() -> None:
    data = View("wf", (Row("x", True),), "al").to_json()
    data["count"] = 99
    assert View.from_json(data).count == 1


def test_unknown_keys_are_ignored_so_an_older_client_reads_a_newer_daemon() -> None:
    data = {**Row("x", True).to_json(), "added_later": 1}
    assert Row.from_json(data) == Row("x", True)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ([], "View: expected an object, got an array"),
        ({"rows": [], "detached": "a"}, "View.workflow_id: missing"),
        ({"workflow_id": 1, "rows": [], "detached": "a"}, "View.workflow_id: expected a string, got an integer"),
        ({"workflow_id": "w", "rows": {}, "detached": "a"}, "View.rows: expected an array, got an object"),
        ({"workflow_id": "w", "rows": [{"workflow_id": "x", "exists": 1}], "detached": "a"},
         "View.rows[0].exists: expected a boolean, got an integer"),
        ({"workflow_id": "w", "rows": [], "detached": "a", "kind": "c"}, "View.kind: expected one of 'a', 'b', got 'c'"),
        ({"workflow_id": "w", "rows": [], "detached": "a", "score": True}, "View.score: expected a number, got a boolean"),
        ({"workflow_id": "w", "rows": [], "detached": "a", "env": {"A": None}}, "View.env.A: expected a string, got null"),
        ({"workflow_id": "w", "rows": [], "detached": "a", "parent": "x"}, "View.parent: expected an object, got a string"),
    ],
)  # fmt: skip
def test_each_misfit_names_its_key_and_what_was_expected(data: Any, message: str) -> None:
    with pytest.raises(InvalidInput) as err:
        View.from_json(data)
    assert str(err.value) == message


def test_the_schema_names_nested_records_once_and_moves_under_a_prefix() -> None:
    schema = View.json_schema()
    assert schema["title"] == "View" and schema["description"] == "A view with every kind of field."
    assert schema["properties"]["rows"]["items"] == {"$ref": REF_PREFIX + "Row"}
    assert set(schema["$defs"]) == {"Row"}
    assert "hint" not in schema["required"] and "detached" in schema["required"]
    moved = refs_under(schema, "#/components/schemas/")
    assert moved["properties"]["parent"]["anyOf"][0] == {"$ref": "#/components/schemas/Row"}
    defs: dict[str, Any] = {}
    assert View.json_schema(defs) == {"$ref": REF_PREFIX + "View"} and set(defs) == {"View", "Row"}


def test_a_field_type_without_a_json_spelling_is_refused_when_first_used() -> None:
    @dataclass(frozen=True)
    class Odd(Record):
        when: set[str]

    with pytest.raises(TypeError, match="cannot be"):
        Odd(set()).to_json()

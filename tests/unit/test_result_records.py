"""Every result under kbd/ is a Record (docs/architecture.md "Typed operations"): its schema
builds, it reads back what it writes, and what it writes fits its schema."""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kbd
from kbd.core.folders import FolderStatus
from kbd.core.plan import Grant, Origin, Plan, build_plan
from kbd.core.records import Record
from kbd.core.resolve import Attachment, WriteStatus
from kbd.fs.datafiles import consumer_kind
from kbd.service.admin import Validation
from kbd.service.browse import FileRead, Listing
from kbd.service.contributions import Report
from kbd.service.history import NoteVersion
from kbd.service.sessions import Environment, RunningCommand, SessionView
from kbd.state.processes import ProcessRow
from kbd.state.sessions import SessionRow


def _all_records() -> list[type[Record]]:
    for info in pkgutil.walk_packages(kbd.__path__, "kbd."):
        if not info.name.endswith(".__main__"):  # runs the CLI
            importlib.import_module(info.name)
    found: list[type[Record]] = []
    todo = list(Record.__subclasses__())
    while todo:
        cls = todo.pop()
        if cls not in found and cls.__module__.startswith("kbd."):  # not a test's own records
            if dataclasses.is_dataclass(cls):  # not a base of records (kbd.service.ContentRecord)
                found.append(cls)
            todo += cls.__subclasses__()
    return sorted(found, key=lambda c: f"{c.__module__}.{c.__qualname__}")


RECORDS = _all_records()
NAMES = [f"{c.__module__}.{c.__qualname__}" for c in RECORDS]


def _hand_written(cls: type[Record]) -> bool:
    return any("to_json" in vars(c) for c in cls.__mro__ if c is not Record and issubclass(c, Record))


text = st.text(max_size=8)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | text,
    lambda inner: st.lists(inner, max_size=2) | st.dictionaries(text, inner, max_size=2),
    max_leaves=4,
)


def strategy(hint: Any) -> st.SearchStrategy[Any]:
    """Values of a field's type, as :mod:`kbd.core.records` accepts them."""
    if hint is Any:
        return json_values
    simple: dict[Any, st.SearchStrategy[Any]] = {
        str: text, int: st.integers(), bool: st.booleans(), type(None): st.none(),
        float: st.floats(allow_nan=False, allow_infinity=False),
    }  # fmt: skip
    if hint in simple:
        return simple[hint]
    origin = get_origin(hint)
    if origin in (Union, types.UnionType):
        return st.one_of(*(strategy(a) for a in get_args(hint)))
    if origin is Literal:
        return st.sampled_from(get_args(hint))
    if origin is tuple:
        return st.lists(strategy(get_args(hint)[0]), max_size=2).map(tuple)
    if origin is list:
        return st.lists(strategy(get_args(hint)[0]), max_size=2)
    if origin is dict:
        return st.dictionaries(text, strategy(get_args(hint)[1]), max_size=2)
    if isinstance(hint, type) and issubclass(hint, Record):
        return records(hint)
    raise AssertionError(f"no strategy for {hint!r}")


R = Path("/r/workflows")


def _attachment(alias: str, *, writable: bool) -> Attachment:
    return Attachment(alias, f"wf_{alias}", alias, "write" if writable else "read", True, None, None,
                      WriteStatus(True, None) if writable else None, R / alias / "knowledgebase")  # fmt: skip


def _plan(session: bool) -> Plan:
    plan = build_plan(
        workflow_id="wf_con", workflow_folder=R / "con", policy=consumer_kind("execution"), kb_access="read-write",
        item_kb_write=False, attachments=[_attachment("rts", writable=False), _attachment("sec", writable=True)],
        folders=[FolderStatus("shared", "read_write", True, None, None, R / "shared"),
                 FolderStatus("", "read_only", False, "invalid_entry", "no alias", None)],
    )  # fmt: skip
    return plan.with_generation(2, session_id="s_1", parent=None, opened_by="alice") if session else plan


def _process(generation: int) -> ProcessRow:
    return ProcessRow("", 42, 42, generation, 1.5, ["sh", "-c", "é"])


#: Records that write their JSON by hand: instances whose JSON says all they hold.
HAND_MADE: dict[type[Record], st.SearchStrategy[Any]] = {
    Grant: st.builds(Grant, st.just(R / "x"), st.sampled_from(["read", "write", "read_only", "hidden"]),
                     st.sampled_from([Origin("own"), Origin("kb", "rts"), Origin("folder", "shared")])),
    FolderStatus: st.sampled_from(_plan(False).folders),
    Attachment: st.sampled_from(_plan(False).sources),
    Plan: st.builds(_plan, st.booleans()),
    SessionView: st.builds(SessionView, st.builds(_plan, st.booleans()),
                           st.lists(st.builds(RunningCommand, st.builds(_process, st.integers(0, 3)),
                                              st.booleans()), max_size=2).map(tuple)),
    RunningCommand: st.builds(RunningCommand, st.builds(_process, st.integers(0, 3)), st.booleans()),
    ProcessRow: st.builds(_process, st.integers(0, 3)),
    SessionRow: st.builds(lambda closed: SessionRow("s_1", "wf", "execution", "read", False, None, "alice", 2.5,
                                                    2.5 if closed else None, 1, ""), st.booleans()),
    Environment: st.builds(Environment, st.dictionaries(text, text, max_size=3)),
    NoteVersion: st.builds(NoteVersion, text, text, text, st.binary(max_size=8)),
    FileRead: st.builds(FileRead, text, st.none() | text, text, st.binary(max_size=8)),
    Validation: st.builds(Validation, text, st.none() | text, st.none() | text, st.just(0),
                          st.lists(text, max_size=2).map(tuple)),
    # The JSON lists the committed relpaths, and each alias's own: the order of one relpath committed
    # into two sources is not in it (nothing reads that order), so the examples' relpaths differ.
    Report: st.builds(Report, st.lists(st.tuples(st.sampled_from(["a", "b"]), text), max_size=3,
                                       unique_by=lambda c: c[1]),
                      st.lists(st.dictionaries(text, text, max_size=2), max_size=2), st.none() | text),
    # Its entries are what a listing holds (a TypedDict), not any JSON.
    Listing: st.builds(Listing, text, st.none() | text, text,
                       st.lists(st.fixed_dictionaries({"name": text, "type": text},
                                                      optional={"contributed_by": st.none() | text}),
                                max_size=2).map(tuple), st.booleans(), st.none() | text),
}  # fmt: skip


def records(cls: type[Record]) -> st.SearchStrategy[Any]:
    if cls in HAND_MADE:
        return HAND_MADE[cls]
    assert not _hand_written(cls), f"{cls.__name__} writes its JSON by hand: give it a strategy in HAND_MADE"
    hints = typing.get_type_hints(cls)
    fields = {f.name: _field_values(f, hints[f.name]) for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    return st.builds(cls, **fields)


def _field_values(f: dataclasses.Field[Any], hint: Any) -> st.SearchStrategy[Any]:
    """A field's values: those its declared schema ``pattern`` admits (a note's version), else its type's."""
    spec = next(iter(f.metadata.values()), None)
    pattern = getattr(spec, "schema", {}).get("pattern")
    return st.from_regex(pattern, fullmatch=True) if isinstance(pattern, str) else strategy(hint)


def test_every_result_with_json_is_a_record() -> None:
    names = {c.__name__ for c in RECORDS}
    assert {"Plan", "Attachment", "WorkflowDetail", "SessionView", "NoteLog", "Report", "SessionRow"} <= names
    assert not set(HAND_MADE) - set(RECORDS)


@pytest.mark.parametrize("cls", RECORDS, ids=NAMES)
def test_its_schema_builds(cls: type[Record]) -> None:
    schema = cls.json_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    assert schema["title"] == cls.__name__


@pytest.mark.parametrize("cls", RECORDS, ids=NAMES)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_it_reads_back_what_it_writes_which_fits_its_schema(cls: type[Record], data: st.DataObject) -> None:
    value = data.draw(records(cls))
    written = value.to_json()
    jsonschema.Draft202012Validator(cls.json_schema()).validate(written)
    assert cls.from_json(written) == value
    assert cls.from_json(written).to_json() == written

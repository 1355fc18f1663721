"""Typed results whose JSON is spelled once (docs/architecture.md "Typed operations"). Pure.

An operation's result is a frozen dataclass that derives from :class:`Record`.
Its fields, in order, *are* its JSON object: :meth:`Record.to_json` writes them,
:meth:`Record.from_json` reads them back (the CLI through the daemon gets the
same typed value the operation returned on the root itself), and
:meth:`Record.json_schema` describes them (the API's OpenAPI document and the
MCP tools' ``outputSchema``). Nothing else spells a result's keys.

What a field's JSON differs in is said on the field, with :func:`key`:

* ``name=``: its key when that is not the attribute's name;
* ``omit_none=True``: left out of the object while it is None;
* ``schema=``: more of its JSON Schema (a pattern, a description);
* ``computed=True`` on a ``field(init=False)``: derived from the others in
  ``__post_init__`` (written, documented, never read back).

Types a field may have: ``str``, ``int``, ``float``, ``bool``, ``None``, unions
of those with ``None``, ``Literal[...]`` of strings, ``tuple[T, ...]`` and
``list[T]`` (a JSON array), ``dict[str, T]``, another :class:`Record`, and
``JsonValue`` (any JSON, passed through: a shape kbd does not model, such as a
manifest entry it keeps as it found it). Anything else is refused when the
class is first used, so a result cannot silently lose a field.

A result whose JSON is not its fields (a path, a key written only in some
states, another object's keys merged in) writes ``to_json`` by hand and reads
and describes itself with a :class:`Keys`; such exceptions say why on the class.
"""

from __future__ import annotations

import dataclasses
import operator
import types
import typing
from collections.abc import Callable
from typing import Any, ClassVar, Literal, TypeAlias, TypeVar, Union, get_args, get_origin

from kbd.errors import InvalidInput

#: A JSON value (what :func:`orjson.loads` returns).
JsonValue: TypeAlias = Any
JsonObject: TypeAlias = dict[str, Any]

R = TypeVar("R", bound="Record")

_META = "kbd.json"


def key(
    *,
    name: str | None = None,
    omit_none: bool = False,
    schema: JsonObject | None = None,
    computed: bool = False,
) -> dict[str, Any]:
    """The ``metadata`` of a field whose JSON differs from its attribute (see the module)."""
    return {_META: _FieldSpec(name, omit_none, schema or {}, computed)}


@dataclasses.dataclass(frozen=True)
class _FieldSpec:
    name: str | None
    omit_none: bool
    schema: JsonObject
    computed: bool


_PLAIN = _FieldSpec(None, False, {}, False)


class Record:
    """A result whose JSON is its fields (see the module). Subclasses are frozen dataclasses."""

    __slots__ = ()
    #: The schema's description: the class's first docstring line unless set.
    json_title: ClassVar[str | None] = None

    def to_json(self) -> JsonObject:
        return _codec(type(self)).encode(self)

    @classmethod
    def from_json(cls: type[R], data: object, where: str = "") -> R:
        """The record ``data`` spells; InvalidInput naming the first key that does not fit."""
        value: R = _codec(cls).decode(data, where or cls.__name__)
        return value

    @classmethod
    def json_schema(cls, defs: dict[str, JsonObject] | None = None) -> JsonObject:
        """This record's JSON Schema (draft 2020-12, as OpenAPI 3.1 uses it). Nested
        records go into ``defs`` and are referred to as ``#/$defs/NAME`` (or, when
        ``defs`` is given, as the caller's :data:`REF_PREFIX` says); without ``defs``
        the schema carries its own ``$defs``."""
        return _rooted(cls, defs, lambda table: _fields_schema(cls, table))


#: Where a nested record's schema is referred to: "#/$defs/" in a schema of its
#: own; OpenAPI documents put them under "#/components/schemas/" (see :func:`refs_under`).
REF_PREFIX = "#/$defs/"


def refs_under(schema: JsonValue, prefix: str) -> JsonValue:
    """``schema`` with every ``#/$defs/NAME`` reference moved under ``prefix``."""
    if isinstance(schema, dict):
        return {
            k: (prefix + v[len(REF_PREFIX) :] if k == "$ref" and isinstance(v, str) and v.startswith(REF_PREFIX)
                else refs_under(v, prefix))
            for k, v in schema.items()
        }  # fmt: skip
    if isinstance(schema, list):
        return [refs_under(v, prefix) for v in schema]
    return schema


# -- the codec of one class ------------------------------------------------------------------------

Encode = Callable[[Any], Any]
Decode = Callable[[Any, str], Any]


@dataclasses.dataclass(frozen=True)
class _Slot:
    attr: str
    name: str
    spec: _FieldSpec
    hint: Any
    encode: Encode
    decode: Decode
    required: bool


class _Codec:
    def __init__(self, cls: type[Record]) -> None:
        if not dataclasses.is_dataclass(cls):
            raise TypeError(f"{cls.__name__} derives from Record but is not a dataclass")
        self.cls: type[Record] = cls
        hints = typing.get_type_hints(cls)  # each class's annotations in its own module
        self.slots: list[_Slot] = []
        for f in dataclasses.fields(cls):
            spec: _FieldSpec = f.metadata.get(_META, _PLAIN)
            if not f.init and not spec.computed:
                continue
            hint = hints[f.name]
            has_default = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
            self.slots.append(_Slot(f.name, spec.name or f.name, spec, hint, _encoder(hint, cls),
                                    _decoder(hint, cls), required=f.init and not has_default))  # fmt: skip

        self.encode: Callable[[Any], JsonObject] = _compiled_encoder(cls, self.slots)

    def decode(self, data: object, where: str) -> Any:
        if not isinstance(data, dict):
            raise InvalidInput(f"{where}: expected an object, got {_kind(data)}")
        kwargs: dict[str, Any] = {}
        for s in self.slots:
            if s.spec.computed:
                continue
            if s.name not in data:
                if s.required and not s.spec.omit_none:
                    raise InvalidInput(f"{where}.{s.name}: missing")
                if s.spec.omit_none and s.required:
                    kwargs[s.attr] = None
                continue
            kwargs[s.attr] = s.decode(data[s.name], f"{where}.{s.name}")
        return self.cls(**kwargs)


def _compiled_encoder(cls: type, slots: list[_Slot]) -> Callable[[Any], JsonObject]:
    """``cls``'s ``to_json``, written out once as Python, as :mod:`dataclasses` writes
    ``__init__``: as fast as one written by hand (a plan is encoded on every lookup).
    The text holds only attribute names, ``repr`` of key strings and ``_e<i>``, each
    non-trivial field's encoder."""
    namespace: dict[str, Any] = {}
    lines = ["def encode(obj):", "    out = {}"]
    for i, s in enumerate(slots):
        if s.encode is _same:
            value = "v"
        else:
            namespace[f"_e{i}"] = s.encode
            value = f"_e{i}(v)"
        lines.append(f"    v = obj.{s.attr}")
        if s.spec.omit_none:
            lines.append(f"    if v is not None: out[{s.name!r}] = {value}")
        else:
            lines.append(f"    out[{s.name!r}] = {value}")
    lines.append("    return out")
    exec("\n".join(lines), namespace)  # noqa: S102 - the text above: names and encoders, no input
    encode: Callable[[Any], JsonObject] = namespace["encode"]
    encode.__qualname__ = f"{cls.__qualname__}.to_json"
    return encode


_CODECS: dict[type, _Codec] = {}


def _codec(cls: type[Record]) -> _Codec:
    codec = _CODECS.get(cls)
    if codec is None:
        codec = _CODECS[cls] = _Codec(cls)
    return codec


def _kind(value: object) -> str:
    if value is None:
        return "null"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
            dict: "an object"}.get(type(value), type(value).__name__)  # fmt: skip


def _same(value: Any) -> Any:
    return value


_to_json = operator.methodcaller("to_json")


def _is_union(hint: Any) -> bool:
    return get_origin(hint) in (Union, types.UnionType)


def _record_class(hint: Any) -> bool:
    return isinstance(hint, type) and issubclass(hint, Record)


def _encoder(hint: Any, owner: type) -> Encode:
    if hint is Any or hint in (str, int, float, bool, type(None)):
        return _same
    if _is_union(hint):
        parts = [a for a in get_args(hint) if a is not type(None)]
        if len(parts) != 1:
            raise TypeError(f"{owner.__name__}: a field's union may only add None to one type: {hint}")
        inner = _encoder(parts[0], owner)
        return _same if inner is _same else (lambda v: None if v is None else inner(v))
    origin = get_origin(hint)
    if origin is Literal:
        return _same
    if origin in (tuple, list):
        args = get_args(hint)
        if origin is tuple and (len(args) != 2 or args[1] is not Ellipsis):
            raise TypeError(f"{owner.__name__}: a tuple field is tuple[T, ...], not {hint}")
        item = _encoder(args[0], owner)
        return list if item is _same else (lambda v: [item(x) for x in v])
    if origin is dict:
        k, v_hint = get_args(hint)
        if k is not str:
            raise TypeError(f"{owner.__name__}: a dict field has str keys, not {hint}")
        value = _encoder(v_hint, owner)
        return dict if value is _same else (lambda v: {a: value(b) for a, b in v.items()})
    if _record_class(hint):
        return _to_json
    raise TypeError(f"{owner.__name__}: a Record field cannot be {hint!r} (see kbd.core.records)")


_SCALARS: dict[type, tuple[type, ...]] = {str: (str,), int: (int,), float: (int, float), bool: (bool,)}


def _decoder(hint: Any, owner: type) -> Decode:
    if hint is Any:
        return lambda v, where: v
    if hint is type(None):

        def none(v: Any, where: str) -> None:
            if v is not None:
                raise InvalidInput(f"{where}: expected null, got {_kind(v)}")

        return none
    if hint in _SCALARS:
        allowed = _SCALARS[hint]
        what = {str: "a string", int: "an integer", float: "a number", bool: "a boolean"}[hint]

        def scalar(v: Any, where: str) -> Any:
            # bool is an int to Python, never to JSON.
            if not isinstance(v, allowed) or (isinstance(v, bool) and hint is not bool):
                raise InvalidInput(f"{where}: expected {what}, got {_kind(v)}")
            return float(v) if hint is float and isinstance(v, int) else v

        return scalar
    if _is_union(hint):
        (inner_hint,) = [a for a in get_args(hint) if a is not type(None)]
        inner = _decoder(inner_hint, owner)
        return lambda v, where: None if v is None else inner(v, where)
    origin = get_origin(hint)
    if origin is Literal:
        choices = get_args(hint)

        def literal(v: Any, where: str) -> Any:
            if v not in choices or isinstance(v, bool) != any(isinstance(c, bool) for c in choices):
                raise InvalidInput(f"{where}: expected one of {', '.join(map(repr, choices))}, got {v!r}")
            return v

        return literal
    if origin in (tuple, list):
        item = _decoder(get_args(hint)[0], owner)
        make: Callable[[Any], Any] = tuple if origin is tuple else list

        def array(v: Any, where: str) -> Any:
            if not isinstance(v, list):
                raise InvalidInput(f"{where}: expected an array, got {_kind(v)}")
            return make(item(x, f"{where}[{i}]") for i, x in enumerate(v))

        return array
    if origin is dict:
        value = _decoder(get_args(hint)[1], owner)

        def mapping(v: Any, where: str) -> Any:
            if not isinstance(v, dict):
                raise InvalidInput(f"{where}: expected an object, got {_kind(v)}")
            return {k: value(x, f"{where}.{k}") for k, x in v.items()}

        return mapping
    if _record_class(hint):
        return lambda v, where: hint.from_json(v, where)
    raise TypeError(f"{owner.__name__}: a Record field cannot be {hint!r} (see kbd.core.records)")


# -- JSON Schema -----------------------------------------------------------------------------------


def _rooted(
    cls: type[Record],
    defs: dict[str, JsonObject] | None,
    build: Callable[[dict[str, JsonObject]], tuple[JsonObject, list[str]]],
    others: Callable[[dict[str, JsonObject]], JsonObject] | None = None,
) -> JsonObject:
    """:meth:`Record.json_schema` of ``cls``, whose properties and required keys ``build`` says."""  # fmt: skip
    table: dict[str, JsonObject] = {} if defs is None else defs
    name = cls.__name__
    if name not in table:
        table[name] = {}  # placed first: a record that (indirectly) holds itself refers to itself
        props, required = build(table)
        schema: JsonObject = {"type": "object", "title": name, "properties": props, "required": required}
        if others is not None:
            schema["additionalProperties"] = others(table)
        doc = cls.json_title or (cls.__doc__ or "").strip().split("\n\n")[0]
        if doc and not doc.startswith(f"{name}("):  # not the dataclass's generated signature
            schema["description"] = " ".join(doc.split())
        table[name] = schema
    if defs is not None:
        return {"$ref": REF_PREFIX + name}
    schema = dict(table.pop(name))
    if table:
        schema["$defs"] = table
    return schema


def _fields_schema(cls: type[Record], defs: dict[str, JsonObject]) -> tuple[JsonObject, list[str]]:
    codec = _codec(cls)
    props = {}
    for s in codec.slots:
        prop = _type_schema(s.hint, defs)
        if s.spec.schema:
            prop = {**prop, **s.spec.schema}
        props[s.name] = prop
    # Every key is always written unless it is omitted while None.
    return props, [s.name for s in codec.slots if not s.spec.omit_none]


def _type_schema(hint: Any, defs: dict[str, JsonObject]) -> JsonObject:
    if hint is Any:
        return {}
    simple = {str: "string", int: "integer", float: "number", bool: "boolean", type(None): "null"}
    if hint in simple:
        return {"type": simple[hint]}
    if _is_union(hint):
        (inner,) = [a for a in get_args(hint) if a is not type(None)]
        return {"anyOf": [_type_schema(inner, defs), {"type": "null"}]}
    origin = get_origin(hint)
    if origin is Literal:
        return {"enum": list(get_args(hint))}
    if origin in (tuple, list):
        return {"type": "array", "items": _type_schema(get_args(hint)[0], defs)}
    if origin is dict:
        return {"type": "object", "additionalProperties": _type_schema(get_args(hint)[1], defs)}
    if _record_class(hint):
        ref: JsonObject = hint.json_schema(defs)  # its own, when it writes its JSON by hand
        return ref
    raise TypeError(f"no JSON Schema for {hint!r}")


# -- a record whose JSON is written by hand ------------------------------------------------------------


class Keys:
    """The keys of a record whose ``to_json`` is written by hand, because its JSON
    is not its fields (a path, a key written only in some states, another
    object's keys merged in). Each key's type, in order, is one a field may have
    (``types`` is called once, when first needed: a nested record's class may be
    imported late); ``omitted`` keys are left out while None; ``others``, when
    given, is the type of every other key (an object whose keys are names). The record's
    ``from_json`` reads with :meth:`read` (strict, naming the first misfit as
    :meth:`Record.from_json` does) and its ``json_schema`` is :meth:`schema`."""

    def __init__(
        self, types: Callable[[], dict[str, Any]], *, omitted: tuple[str, ...] = (), others: Any = None
    ) -> None:
        self._types = types
        self._omitted = frozenset(omitted)
        self._others = others
        self._decoders: dict[str, tuple[Any, Decode]] | None = None
        self._other: Decode | None = None

    def _table(self, owner: type) -> dict[str, tuple[Any, Decode]]:
        if self._decoders is None:
            self._decoders = {k: (hint, _decoder(hint, owner)) for k, hint in self._types().items()}
            if self._others is not None:
                self._other = _decoder(self._others, owner)
        return self._decoders

    def read(self, cls: type[Record], data: object, where: str) -> dict[str, Any]:
        """Every key's value in ``data`` (an omitted key's: None), each checked as its type says."""
        where = where or cls.__name__
        if not isinstance(data, dict):
            raise InvalidInput(f"{where}: expected an object, got {_kind(data)}")
        out: dict[str, Any] = {}
        for k, (_, decode) in self._table(cls).items():
            if k not in data:
                if k not in self._omitted:
                    raise InvalidInput(f"{where}.{k}: missing")
                out[k] = None
                continue
            out[k] = decode(data[k], f"{where}.{k}")
        if (other := self._other) is not None:
            out.update((k, other(v, f"{where}.{k}")) for k, v in data.items() if k not in out)
        return out

    def schema(self, cls: type[Record], defs: dict[str, JsonObject] | None) -> JsonObject:
        """``cls``'s JSON Schema, as :meth:`Record.json_schema` gives it."""

        def build(table: dict[str, JsonObject]) -> tuple[JsonObject, list[str]]:
            props = {k: _type_schema(hint, table) for k, (hint, _) in self._table(cls).items()}
            return props, [k for k in props if k not in self._omitted]

        if self._others is not None:
            others = self._others
            return _rooted(cls, defs, build, lambda table: _type_schema(others, table))

        return _rooted(cls, defs, build)

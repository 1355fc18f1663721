"""Small strict readers for untrusted structured data (YAML and JSON).

kbd validates its own config by hand instead of with pydantic so the hot paths
(`kbd exec`, plan lookups) never pay pydantic's import cost (docs/performance.md). Every
failure names the file, the dotted field, what was wrong and what is allowed.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Mapping
from decimal import Decimal
from typing import Any

from kbd.errors import InvalidConfig


@functools.cache
def _loader() -> Any:
    """A SafeLoader that refuses duplicate mapping keys (built on first use, so
    commands that never parse YAML never import it).

    PyYAML keeps the last duplicate silently; for a security config two readers
    could then disagree about who is an admin, so a duplicate is an error.
    """
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        pass

    def construct_mapping(loader: Any, node: Any) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = loader.construct_object(key_node)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return dict(loader.construct_mapping(node))

    UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, construct_mapping)
    return UniqueKeyLoader


def load_yaml(text: str, *, source: str) -> Any:
    """Parse YAML safely (no tags, no duplicates); raise InvalidConfig naming ``source``."""
    import yaml

    try:
        return yaml.load(text, Loader=_loader())  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise InvalidConfig(f"{source}: not valid YAML: {exc}") from exc


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _pairs_no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            # Two parsers may pick different duplicates; refuse instead of guessing.
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def load_json_strict(data: bytes | str) -> Any:
    """Parse JSON with the stdlib, refusing duplicate keys and NaN/Infinity.

    Integers stay exact (Python ints); other numbers become ``Decimal`` so a
    value kbd does not own is written back exactly as it was (``1e400`` would
    otherwise turn into ``inf`` and then into invalid JSON). Raises ValueError.
    """
    return json.loads(
        data,
        object_pairs_hook=_pairs_no_duplicates,
        parse_constant=_reject_constant,
        parse_float=Decimal,
    )


def is_unicode(text: str) -> bool:
    """Whether ``text`` is Unicode text: no lone surrogate, which JSON's ``\\u``
    escapes can spell but nothing can encode, store or compare as a name.
    Linear at C speed (a 1 MiB note costs about a millisecond)."""
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_keys(obj: Mapping[str, Any], *, allowed: Iterable[str], where: str, source: str) -> None:
    """Refuse keys outside ``allowed``, naming the first unknown key and the file."""
    allowed_set = set(allowed)
    for key in obj:
        if key not in allowed_set:
            raise InvalidConfig(
                f"{source}: unknown key {where + '.' if where else ''}{key}; "
                f"allowed: {', '.join(sorted(allowed_set))}"
            )


def expect_mapping(value: Any, *, where: str, source: str) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise InvalidConfig(f"{source}: {where or 'document'} must be a mapping, got {_kind(value)}")
    for key in value:
        if not isinstance(key, str):
            raise InvalidConfig(f"{source}: {where or 'document'} has a non-string key {key!r}")
    return value


def expect_str(value: Any, *, where: str, source: str) -> str:
    if not isinstance(value, str):
        raise InvalidConfig(f"{source}: {where} must be a string, got {_kind(value)}")
    return value


def expect_choice(value: Any, choices: Iterable[str], *, where: str, source: str) -> str:
    """A string out of ``choices``; the error lists them (and explains YAML's
    habit of reading unquoted off/no/yes as booleans)."""
    allowed = tuple(choices)
    if isinstance(value, str) and value in allowed:
        return value
    got = repr(value) if isinstance(value, str) else f"{_kind(value)} {value!r}"
    yaml_note = (
        " (YAML reads unquoted off/no/yes/on as booleans: quote the value)" if isinstance(value, bool) else ""
    )
    raise InvalidConfig(f"{source}: {where} is {got}; allowed: {', '.join(allowed)}{yaml_note}")


def expect_bool(value: Any, *, where: str, source: str) -> bool:
    if not isinstance(value, bool):
        raise InvalidConfig(f"{source}: {where} must be true or false, got {_kind(value)}")
    return value


def expect_number(value: Any, *, where: str, source: str, minimum: float, maximum: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidConfig(f"{source}: {where} must be a number, got {_kind(value)}")
    if not minimum <= value <= maximum:
        raise InvalidConfig(f"{source}: {where} must be between {minimum} and {maximum}, got {value}")
    return float(value)


def expect_str_list(value: Any, *, where: str, source: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise InvalidConfig(f"{source}: {where} must be a list of strings, got {_kind(value)}")
    return list(value)


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    return {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean"}.get(
        type(value), type(value).__name__
    )


kind_of = _kind

"""The prompt-injection gate for contributed notes (DESIGN §7; seed 003's
fail-closed INJECTION gate). Rules are data in ``policies/injection.yaml``.

A contributed note is refused, with the matching rule named, when any rule
matches. The rule set is validated strictly and must not be empty: a gate with
no rules would pass everything, so it fails closed instead.
"""

from __future__ import annotations

import functools
import html
import re
import unicodedata
from dataclasses import dataclass
from typing import Any

from kbd.config import read_yaml_cached
from kbd.errors import InvalidConfig, InvalidInput
from kbd.policy import policy_path
from kbd.strict import check_keys, expect_mapping, expect_str

NAME = "injection.yaml"


@dataclass(frozen=True)
class Rule:
    id: str
    description: str
    pattern: re.Pattern[str]


class InjectionRefused(InvalidInput):
    code = "injection-refused"
    default_hint = (
        "contributed notes are reference data; rephrase the text so it does not instruct the reader"
    )

    def __init__(self, message: str, *, rule: str) -> None:
        super().__init__(message)
        self.rule = rule


def parse_rules(data: Any, *, source: str) -> tuple[Rule, ...]:
    doc = expect_mapping(data, where="", source=source)
    check_keys(doc, allowed=("version", "rules"), where="", source=source)
    if doc.get("version") != 1:
        raise InvalidConfig(f"{source}: version must be 1")
    raw = doc.get("rules")
    if not isinstance(raw, list) or not raw:
        raise InvalidConfig(f"{source}: rules must be a non-empty list (an empty gate would pass everything)")
    rules = []
    seen: set[str] = set()
    for i, item in enumerate(raw):
        entry = expect_mapping(item, where=f"rules[{i}]", source=source)
        check_keys(entry, allowed=("id", "description", "pattern"), where=f"rules[{i}]", source=source)
        rid = expect_str(entry.get("id"), where=f"rules[{i}].id", source=source)
        if rid in seen:
            raise InvalidConfig(f"{source}: rules[{i}].id {rid!r} is used twice")
        seen.add(rid)
        pattern = expect_str(entry.get("pattern"), where=f"rules[{i}].pattern", source=source)
        try:
            compiled = re.compile(pattern, re.IGNORECASE | re.MULTILINE)
        except re.error as exc:
            raise InvalidConfig(f"{source}: rules[{i}].pattern does not compile: {exc}") from exc
        rules.append(
            Rule(
                rid,
                expect_str(entry.get("description", ""), where=f"rules[{i}].description", source=source),
                compiled,
            )
        )
    return tuple(rules)


@functools.cache
def rules() -> tuple[Rule, ...]:
    return read_yaml_cached(
        policy_path(NAME),
        what=f"policies/{NAME}",
        cache=None,
        parse=lambda data: parse_rules(data, source=f"policies/{NAME}"),
    )


# Latin look-alikes from Cyrillic and Greek that NFKC leaves alone.
_CONFUSABLES = str.maketrans(
    "аеорсухіјѕԁɡκνοτАВЕКМНОРСТХІЈЅ",
    "aeopcyxijsdgkvotABEKMHOPCTXIJS",
)
_COMMENT = re.compile(r"<!--.*?-->", re.DOTALL)
_SPACE = re.compile(r"\s+")


def normalize(text: str) -> str:
    """What the rules see. Hiding a phrase from the gate must not be cheaper than
    writing it: HTML entities are decoded and HTML comments removed; NFKC turns
    full-width and other compatibility letters into plain ones; invisible format
    characters (zero-width spaces and joiners, bidi controls, soft hyphens) are
    removed; and common Cyrillic and Greek look-alikes become Latin letters.
    Encodings such as base64 are not decoded. See :func:`check` for line breaks."""
    text = _COMMENT.sub("", html.unescape(text))
    text = "".join(ch for ch in unicodedata.normalize("NFKC", text) if unicodedata.category(ch) != "Cf")
    return text.translate(_CONFUSABLES)


def check(text: str, *, ruleset: tuple[Rule, ...] | None = None) -> None:
    """Raise InjectionRefused naming the first rule that matches ``text``."""
    seen = normalize(text)
    # Rules see the text twice: with its lines (for rules anchored at a line
    # start) and with every whitespace run made one space (so a phrase split over
    # lines still matches).
    flat = _SPACE.sub(" ", seen)
    for rule in rules() if ruleset is None else ruleset:
        m = rule.pattern.search(seen) or rule.pattern.search(flat)
        if m is not None:
            excerpt = m.group(0)[:80]
            raise InjectionRefused(
                f"the note matches injection rule {rule.id!r} ({rule.description}): {excerpt!r}", rule=rule.id
            )

"""The prompt-injection gate for contributed notes (docs/notes.md "Injection gate": fail closed). Rules are
data in ``policies/injection.yaml``
(:func:`kbd.fs.datafiles.injection_rules` reads them; :func:`parse_rules`
validates them).

A contributed note is refused, with the matching rule named, when any rule
matches. The rule set is validated strictly and must not be empty: a gate with
no rules would pass everything, so it fails closed instead.
"""

from __future__ import annotations

import functools
import html
import importlib
import re
import unicodedata
from dataclasses import dataclass
from typing import Any

from kbd.core.strict import check_keys, expect_mapping, expect_str
from kbd.errors import InjectionRefused, InvalidConfig

# The regex parser of ``re`` itself (no public name, no stubs; ``sre_parse`` is deprecated).
sre_parse: Any = importlib.import_module("re._parser")
sre_constants: Any = importlib.import_module("re._constants")
sre_compiler: Any = importlib.import_module("re._compiler")

# Every rule must run in time linear in the note's length (docs/notes.md "Injection gate": one unbounded
# ``^\s*#{0,3}\s*system`` made 2,000 newlines cost 39 s).
# Python's ``re`` backtracks, so linearity is a property of each rule's shape,
# checked when the rules are loaded: every quantifier is bounded (at most
# MAX_REPEAT), only a single character is ever repeated more than once (no
# nested quantifiers), and nothing refers back or looks around. That bounds the
# work per start position by the rule alone, but the bound multiplies: four
# adjacent ``\s{0,64}`` can split one run of spaces 65**3 ways, and each split is
# tried. So the loader also counts the ways (see :func:`ways`) and refuses a
# rule that can try more than MAX_WAYS of them from one start position.
MAX_REPEAT = 64
MAX_WAYS = 1 << 14
_SINGLE_CHAR = {sre_constants.LITERAL, sre_constants.NOT_LITERAL, sre_constants.ANY, sre_constants.IN}
_REPEATS = {sre_constants.MAX_REPEAT, sre_constants.MIN_REPEAT, sre_constants.POSSESSIVE_REPEAT}
_REFUSED = {
    sre_constants.GROUPREF: "a back-reference",
    sre_constants.GROUPREF_EXISTS: "a conditional group",
    sre_constants.ASSERT: "a lookaround",
    sre_constants.ASSERT_NOT: "a negative lookaround",
}


@dataclass(frozen=True)
class Rule:
    id: str
    description: str
    pattern: re.Pattern[str]
    # Prefilter: every match contains a word of each group (case-folded, see
    # :func:`fold`), so a note that lacks a group is not searched. None: the rule
    # has no such words and is always searched.
    words: tuple[frozenset[str], ...] | None = None
    width: int = 0  # the longest text one match can span (every repeat is bounded)
    # What every match ends with: the part after the rule's last long gap (see
    # :func:`tail_pattern`), or None. A text it does not occur in has no match.
    tail: re.Pattern[str] | None = None


def parse_rules(data: object, *, source: str) -> tuple[Rule, ...]:
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
        if problem := shape_problem(pattern):
            raise InvalidConfig(
                f"{source}: rules[{i}].pattern ({rid}) could backtrack super-linearly: {problem}; allowed are "
                f"bounded repeats ({{m,n}}, n <= {MAX_REPEAT}) of one character or class, and ? on groups"
            )
        if (n := ways(pattern)) > MAX_WAYS:
            raise InvalidConfig(
                f"{source}: rules[{i}].pattern ({rid}) could backtrack too much: from one position it can try "
                f"{n} ways (more than {MAX_WAYS}); repeats in a row whose characters overlap (with nothing or "
                "only optional parts between), or alternatives that can match the same text, multiply their "
                "counts: write one repeat where there are two in a row (\\s{0,64}, not \\s{0,32}\\s{0,32}), "
                "or make what follows a repeat begin with a character the repeat cannot take"
            )
        rules.append(
            Rule(
                rid,
                expect_str(entry.get("description", ""), where=f"rules[{i}].description", source=source),
                compiled,
                required_words(pattern),
                sre_parse.parse(pattern, re.IGNORECASE | re.MULTILINE).getwidth()[1],
                tail_pattern(pattern),
            )
        )
    return tuple(rules)


def shape_problem(pattern: str) -> str | None:
    """Why ``pattern`` is not provably linear-time under Python's ``re``, or None."""
    return _items_problem(sre_parse.parse(pattern, re.IGNORECASE | re.MULTILINE))


def _items_problem(items: Any) -> str | None:
    for op, av in items:
        if op in _REFUSED:
            return f"it uses {_REFUSED[op]}"
        if op in _REPEATS:
            _lo, hi, body = av
            if hi == sre_constants.MAXREPEAT:
                return "it has an unbounded quantifier (*, + or {m,})"
            if hi > MAX_REPEAT:
                return f"a quantifier allows {hi} repeats (more than {MAX_REPEAT})"
            if hi > 1 and not (len(body) == 1 and body[0][0] in _SINGLE_CHAR):
                return "a quantifier repeats more than one character (a nested or group repeat)"
            problem = _items_problem(body)
        elif op == sre_constants.BRANCH:
            problem = next(filter(None, (_items_problem(alt) for alt in av[1])), None)
        elif op in (sre_constants.SUBPATTERN, sre_constants.ATOMIC_GROUP):
            problem = _items_problem(av[-1])
        else:
            problem = None
        if problem:
            return problem
    return None


# -- counting the ways a rule can backtrack -------------------------------------------------------
#
# Matching from one start position, ``re`` tries alternatives depth first: a
# single-character repeat {m,n} hands the rest of the rule up to n-m+1 lengths,
# an alternation each alternative, an optional group the group and its absence.
# The number of times the rest of the rule is tried is at most the product of
# those counts, and the work per try is bounded by the rule's length, so that
# product (``ways``) bounds the work per start position. A choice counts 1 when
# at most one of its options can be followed:
# - a repeat whose characters cannot begin what follows it: every shorter run
#   leaves a character the repeat took, which what follows cannot take, so only
#   the longest run gets past the next character;
# - an alternation whose alternatives pairwise differ at some character position
#   before either's first non-character item (``all`` and ``any``): at most one
#   gets past its leading characters;
# - an optional group whose first characters cannot begin what follows it and
#   which cannot match empty: if the group matched, skipping it leaves a
#   character the group began with.
# A shorter try that fails at its first character costs the rule's length, not
# a product. Overlap is decided conservatively: two sets that cannot both be
# listed (both a class such as [^.] or \S) are taken to overlap.


@dataclass(frozen=True)
class _CharSet:
    """What one character item matches (IGNORECASE, as the rules are compiled).
    ``members``: a superset of the characters, when it can be listed."""

    test: re.Pattern[str]
    members: frozenset[str] | None


_ANYTHING = _CharSet(re.compile(r"(?s:.)"), None)
_FLAGS = re.IGNORECASE | re.MULTILINE


@functools.cache
def _spaces() -> frozenset[str]:
    # Every \\s character is at most U+3000 (a unit test checks \\s is str.isspace).
    return frozenset(c for c in map(chr, range(0x3001)) if c.isspace())


def _variants(code: int) -> set[str]:
    """Under IGNORECASE ``re`` compares the lower-cased character, except for its
    table of extra equal pairs (long s and s, ...), so a character item matches
    one of these for every character it matches (see :func:`_overlap`)."""
    ch = chr(code)
    out = {ch} | {c for c in (ch.lower(), ch.upper()) if len(c) == 1}
    extra: dict[int, tuple[int, ...]] = importlib.import_module("re._casefix")._EXTRA_CASES
    for c in list(out):
        out.update(map(chr, extra.get(ord(c), ())))
    return out


def _charset(op: Any, av: Any) -> _CharSet:
    # The item alone, compiled as the rule is (str patterns are UNICODE: \s is not ASCII-only).
    flags = _FLAGS | re.UNICODE
    state = sre_parse.State()
    state.flags = flags
    test = sre_compiler.compile(sre_parse.SubPattern(state, [(op, av)]), flags)
    return _CharSet(test, _members(op, av))


def _members(op: Any, av: Any) -> frozenset[str] | None:
    if op == sre_constants.LITERAL:
        return frozenset(_variants(av))
    if op != sre_constants.IN:
        return None  # ANY, NOT_LITERAL: nearly everything
    out: set[str] = set()
    for iop, iav in av:
        if iop == sre_constants.LITERAL:
            out |= _variants(iav)
        elif iop == sre_constants.RANGE and iav[1] - iav[0] <= 256:
            out.update(c for code in range(iav[0], iav[1] + 1) for c in _variants(code))
        elif iop == sre_constants.CATEGORY and iav == sre_constants.CATEGORY_SPACE:
            out |= _spaces()
        else:
            return None  # a negation, a large range or another class
    return frozenset(out)


def _overlap(a: _CharSet, b: _CharSet) -> bool:
    """Whether some character may match both. A class compiled with IGNORECASE
    decides on the lower-cased character (and tests the extra pairs themselves),
    so trying every listed variant of one side against the other is exact."""
    if a.members is not None:
        return any(b.test.fullmatch(c) for c in a.members)
    if b.members is not None:
        return any(a.test.fullmatch(c) for c in b.members)
    return True


def _first(items: Any) -> tuple[list[_CharSet], bool]:
    """The sets one of which holds the first character ``items`` take, and
    whether ``items`` can match empty (then what follows may come first)."""
    sets: list[_CharSet] = []
    for op, av in items:
        if op in _SINGLE_CHAR:
            sets.append(_charset(op, av))
            return sets, False
        if op == sre_constants.AT:
            continue
        if op in _REPEATS:
            inner, empty = _first(av[2])
            nullable = empty or av[0] == 0
        elif op == sre_constants.BRANCH:
            firsts = [_first(alt) for alt in av[1]]
            inner = [s for f, _ in firsts for s in f]
            nullable = any(e for _, e in firsts)
        elif op in (sre_constants.SUBPATTERN, sre_constants.ATOMIC_GROUP):
            inner, nullable = _first(av[-1])
        else:  # not reached after shape_problem; assume the worst
            inner, nullable = [_ANYTHING], True
        sets.extend(inner)
        if not nullable:
            return sets, False
    return sets, True


def _follow(items: Any, i: int, after: list[_CharSet]) -> list[_CharSet]:
    sets, empty = _first(items[i + 1 :])
    return sets + after if empty else sets


def _disjoint(sets: list[_CharSet], follow: list[_CharSet]) -> bool:
    return not any(_overlap(s, f) for s in sets for f in follow)


def ways(pattern: str) -> int:
    """How many ways a rule can try the rest of itself from one start position
    (an upper bound, see the comment above; only for rules shape_problem allows)."""
    return _seq_ways(sre_parse.parse(pattern, _FLAGS), [])


def _seq_ways(items: Any, after: list[_CharSet]) -> int:
    total = 1
    for i, (op, av) in enumerate(items):
        total *= _item_ways(op, av, _follow(items, i, after))
    return total


def _item_ways(op: Any, av: Any, follow: list[_CharSet]) -> int:
    if op in (sre_constants.SUBPATTERN, sre_constants.ATOMIC_GROUP):
        return _seq_ways(av[-1], follow)
    if op == sre_constants.BRANCH:
        counts = [_seq_ways(alt, follow) for alt in av[1]]
        return max(counts) if _exclusive(av[1]) else sum(counts)
    if op not in _REPEATS:
        return 1
    lo, hi, body = av
    if hi <= lo or op == sre_constants.POSSESSIVE_REPEAT:
        return _seq_ways(body, follow) if hi else 1
    first, empty = _first(body)
    if hi > 1:  # one character (shape_problem): n-m+1 lengths
        return 1 if _disjoint(first, follow) else hi - lo + 1
    inner = _seq_ways(body, follow)  # an optional item or group
    return inner if not empty and _disjoint(first, follow) else inner + 1


def _exclusive(alts: list[Any]) -> bool:
    """Whether no two alternatives can match from the same position: each pair
    differs, at some position of their leading characters, in characters."""
    heads = [_head(alt) for alt in alts]
    return all(
        any(not _overlap(x, y) for x, y in zip(a, b, strict=False))
        for i, a in enumerate(heads)
        for b in heads[i + 1 :]
    )


def _head(alt: Any) -> list[_CharSet]:
    """The character items an alternative begins with (assertions take none)."""
    head = []
    for op, av in alt:
        if op == sre_constants.AT:
            continue
        if op not in _SINGLE_CHAR:
            break
        head.append(_charset(op, av))
    return head


# A gap: a long repeat of a class too large to list ([^.\n]{0,60}). Each start
# before one rescans it, so the part after the last gap is worth a search of its own.
_GAP = 16


def tail_pattern(pattern: str) -> re.Pattern[str] | None:
    """The items after the rule's last top-level gap, compiled alone, or None
    when the rule has no gap. Every match of the rule holds a match of the tail
    at the same place of the same text (assertions such as \\b see the same
    neighbours), so a text without one cannot match the rule. Keyword spam makes
    a chained rule rescan its gaps from every keyword (a 1 MiB note of
    "reveal secret to a@b " cost 0.3 s); the tail alone is one short scan."""
    parsed = sre_parse.parse(pattern, _FLAGS)
    items: Any = parsed
    # A rule that is one group of alternatives: the alternatives' tails, as alternatives.
    if len(items) == 1 and items[0][0] == sre_constants.SUBPATTERN:
        items = items[0][1][-1]
    if len(items) == 1 and items[0][0] == sre_constants.BRANCH:
        alts = [_after_gap(alt) for alt in items[0][1][1]]
        if all(a is None for a in alts):
            return None
        branch = [alt if a is None else a for alt, a in zip(items[0][1][1], alts, strict=True)]
        tail = sre_parse.SubPattern(parsed.state, [(sre_constants.BRANCH, (None, branch))])
    elif (after := _after_gap(items)) is not None:
        tail = after
    else:
        return None
    compiled: re.Pattern[str] = sre_compiler.compile(tail, _FLAGS | re.UNICODE)
    return compiled


def _after_gap(items: Any) -> Any:
    """The items after the last gap of a sequence (a SubPattern), or None."""
    cut = None
    for i, (op, av) in enumerate(items):
        if op in _REPEATS and av[1] >= _GAP and av[1] != sre_constants.MAXREPEAT:
            body = av[2]
            if len(body) == 1 and body[0][0] in _SINGLE_CHAR and _members(*body[0]) is None:
                cut = i
    if cut is None or cut == len(items) - 1:
        return None
    return items[cut + 1 :]


def required_words(pattern: str) -> tuple[frozenset[str], ...] | None:
    """Groups of words (case-folded, no whitespace) such that every match of
    ``pattern`` contains a word of each group, or None when there are none to
    rely on. Only mandatory parts count: never one inside an optional or
    repeated part, and of alternatives only words every alternative offers."""
    if _FOLD is None:
        return None  # without IGNORECASE's own table a fold could miss a match
    groups = _seq_groups(sre_parse.parse(pattern, re.IGNORECASE | re.MULTILINE))
    # The strongest filter first (its shortest word the longest): an absent group ends the check.
    groups.sort(key=lambda ws: (-min(map(len, ws)), len(ws)))
    return tuple(frozenset(fold(w) for w in ws) for ws in groups) or None


def _seq_groups(items: Any) -> list[frozenset[str]]:
    """Every word group one sequence must match: each mandatory literal run
    (split at whitespace), and each mandatory group or branch every alternative
    of which has words (its group is the union of each alternative's best)."""
    groups: list[frozenset[str]] = []
    run: list[str] = []

    def end_run() -> None:
        if run:
            groups.append(frozenset(["".join(run)]))
            run.clear()

    for op, av in items:
        if op == sre_constants.LITERAL and not chr(av).isspace():
            run.append(chr(av))
            continue
        end_run()
        if op == sre_constants.SUBPATTERN:
            groups.extend(_seq_groups(av[-1]))
        elif op == sre_constants.BRANCH:
            best = [_best(_seq_groups(alt)) for alt in av[1]]
            if best and all(b is not None for b in best):
                groups.append(frozenset().union(*[b for b in best if b is not None]))
    end_run()
    return groups


def _best(groups: list[frozenset[str]]) -> frozenset[str] | None:
    return max(groups, key=lambda ws: (min(map(len, ws)), -len(ws)), default=None)


def _fold_table() -> dict[int, int | None]:
    """After str.lower(): characters ``re.IGNORECASE`` treats as equal become one
    (its own table of extra cases: dotless i and i, long s and s, micro and mu, ...)."""
    table: dict[int, int | None] = {}
    extra: dict[int, tuple[int, ...]] = importlib.import_module("re._casefix")._EXTRA_CASES
    for key, others in extra.items():
        group = (key, *others)
        for member in group:
            if member != min(group):
                table[member] = min(group)
    return table


try:
    _FOLD: dict[int, int | None] | None = _fold_table()
except (ImportError, AttributeError):  # pragma: no cover - another Python: no prefilter (fail closed)
    _FOLD = None


_DOTTED_I = {0x130: "i"}


def fold(text: str) -> str:
    """``text`` such that two characters ``re.IGNORECASE`` matches as equal are
    the same character, index for index (only for the prefilter: a fold may also
    join characters that IGNORECASE keeps apart, which only lets more through).
    İ is the one character whose lower() is longer (i + a combining dot), and
    IGNORECASE matches it as i: it becomes i first, so every index is kept."""
    if text.isascii():
        return text.lower()
    lowered = text.translate(_DOTTED_I).lower()
    return lowered if _FOLD is None else lowered.translate(_FOLD)


# Latin look-alikes from Cyrillic and Greek that NFKC leaves alone.
_CONFUSABLES = str.maketrans(
    "аеорсухіјѕԁɡκνοτАВЕКМНОРСТХІЈЅ",
    "aeopcyxijsdgkvotABEKMHOPCTXIJS",
)
# Every format (Cf) character of Unicode 14 (Python 3.11's unicodedata; a unit
# test keeps this in step), as one class: one C-speed pass over a 1 MiB note
# instead of a Python-level loop over each character.
_FORMAT = re.compile(
    "[\u00ad\u0600-\u0605\u061c\u06dd\u070f\u0890-\u0891\u08e2\u180e\u200b-\u200f\u202a-\u202e"
    "\u2060-\u2064\u2066-\u206f\ufeff\ufff9-\ufffb\U000110bd\U000110cd\U00013430-\U00013438"
    "\U0001bca0-\U0001bca3\U0001d173-\U0001d17a\U000e0001\U000e0020-\U000e007f]"
)


def normalize(text: str) -> str:
    """What the rules see. Hiding a phrase from the gate must not be cheaper than
    writing it: HTML entities are decoded and HTML comments removed; NFKC turns
    full-width and other compatibility letters into plain ones; invisible format
    characters (zero-width spaces and joiners, bidi controls, soft hyphens) are
    removed; and common Cyrillic and Greek look-alikes become Latin letters.
    Encodings such as base64 are not decoded. See :func:`check` for line breaks."""
    text = strip_comments(html.unescape(text))
    if text.isascii():
        return text  # NFKC, format characters and look-alikes are all non-ASCII
    return _FORMAT.sub("", unicodedata.normalize("NFKC", text)).translate(_CONFUSABLES)


def flatten(text: str) -> str:
    """``text`` with every whitespace run made one space (as ``re.sub(r"\\s+", " ",
    text)``: str.isspace is exactly ``\\s``, a unit test checks it), three times faster."""
    parts = text.split()
    if not parts:
        return " " if text else ""
    return (" " if text[0].isspace() else "") + " ".join(parts) + (" " if text[-1].isspace() else "")


def strip_comments(text: str) -> str:
    """``text`` without ``<!-- ... -->`` comments (an unclosed one runs to the end),
    in one left-to-right pass: a lazy ``<!--.*?-->`` regex rescans the rest of
    the text from every unclosed ``<!--`` (quadratic)."""
    out: list[str] = []
    pos = 0
    while (start := text.find("<!--", pos)) != -1:
        out.append(text[pos:start])
        end = text.find("-->", start + 4)
        if end == -1:
            # The old regex kept an unclosed comment as text; so do we.
            pos = start
            break
        pos = end + 3
    out.append(text[pos:])
    return "".join(out)


def check(text: str, *, ruleset: tuple[Rule, ...]) -> None:
    """Raise InjectionRefused naming the first rule of ``ruleset`` that matches ``text``."""
    seen = normalize(text)
    # Rules see the text twice: with its lines (for rules anchored at a line
    # start) and with every whitespace run made one space (so a phrase split over
    # lines still matches). Folding keeps whitespace, so the flat text's fold is
    # the folded text made flat.
    folded = fold(seen)
    flat: tuple[str, str] | None = None
    present: dict[str, bool] = {}  # rules share words: look each up once

    def occurs(word: str) -> bool:
        if word not in present:
            present[word] = word in folded
        return present[word]

    for rule in ruleset:
        # A rule one of whose word groups is absent cannot match (the words hold
        # no whitespace, so the flat text has the same ones): no regex scan at all.
        if rule.words is not None and not all(any(map(occurs, group)) for group in rule.words):
            continue
        # One plan per rule and text: the windows serve both the search and the
        # question whether the flat text needs its own pass.
        plan = _plan(rule, folded)
        m = _search(rule, seen, plan)
        if m is None and _flat_differs(seen, plan):
            if flat is None:  # made once, and only when a rule needs it
                flat_seen = flatten(seen)
                flat = (flat_seen, fold(flat_seen))
            m = _search(rule, flat[0], _plan(rule, flat[1]))
        if m is not None:
            excerpt = m.group(0)[:80]
            raise InjectionRefused(
                f"the note matches injection rule {rule.id!r} ({rule.description}): {excerpt!r}", rule=rule.id
            )


# Where the flat text differs from the text: a whitespace character other than
# a space, or two whitespace characters in a row.
_WS_CHANGE = re.compile(r"[^\S ]|\s\s")
# Every ASCII whitespace character but the space (str.isspace, which is \s).
_ASCII_WS = "\t\n\x0b\x0c\r\x1c\x1d\x1e\x1f"


def _ws_change(text: str) -> bool:
    """``_WS_CHANGE.search(text) is not None``; for ASCII text as a few substring
    searches (memchr speed; the regex tries two alternatives at every character).
    With no other whitespace, two in a row are two spaces."""
    if not text.isascii():
        return _WS_CHANGE.search(text) is not None
    return "  " in text or any(c in text for c in _ASCII_WS)


def _rarest(rule: Rule, folded: str) -> tuple[frozenset[str], int]:
    """The rule's word group with the fewest occurrences in ``folded``, and that number."""
    assert rule.words is not None
    counts = [(sum(folded.count(w) for w in ws), ws) for ws in rule.words]
    n, group = min(counts, key=lambda c: c[0])
    return group, n


def _plan(rule: Rule, folded: str) -> list[tuple[int, int]] | None:
    """Where to search: merged windows [start, end) that hold every match (and
    the characters around it, see :func:`_flat_differs`), or None for the whole
    text. Dense words (windows that would cover the text anyway) go straight to
    one whole-text search: building and searching tens of thousands of windows
    in Python cost more than the C-speed scan they were meant to save."""
    if rule.words is None:
        return None
    group, count = _rarest(rule, folded)
    width = rule.width + max(map(len, group)) + 2
    if count * (2 * width + 1) >= len(folded):
        return None
    return _windows(folded, group, width)


def _flat_differs(seen: str, plan: list[tuple[int, int]] | None) -> bool:
    """Whether the flat text could hold a match the text does not. Where the text
    around an occurrence of the rule's words has no whitespace to collapse, the
    flat text there is the same characters (with the same neighbours), so its
    windows were already searched; only the rest needs the flat pass. (Each
    window is widened so it holds a match's neighbours on both sides.)"""
    if plan is None:
        return _ws_change(seen)
    return any(_WS_CHANGE.search(seen, start, end) for start, end in plan)


def _search(rule: Rule, text: str, plan: list[tuple[int, int]] | None) -> re.Match[str] | None:
    """``rule.pattern.search(text)``, but only in the plan's windows (found by a
    plain substring search of ``text`` folded index for index): a match contains
    a word of each group and spans at most ``rule.width`` characters, so it lies
    within ``width`` of an occurrence of the rarest group. A note without any of
    the words costs a few substring searches. The first match decides: the gate
    refuses on any."""
    if plan is None:
        # Dense words: one whole-text search, unless the rule's tail occurs nowhere.
        if rule.tail is not None and rule.tail.search(text) is None:
            return None
        return rule.pattern.search(text)
    for start, end in plan:
        pos = start
        while (m := rule.pattern.search(text, pos, end)) is not None:
            # The window's end is the text's end to the engine (for \b and $):
            # confirm against the whole text.
            if (real := rule.pattern.match(text, m.start())) is not None:
                return real
            pos = m.start() + 1
    return None


def _windows(folded: str, words: frozenset[str], width: int) -> list[tuple[int, int]]:
    """Merged ranges [start, end) that hold every match containing an occurrence
    of one of ``words``: from ``width`` before its end to ``width`` after its
    start, plus one character so \b and $ at a match's end see what follows.
    Overlapping windows become one, so no character is searched twice."""
    spans = []
    for word in words:
        at = folded.find(word)
        while at != -1:
            spans.append((max(0, at + len(word) - width), min(len(folded), at + width + 1)))
            at = folded.find(word, at + 1)
    spans.sort()
    merged: list[tuple[int, int]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged

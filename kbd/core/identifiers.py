"""Identifier rules shared by workflows and principals (docs/on-disk.md "IDs")."""

from __future__ import annotations

import re

MAX_ID_LEN = 128
ALIAS_RE = re.compile(r"[a-z][a-z0-9_]{0,47}")
RESERVED_ALIASES = frozenset({"access"})


#: Unicode categories no ID may contain (docs/on-disk.md "IDs"): control (Cc, C0 and C1),
#: format (Cf: zero-width characters, bidi overrides), line and paragraph
#: separators (Zl, Zp). Together with whitespace (``str.isspace``) these are the
#: characters that make two IDs look the same, or that break a line in a
#: listing, a log or an agent's context block.
_UNPLAIN = {"Cc": "a control character", "Cf": "a format character (invisible or bidi)",
            "Zl": "a line separator", "Zp": "a paragraph separator"}  # fmt: skip


def char_name(ch: str) -> str:
    """``U+200B ZERO WIDTH SPACE``: how an error names a character it refuses
    (never the raw character, which may be invisible or reorder the message)."""
    import unicodedata

    name = unicodedata.name(ch, "")
    return f"U+{ord(ch):04X}" + (f" {name}" if name else "")


def unplain_problem(value: str) -> str | None:
    """Why ``value`` holds a character that has no place in an ID or a name shown
    on one line (Cc, Cf, Zl, Zp or whitespace), naming the first one and where."""
    import unicodedata

    for i, ch in enumerate(value):
        what = _UNPLAIN.get(unicodedata.category(ch))
        if what is None and ch.isspace():
            what = "whitespace"
        if what is not None:
            return f"must not contain {what}: {char_name(ch)} at position {i}"
    return None


def id_problem(value: object) -> str | None:
    """Return why ``value`` is not a valid workflow or principal ID, or None if it is.

    docs/on-disk.md "IDs": a non-empty string of at most :data:`MAX_ID_LEN` characters, no
    ``/`` or ``\\``, not ``.`` or ``..``, and no control (Cc, C1 included),
    format (Cf), line/paragraph-separator (Zl, Zp) or whitespace character
    anywhere.
    """
    if not isinstance(value, str):
        return "must be a string"
    if not value:
        return "must not be empty"
    if len(value) > MAX_ID_LEN:
        return f"must be at most {MAX_ID_LEN} characters (got {len(value)})"
    if "/" in value or "\\" in value:
        return "must not contain '/' or '\\' (an ID is not a path)"
    if (problem := unplain_problem(value)) is not None:
        return problem + " (an ID holds no control, format, line-separator or whitespace characters)"
    if value in {".", ".."}:
        return "must not be '.' or '..'"
    return None


def alias_problem(value: object) -> str | None:
    """Return why ``value`` is not a valid attachment alias, or None if it is."""
    if not isinstance(value, str):
        return "must be a string"
    if not ALIAS_RE.fullmatch(value):
        return "must be 1-48 characters of lowercase letters, digits and underscores, starting with a letter"
    if value in RESERVED_ALIASES:
        return "is reserved (WORKFLOW_KB_ACCESS carries the session's KB access mode)"
    return None


def env_name(alias: str) -> str:
    return f"WORKFLOW_KB_{alias.upper()}"


def one_line(text: str, *, limit: int = 120) -> str:
    """Untrusted text (a label, a file name) made safe to show on one line of a
    terminal or an agent's context: control and format characters become
    ``\\xNN``-style escapes, so a newline or carriage return cannot forge a
    second line or overwrite the first; long text is cut with an ellipsis."""
    if text.isprintable():
        # No Cc/Cf/Zl/Zp character can be present (isprintable is False for all
        # of them): the common case skips the per-character walk (plan lookups
        # render every label this way).
        shown = text
    else:
        import unicodedata

        shown = "".join(
            ch.encode("unicode_escape").decode("ascii")
            if unicodedata.category(ch) in ("Cc", "Cf", "Zl", "Zp")
            else ch
            for ch in text
        )
    return shown if len(shown) <= limit else shown[: limit - 1] + "…"

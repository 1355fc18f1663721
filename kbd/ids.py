"""Identifier rules shared by workflows and principals (DESIGN §2)."""

from __future__ import annotations

import re

MAX_ID_LEN = 128
ALIAS_RE = re.compile(r"[a-z][a-z0-9_]{0,47}")
RESERVED_ALIASES = frozenset({"access"})


def id_problem(value: object) -> str | None:
    """Return why ``value`` is not a valid workflow or principal ID, or None if it is."""
    if not isinstance(value, str):
        return "must be a string"
    if not value:
        return "must not be empty"
    if value != value.strip():
        return "must not start or end with whitespace"
    if "/" in value or "\\" in value:
        return "must not contain '/' or '\\' (an ID is not a path)"
    if "\x00" in value:
        return "must not contain NUL"
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in value):
        return "must not contain control characters"
    if value in {".", ".."}:
        return "must not be '.' or '..'"
    if len(value) > MAX_ID_LEN:
        return f"must be at most {MAX_ID_LEN} characters (got {len(value)})"
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
    import unicodedata

    out = []
    for ch in text:
        if unicodedata.category(ch) in ("Cc", "Cf", "Zl", "Zp"):
            out.append(ch.encode("unicode_escape").decode("ascii"))
        else:
            out.append(ch)
    shown = "".join(out)
    return shown if len(shown) <= limit else shown[: limit - 1] + "…"

"""Schemathesis hooks for tests/integration/test_api_schema.py (loaded by the
``st`` process through its ``hooks`` setting): strategies for the string
formats /openapi.json names (docs/api.md "Malformed requests"), each drawing only what the
operations' own checks accept, so a "valid" example is valid to the server."""

from __future__ import annotations

import json
from typing import Any

import schemathesis
from hypothesis import strategies as st

from kbd.core.identifiers import MAX_ID_LEN, id_problem
from kbd.core.knowledge import MAX_QUERY_CHARS, match_expression
from kbd.errors import KbdError

# Letters, marks, numbers, punctuation, symbols: never a control, format,
# separator, surrogate, private-use or unassigned character.
_PRINTABLE = st.characters(categories=["L", "M", "N", "P", "S"])


def _searchable(query: str) -> bool:
    try:
        match_expression(query)
    except KbdError:
        return False
    return True


_ids = st.text(_PRINTABLE, min_size=1, max_size=MAX_ID_LEN).filter(lambda s: id_problem(s) is None)
schemathesis.openapi.format("kbd-id", _ids)
schemathesis.openapi.format("kbd-new-workflow-id", _ids.filter(lambda s: not s.startswith(".")))
# A workflow.json as kbd reads one: an ID (most name no workflow: 404) and what else kbd models.
schemathesis.openapi.format(
    "kbd-workflow-json",
    st.builds(
        lambda wid, readers: json.dumps({"id": wid, "access": {"owners": ["bob"], "readers": readers}}),
        _ids,
        st.lists(_ids, max_size=3),
    ),
)
schemathesis.openapi.format("kbd-search-query", st.text(max_size=MAX_QUERY_CHARS).filter(_searchable))
schemathesis.openapi.format(
    "kbd-label", st.text(st.one_of(_PRINTABLE, st.just(" ")), min_size=1, max_size=200).filter(str.strip)
)


@schemathesis.hook
def before_call(context: Any, case: Any, kwargs: dict[str, Any]) -> None:
    """The change feed follows until its client leaves (docs/daemon.md "The change feed"): asked to follow, it
    is asked for its bounded replay instead
    (``follow=false``), any other value of ``follow`` stays as generated."""
    del context, kwargs
    query = case.query if isinstance(case.query, dict) else {}
    if case.path == "/v1/events" and query.get("follow") in (None, True, "true"):
        case.query = {**query, "follow": "false"}

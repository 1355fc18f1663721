"""Hypothesis strategies for kbd's access model (docs/on-disk.md, docs/access.md).

Everything here produces plain JSON-ready data (dicts and lists, as they would
sit in a ``workflow.json``) or a :class:`kbd.core.principals.Principals` table, so
the tests feed kbd exactly what it reads from disk and keep their own oracles
independent of kbd's parsing.

The principal pool is small on purpose: audiences then overlap, collide and
contain admins often enough for the interesting cases to be common.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import cache
from typing import Any, TypeVar

from hypothesis import strategies as st

from kbd.core.principals import Principal, Principals

# -- principals -----------------------------------------------------------------

USERS = ("alice", "bob", "carol", "dave", "erin")
ADMIN = "ops"  # always an enabled admin
SERVICE = "svc"
DISABLED = "mallory"
DISABLED_ADMIN = "exadmin"  # an admin that is disabled: an ordinary member
UNKNOWN = ("ghost", "zed")  # listed in audiences, absent from principals.yaml
KNOWN = (*USERS, ADMIN, SERVICE, DISABLED, DISABLED_ADMIN)
POOL = (*KNOWN, *UNKNOWN)

# Top-level workflow.json fields kbd reads or owns (docs/on-disk.md); anything else is "unknown".
KNOWN_FIELDS = frozenset(
    {"id", "label", "host", "created_by", "access", "knowledgebase_sources", "folder_access"}
)
HOST = "test-host"
OTHER_HOST = "elsewhere"
# Source workflow IDs of generated worlds (some with characters an ID may hold).
SOURCE_IDS = ("wf_rts", "wf_sec", "wf_cost", "wf_docs", "wf+pay", "wf:ü", "wf.7", "WF-Big")
CONSUMER_ID = "wf_con"

# Characters safe inside a valid ID: no whitespace, no '/', no '\\', no control characters.
_ID_ALPHABET = st.characters(
    codec="utf-8",
    categories=["L", "N", "Pc", "Pd", "Po", "S"],
    exclude_characters="/\\",
)


# Strategies are built once and shared: hypothesis validates every new strategy
# object, which dominates the run time when composites build them per draw.

T = TypeVar("T")


def weighted(*options: tuple[int, st.SearchStrategy[T]]) -> st.SearchStrategy[T]:
    """Choose among strategies with integer weights (``st.one_of`` picks evenly,
    and repeating a strategy in it does not change that). Shrinks towards the first."""
    table = [strategy for weight, strategy in options for _ in range(weight)]
    return st.integers(0, len(table) - 1).flatmap(lambda i: table[i])


@cache
def valid_ids() -> st.SearchStrategy[str]:
    """Workflow or principal IDs that are valid by construction (docs/on-disk.md)."""
    short = st.text(_ID_ALPHABET, min_size=1, max_size=16)
    # No whitespace anywhere (docs/on-disk.md "IDs"): punctuation-joined instead.
    joined = st.tuples(short, st.sampled_from("-_.:@"), short).map("".join)
    longest = st.text(_ID_ALPHABET, min_size=120, max_size=128)
    return weighted((6, short), (2, joined), (1, longest)).filter(lambda s: s not in {".", ".."})


@cache
def principal_ids() -> st.SearchStrategy[str]:
    """Mostly the shared pool (so audiences collide), sometimes an arbitrary valid ID."""
    return weighted((7, st.sampled_from(POOL)), (1, valid_ids()))


@cache
def principal_sets(*, min_size: int = 0, max_size: int = 4) -> st.SearchStrategy[list[str]]:
    """A list of principal IDs as written in an ``access`` tier (duplicates allowed)."""
    return st.lists(principal_ids(), min_size=min_size, max_size=max_size)


@st.composite
def principal_tables(draw: st.DrawFn) -> Principals:
    """principals.yaml: fixed roles for ops/svc/mallory/exadmin, random flags for the users."""
    by_id: dict[str, Principal] = {
        ADMIN: Principal(ADMIN, admin=True),
        SERVICE: Principal(SERVICE, kind="service"),
        DISABLED: Principal(DISABLED, disabled=True),
        DISABLED_ADMIN: Principal(DISABLED_ADMIN, admin=True, disabled=True),
    }
    for user in USERS:
        by_id[user] = Principal(
            user, kind=draw(_KINDS), admin=draw(st.booleans()), disabled=draw(st.booleans())
        )
    return Principals(by_id=by_id)


# -- access blocks ----------------------------------------------------------------------

_ABSENT = object()
_KINDS = st.sampled_from(("user", "user", "service"))
_SMALL = st.integers(0, 4)
_LEGACY_CREATED_BY = st.sampled_from([_ABSENT, None, "", "  ", "\t"])
_OWNER_STYLE = st.sampled_from(("owners", "created_by", "both"))
_OTHER_TIER = st.sampled_from(("auditors", "viewers"))
_JUNK = st.sampled_from(["free text", [], [1, 2], {"x": 1}, None, True])


@st.composite
def access_fields(
    draw: st.DrawFn, *, legacy: bool | None = None, writers: Sequence[str] = ()
) -> dict[str, Any]:
    """The audience-related top-level fields of a workflow.json: ``created_by`` and ``access``.

    ``legacy=True`` gives no effective owner (owners absent or empty, created_by
    absent, null or blank); ``False`` guarantees one; ``None`` draws either.
    ``writers`` are candidate workflow IDs for ``access.allowed_kb_writers``.
    """
    if legacy is None:
        legacy = draw(_SMALL) == 0
    out: dict[str, Any] = {}
    access: dict[str, Any] = {}
    if legacy:
        if draw(st.booleans()):
            access["owners"] = []
        created_by = draw(_LEGACY_CREATED_BY)
        if created_by is not _ABSENT:
            out["created_by"] = created_by
    else:
        style = draw(_OWNER_STYLE)
        if style in ("owners", "both"):
            access["owners"] = draw(principal_sets(min_size=1, max_size=3))
        elif draw(st.booleans()):
            access["owners"] = []
        if style in ("created_by", "both"):
            out["created_by"] = draw(principal_ids())
    for tier in ("editors", "readers"):
        if draw(st.booleans()):
            access[tier] = draw(principal_sets())
    if draw(_SMALL) == 0:
        # A tier kbd does not know: counts in a consumer's audience only.
        access[draw(_OTHER_TIER)] = draw(principal_sets(min_size=1))
    if draw(_SMALL) == 0:
        # Non-tier junk under access: ignored.
        access["note"] = draw(_JUNK)
    if draw(st.booleans()):
        access["allowed_kb_writers"] = draw(_writer_lists(tuple(writers)))
    keep_empty: bool = draw(st.booleans())
    if access or keep_empty:
        out["access"] = access
    return out


@cache
def _writer_lists(writers: tuple[str, ...]) -> st.SearchStrategy[list[str]]:
    # Hand-edited junk ("", " wf_con ", "wf/x") is ignored by kbd, never trimmed into a grant.
    return st.lists(st.sampled_from([*writers * 4, "wf_other", " wf_con ", "", "wf/x"]), max_size=4)


# -- attachment entries -------------------------------------------------------------


@cache
def aliases() -> st.SearchStrategy[str]:
    """Valid attachment aliases (``^[a-z][a-z0-9_]{0,47}$``, not ``access``)."""
    short = st.sampled_from(("rts", "sec", "cost", "docs", "pay", "a", "x_1", "notes"))
    generated = st.from_regex(r"[a-z][a-z0-9_]{0,47}", fullmatch=True)
    return weighted((2, short), (1, generated)).filter(lambda a: a != "access")


@cache
def any_workflow_ids() -> st.SearchStrategy[str]:
    """A generated world's source IDs, or any other valid ID (not found)."""
    return st.one_of(st.sampled_from(SOURCE_IDS), valid_ids())


_MODES = st.sampled_from(("read", "write", None))


@cache
def valid_entries(ids: st.SearchStrategy[str] | None = None) -> st.SearchStrategy[dict[str, Any]]:
    """One well-formed ``knowledgebase_sources`` entry (access explicit or defaulted)."""
    wid = ids if ids is not None else any_workflow_ids()

    def build(t: tuple[str, str, str | None]) -> dict[str, Any]:
        entry: dict[str, Any] = {"workflow_id": t[0], "alias": t[1]}
        if t[2] is not None:
            entry["access"] = t[2]
        return entry

    return st.tuples(wid, aliases(), _MODES).map(build)


BAD_IDS: tuple[Any, ...] = (
    "",
    " wf_rts",
    "wf_rts ",
    "wf_rts\n",
    "\u2003wf",
    "../wf_rts",
    "workflows/rts",
    "wf\\rts",
    "wf\x00rts",
    "wf\x07",
    "wf\x7f",
    ".",
    "..",
    "x" * 129,
    None,
    7,
    ["wf_rts"],
)
BAD_ALIASES: tuple[Any, ...] = (
    "",
    "access",
    "Rts",
    "1rts",
    "_rts",
    "rts-1",
    "rts\n",
    "r" * 49,
    "ärts",
    "rts ",
    None,
    3,
)
BAD_ACCESS: tuple[Any, ...] = ("READ", "admin", "rw", "", None, 1, True, ["read"])
_INVALID_KIND = st.sampled_from(
    ("not_object", "unknown_key", "missing", "bad_id", "bad_alias", "bad_access", "self")
)
_NOT_OBJECT = st.sampled_from(["wf_rts", 1, None, ["wf_rts", "rts"], True])
_UNKNOWN_ENTRY_KEY = st.sampled_from(("path", "label", "Alias", "write"))
_REQUIRED_KEY = st.sampled_from(("workflow_id", "alias"))
_BAD_ID = st.sampled_from(BAD_IDS)
_BAD_ALIAS = st.sampled_from(BAD_ALIASES)
_BAD_ACCESS = st.sampled_from(BAD_ACCESS)


@st.composite
def invalid_entries(draw: st.DrawFn, *, self_id: str = CONSUMER_ID) -> Any:
    """An entry that is wrong on its own (shape, key, ID, alias, access or self-reference)."""
    base = draw(valid_entries())
    kind = draw(_INVALID_KIND)
    if kind == "not_object":
        return draw(_NOT_OBJECT)
    if kind == "unknown_key":
        base[draw(_UNKNOWN_ENTRY_KEY)] = "x"
    elif kind == "missing":
        del base[draw(_REQUIRED_KEY)]
    elif kind == "bad_id":
        base["workflow_id"] = draw(_BAD_ID)
    elif kind == "bad_alias":
        base["alias"] = draw(_BAD_ALIAS)
    elif kind == "bad_access":
        base["access"] = draw(_BAD_ACCESS)
    else:
        base["workflow_id"] = self_id
    return base


@cache
def entries(*, self_id: str = CONSUMER_ID) -> st.SearchStrategy[Any]:
    """Any entry, valid or not (valid ones about three times as often)."""
    v = valid_entries(_SOURCE_ID)
    return weighted((3, v), (1, valid_entries()), (1, invalid_entries(self_id=self_id)))


_SOURCE_ID = st.sampled_from(SOURCE_IDS)


@st.composite
def entry_lists(draw: st.DrawFn, *, self_id: str = CONSUMER_ID, max_size: int = 22) -> list[Any]:
    """A ``knowledgebase_sources`` list as found on disk: possibly with duplicates,
    invalid entries or more than 20 entries."""
    size = min(draw(_UP_TO_22), max_size) if draw(_SMALL) == 0 else min(draw(_FEW), max_size)
    one = entries(self_id=self_id)
    return [draw(one) for _ in range(size)]


@st.composite
def clean_entry_lists(draw: st.DrawFn, *, self_id: str = CONSUMER_ID) -> list[dict[str, Any]]:
    """A list that is valid as a whole: unique aliases and IDs, no self, at most 20."""
    size = draw(_UP_TO_20) if draw(_SMALL) == 0 else draw(_FEW)
    ids: list[str] = []
    names: list[str] = []
    for _ in range(4 * size):
        wid = draw(any_workflow_ids())
        if wid != self_id and wid not in ids:
            ids.append(wid)
        alias = draw(aliases())
        if alias not in names:
            names.append(alias)
        if min(len(ids), len(names)) >= size:
            break
    size = min(len(ids), len(names), size)
    ids, names = ids[:size], names[:size]
    out: list[dict[str, Any]] = []
    for wid, alias in zip(ids, names, strict=True):
        mode = draw(_MODES)
        entry: dict[str, Any] = {"workflow_id": wid, "alias": alias}
        if mode is not None:
            entry["access"] = mode
        out.append(entry)
    return out


@st.composite
def candidate_source_lists(draw: st.DrawFn, *, self_id: str = CONSUMER_ID) -> Any:
    """Values offered to ``validate_sources``: about half valid lists, the rest
    broken in one or more ways (bad entries, duplicates, self, too many, not a list).
    Whether a value is valid is for the test's oracle to decide, not this strategy."""
    if draw(_ONE_IN_16) == 0:
        return draw(_NOT_A_LIST)
    items: list[Any] = list(draw(clean_entry_lists(self_id=self_id)))
    if draw(st.booleans()):
        return items
    for _ in range(draw(_ONE_TO_3)):
        how = draw(_BREAKAGE)
        where = draw(_POSITION) % (len(items) + 1)
        if how == "bad_entry":
            items.insert(where, draw(invalid_entries(self_id=self_id)))
        elif how == "any_entry":
            items.insert(where, draw(entries(self_id=self_id)))
        elif how in ("dup_alias", "dup_id") and items:
            dicts = [e for e in items if isinstance(e, dict)] or [{}]
            victim = dicts[draw(_POSITION) % len(dicts)]
            copy = draw(valid_entries())
            key = "alias" if how == "dup_alias" else "workflow_id"
            if key in victim:
                copy[key] = victim[key]
            items.insert(where, copy)
        elif how == "too_many":
            extra = draw(clean_entry_lists(self_id=self_id))
            filler = [{"workflow_id": f"wf_fill_{i}", "alias": f"fill_{i}"} for i in range(21)]
            items = items + extra + filler[: max(0, 21 - len(items) - len(extra))]
    return items


# -- manifests -----------------------------------------------------------------------


_FEW = st.integers(0, 6)
_UP_TO_20 = st.integers(0, 20)
_UP_TO_22 = st.integers(0, 22)
_ONE_IN_16 = st.integers(0, 15)
_ONE_TO_3 = st.integers(1, 3)
_POSITION = st.integers(0, 1000)
_BREAKAGE = st.sampled_from(("bad_entry", "dup_alias", "dup_id", "too_many", "any_entry"))
_NOT_A_LIST = st.sampled_from([None, {}, "wf_rts", 3, {"workflow_id": "wf_rts", "alias": "rts"}])
_LABELS = st.text(max_size=20)
_HOSTS = st.sampled_from([_ABSENT, _ABSENT, None, HOST, OTHER_HOST])


@cache
def json_values(*, max_leaves: int = 10) -> st.SearchStrategy[Any]:
    """JSON values kbd does not own: big ints, exact floats, unicode, nesting."""
    leaves = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(),
        st.integers(min_value=2**63 - 2, max_value=2**200),
        st.integers(min_value=-(2**200), max_value=-(2**63)),
        st.floats(allow_nan=False, allow_infinity=False),
        st.sampled_from([0.1, 1e-320, 5e-324, 1.7976931348623157e308, -0.0, 1e22, 123456789.123456789]),
        st.text(max_size=12),
        st.sampled_from(["é", "漢字", "😀", "\u200b", "\u2028", "\ufeff", '"\\', "</script>"]),
    )
    return st.recursive(
        leaves,
        lambda children: st.one_of(
            st.lists(children, max_size=4),
            st.dictionaries(st.text(max_size=8), children, max_size=4),
        ),
        max_leaves=max_leaves,
    )


@cache
def unknown_keys() -> st.SearchStrategy[str]:
    return st.one_of(
        st.sampled_from(("schedule", "soul", "model", "Access", "ID", "knowledgebase", "", " id", "🔑")),
        st.text(max_size=12),
    ).filter(lambda k: k not in KNOWN_FIELDS)


@cache
def extra_fields(
    *, values: st.SearchStrategy[Any] | None = None, min_size: int = 0
) -> st.SearchStrategy[dict[str, Any]]:
    """Random unknown top-level fields of a workflow.json."""
    return st.dictionaries(unknown_keys(), values or json_values(), min_size=min_size, max_size=5)


@st.composite
def manifests(
    draw: st.DrawFn,
    *,
    wid: str | st.SearchStrategy[str] | None = None,
    legacy: bool | None = None,
    sources: st.SearchStrategy[Any] | None = None,
    writers: Sequence[str] = (),
    extra: bool = True,
) -> dict[str, Any]:
    """A workflow.json as a dict: id, maybe label and host, audience fields,
    maybe ``knowledgebase_sources``, and (``extra``) unknown fields, in a random order."""
    if wid is None:
        wid = valid_ids()
    doc: dict[str, Any] = {"id": wid if isinstance(wid, str) else draw(wid)}
    if draw(st.booleans()):
        doc["label"] = draw(_LABELS)
    host = draw(_HOSTS)
    if host is not _ABSENT:
        doc["host"] = host
    doc.update(draw(access_fields(legacy=legacy, writers=writers)))
    if sources is not None:
        doc["knowledgebase_sources"] = draw(sources)
    if extra:
        for key, value in draw(extra_fields()).items():
            doc.setdefault(key, value)
    keys = list(doc)
    draw(st.randoms(use_true_random=False)).shuffle(keys)
    return {k: doc[k] for k in keys}


def encode(doc: Any) -> bytes:
    """Bytes of a workflow.json as a hand editor or another tool could write them."""
    return json.dumps(doc, ensure_ascii=True).encode("ascii")


# -- note names (docs/access.md "Names") ------------------------------------------------------------

#: Path components a contributor (or a confused agent) might send as a note name:
#: plain and odd-but-fine names, every suffix class, the index and look-alikes, kbd's
#: temp names, traversal pieces, and every character class the name rule refuses
#: (C0, DEL, C1, backslash) beside look-alikes it allows (U+2028, U+200B, é).
NOTE_COMPONENTS: tuple[str, ...] = (
    "a.md",
    "fact.md",
    "x.txt",
    "y.markdown",
    "Z.MD",
    "README",
    "x.json",
    "x.md.sh",
    "sub",
    "new",
    "_index.json",
    "_INDEX.json",
    "\uff3findex.json",
    "_\u0131ndex.json",
    ".kbd-0123456789abcdef.tmp",
    ".",
    "..",
    "",
    "...md",
    "a\\b.md",
    "..\\..\\x.md",
    "evil\nWORKFLOW_KB_X=1.md",
    "a\r.md",
    "a\t.md",
    "a\x1b[31m.md",
    "a\x7f.md",
    "a\x85.md",
    "a\x9b.md",
    "a\x00.md",
    "a\u2028.md",
    "a\u200b.md",
    "caf\u00e9.md",
    "\udcff.md",
    "x" * 253 + ".md",
)


@st.composite
def note_relpaths(draw: st.DrawFn) -> str:
    """A RELPATH for ``kbd notes write`` / the tail of a ``kbd check`` path: 1-3
    components from :data:`NOTE_COMPONENTS` or generated text, an optional
    leading ``/`` or ``./`` and an optional trailing ``/``, ``/.`` or ``//``."""
    generated = st.tuples(
        st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=8),
        st.sampled_from(("", ".md", ".txt")),
    ).map("".join)
    component = weighted((4, st.sampled_from(NOTE_COMPONENTS)), (1, generated))
    parts = draw(st.lists(component, min_size=1, max_size=3))
    head = draw(st.sampled_from(("", "", "", "/", "./")))
    tail = draw(st.sampled_from(("", "", "", "/", "/.", "//")))
    return head + "/".join(parts) + tail

"""Property tests of the access rules (docs/on-disk.md, docs/access.md) over generated audiences and manifests.

Pure: kbd.core.audience, kbd.core.manifest and kbd.core.resolve over a fake SourceView. The
oracles below restate the contract of docs/access.md on the raw JSON dicts, without
kbd's parsing, so a wrong parse and a wrong rule are both caught.
"""

from __future__ import annotations

import copy
import json
import math
import string
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import assume, event, given
from hypothesis import strategies as st

from kbd.core import audience
from kbd.core.manifest import Manifest, SourceRef, parse_manifest, render, validate_sources, with_sources
from kbd.core.principals import Principals
from kbd.core.resolve import REASONS, WRITE_NOT_GRANTED, Attachment, resolve_all
from kbd.errors import InvalidManifest, ManifestUnreadable
from kbd.fs.registry import Ambiguous, Folder, Found, KbProbe, KbProblem, Lookup, Missing, Unreadable
from tests import strategies as s

# -- oracles over raw workflow.json dicts (docs/on-disk.md, docs/access.md) ---------------------------------

TIERS = ("owners", "editors", "readers")


def _access(doc: dict[str, Any]) -> dict[str, Any]:
    value = doc.get("access")
    return value if isinstance(value, dict) else {}


def _tier(doc: dict[str, Any], name: str) -> list[str]:
    return list(_access(doc).get(name, []))


def effective_owners(doc: dict[str, Any]) -> set[str]:
    owners = _tier(doc, "owners")
    if owners:
        return set(owners)
    created_by = doc.get("created_by")
    return {created_by} if isinstance(created_by, str) and created_by.strip() else set()


def is_legacy(doc: dict[str, Any]) -> bool:
    return not effective_owners(doc)


def source_audience(doc: dict[str, Any]) -> set[str]:
    return effective_owners(doc) | set(_tier(doc, "editors")) | set(_tier(doc, "readers"))


def consumer_audience(doc: dict[str, Any]) -> set[str]:
    """Tiers kbd does not know narrow a consumer (they are readers of its outputs too)."""
    out = source_audience(doc)
    for key, value in _access(doc).items():
        if key in (*TIERS, "allowed_kb_writers"):
            continue
        if isinstance(value, list) and value and all(isinstance(x, str) for x in value):
            out |= set(value)
    return out


def enabled_admin(principals: Principals, pid: str) -> bool:
    p = principals.by_id.get(pid)
    return p is not None and p.admin and not p.disabled


def oracle_can_read(consumer: dict[str, Any], source: dict[str, Any], principals: Principals) -> bool:
    if is_legacy(source):
        return True
    if is_legacy(consumer):
        return False
    allowed = source_audience(source)
    return all(p in allowed or enabled_admin(principals, p) for p in consumer_audience(consumer))


def oracle_can_write(consumer: dict[str, Any], source: dict[str, Any], principals: Principals) -> bool:
    writers = _access(source).get("allowed_kb_writers", [])
    return (
        oracle_can_read(consumer, source, principals)
        and not is_legacy(source)
        and consumer["id"] in [w for w in writers if oracle_id_ok(w)]
    )


def oracle_id_ok(value: object) -> bool:
    """docs/on-disk.md / kbd.core.identifiers: non-empty string, no '/', '\\', no control (Cc, C1 included),
    format (Cf), line/paragraph-separator (Zl, Zp) or whitespace character anywhere
    (docs/on-disk.md "IDs"), not '.' or '..',
    at most 128 characters."""
    if not isinstance(value, str) or not value:
        return False
    if any(c.isspace() or unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp") for c in value):
        return False
    if any(c in "/\\" for c in value):
        return False
    return value not in (".", "..") and len(value) <= 128


_ALIAS_HEAD = frozenset(string.ascii_lowercase)
_ALIAS_TAIL = _ALIAS_HEAD | frozenset(string.digits) | {"_"}


def oracle_alias_ok(value: object) -> bool:
    """``^[a-z][a-z0-9_]{0,47}$`` (ASCII only, no trailing newline), not ``access``."""
    if not isinstance(value, str) or not 1 <= len(value) <= 48:
        return False
    return value[0] in _ALIAS_HEAD and all(c in _ALIAS_TAIL for c in value[1:]) and value != "access"


def oracle_validate(raw: Any, *, self_id: str) -> list[tuple[str, str, str]] | None:
    """The accepted (workflow_id, alias, access) list, or None when the value must be rejected."""
    if not isinstance(raw, list) or len(raw) > 20:
        return None
    out: list[tuple[str, str, str]] = []
    for item in raw:
        if not isinstance(item, dict) or not set(item) <= {"workflow_id", "alias", "access"}:
            return None
        if "workflow_id" not in item or "alias" not in item:
            return None
        wid, alias, access = item["workflow_id"], item["alias"], item.get("access", "read")
        if not oracle_id_ok(wid) or not oracle_alias_ok(alias):
            return None
        if not (isinstance(access, str) and access in ("read", "write")):
            return None
        if wid == self_id or any(alias == a or wid == w for w, a, _ in out):
            return None
        out.append((wid, alias, access))
    return out


def same_json(a: Any, b: Any) -> bool:
    """Equal as JSON values, strictly: same types (1 is not 1.0), same sign of zero, same key order."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)
    if isinstance(a, dict):
        return list(a) == list(b) and all(same_json(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same_json(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


# -- edits on raw dicts -------------------------------------------------------------------


def parse(doc: dict[str, Any]) -> Manifest:
    return parse_manifest(s.encode(doc))


def add_member(doc: dict[str, Any], tier: str, member: str) -> dict[str, Any]:
    """``doc`` with ``member`` added to its audience through ``tier``, keeping everyone else.

    Two cases are not a plain list append, because the contract makes them
    change more than one member: the first explicit owner replaces the
    ``created_by`` fallback (so created_by is listed with it), and an owner on a
    legacy (account-visible) workflow would *narrow* "everyone" to one person
    (so on a legacy workflow the member is added as an editor; it stays legacy).
    """
    new = copy.deepcopy(doc)
    access = new.get("access")
    if not isinstance(access, dict):
        access = {}
        new["access"] = access
    if tier == "owners":
        if is_legacy(doc):
            tier = "editors"
        elif not access.get("owners"):
            access["owners"] = [new["created_by"], member]
            return new
    current = access.get(tier)
    access[tier] = [*(current if isinstance(current, list) else []), member]
    return new


def remove_member(doc: dict[str, Any], member: str) -> dict[str, Any]:
    new = copy.deepcopy(doc)
    access = _access(new)
    for tier in TIERS:
        if tier in access:
            access[tier] = [p for p in access[tier] if p != member]
    if new.get("created_by") == member:
        del new["created_by"]
    return new


# -- a fake SourceView -----------------------------------------------------------------

FOLDERS = Path("/srv/kbd/workflows")


@dataclass
class FakeView:
    """``kbd.core.resolve.SourceView`` over a dict; records what was asked."""

    lookups: dict[str, Lookup]
    kb: dict[Path, KbProblem] = field(default_factory=dict)
    asked: list[str] = field(default_factory=list)

    def find(self, workflow_id: str) -> Lookup:
        self.asked.append(workflow_id)
        return self.lookups.get(workflow_id, Missing(workflow_id))

    def kb_problem(self, workflow_folder: Path) -> KbProblem | None:
        return self.kb.get(workflow_folder)

    def probe_kb(self, workflow_folder: Path, *, notes: bool = False) -> KbProbe:
        problem = self.kb_problem(workflow_folder)
        if problem is not None:
            return KbProbe(problem)
        return KbProbe(None, (1, abs(hash(workflow_folder))))


@dataclass(frozen=True)
class World:
    """Source workflows of one host: how each ID resolves, their manifests, their KB state."""

    kinds: dict[str, str]
    docs: dict[str, dict[str, Any]]
    kb: dict[Path, KbProblem]

    def view(self, edit: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> FakeView:
        lookups: dict[str, Lookup] = {}
        for wid, kind in self.kinds.items():
            path = FOLDERS / wid
            if kind == "found":
                doc = self.docs[wid] if edit is None else edit(self.docs[wid])
                lookups[wid] = Found(Folder(path, parse(doc), None, wid, None))
            elif kind == "ambiguous":
                copies = tuple(Folder(FOLDERS / f"{wid}.{i}", None, None, wid, None) for i in range(2))
                lookups[wid] = Ambiguous(wid, copies)
            elif kind == "unreadable":
                lookups[wid] = Unreadable(Folder(path, None, "not valid JSON", wid, None))
        return FakeView(lookups, dict(self.kb))


KB_PROBLEMS = (
    KbProblem("kb_missing", "no knowledgebase/"),
    KbProblem("kb_not_dir", "not a folder"),
    KbProblem("kb_symlinked", "a link"),
    KbProblem("kb_mountpoint", "a mount point"),
)


# A source's own attachments (often back to the consumer): never followed.
_SOURCES_OWN_ENTRIES = st.lists(s.valid_entries(st.sampled_from((*s.SOURCE_IDS, s.CONSUMER_ID))), max_size=2)
_WORLD_KIND = st.sampled_from(("found",) * 5 + ("missing", "ambiguous", "unreadable"))
_KB_STATE = st.sampled_from((None,) * 8 + KB_PROBLEMS)
_SMALL = st.integers(0, 3)


@st.composite
def worlds(draw: st.DrawFn) -> World:
    kinds: dict[str, str] = {}
    docs: dict[str, dict[str, Any]] = {}
    kb: dict[Path, KbProblem] = {}
    for wid in s.SOURCE_IDS:
        kind = draw(_WORLD_KIND)
        kinds[wid] = kind
        if kind == "found":
            # Each source has its own attachments: they must never be followed.
            doc = draw(
                s.manifests(wid=wid, writers=[s.CONSUMER_ID], sources=_SOURCES_OWN_ENTRIES, extra=False)
            )
            if draw(_SMALL) > 0 and isinstance(doc.get("access"), dict):
                # Readable by the whole pool, so that more attachments end up available.
                doc["access"]["readers"] = [*doc["access"].get("readers", []), *s.POOL]
            docs[wid] = doc
            problem = draw(_KB_STATE)
            if problem is not None:
                kb[FOLDERS / wid] = problem
    return World(kinds, docs, kb)


@st.composite
def _attached_to_world(draw: st.DrawFn) -> list[dict[str, Any]]:
    """A clean list naming mostly the world's sources (so that many resolve)."""
    ids = draw(st.lists(st.sampled_from(s.SOURCE_IDS), unique=True, max_size=len(s.SOURCE_IDS)))
    if draw(st.booleans()):
        ids.append("wf_nowhere")
    modes = st.sampled_from(("read", "write"))
    return [{"workflow_id": w, "alias": f"src_{i}", "access": draw(modes)} for i, w in enumerate(ids)]


# As found on disk (duplicates, invalid entries, > 20) or as kbd saves them (clean).
_CONSUMER_ENTRIES = st.one_of(s.entry_lists(), s.clean_entry_lists(), _attached_to_world())


def consumers(legacy: bool | None = None) -> st.SearchStrategy[dict[str, Any]]:
    return s.manifests(wid=s.CONSUMER_ID, legacy=legacy, sources=_CONSUMER_ENTRIES, extra=False)


def resolve(consumer: dict[str, Any], view: FakeView, principals: Principals) -> list[Attachment]:
    return resolve_all(parse(consumer), view=view, principals=principals, host=s.HOST)


# Pairs used by the can_read / can_write properties. Sources may list the consumer as writer.
any_consumer = s.manifests(wid=s.CONSUMER_ID, extra=False)
any_source = s.manifests(wid="wf_src", writers=[s.CONSUMER_ID], extra=False)
owned_source = s.manifests(wid="wf_src", legacy=False, writers=[s.CONSUMER_ID], extra=False)


# -- audience rules ---------------------------------------------------------------------


@given(consumer=any_consumer, source=any_source, principals=s.principal_tables())
def test_can_write_implies_can_read(
    consumer: dict[str, Any], source: dict[str, Any], principals: Principals
) -> None:
    c, src = parse(consumer), parse(source)
    writes = audience.can_write(c, src, principals)
    reads = audience.can_read(c, src, principals)
    event(f"read={reads} write={writes}")
    assert not writes or reads
    assert not writes or not src.is_legacy


@given(consumer=any_consumer, source=any_source, principals=s.principal_tables())
def test_rules_match_the_contract_oracle(
    consumer: dict[str, Any], source: dict[str, Any], principals: Principals
) -> None:
    c, src = parse(consumer), parse(source)
    assert c.is_legacy == is_legacy(consumer)
    assert audience.audience(src) == source_audience(source)
    assert audience.consumer_audience(c) == consumer_audience(consumer)
    expected = oracle_can_read(consumer, source, principals)
    event(f"can_read={expected}")
    assert audience.can_read(c, src, principals) == expected
    assert audience.can_write(c, src, principals) == oracle_can_write(consumer, source, principals)


@given(
    consumer=any_consumer,
    source=any_source,
    principals=s.principal_tables(),
    tier=st.sampled_from((*TIERS, "auditors")),
    member=s.principal_ids(),
)
def test_adding_a_consumer_member_never_allows_a_denied_source(
    consumer: dict[str, Any], source: dict[str, Any], principals: Principals, tier: str, member: str
) -> None:
    wider = add_member(consumer, tier, member)
    # The edit really is "one more member" (test-side sanity check).
    assert is_legacy(wider) == is_legacy(consumer)
    assert consumer_audience(wider) >= consumer_audience(consumer)
    before, after = parse(consumer), parse(wider)
    src = parse(source)
    denied = not audience.can_read(before, src, principals)
    event(f"denied before: {denied}")
    if denied:
        assert not audience.can_read(after, src, principals)
    if not audience.can_write(before, src, principals):
        assert not audience.can_write(after, src, principals)


@given(consumer=any_consumer, source=owned_source, principals=s.principal_tables(), data=st.data())
def test_removing_a_source_member_never_allows_a_denied_source(
    consumer: dict[str, Any], source: dict[str, Any], principals: Principals, data: st.DataObject
) -> None:
    # Only removals that shrink the audience by exactly that member: removing the
    # last effective owner would make the source legacy (account-visible), or
    # promote created_by, which is a different change than removing a member.
    before = source_audience(source)
    removable = sorted(
        m
        for m in before
        if not is_legacy(remove_member(source, m))
        and source_audience(remove_member(source, m)) == before - {m}
    )
    assume(removable)
    member = data.draw(st.sampled_from(removable), label="removed")
    narrower = remove_member(source, member)
    c = parse(consumer)
    denied = not audience.can_read(c, parse(source), principals)
    event(f"denied before: {denied}")
    if denied:
        assert not audience.can_read(c, parse(narrower), principals)
    if not audience.can_write(c, parse(source), principals):
        assert not audience.can_write(c, parse(narrower), principals)


@given(
    consumer=any_consumer,
    source=any_source,
    principals=s.principal_tables(),
    tier=st.sampled_from((*TIERS, "auditors")),
    data=st.data(),
)
def test_an_enabled_admin_never_narrows(
    consumer: dict[str, Any],
    source: dict[str, Any],
    principals: Principals,
    tier: str,
    data: st.DataObject,
) -> None:
    admins = sorted(p.id for p in principals if p.admin and not p.disabled)
    admin = data.draw(st.sampled_from(admins), label="admin")
    c, src = parse(consumer), parse(source)
    with_admin = parse(add_member(consumer, tier, admin))
    before = audience.can_read(c, src, principals)
    event(f"allowed before: {before}")
    if before:
        assert audience.can_read(with_admin, src, principals)
    # Stronger: an enabled admin changes nothing at all.
    assert audience.can_read(with_admin, src, principals) == before
    assert audience.can_write(with_admin, src, principals) == audience.can_write(c, src, principals)


@given(
    consumer=any_consumer,
    source=any_source,
    principals=s.principal_tables(),
    tier=st.sampled_from((*TIERS, "auditors")),
    data=st.data(),
)
def test_a_disabled_admin_counts_as_an_ordinary_member(
    consumer: dict[str, Any],
    source: dict[str, Any],
    principals: Principals,
    tier: str,
    data: st.DataObject,
) -> None:
    candidates = sorted(p.id for p in principals if p.admin and p.disabled)
    member = data.draw(st.sampled_from(candidates), label="disabled admin")
    if data.draw(st.booleans(), label="source lists the member") and isinstance(source.get("access"), dict):
        source = add_member(source, "readers", member)
    c, src = parse(consumer), parse(source)
    after = audience.can_read(parse(add_member(consumer, tier, member)), src, principals)
    before = audience.can_read(c, src, principals)
    if c.is_legacy:
        # Added as an editor of an account-visible consumer: still legacy.
        assert after == before
    else:
        expected = before and (src.is_legacy or member in audience.audience(src))
        event(f"member in source audience: {member in audience.audience(src)}")
        assert after == expected


@given(consumer=any_consumer, source=s.manifests(wid="wf_src", legacy=True, extra=False))
def test_a_legacy_source_is_readable_by_any_consumer(
    consumer: dict[str, Any], source: dict[str, Any]
) -> None:
    # Even a table where nobody is an admin.
    nobody = Principals(by_id={})
    c, src = parse(consumer), parse(source)
    assert src.is_legacy
    assert audience.can_read(c, src, nobody)
    assert not audience.can_write(c, src, nobody)  # nobody could have granted it


@given(
    consumer=s.manifests(wid=s.CONSUMER_ID, legacy=True, extra=False),
    source=owned_source,
    principals=s.principal_tables(),
)
def test_a_legacy_consumer_cannot_read_an_owned_source(
    consumer: dict[str, Any], source: dict[str, Any], principals: Principals
) -> None:
    c, src = parse(consumer), parse(source)
    assert c.is_legacy and not src.is_legacy
    assert not audience.can_read(c, src, principals)
    assert not audience.can_write(c, src, principals)


@given(doc=s.manifests(extra=False), tier=st.sampled_from(TIERS), bad=st.sampled_from(s.BAD_IDS))
def test_a_malformed_principal_makes_the_manifest_unreadable(
    doc: dict[str, Any], tier: str, bad: Any
) -> None:
    # Fail closed: a bad access block must never read as "legacy, account-visible".
    broken = copy.deepcopy(doc)
    access = broken.setdefault("access", {})
    access[tier] = [*access.get(tier, []), bad]
    with pytest.raises(ManifestUnreadable):
        parse(broken)


# -- resolution ----------------------------------------------------------------------------


@given(world=worlds(), consumer=consumers(), principals=s.principal_tables(), data=st.data())
def test_attaching_never_changes_the_other_attachments(
    world: World,
    consumer: dict[str, Any],
    principals: Principals,
    data: st.DataObject,
) -> None:
    old: list[Any] = consumer["knowledgebase_sources"]
    used_aliases = {e["alias"] for e in old if isinstance(e, dict) and isinstance(e.get("alias"), str)}
    used_ids = {
        e["workflow_id"] for e in old if isinstance(e, dict) and isinstance(e.get("workflow_id"), str)
    }
    alias = data.draw(s.aliases().filter(lambda a: a not in used_aliases), label="alias")
    wid = data.draw(
        st.one_of(st.sampled_from(s.SOURCE_IDS), s.valid_ids()).filter(lambda w: w not in used_ids),
        label="workflow_id",
    )
    access = data.draw(st.sampled_from(("read", "write", "bogus")), label="access")
    # `kbd sources attach` appends; `sources set` may put it anywhere (within the 20 limit).
    at = len(old) if len(old) >= 20 else data.draw(st.integers(0, len(old)), label="position")
    new_list = [*old[:at], {"workflow_id": wid, "alias": alias, "access": access}, *old[at:]]

    before = resolve(consumer, world.view(), principals)
    after = resolve({**consumer, "knowledgebase_sources": new_list}, world.view(), principals)
    event(f"entries before: {min(len(old), 21) // 5 * 5}+")
    assert len(after) == len(before) + 1
    others = after[:at] + after[at + 1 :]
    assert [a.to_json() for a in others] == [a.to_json() for a in before]


@given(world=worlds(), consumer=consumers(), principals=s.principal_tables())
def test_resolution_reports_every_entry_and_is_not_transitive(
    world: World, consumer: dict[str, Any], principals: Principals
) -> None:
    view = world.view()
    atts = resolve(consumer, view, principals)
    entries: list[Any] = consumer["knowledgebase_sources"]
    assert len(atts) == len(entries)  # never dropped
    for att in atts:
        event(f"reason={att.reason}")
        assert att.available == (att.reason is None) == (att.path is not None)
        assert att.reason is None or att.reason in REASONS
        assert att.access in ("read", "write")
        assert (att.write is not None) == (att.access == "write")
        if att.write is not None and att.write.available:
            assert att.available
        if att.write is not None and att.available and not att.write.available:
            assert att.write.reason == WRITE_NOT_GRANTED
        if att.available:
            # Found, on this host, readable by the whole audience, KB fine, and
            # pointing at that source's own folder, never another one.
            doc = world.docs[att.workflow_id]
            assert world.kinds[att.workflow_id] == "found"
            assert doc.get("host") in (None, s.HOST)
            assert oracle_can_read(consumer, doc, principals)
            assert FOLDERS / att.workflow_id not in world.kb
            assert att.path == FOLDERS / att.workflow_id / "knowledgebase"
            if att.write is not None:
                assert att.write.available == oracle_can_write(consumer, doc, principals)
    # Attachments are not transitive: only the consumer's own entries are looked
    # up, and what the sources attach themselves changes nothing.
    own = {e["workflow_id"] for e in entries if isinstance(e, dict) and isinstance(e.get("workflow_id"), str)}
    assert set(view.asked) <= own

    def strip_sources(doc: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in doc.items() if k != "knowledgebase_sources"}

    stripped = resolve(consumer, world.view(strip_sources), principals)
    assert [a.to_json() for a in stripped] == [a.to_json() for a in atts]


# -- validation for saving -----------------------------------------------------------------


@given(raw=s.candidate_source_lists(), self_id=st.sampled_from((s.CONSUMER_ID, "wf_rts")))
def test_validate_sources_accepts_exactly_the_valid_lists(raw: Any, self_id: str) -> None:
    expected = oracle_validate(raw, self_id=self_id)
    event("valid" if expected is not None else "invalid")
    if expected is None:
        with pytest.raises(InvalidManifest):
            validate_sources(raw, self_id=self_id)
    else:
        refs = validate_sources(raw, self_id=self_id)
        assert [(r.workflow_id, r.alias, r.access) for r in refs] == expected


# -- manifest round trip ----------------------------------------------------------------------


def _encode_like_an_editor(doc: dict[str, Any], style: int) -> bytes:
    if style == 0:
        return s.encode(doc)
    if style == 1:
        return json.dumps(doc, ensure_ascii=False, indent=2).encode("utf-8")
    return json.dumps(doc, ensure_ascii=False, indent="\t", separators=(",", " : ")).encode("utf-8")


def _check_round_trip(data: bytes, refs: list[SourceRef], *, strict: bool = False) -> None:
    """Save ``refs`` into the manifest ``data`` as kbd does (with_sources, render)
    and compare every other field, as ``json.loads`` sees it, before and after.
    ``strict`` also requires the same JSON type (an integer stays an integer, a
    float a float) and the same sign of zero."""
    original: dict[str, Any] = json.loads(data)
    m = parse_manifest(data)
    before = copy.deepcopy(m.raw)
    out = render(with_sources(m.raw, refs))
    saved = parse_manifest(out)  # kbd reads back what it saved
    assert m.raw == before  # with_sources did not touch its input
    rendered: dict[str, Any] = json.loads(out)
    expected_keys = list(original)
    if "knowledgebase_sources" not in expected_keys:
        expected_keys.append("knowledgebase_sources")
    assert list(rendered) == expected_keys  # nothing added, dropped or moved
    for key, value in original.items():
        if key == "knowledgebase_sources":
            continue
        if strict:
            assert same_json(rendered[key], value), (key, out)
        else:
            assert rendered[key] == value, key
    assert rendered["knowledgebase_sources"] == [r.to_json() for r in refs]
    assert [e.ref for e in saved.entries] == refs


def _refs(raw: list[dict[str, Any]]) -> list[SourceRef]:
    return [SourceRef(e["workflow_id"], e["alias"], e.get("access", "read")) for e in raw]


@given(
    doc=s.manifests(sources=st.one_of(s.entry_lists(), st.none(), st.just([]))),
    extra=s.extra_fields(min_size=1),
    new=s.clean_entry_lists(),
    style=st.integers(0, 2),
)
def test_saving_sources_keeps_every_unknown_field(
    doc: dict[str, Any], extra: dict[str, Any], new: list[dict[str, Any]], style: int
) -> None:
    full = {**extra, **doc}
    assume(all(e["workflow_id"] != full["id"] for e in new))
    event(f"unknown fields: {len(set(full) - s.KNOWN_FIELDS)}")
    _check_round_trip(_encode_like_an_editor(full, style), _refs(new))


_LONE_SURROGATES = st.text(
    st.one_of(st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), st.sampled_from("ab")),
    min_size=1,
    max_size=4,
).filter(lambda t: any(0xD800 <= ord(c) <= 0xDFFF for c in t))


@given(
    doc=s.manifests(extra=False),
    key=s.unknown_keys(),
    text=_LONE_SURROGATES,
    new=s.clean_entry_lists(),
)
def test_saving_sources_keeps_escaped_lone_surrogates(
    doc: dict[str, Any], key: str, text: str, new: list[dict[str, Any]]
) -> None:
    # `{"note": "\ud800"}` is grammatical JSON; kbd reads it (parse_manifest
    # accepts it) so it must also be able to save the file around it.
    assume(key not in doc and all(e["workflow_id"] != doc["id"] for e in new))
    full = {**doc, key: text}
    _check_round_trip(s.encode(full), _refs(new))


# Number literals as other tools write them; each is a float to json.loads.
FLOAT_LITERALS = (
    "1e400",
    "-1E+309",
    "2e308",
    "1.5e1",
    "1e0",
    "2.50e2",
    "1.0374859492643012e+16",
    "12.5e-1",
    "0.5",
    "-0.0",
    "1.0",
    "1E-7",
    "5e-324",
)
_MARK = "@@NUMBER-{}@@"


@st.composite
def number_fields(draw: st.DrawFn) -> tuple[dict[str, Any], dict[str, str]]:
    """Unknown fields holding numbers (also nested), and the literal text each marker stands for."""
    literals: dict[str, str] = {}

    def number() -> Any:
        if draw(st.booleans()):
            return draw(st.floats(allow_nan=False, allow_infinity=False))
        marker = _MARK.format(len(literals))
        literals[marker] = draw(st.sampled_from(FLOAT_LITERALS))
        return marker

    fields: dict[str, Any] = {}
    for key in draw(st.lists(s.unknown_keys(), min_size=1, max_size=3, unique=True)):
        shape = draw(st.sampled_from(("plain", "list", "object")))
        if shape == "plain":
            fields[key] = number()
        elif shape == "list":
            fields[key] = [number() for _ in range(draw(st.integers(1, 3)))]
        else:
            fields[key] = {"value": number(), "n": draw(st.integers())}
    return fields, literals


@given(doc=s.manifests(extra=False), numbers=number_fields(), new=s.clean_entry_lists())
def test_saving_sources_keeps_the_json_type_of_every_number(
    doc: dict[str, Any], numbers: tuple[dict[str, Any], dict[str, str]], new: list[dict[str, Any]]
) -> None:
    # `1.5e1` is a float to every JSON reader that has floats; written back as
    # `15` it becomes an integer (Python json, serde_json, ...), which changes a
    # field kbd does not own (docs/on-disk.md: preserved untouched on save).
    fields, literals = numbers
    assume(not set(fields) & set(doc) and all(e["workflow_id"] != doc["id"] for e in new))
    data = s.encode({**doc, **fields})
    for marker, literal in literals.items():
        data = data.replace(json.dumps(marker).encode(), literal.encode())
    for literal in literals.values():
        event(f"literal {literal}")
    parse_manifest(data)  # kbd reads it: the precondition of the contract
    _check_round_trip(data, _refs(new), strict=True)

"""workflow.json: the fields kbd reads, their validation, and pure edits (docs/on-disk.md).

This module is pure: it turns bytes into a :class:`Manifest` and a raw document
into a changed raw document. Reading and atomic saving live in
:mod:`kbd.fs.manifest_store`.

Two strictness levels, on purpose:

* **Saving** (:func:`validate_sources`) is strict: one bad entry rejects the
  whole request with a message naming the entry, the field and what is allowed.
* **Looking up** (:func:`parse_manifest`) keeps a hand-edited bad entry visible
  as ``invalid_entry`` instead of dropping it or failing every attachment, so it
  can be repaired or detached. The kbd-owned access fields are strict in both:
  a malformed ``access`` block could otherwise read as "legacy, account-visible"
  and widen access, so it makes the manifest unreadable (fail closed).
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from kbd.core.identifiers import alias_problem, id_problem
from kbd.core.layout import MANIFEST
from kbd.core.records import Record
from kbd.core.strict import kind_of, load_json_strict
from kbd.errors import InvalidInput, InvalidManifest, ManifestUnreadable

MAX_SOURCES = 20
MAX_WRITERS = 50
MAX_MANIFEST_BYTES = 1 << 20
ACCESS_MODES = ("read", "write")
ENTRY_KEYS = ("workflow_id", "alias", "access")
AUDIENCE_TIERS = ("owners", "editors", "readers")
# Keys of `access` that are not principal tiers; everything else that holds a
# list of strings is treated as a future audience tier (see AccessBlock).
NON_TIER_ACCESS_KEYS = frozenset({"allowed_kb_writers"})


@dataclass(frozen=True)
class SourceRef(Record):
    """One valid attachment entry of ``knowledgebase_sources``."""

    workflow_id: str
    alias: str
    access: str = "read"


@dataclass(frozen=True)
class Entry:
    """An entry as found on disk: valid (``ref``) or kept with its ``problem``."""

    index: int
    ref: SourceRef | None
    problem: str | None
    # Best-effort display values for an invalid entry (never used for access).
    alias: str
    workflow_id: str
    access: str


@dataclass(frozen=True)
class AccessBlock:
    owners: tuple[str, ...] = ()
    editors: tuple[str, ...] = ()
    readers: tuple[str, ...] = ()
    # Lists of principals under `access` keys kbd does not know. They count in
    # this workflow's audience as a *consumer* (narrowing what it may attach)
    # but never in its audience as a *source* (they cannot widen who reads it).
    other_tiers: tuple[str, ...] = ()
    allowed_kb_writers: tuple[str, ...] = ()


@dataclass(frozen=True)
class Manifest:
    id: str
    label: str
    host: str | None
    created_by: str | None
    access: AccessBlock
    entries: tuple[Entry, ...]
    # Set when `knowledgebase_sources` itself is malformed: the workflow can
    # still be a source, but nothing can be resolved or saved for it as consumer.
    sources_problem: str | None
    raw: dict[str, Any] = field(repr=False, compare=False)
    version: str = ""

    @property
    def effective_owners(self) -> tuple[str, ...]:
        if self.access.owners:
            return self.access.owners
        return (self.created_by,) if self.created_by else ()

    @property
    def is_legacy(self) -> bool:
        return not self.effective_owners


def version_of(data: bytes) -> str:
    """The manifest version used for expected-version checks: a digest of its bytes."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


def extract_id(data: bytes) -> str | None:
    """Best effort: the ``id`` of a manifest that failed validation, for reporting
    ``manifest_unreadable`` against the right reference. Never used for access."""
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError):
        return None
    wid = doc.get("id") if isinstance(doc, dict) else None
    return wid if isinstance(wid, str) and id_problem(wid) is None else None


def _principal_list(value: Any, *, field_name: str) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise ManifestUnreadable(f"{field_name} must be a list of principal IDs, got {kind_of(value)}")
    out: list[str] = []
    for i, item in enumerate(value):
        if (problem := id_problem(item)) is not None:
            raise ManifestUnreadable(f"{field_name}[{i}] {problem}")
        out.append(item)
    return tuple(out)


def _access_problems(value: Any) -> list[str]:
    """Each field of the access block that makes the manifest unreadable (its tiers', one each)."""
    if value is None:
        return []
    if not isinstance(value, dict):
        return [f"access must be an object, got {kind_of(value)}"]
    out = [
        p for t in AUDIENCE_TIERS if (p := _field_problem(_principal_list, value.get(t, []), f"access.{t}"))
    ]
    writers_raw = value.get("allowed_kb_writers", [])
    if not isinstance(writers_raw, list):
        out.append(f"access.allowed_kb_writers must be a list of workflow IDs, got {kind_of(writers_raw)}")
    return out


def _field_problem(check: Callable[..., object], value: Any, field_name: str) -> str | None:
    try:
        check(value, field_name=field_name)
    except ManifestUnreadable as exc:
        return exc.message
    return None


def _parse_access(value: Any) -> AccessBlock:
    if value is None:
        return AccessBlock()
    if problems := _access_problems(value):
        raise ManifestUnreadable(problems[0])
    tiers = {t: _principal_list(value.get(t, []), field_name=f"access.{t}") for t in AUDIENCE_TIERS}
    writers_raw = value.get("allowed_kb_writers", [])
    # A hand-edited writer that is not an exact valid ID can never match a
    # consumer ID, so it is ignored rather than trimmed into a grant.
    writers = tuple(w for w in writers_raw if isinstance(w, str) and id_problem(w) is None)
    other: list[str] = []
    for key, tier in value.items():
        if key in AUDIENCE_TIERS or key in NON_TIER_ACCESS_KEYS:
            continue
        if isinstance(tier, list) and tier and all(isinstance(x, str) for x in tier):
            other.extend(tier)
    return AccessBlock(
        owners=tiers["owners"],
        editors=tiers["editors"],
        readers=tiers["readers"],
        other_tiers=tuple(other),
        allowed_kb_writers=writers,
    )


def _optional_str(doc: dict[str, Any], key: str) -> str | None:
    value = doc.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise ManifestUnreadable(f"{key} must be a string, got {kind_of(value)}")
    return value


def _string_field(value: Any, *, field_name: str) -> None:
    _optional_str({field_name: value}, field_name)


def entry_problem(raw: Any, *, self_id: str | None) -> tuple[SourceRef | None, str | None]:
    """Validate one attachment entry on its own. Returns (ref, None) or (None, its first problem)."""
    problems = entry_problems(raw, self_id=self_id)
    if problems:
        return None, problems[0]
    return SourceRef(
        workflow_id=raw["workflow_id"], alias=raw["alias"], access=raw.get("access", "read")
    ), None


def entry_problems(raw: Any, *, self_id: str | None) -> list[str]:
    """Every problem of one attachment entry on its own (``kbd validate`` shows
    them all), most fundamental first; empty when the entry is valid."""
    if not isinstance(raw, dict):
        return [f"must be an object with workflow_id, alias and access, got {kind_of(raw)}"]
    out = [
        f"unknown key {key!r}; allowed: {', '.join(ENTRY_KEYS)} "
        "(paths are never accepted here: reference workflows by ID)"
        for key in sorted(set(raw) - set(ENTRY_KEYS))
    ]
    wid = raw.get("workflow_id")
    if "workflow_id" not in raw:
        out.append("workflow_id is required")
    elif (problem := id_problem(wid)) is not None:
        hint = (
            " (it looks like a path; reference the source by its workflow ID)"
            if (isinstance(wid, str) and ("/" in wid or "\\" in wid))
            else ""
        )
        out.append(f"workflow_id {problem}{hint}")
    alias = raw.get("alias")
    if "alias" not in raw:
        out.append("alias is required")
    elif (problem := alias_problem(alias)) is not None:
        out.append(f"alias {alias!r} {problem}" if isinstance(alias, str) else f"alias {problem}")
    access = raw.get("access", "read")
    if access not in ACCESS_MODES:
        out.append(f"access {access!r} is not allowed; allowed: read, write")
    if self_id is not None and "workflow_id" in raw and wid == self_id:
        out.append("workflow_id names this workflow itself; a workflow cannot attach its own KB")
    return out


def parse_entries(raw: Any, *, self_id: str | None) -> tuple[tuple[Entry, ...], str | None]:
    """Lenient parse for lookups: every entry kept, bad ones carry their problem."""
    if raw is None:
        return (), None
    if not isinstance(raw, list):
        return (), f"knowledgebase_sources must be a list, got {kind_of(raw)}"
    first: list[tuple[SourceRef | None, str | None]] = [entry_problem(e, self_id=self_id) for e in raw]
    aliases = Counter(r.alias for r, _ in first if r is not None)
    ids = Counter(r.workflow_id for r, _ in first if r is not None)
    entries: list[Entry] = []
    for i, (parsed, problem) in enumerate(first):
        ref = parsed
        if parsed is not None and aliases[parsed.alias] > 1:
            ref, problem = None, f"alias {parsed.alias!r} is used by more than one entry"
        elif parsed is not None and ids[parsed.workflow_id] > 1:
            ref, problem = None, f"workflow {parsed.workflow_id!r} is attached more than once"
        if ref is not None and i >= MAX_SOURCES:
            ref, problem = None, f"more than {MAX_SOURCES} sources; this entry is ignored"
        item = raw[i] if isinstance(raw[i], dict) else {}
        entries.append(
            Entry(
                index=i,
                ref=ref,
                problem=problem,
                alias=ref.alias if ref else _display(item.get("alias")),
                workflow_id=ref.workflow_id if ref else _display(item.get("workflow_id")),
                access=ref.access if ref else _display(item.get("access", "read")),
            )
        )
    return tuple(entries), None


def _display(value: Any) -> str:
    return value if isinstance(value, str) and len(value) <= 256 else ""


def parse_manifest(data: bytes) -> Manifest:
    """Parse and validate the kbd-owned fields of a workflow.json.

    Raises ManifestUnreadable (fail closed) when the document is not a JSON
    object, has duplicate keys, or any kbd-owned identity or access field is
    malformed. Attachment entries are parsed leniently (see module docstring).
    """
    doc = manifest_document(data)
    if "id" not in doc:
        raise ManifestUnreadable("workflow.json has no id")
    wid = doc["id"]
    if (problem := id_problem(wid)) is not None:
        raise ManifestUnreadable(f"id {problem}")
    label = _optional_str(doc, "label")
    created_by = _optional_str(doc, "created_by")
    if created_by is not None and created_by.strip() == "":
        created_by = None
    entries, sources_problem = parse_entries(doc.get("knowledgebase_sources"), self_id=wid)
    return Manifest(
        id=wid,
        label=label if label else wid,
        host=_optional_str(doc, "host"),
        created_by=created_by,
        access=_parse_access(doc.get("access")),
        entries=entries,
        sources_problem=sources_problem,
        raw=doc,
        version=version_of(data),
    )


def manifest_document(data: bytes, *, name: str = MANIFEST) -> dict[str, Any]:
    """``data`` as a JSON object (strict: no duplicate key), or ManifestUnreadable
    naming the file ``name`` and what is wrong with it as a whole."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestUnreadable(f"{name} is larger than {MAX_MANIFEST_BYTES} bytes")
    try:
        doc = load_json_strict(data)
    except (ValueError, RecursionError) as exc:
        raise ManifestUnreadable(f"{name} is not valid JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise ManifestUnreadable(f"{name} must be a JSON object, got {kind_of(doc)}")
    return doc


def field_problems(doc: dict[str, Any], *, name: str = MANIFEST) -> list[str]:
    """Every top-level field of ``doc`` that makes it unreadable, each named
    (``kbd validate`` lists them all; :func:`parse_manifest` refuses at the first)."""
    out: list[str] = []
    if "id" not in doc:
        out.append(f"{name} has no id")
    elif (problem := id_problem(doc["id"])) is not None:
        out.append(f"id {problem}")
    out += [
        p
        for key in ("label", "host", "created_by")
        if (p := _field_problem(_string_field, doc.get(key), key))
    ]
    out += _access_problems(doc.get("access"))
    if (sources := parse_entries(doc.get("knowledgebase_sources"), self_id=None)[1]) is not None:
        out.append(sources)
    return out


def validate_sources(raw: Any, *, self_id: str) -> list[SourceRef]:
    """Strict validation of a complete ``knowledgebase_sources`` value for saving.

    Raises InvalidManifest naming the entry index, the field and what is allowed.
    Reachability (exists, same host, audience) is checked separately by the
    caller, because unchanged entries may stay even when they became unavailable.
    """
    if not isinstance(raw, list):
        raise InvalidManifest(
            f"knowledgebase_sources must be a JSON array of entries, got {kind_of(raw)}",
            hint='pass e.g. [{"workflow_id": "wf_rts", "alias": "rts", "access": "read"}], or [] to detach all',
        )
    if len(raw) > MAX_SOURCES:
        raise InvalidManifest(
            f"knowledgebase_sources has {len(raw)} entries; at most {MAX_SOURCES} are allowed"
        )
    refs: list[SourceRef] = []
    seen_alias: dict[str, int] = {}
    seen_id: dict[str, int] = {}
    for i, item in enumerate(raw):
        ref, problem = entry_problem(item, self_id=self_id)
        if ref is None:
            raise InvalidManifest(f"knowledgebase_sources[{i}]: {problem}")
        if ref.alias in seen_alias:
            raise InvalidManifest(
                f"knowledgebase_sources[{i}]: alias {ref.alias!r} is already used by entry {seen_alias[ref.alias]}",
                hint="each attachment needs its own alias",
            )
        if ref.workflow_id in seen_id:
            raise InvalidManifest(
                f"knowledgebase_sources[{i}]: workflow {ref.workflow_id!r} is already attached "
                f"as entry {seen_id[ref.workflow_id]}",
                hint="attach each source once; use access 'write' on that entry for write access",
            )
        seen_alias[ref.alias] = i
        seen_id[ref.workflow_id] = i
        refs.append(ref)
    return refs


def validate_writers(raw: Sequence[Any], *, self_id: str) -> list[str]:
    """Trim, de-duplicate and check a writer grant list. Existence is the caller's job."""
    out: list[str] = []
    for i, item in enumerate(raw):
        if not isinstance(item, str):
            raise InvalidManifest(
                f"allowed_kb_writers[{i}] must be a workflow ID string, got {kind_of(item)}"
            )
        wid = item.strip()
        if (problem := id_problem(wid)) is not None:
            raise InvalidManifest(f"allowed_kb_writers[{i}] {problem}")
        if wid == self_id:
            raise InvalidManifest(
                f"allowed_kb_writers[{i}] names the source workflow itself",
                hint="a workflow already writes its own notes; grants are for other workflows",
            )
        if wid not in out:
            out.append(wid)
    if len(out) > MAX_WRITERS:
        raise InvalidManifest(
            f"allowed_kb_writers would hold {len(out)} workflows; at most {MAX_WRITERS} are allowed"
        )
    return out


def writer_problems(doc: dict[str, Any], *, self_id: str) -> list[str]:
    """Every rule of docs/on-disk.md a hand-edited ``access.allowed_kb_writers`` breaks
    (for ``kbd validate``; lookups simply never match a bad entry)."""
    access = doc.get("access")
    raw = access.get("allowed_kb_writers") if isinstance(access, dict) else None
    if raw is None:
        return []
    where = "access.allowed_kb_writers"
    if not isinstance(raw, list):
        return [f"{where} must be a list of workflow IDs"]
    out: list[str] = []
    seen: set[str] = set()
    for i, item in enumerate(raw):
        if (problem := id_problem(item)) is not None:
            out.append(f"{where}[{i}] {problem}")
        elif item == self_id:
            out.append(f"{where}[{i}] names the workflow itself")
        elif item in seen:
            out.append(f"{where}[{i}] repeats {item!r}")
        if isinstance(item, str):
            seen.add(item)
    if len(raw) > MAX_WRITERS:
        out.append(f"{where} has {len(raw)} entries; at most {MAX_WRITERS} are allowed")
    return out


def with_sources(raw: dict[str, Any], refs: Sequence[SourceRef]) -> dict[str, Any]:
    """A copy of ``raw`` with ``knowledgebase_sources`` replaced; all else untouched."""
    doc = copy.deepcopy(raw)
    doc["knowledgebase_sources"] = [r.to_json() for r in refs]
    return doc


def with_access(raw: dict[str, Any], name: str, values: Sequence[str]) -> dict[str, Any]:
    """A copy of ``raw`` with the list ``access.<name>`` (``allowed_kb_writers``, ``readers``)
    replaced; all else untouched."""
    doc = copy.deepcopy(raw)
    access = doc.get("access")
    if not isinstance(access, dict):
        access = {}
    access[name] = list(values)
    doc["access"] = access
    return doc


def validate_readers(raw: Sequence[str]) -> list[str]:
    """Trim, de-duplicate and check principal IDs for ``access.readers``."""
    out: list[str] = []
    for i, item in enumerate(raw):
        pid = item.strip()
        if (problem := id_problem(pid)) is not None:
            raise InvalidInput(f"principal {i + 1} ({item[:60]!r}) {problem}")
        if pid not in out:
            out.append(pid)
    if not out:
        raise InvalidInput("name at least one principal")
    if len(out) > MAX_WRITERS:
        raise InvalidInput(f"{len(out)} principals named at once; at most {MAX_WRITERS} are allowed")
    return out


def _encode(value: Any, indent: str, out: list[str]) -> None:
    if isinstance(value, dict):
        if not value:
            out.append("{}")
            return
        inner = indent + "  "
        out.append("{\n")
        for i, (k, v) in enumerate(value.items()):
            out.append(f"{inner}{_string(k)}: ")
            _encode(v, inner, out)
            out.append(",\n" if i < len(value) - 1 else "\n")
        out.append(indent + "}")
    elif isinstance(value, list):
        if not value:
            out.append("[]")
            return
        inner = indent + "  "
        out.append("[\n")
        for i, v in enumerate(value):
            out.append(inner)
            _encode(v, inner, out)
            out.append(",\n" if i < len(value) - 1 else "\n")
        out.append(indent + "]")
    elif isinstance(value, str):
        out.append(_string(value))
    elif value is None or isinstance(value, bool | int):
        out.append(json.dumps(value))
    elif isinstance(value, Decimal):
        # The number's value and JSON type as written: 1e400 stays 1E+400 (not
        # Infinity), and 1.5e1 stays a float ("15.0"), never becomes the int 15.
        text = str(value)
        out.append(text if any(c in text for c in ".eE") else text + ".0")
    else:  # pragma: no cover - parse_manifest only produces the types above
        raise TypeError(f"cannot encode {type(value).__name__}")


def _string(s: str) -> str:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        # A lone surrogate (valid as a JSON escape) cannot be UTF-8: keep it escaped.
        return json.dumps(s, ensure_ascii=True)
    return json.dumps(s, ensure_ascii=False)


def render(doc: dict[str, Any]) -> bytes:
    """Serialise a manifest for saving, keeping every value's meaning exactly:
    integers of any size, numbers in their written precision (parsed as Decimal),
    and strings with escaped lone surrogates."""
    out: list[str] = []
    _encode(doc, "", out)
    out.append("\n")
    return "".join(out).encode("utf-8")

"""Consumer-kind policy, the table of ``policies/consumer_kinds.yaml`` (docs/sessions.md "Consumer kinds").

The table is data so operators and reviewers read the rules in one place
(:mod:`kbd.fs.datafiles` reads it); this module validates it strictly (unknown
kinds, keys and values are errors) and answers the one derived question the
plan needs: the effective KB mode.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kbd.core.strict import check_keys, expect_bool, expect_choice, expect_mapping
from kbd.errors import InvalidConfig, InvalidInput

KB_ACCESS = ("none", "read", "write", "read-write")
OWN_FOLDER = ("read-write", "read-only")
LOCAL_KB = ("full", "per_access", "read_only", "notes")
KINDS = (
    "builder",
    "execution",
    "scripted",
    "message_sequence",
    "reviewer_strategic",
    "reviewer_architecture",
    "kb_maintenance",
)
_KIND_KEYS = ("own_folder", "local_kb", "may_write_kb", "needs_item_flag", "source_write", "readers_may_open")


@dataclass(frozen=True)
class KindPolicy:
    name: str
    own_folder: str
    local_kb: str
    may_write_kb: bool
    needs_item_flag: bool
    source_write: bool
    readers_may_open: bool

    def effective_mode(self, requested: str, *, item_kb_write: bool) -> str:
        """``WORKFLOW_KB_ACCESS``: the requested mode narrowed by what this kind may write."""
        if requested not in KB_ACCESS:
            raise InvalidInput(f"kb_access {requested!r} is not allowed; allowed: {', '.join(KB_ACCESS)}")
        may_write = self.may_write_kb and (item_kb_write or not self.needs_item_flag)
        if may_write:
            return requested
        return {"write": "none", "read-write": "read"}.get(requested, requested)


def parse_policy(data: object, *, source: str) -> dict[str, KindPolicy]:
    doc = expect_mapping(data, where="", source=source)
    check_keys(doc, allowed=("version", "kinds"), where="", source=source)
    if doc.get("version") != 1:
        raise InvalidConfig(f"{source}: version must be 1")
    kinds = expect_mapping(doc.get("kinds"), where="kinds", source=source)
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        raise InvalidConfig(f"{source}: unknown kind {unknown[0]!r}; allowed: {', '.join(KINDS)}")
    missing = sorted(set(KINDS) - set(kinds))
    if missing:
        # An empty or partial table must fail, not silently grant nothing to some kind.
        raise InvalidConfig(f"{source}: kind {missing[0]!r} is not defined")
    out: dict[str, KindPolicy] = {}
    for name, body in kinds.items():
        where = f"kinds.{name}"
        entry = expect_mapping(body, where=where, source=source)
        check_keys(entry, allowed=_KIND_KEYS, where=where, source=source)
        for key in _KIND_KEYS:
            if key not in entry:
                raise InvalidConfig(f"{source}: {where}.{key} is required")
        out[name] = KindPolicy(
            name=name,
            own_folder=expect_choice(
                entry["own_folder"], OWN_FOLDER, where=f"{where}.own_folder", source=source
            ),
            local_kb=expect_choice(entry["local_kb"], LOCAL_KB, where=f"{where}.local_kb", source=source),
            may_write_kb=expect_bool(entry["may_write_kb"], where=f"{where}.may_write_kb", source=source),
            needs_item_flag=expect_bool(
                entry["needs_item_flag"], where=f"{where}.needs_item_flag", source=source
            ),
            source_write=expect_bool(entry["source_write"], where=f"{where}.source_write", source=source),
            readers_may_open=expect_bool(
                entry["readers_may_open"], where=f"{where}.readers_may_open", source=source
            ),
        )
    return out


def kind(table: Mapping[str, KindPolicy], name: str) -> KindPolicy:
    """The policy of kind ``name`` in ``table`` (see :func:`parse_policy`)."""
    if name not in table:
        raise InvalidInput(f"unknown consumer kind {name!r}; allowed: {', '.join(KINDS)}")
    return table[name]

"""The JSON Schema of workflow.json (docs/on-disk.md "workflow.json"), built from
the very constants ``kbd validate`` checks with (pure).

A schema cannot say everything kbd checks, so it says less, never more: every
document ``kbd validate`` accepts, the schema accepts, and everything the schema
refuses, ``kbd validate`` refuses (tests/unit/test_manifest_schema.py holds both
directions). What only kbd checks is listed in :data:`ONLY_KBD` and in the
schema's own description: an editor's schema check is a first line, ``kbd
validate`` the verdict.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from kbd.core.folders import ACCESS as FOLDER_ACCESS
from kbd.core.folders import KEYS as FOLDER_KEYS
from kbd.core.folders import MAX_FOLDERS
from kbd.core.identifiers import ALIAS_RE, MAX_ID_LEN, RESERVED_ALIASES
from kbd.core.manifest import (
    ACCESS_MODES,
    AUDIENCE_TIERS,
    ENTRY_KEYS,
    MAX_SOURCES,
    MAX_WRITERS,
)

SCHEMA_ID = "https://kbd.invalid/schema/workflow.schema.json"  # a name, never fetched

#: The rules ``kbd validate`` adds to the schema's.
ONLY_KBD = (
    "an ID holds no control (Cc), format (Cf), line or paragraph separator (Zl, Zp) character: Unicode "
    "categories, which regex dialects spell differently (the schema refuses whitespace, '/' and '\\')",
    "aliases and workflow IDs are unique across knowledgebase_sources; folder_access aliases are unique",
    "no entry attaches the workflow itself, and no allowed_kb_writers entry names it",
    "a folder_access path has no '..' component",
)


def _id(what: str) -> dict[str, Any]:
    return {
        "type": "string",
        "minLength": 1,
        "maxLength": MAX_ID_LEN,
        # No whitespace, '/' or '\' (an ID is not a path); '.' and '..' are refused below.
        "pattern": r"^[^\s/\\]+$",
        "not": {"enum": [".", ".."]},
        "description": f"{what}: at most {MAX_ID_LEN} characters, no whitespace, control, format or separator "
        "character, no '/' or '\\', not '.' or '..' (docs/on-disk.md \"IDs\")",
    }


def _alias() -> dict[str, Any]:
    return {
        "type": "string",
        "pattern": f"^{ALIAS_RE.pattern}$",
        "not": {"enum": sorted(RESERVED_ALIASES)},
        "description": "1-48 lowercase letters, digits and underscores, starting with a letter; the variable is "
        "WORKFLOW_KB_<ALIAS>",
    }


def _entries(
    most: int, keys: Sequence[str], required: list[str], properties: dict[str, Any]
) -> dict[str, Any]:
    """A list of at most ``most`` entries (or null), each an object of exactly ``keys``."""
    return {
        "type": ["array", "null"],
        "maxItems": most,
        "items": {"type": "object", "required": required, "properties": properties,
                  "additionalProperties": False, "propertyNames": {"enum": list(keys)}},
    }  # fmt: skip


def workflow_schema() -> dict[str, Any]:
    """The schema (JSON Schema 2020-12) ``kbd validate --schema`` prints and
    docs/workflow.schema.json holds."""
    ids = {"type": "array", "items": {"$ref": "#/$defs/principal_id"}}
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": SCHEMA_ID,
        "title": "kbd workflow.json",
        "description": "A workflow's manifest as kbd reads it. Fields kbd does not model are kept untouched. "
        "`kbd validate FILE` also checks: " + "; ".join(ONLY_KBD) + ".",
        "type": "object",
        "required": ["id"],
        "properties": {
            "id": {"$ref": "#/$defs/workflow_id"},
            "label": {"type": ["string", "null"], "description": "for people; the ID when absent"},
            "host": {"type": ["string", "null"], "description": "the execution host it lives on"},
            "created_by": {
                "type": ["string", "null"],
                "description": "its owner when access.owners is absent",
            },
            "access": {
                "type": ["object", "null"],
                "description": "who may see, manage and read it; no owner at all makes a legacy workflow",
                "properties": {
                    **{tier: ids for tier in AUDIENCE_TIERS},
                    "allowed_kb_writers": {
                        "type": "array",
                        "items": {"$ref": "#/$defs/workflow_id"},
                        "uniqueItems": True,
                        "maxItems": MAX_WRITERS,
                        "description": "consumers the owners let write into this KB's notes/",
                    },
                },
                # Other list-valued tiers narrow a consumer's audience, never widen a source's.
                "additionalProperties": True,
            },
            "knowledgebase_sources": _entries(
                MAX_SOURCES,
                ENTRY_KEYS,
                ["workflow_id", "alias"],
                {
                    "workflow_id": {"$ref": "#/$defs/workflow_id"},
                    "alias": {"$ref": "#/$defs/alias"},
                    "access": {"enum": list(ACCESS_MODES), "default": "read"},
                },
            ),
            "folder_access": _entries(
                MAX_FOLDERS,
                FOLDER_KEYS,
                ["alias", "path"],
                {
                    "alias": {"$ref": "#/$defs/alias"},
                    "path": {"type": "string", "pattern": "^/[^\\u0000]*$"},
                    "access": {"enum": list(FOLDER_ACCESS), "default": "read_only"},
                },
            ),
        },
        "additionalProperties": True,
        "$defs": {
            "workflow_id": _id("a workflow ID"),
            "principal_id": _id("a principal ID"),
            "alias": _alias(),
        },
    }


def schema_text() -> str:
    """The schema as docs/workflow.schema.json holds it: indented, key order kept."""
    return json.dumps(workflow_schema(), indent=2, ensure_ascii=False) + "\n"

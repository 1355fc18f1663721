"""docs/on-disk.md "kbd.yaml" is the full reference: every key it lists is one the
loader (kbd/core/config.py) accepts, and every key the loader accepts is listed.
The loader names its allowed keys when it refuses an unknown one: the test asks it."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from kbd.core.config import parse_config
from kbd.errors import InvalidConfig

REPO = Path(__file__).resolve().parents[2]
SECTIONS = ("locks", "sandbox", "revocation", "requests", "notes_quota", "note_history", "limits")
# A value each documented key accepts (the defaults, mostly).
VALUES: dict[str, Any] = {
    "host": "h1",
    "workflow_roots": ["workflows"],
    "folder_roots": [],
    "socket": "state/run/kbd.sock",
    "locks.timeout_seconds": 10,
    "sandbox.backend": "auto",
    "sandbox.network": "none",
    "sandbox.unsafe_landlock_writes": False,
    "sandbox.unsafe_no_sandbox": False,
    "sandbox.grant_group": None,
    "sandbox.report_denials": True,
    "revocation.immediate": False,
    "revocation.grace_seconds": 5,
    "requests.expire_days": 14,
    "notes_quota.max_bytes": 1 << 28,
    "notes_quota.max_files": 10_000,
    "note_history.max_versions": 100,
    "note_history.max_bytes": 1 << 26,
    "note_history.source_max_versions": 20_000,
    "note_history.source_max_bytes": 1 << 29,
    "note_history.deleted_days": 30,
    "limits.pids_max": 512,
    "limits.memory_max": "4G",
    "limits.cpu_weight": 50,
    "limits.cpu_max": None,
    "limits.file_size_max": "1G",
    "limits.open_files_max": 4096,
    "limits.address_space_max": None,
    "limits.cpu_time_max": None,
    "limits.tmpfs_size": "512M",
}


def documented() -> list[str]:
    text = (REPO / "docs" / "on-disk.md").read_text()
    section = text[text.index("## kbd.yaml") :]
    section = section[: section.index("\n## ", 5)]
    return re.findall(r"^\| `([a-z_.]+)` \|", section, re.M)


def accepted() -> set[str]:
    """Every key the loader accepts, as it names them refusing an unknown one."""
    out: set[str] = set()
    for where in ("", *SECTIONS):
        doc: dict[str, Any] = {"host": "h1"}
        if where:
            doc[where] = {"zz_unknown": 1}
        else:
            doc["zz_unknown"] = 1
        with pytest.raises(InvalidConfig) as err:
            parse_config(doc, root=Path("/r"))
        allowed = err.value.message.split("allowed: ", 1)[1].split(", ")
        out |= {f"{where}.{k}" if where else k for k in allowed}
    return out - set(SECTIONS)


def test_every_key_the_loader_accepts_is_documented_and_nothing_else() -> None:
    assert sorted(documented()) == sorted(accepted())


@pytest.mark.parametrize("key", documented())
def test_each_documented_key_loads_with_the_value_it_documents(key: str) -> None:
    doc: dict[str, Any] = {"host": "h1"}
    section, _, name = key.rpartition(".")
    if section:
        doc[section] = {name: VALUES[key]}
    else:
        doc[name] = VALUES[key]
    parse_config(doc, root=Path("/r"))

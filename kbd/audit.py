"""Append-only audit log: one JSON object a line in ``state/audit.log``.

The stdlib json module is used on purpose: this runs on ``kbd exec``'s path,
where importing orjson costs more than it saves.

Each event is one ``write()`` on an ``O_APPEND`` descriptor followed by fsync:
concurrent appenders (CLI processes and the daemon) never interleave lines.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from kbd.fsio import ensure_private_dir

AUDIT_NAME = "audit.log"


def append(state_dir: Path, event: str, **fields: Any) -> None:
    ensure_private_dir(state_dir)
    record = {"ts": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "event": event, **fields}
    # A refused name may hold a lone surrogate (an undecodable argv byte, JSON
    # "\ud800"): backslashreplace writes it as a JSON \udcff escape, still one valid line.
    line = (json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n").encode(
        "utf-8", "backslashreplace"
    )
    fd = os.open(
        state_dir / AUDIT_NAME,
        os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW,
        0o640,
    )
    try:
        os.write(fd, line)
        os.fsync(fd)
    finally:
        os.close(fd)


def read(state_dir: Path) -> list[dict[str, Any]]:
    try:
        with open(state_dir / AUDIT_NAME, "rb") as fh:
            return [json.loads(line) for line in fh if line.strip()]
    except FileNotFoundError:
        return []

"""A kbd Watcher in a process of its own, for the failure-mode tests that need
to act on the whole process: stop it (SIGSTOP, so the kernel queue overflows),
run it in a user namespace with a lowered ``max_inotify_watches``, or mount over
one of its folders inside its mount namespace.

``python -m tests.integration.watch_child CONFIG_JSON``: CONFIG is
``{"segments": {name: [paths]}, "options": {Watcher keyword arguments},
"max_user_watches": N?}``. Prints one JSON object per line on stdout (``started``,
``batch``, ``health``, ``done``, ``stopped``) and takes one JSON command per line
on stdin: ``{"op": "set", "name", "paths"}``, ``{"op": "limit", "value"}``,
``{"op": "stop"}``.
"""

from __future__ import annotations

import json
import sys
import threading
from typing import Any

from kbd.core.watching import WatchBatch, WatchHealth
from kbd.fs.watch import Watcher

LIMIT = "/proc/sys/user/max_inotify_watches"  # per user namespace: never the host's


def main() -> None:
    config: dict[str, Any] = json.loads(sys.argv[1])
    lock = threading.Lock()

    def emit(kind: str, **data: Any) -> None:
        with lock:
            sys.stdout.write(json.dumps({"kind": kind, **data}) + "\n")
            sys.stdout.flush()

    def on_batch(batch: WatchBatch) -> None:
        paths = [c.path for c in batch.changes] if len(batch.changes) <= 100 else []
        emit("batch", segment=batch.segment, n=len(batch.changes), lossy=batch.lossy, paths=paths)

    def on_health(health: WatchHealth) -> None:
        emit(
            "health",
            ok=health.ok,
            reason=health.reason,
            segment=health.segment,
            watches=health.watches,
            expected=health.expected,
            detail=health.detail,
        )

    if "max_user_watches" in config:
        set_limit(int(config["max_user_watches"]))
    watcher = Watcher(on_batch=on_batch, on_health=on_health, **config.get("options", {}))
    for name, paths in config["segments"].items():
        watcher.set_segment(name, paths)
    watcher.start()
    emit("started")
    for line in sys.stdin:
        command = json.loads(line)
        if command["op"] == "stop":
            break
        if command["op"] == "set":
            watcher.set_segment(command["name"], command["paths"])
        elif command["op"] == "limit":
            set_limit(int(command["value"]))
        emit("done", op=command["op"])
    watcher.stop()
    emit("stopped", threads=threading.active_count())


def set_limit(value: int) -> None:
    with open(LIMIT, "w", encoding="ascii") as fh:
        fh.write(f"{value}\n")


if __name__ == "__main__":
    main()

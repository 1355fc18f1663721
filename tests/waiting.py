"""The one way a test waits for a daemon, a watcher or a process: poll something
observable until it holds, and fail with a message naming what was awaited.

Tests never sleep to wait for something (STYLE.md habit 13, "A fast loop"): a
fixed sleep is too long on a quiet host and too short on a loaded one (the suite
runs in parallel, README "Development"). :func:`wait_for` polls with a short,
growing interval, so a quick answer is seen at once and a slow one costs few
wake-ups; its predicate is asked once more after the deadline, so a host that
was descheduled past the deadline still gets its answer checked, never a silent
pass and never a failure for want of one last look.

:func:`holds_for` is the other kind of wait: a deliberate window in which
something must *not* happen (a blocked command must stay blocked). It polls the
same way and fails as soon as the condition breaks, naming it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

FIRST_INTERVAL = 0.005
MAX_INTERVAL = 0.1


def wait_for(
    predicate: Callable[[], T | None],
    timeout: float,
    what: str,
    *,
    max_interval: float = MAX_INTERVAL,
    detail: Callable[[], object] | None = None,
) -> T:
    """Call ``predicate`` until it returns something truthy and return that.

    Raises AssertionError naming ``what`` (and ``detail()``, when given: a
    daemon's stderr, the last state seen) when ``timeout`` seconds have passed
    and a last call after the deadline is still falsy. Exceptions of the
    predicate propagate at once. ``max_interval`` caps the backoff: a test that
    measures a latency with the wait passes a small one."""
    deadline = time.monotonic() + timeout
    interval = FIRST_INTERVAL
    while True:
        value = predicate()
        if value:
            return value
        left = deadline - time.monotonic()
        if left <= 0:
            break
        time.sleep(min(interval, left))
        interval = min(interval * 1.5, max_interval)
    value = predicate()  # one look after the deadline: a descheduled host still gets checked
    if value:
        return value
    extra = f"\n{detail()}" if detail is not None else ""
    raise AssertionError(f"timed out after {timeout} s waiting for: {what}{extra}")


def holds_for(
    predicate: Callable[[], object],
    seconds: float,
    what: str,
    *,
    max_interval: float = MAX_INTERVAL,
    detail: Callable[[], object] | None = None,
) -> None:
    """Assert that ``predicate`` stays truthy for ``seconds`` (checked from the
    start, through the window, and once at its end): a negative window giving
    something time to misbehave. Raises AssertionError naming ``what`` as soon
    as it is falsy."""
    deadline = time.monotonic() + seconds
    interval = FIRST_INTERVAL
    while True:
        if not predicate():
            extra = f"\n{detail()}" if detail is not None else ""
            raise AssertionError(f"stopped holding within its {seconds} s window: {what}{extra}")
        left = deadline - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(interval, left))
        interval = min(interval * 1.5, max_interval)

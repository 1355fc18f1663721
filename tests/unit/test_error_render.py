"""kbd/errors/render.py: how an unexpected exception is named (exit 70, never a traceback)."""

from __future__ import annotations

import errno

from kbd.errors import render


def test_a_task_groups_one_failure_is_named_not_the_group() -> None:
    """An async server (kbd mcp, kbd ui) fails inside a task group: the message
    names the failure ("unexpected ExceptionGroup" told nobody anything)."""
    err = render.internal_error(ExceptionGroup("unhandled errors in a TaskGroup", [ValueError("bad frame")]))
    assert err.message == "unexpected ValueError: bad frame" and err.exit_code == 70
    nested = ExceptionGroup(
        "outer", [ExceptionGroup("inner", [OSError(errno.ENOSPC, "No space left on device")])]
    )
    assert render.internal_error(nested).code == "no-space"
    two = render.internal_error(ExceptionGroup("g", [KeyError("k"), RuntimeError("r")]))
    assert two.message == "unexpected errors: KeyError: 'k'; RuntimeError: r"

"""The renderings of an error every interface shares: :func:`error_text`
(the lines a person reads: the CLI's stderr via :func:`print_error`, an MCP
tool error) and
:func:`internal_error` (what an exception kbd did not expect becomes: code
``internal``, exit 70; the daemon's 500 and the CLI's last resort)."""

from __future__ import annotations

import sys

from kbd.errors import NO_SPACE_ERRNOS, KbdError, from_oserror


def error_text(err: KbdError, *, hint: str | None = None) -> str:
    """``error[code]: message`` and ``hint: …`` lines: the one shape of an error
    for a person, on the CLI's stderr and in an MCP tool error (kbd mcp, which
    gives its own ``hint`` where the error's names a command an agent cannot run)."""
    hint = err.hint if hint is None else hint
    lines = f"error[{err.code}]: {err.message}\n"
    if hint:
        lines += f"hint: {hint}\n"
    return lines


def print_error(err: KbdError) -> None:
    """:func:`error_text` on stderr (best effort: a closed stderr must not turn
    one error into another)."""
    lines = error_text(err)
    try:
        sys.stderr.write(lines)
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def internal_error(exc: BaseException) -> KbdError:
    """A KbdError (code ``internal``, exit 70) for an exception kbd did not expect."""
    if isinstance(exc, BaseExceptionGroup):
        # An async server's task group wraps the real failure: name it, not the group.
        leaves = _leaves(exc)
        if len(leaves) == 1:
            return internal_error(leaves[0])
        return KbdError("unexpected errors: " + "; ".join(f"{type(e).__name__}: {e}" for e in leaves[:3]))
    if isinstance(exc, OSError) and exc.errno in NO_SPACE_ERRNOS:
        return from_oserror(exc, what="finish the command")
    if isinstance(exc, OSError):
        return KbdError(
            f"unexpected I/O error: {exc.strerror or exc}",
            hint="check the root's permissions; run `kbd doctor`",
        )
    return KbdError(f"unexpected {type(exc).__name__}: {exc}")


def _leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    out: list[BaseException] = []
    for e in group.exceptions:
        out.extend(_leaves(e) if isinstance(e, BaseExceptionGroup) else [e])
    return out


def reference_rows() -> list[str]:
    """docs/errors.md's table, one Markdown row per class of the error tree (depth first, in
    declaration order): the code, the class and the one it refines, the exit code, the HTTP
    status and the default hint (tests/unit/test_errors.py holds the document to it)."""
    from kbd import errors

    def walk(cls: type[errors.KbdError], parent: str) -> list[str]:
        hint = cls.default_hint.replace("|", "\\|")
        rows = [
            f"| `{cls.code}` | {cls.__name__} | {parent} | {cls.exit_code} | {cls.http_status} | {hint} |"
        ]
        for sub in cls.__subclasses__():
            if sub.__module__ == errors.__name__:
                rows += walk(sub, cls.__name__)
        return rows

    return walk(errors.KbdError, "—")

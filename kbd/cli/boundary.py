"""The CLI boundary: the one place where an error becomes stderr lines and an exit code.

Both entry points use it: the lean ``kbd exec`` path (:mod:`kbd.cli.entry`) and the
click CLI (:mod:`kbd.cli.commands`). Standard library only, so the exec path stays lean.

- A :class:`KbdError` prints ``error[<code>]: <message>`` and ``hint: <hint>`` and
  exits with its code.
- An ``OSError`` that escaped the library is an internal I/O error (70), except
  a full disk or quota: ``no-space`` (75, see :class:`kbd.errors.NoSpace`).
- Anything else is a bug: ``error[internal]: …`` and 70, never a traceback unless
  ``KBD_DEBUG=1`` asks for one (a traceback can carry host paths and data).
- A closed stdout (``kbd audit | head -1``) ends the process the way git and the
  coreutils end: killed by SIGPIPE, without a word. A shell then sees 141
  (128 + SIGPIPE), which ``set -o pipefail`` scripts already treat as "reader
  went away" for every other producer; exiting 0 would hide that the output was
  cut short, and any message would land in the middle of the reader's terminal.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from typing import NoReturn

from kbd.errors import KbdError
from kbd.errors.render import internal_error, print_error

SIGPIPE_EXIT = 128 + signal.SIGPIPE


def die_of_sigpipe() -> NoReturn:
    """End the process as a writer into a closed pipe ends by default: SIGPIPE.

    Python ignores SIGPIPE at start-up (so writes raise BrokenPipeError instead);
    restoring the default and raising it gives the exact status git gives. The
    buffered stdout is dropped first so nothing tries to flush it on the way out.
    """
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGPIPE)
    os._exit(SIGPIPE_EXIT)  # not reached unless the signal is blocked


def _is_broken_pipe(exc: BaseException) -> bool:
    return isinstance(exc, BrokenPipeError) or (
        isinstance(exc, KbdError) and isinstance(exc.__cause__, BrokenPipeError)
    )


def guarded(body: Callable[[], int]) -> int:
    """Run ``body`` and return its exit code, turning every exception into the
    contract's output and exit code (see the module docstring); stdout is
    flushed here, so a reader that left during the last write ends us quietly
    too."""
    code = _answer(body)
    try:
        if sys.stdout is not None:  # None: started with fd 1 closed
            sys.stdout.flush()
    except BrokenPipeError:
        die_of_sigpipe()
    return code


def _answer(body: Callable[[], int]) -> int:
    try:
        return body()
    except KeyboardInterrupt:
        return 130  # the terminal already showed ^C; a traceback would add nothing
    except Exception as exc:  # the boundary: nothing passes it as a traceback
        if _is_broken_pipe(exc):
            die_of_sigpipe()
        err = exc if isinstance(exc, KbdError) else internal_error(exc)
        print_error(err)
        if os.environ.get("KBD_DEBUG") == "1" and not isinstance(exc, KbdError):
            import traceback  # only when asked: kept off kbd exec's start-up path

            traceback.print_exception(exc, file=sys.stderr)
        return err.exit_code

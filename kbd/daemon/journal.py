"""Where ``kbd serve`` logs: journald's native protocol when systemd runs it,
else text on stderr (:func:`configure`).

Detection is systemd's documented one: ``$JOURNAL_STREAM`` holds the
``st_dev:st_ino`` of the stream systemd connected to the service's stderr, and
only when it names the stderr this process really has is stderr the journal
(a child whose stderr was redirected elsewhere inherits the variable but not
the stream). Records are then sent as datagrams in the native protocol
(:func:`kbd.core.telemetry.journal_datagram`) to ``/run/systemd/journal/socket``
with ``MESSAGE``, ``PRIORITY``, ``SYSLOG_IDENTIFIER=kbd``, ``LOGGER`` and, for
access lines, ``KBD_PRINCIPAL``, ``KBD_ROUTE``, ``KBD_STATUS`` and ``KBD_MS``:
fields ``journalctl -o json`` and ``journalctl KBD_STATUS=500`` can use,
without systemd-python (it needs libsystemd's headers to build).

A send never fails a request: a record journald cannot take (its socket gone,
refused, the record too large, its queue full) is written to stderr instead;
when the socket is gone or refuses, stderr is used from then on, said once.

``KBD_TEST_JOURNAL_SOCKET`` replaces the journal socket's path. It is for the
test suite only (which binds its own datagram socket and reads what the real
daemon sends); nothing else should set it.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import sys
from typing import IO, Any

from kbd.core.telemetry import journal_datagram, syslog_priority

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
JOURNAL_SOCKET = "/run/systemd/journal/socket"
TEST_SOCKET_ENV = "KBD_TEST_JOURNAL_SOCKET"
IDENTIFIER = "kbd"
TEXT_FORMAT = "%(levelname)s %(name)s: %(message)s"
# The socket is gone or nobody listens: journald is not coming back for this
# daemon's lifetime as far as it can tell; everything else is about one record.
_GONE = frozenset({errno.ENOENT, errno.ECONNREFUSED, errno.ENOTDIR, errno.EACCES, errno.EPERM})


def stderr_is_journal(environ: dict[str, str] | os._Environ[str] | None = None, *, fd: int = 2) -> bool:
    """``$JOURNAL_STREAM`` (``DEV:INO``) names the file open on ``fd``."""
    value = (os.environ if environ is None else environ).get("JOURNAL_STREAM", "")
    dev, sep, ino = value.partition(":")
    if not (sep and dev.isdigit() and ino.isdigit()):
        return False
    try:
        st = os.fstat(fd)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == (int(dev), int(ino))


def record_fields(record: logging.LogRecord, message: str) -> list[tuple[str, str]]:
    """The journal fields of one record (``message``: the record formatted)."""
    fields = [("MESSAGE", message), ("PRIORITY", str(syslog_priority(record.levelno))),
              ("SYSLOG_IDENTIFIER", IDENTIFIER), ("LOGGER", record.name)]  # fmt: skip
    access: dict[str, Any] | None = getattr(record, "kbd_access", None)
    if access is not None:
        principal = access["principal"]
        fields += [("KBD_PRINCIPAL", "-" if principal is None else str(principal)),
                   ("KBD_ROUTE", str(access["route"])), ("KBD_STATUS", str(access["status"])),
                   ("KBD_MS", f"{access['ms']:.2f}")]  # fmt: skip
    return fields


class JournalHandler(logging.Handler):
    """Sends records to journald's native socket; see the module docstring."""

    def __init__(self, path: str, *, fallback: logging.Handler) -> None:
        super().__init__()
        self.path = path
        self.fallback = fallback
        self.gone = False
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        # Never block the event loop behind a slow journald: a full queue
        # sends that record to stderr instead.
        self.sock.setblocking(False)

    def emit(self, record: logging.LogRecord) -> None:
        if self.gone:
            self.fallback.handle(record)
            return
        try:
            data = journal_datagram(record_fields(record, self.format(record)))
            self.sock.sendto(data, self.path)
        except OSError as exc:
            if exc.errno in _GONE:
                self.gone = True
                self._say(f"kbd: journald is unreachable at {self.path} ({os.strerror(exc.errno or 0)}): "
                          "logging to stderr from now on")  # fmt: skip
            self.fallback.handle(record)
        except Exception:
            self.handleError(record)

    def _say(self, text: str) -> None:
        self.fallback.handle(logging.makeLogRecord({"name": "kbd.journal", "levelno": logging.WARNING,
                                                    "levelname": "WARNING", "msg": text}))  # fmt: skip

    def close(self) -> None:
        self.sock.close()
        super().close()


def parse_level(name: str) -> int:
    """A ``--log-level`` name as a logging level (KeyError: not one of :data:`LEVELS`)."""
    return LEVELS[name.lower()]


def configure(level: int, *, stream: IO[str] | None = None) -> logging.Handler:
    """Send every logger's records at ``level`` and above to journald (when
    stderr is the journal) or to stderr as text; replaces the root logger's
    handlers (the daemon owns its process). Returns the handler installed."""
    text = logging.StreamHandler(stream if stream is not None else sys.stderr)
    text.setFormatter(logging.Formatter(TEXT_FORMAT))
    handler: logging.Handler = text
    if stderr_is_journal():
        handler = JournalHandler(os.environ.get(TEST_SOCKET_ENV) or JOURNAL_SOCKET, fallback=text)
        handler.setFormatter(logging.Formatter("%(message)s"))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    return handler

"""kbd.daemon.journal: the systemd detection and the native-protocol handler, with a
real datagram socket standing in for journald."""

from __future__ import annotations

import io
import logging
import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kbd.daemon import journal
from tests.unit.core.test_telemetry import parse_datagram


def test_journal_stream_must_name_this_stderr(tmp_path: Path) -> None:
    with open(tmp_path / "err", "w") as f:
        st = os.fstat(f.fileno())
        assert journal.stderr_is_journal({"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}, fd=f.fileno())
        for other in (
            "",
            "x:y",
            f"{st.st_dev}:{st.st_ino + 1}",
            f"{st.st_dev}",
            f"{st.st_dev}:{st.st_ino}:1",
        ):
            assert not journal.stderr_is_journal({"JOURNAL_STREAM": other}, fd=f.fileno()), other
        assert not journal.stderr_is_journal({}, fd=f.fileno())


@pytest.fixture
def sink(tmp_path: Path) -> Iterator[socket.socket]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "j.sock"))
    sock.settimeout(5)
    yield sock
    sock.close()


def _handler(path: str) -> tuple[journal.JournalHandler, io.StringIO]:
    text = io.StringIO()
    fallback = logging.StreamHandler(text)
    fallback.setFormatter(logging.Formatter(journal.TEXT_FORMAT))
    handler = journal.JournalHandler(path, fallback=fallback)
    handler.setFormatter(logging.Formatter("%(message)s"))
    return handler, text


def _record(msg: str, *, level: int = logging.ERROR, exc: bool = False) -> logging.LogRecord:
    info = None
    if exc:
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            info = sys.exc_info()
    return logging.LogRecord("kbd.api", level, __file__, 1, msg, None, info)


def test_a_traceback_travels_in_the_binary_safe_form(sink: socket.socket) -> None:
    handler, text = _handler(sink.getsockname())
    handler.handle(_record("internal error", exc=True))
    fields = dict(parse_datagram(sink.recv(1 << 16)))
    assert fields["MESSAGE"].startswith(b"internal error\nTraceback")
    assert (
        fields["PRIORITY"] == b"3"
        and fields["LOGGER"] == b"kbd.api"
        and fields["SYSLOG_IDENTIFIER"] == b"kbd"
    )
    assert "KBD_ROUTE" not in fields and text.getvalue() == ""
    handler.close()


def test_a_full_journal_queue_sends_that_record_to_stderr(sink: socket.socket) -> None:
    """journald not reading: sends never block (the event loop would), the
    records go to stderr, and the handler keeps trying the journal."""
    handler, text = _handler(sink.getsockname())
    sent = 0
    while not text.getvalue():
        assert sent < 100_000, "every send was taken: the queue never filled"
        handler.handle(_record(f"record {sent} " + "x" * 4000))
        sent += 1
    assert text.getvalue().startswith("ERROR kbd.api: record "), text.getvalue()[:200]
    assert not handler.gone and "unreachable" not in text.getvalue()
    handler.close()


def test_journald_gone_is_said_once(tmp_path: Path) -> None:
    handler, text = _handler(str(tmp_path / "nobody.sock"))
    for n in range(3):
        handler.handle(_record(f"r{n}"))
    out = text.getvalue().splitlines()
    assert out[0].startswith(
        f"WARNING kbd.journal: kbd: journald is unreachable at {tmp_path / 'nobody.sock'}"
    )
    assert out[1:] == [
        "ERROR kbd.api: r0",
        "ERROR kbd.api: r1",
        "ERROR kbd.api: r2",
    ]
    handler.close()


def test_parse_level() -> None:
    assert journal.parse_level("DEBUG") == logging.DEBUG and journal.parse_level("error") == logging.ERROR
    with pytest.raises(KeyError):
        journal.parse_level("verbose")

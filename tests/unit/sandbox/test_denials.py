"""Reading Landlock's audit records (docs/sandbox.md "Refusals the kernel reports"): the
record parser against what the kernel writes (quoted and hex values, a path chosen to look
like more fields), the per-domain buffer's claims and bounds, and why reports are unavailable."""

from __future__ import annotations

import errno
import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kbd.sandbox import denials
from kbd.sandbox.denials import LANDLOCK_ACCESS, LANDLOCK_DOMAIN, Buffer, parse, why_unavailable

# Records as Linux 6.18 writes them (taken from a real run, domain and times kept).
ACCESS = 'audit(1796684928.677:2): domain=1e5376281 blockers=fs.read_file path="/tmp/exp/secret" dev="vda" ino=2147598'
ALLOCATED = (
    "audit(1796684928.677:2): domain=1e5376281 status=allocated mode=enforcing pid=13651 uid=0 "
    'exe="/usr/bin/python3.11" comm="python3"'
)
DEALLOCATED = "audit(1796684928.741:8): domain=1e5376281 status=deallocated denials=6"


def test_parse_reads_the_time_and_the_fields() -> None:
    when, fields = parse(ACCESS)
    assert when == 1796684928.677
    assert fields == {"domain": "1e5376281", "blockers": "fs.read_file", "path": "/tmp/exp/secret",
                      "dev": "vda", "ino": "2147598"}  # fmt: skip


def hexed(text: str) -> str:
    return os.fsencode(text).hex().upper()


@given(st.text(st.characters(exclude_categories=["Cs"]), min_size=1, max_size=40))
def test_a_path_never_becomes_more_fields(name: str) -> None:
    """The kernel quotes a value it does not trust, or writes it in hex when it holds a space,
    a quote or a control character: whatever a command names its file, it is one path."""
    path = f"/w/{name}"
    raw = os.fsencode(path)
    trusted = all(0x21 <= b <= 0x7E and b != 0x22 for b in raw)
    value = f'"{path}"' if trusted else hexed(path)
    _, fields = parse(f'audit(1.0:1): domain=aa blockers=fs.write_file path={value} dev="vda" ino=1')
    assert fields["path"] == path
    assert fields["blockers"] == "fs.write_file" and fields["domain"] == "aa"


def test_messages_splits_a_datagram() -> None:
    def msg(kind: int, text: str) -> bytes:
        body = text.encode()
        length = 16 + len(body)
        return (length.to_bytes(4, "little") + kind.to_bytes(2, "little") + bytes(10) + body
                + bytes(-length % 4))  # fmt: skip

    data = msg(LANDLOCK_ACCESS, ACCESS) + msg(LANDLOCK_DOMAIN, ALLOCATED)
    assert denials.messages(data) == [(LANDLOCK_ACCESS, ACCESS), (LANDLOCK_DOMAIN, ALLOCATED)]
    assert denials.messages(data[:20]) == []  # a truncated message is dropped, not misread


def test_a_claim_takes_its_pids_domains_with_the_kernels_final_count() -> None:
    buf = Buffer()
    for text in (ACCESS, ALLOCATED, ACCESS.replace(":2)", ":7)")):
        buf.take(LANDLOCK_DOMAIN if "status=" in text else LANDLOCK_ACCESS, text, now=0.0)
    other = ALLOCATED.replace("1e5376281", "ff").replace("pid=13651", "pid=99")
    buf.take(LANDLOCK_DOMAIN, other, now=0.0)
    mine = buf.mine(13651, 0, since=1796684928.0)
    assert mine == ["1e5376281"]
    assert buf.mine(13651, 0, since=1796684999.0) == []  # an older domain of a reused pid
    # Another user's domain under a reused pid is never claimed.
    assert buf.mine(13651, 1000, since=1796684928.0) == []
    assert not buf.ended(mine)
    buf.take(LANDLOCK_DOMAIN, DEALLOCATED, now=1.0)
    assert buf.ended(mine)
    got = buf.pop(mine, final=True)
    assert got.refused == (denials.Refused(("fs.read_file",), "/tmp/exp/secret", None, 2),)
    assert (got.lost, got.final) == (4, True)  # the kernel counted 6 refusals, 2 arrived
    assert len(buf) == 1 and buf.mine(13651, 0, since=0) == []  # claimed once only


def test_the_buffer_is_bounded() -> None:
    buf = Buffer()
    buf.take(LANDLOCK_DOMAIN, ALLOCATED, now=0.0)
    for i in range(denials.MAX_DISTINCT + 10):
        buf.take(LANDLOCK_ACCESS, ACCESS.replace("/tmp/exp/secret", f"/x/{i}"), now=0.0)
    long = "/" + "a" * (denials.MAX_PATH * 2)
    other = ALLOCATED.replace("1e5376281", "bb").replace("pid=13651", "pid=7")
    buf.take(LANDLOCK_DOMAIN, other, now=0.0)
    buf.take(LANDLOCK_ACCESS, ACCESS.replace("1e5376281", "bb").replace("/tmp/exp/secret", long), now=0.0)
    got = buf.pop(buf.mine(13651, 0, 0), final=False)
    assert len(got.refused) == denials.MAX_DISTINCT and got.lost == 0  # not final: nothing claimed lost
    (kept,) = buf.pop(buf.mine(7, 0, 0), final=False).refused
    assert kept.path is not None and len(kept.path) == denials.MAX_PATH and kept.path.endswith("…")
    # Ended, unclaimed domains go after ENDED_KEEP; the oldest go past MAX_DOMAINS.
    for i in range(denials.MAX_DOMAINS + 100):
        buf.take(LANDLOCK_DOMAIN, f"audit(1.0:1): domain=d{i} status=deallocated denials=1", now=0.0)
    assert len(buf) <= denials.MAX_DOMAINS
    assert buf.evicted > 0  # counted: a running command's report then says it may be incomplete
    buf.take(
        LANDLOCK_DOMAIN, "audit(1.0:1): domain=late status=allocated pid=1 uid=0", now=denials.ENDED_KEEP + 1
    )
    for i in range(64):
        buf.take(
            LANDLOCK_DOMAIN,
            f"audit(1.0:1): domain=n{i} status=allocated pid=1 uid=0",
            now=denials.ENDED_KEEP + 1,
        )
    assert len(buf) <= 65


def test_other_record_types_are_ignored() -> None:
    buf = Buffer()
    buf.take(1300, "audit(1.0:1): arch=c000003e syscall=257 domain=zz pid=1", now=0.0)
    assert len(buf) == 0


@pytest.mark.parametrize(
    ("abi", "can_read", "status", "expected"),
    [
        (
            6,
            True,
            (0, 1) + (0,) * 6,
            "the kernel's Landlock ABI is 6: refusal reports need ABI 7 (Linux 6.15)",
        ),
        (
            0,
            True,
            (0, 1) + (0,) * 6,
            "the kernel's Landlock ABI is absent: refusal reports need ABI 7 (Linux 6.15)",
        ),
        (7, False, (0, 1) + (0,) * 6, "reading the kernel's audit records needs CAP_AUDIT_READ"),
        (
            7,
            True,
            OSError(errno.EPERM, "Operation not permitted"),
            "cannot ask the kernel whether audit is on",
        ),
        (
            7,
            True,
            (0, 0) + (0,) * 6,
            "kernel audit is off (turn it on with `auditctl -e 1`, or boot with audit=1)",
        ),
        (7, True, (0, 1) + (0,) * 6, None),
        (8, True, (0, 2) + (0,) * 6, None),  # enabled and locked (2) reports too
    ],
)
def test_why_unavailable(
    abi: int, can_read: bool, status: tuple[int, ...] | OSError, expected: str | None
) -> None:
    got = why_unavailable(abi, can_read, status)
    if expected is None:
        assert got is None
    else:
        assert got is not None and got.startswith(expected), got


def test_the_pid_channel_gives_the_writers_pid_and_uid() -> None:
    reader, fd = denials.pid_channel()
    try:
        assert denials.sender(reader) is None  # nothing written yet
        pid = os.fork()
        if pid == 0:
            os.write(fd, b"p")
            os._exit(0)
        os.waitpid(pid, 0)
        assert denials.sender(reader) == (pid, os.getuid())  # the writer's, though it is gone
    finally:
        os.close(fd)
        reader.close()

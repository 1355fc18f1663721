"""The exec broker's wire codec (kbd/core/wire.py; docs/daemon.md "The exec broker").

- Round trips: any valid request and any frame sequence decode to what was
  encoded, whatever the read sizes.
- Every malformed input — truncated, oversized, an unknown tag or kind, a
  repeated singleton, non-UTF-8 where text is required, random bytes — raises
  WireError (a KbdError: 65, HTTP 400, ``protocol-error``) and nothing else.
- Bounds hold before buffering: a header announcing a huge frame is refused
  on its 5 bytes.
- The module is cheap for the thin client: importing it loads no stdlib module
  a bare ``python3 -I -S`` has not already loaded.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import subprocess
import sys

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from kbd.core import wire
from kbd.core.wire import FrameReader, Request, decode_request, encode_request
from kbd.errors import InvalidInput, KbdError, WireError

ids = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), min_size=1, max_size=40).filter(
    lambda s: len(s.encode()) <= wire.MAX_ID_BYTES
)
raw = st.binary(max_size=64).filter(lambda b: b"\x00" not in b)
nonempty_raw = raw.filter(bool)
env_values = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=30)


@st.composite
def requests(draw: st.DrawFn) -> Request:
    argv = [draw(nonempty_raw), *draw(st.lists(raw, max_size=6))]
    return Request(
        draw(ids),
        argv,
        cwd=draw(st.none() | nonempty_raw),
        env=draw(st.dictionaries(st.sampled_from(wire.ENV_NAMES), env_values)),
        as_principal=draw(st.none() | ids),
        root=draw(st.none() | nonempty_raw),
    )


def rec(tag: int, value: bytes) -> bytes:
    return bytes((tag,)) + len(value).to_bytes(4, "big") + value


GOOD = rec(wire.TAG_SID, b"s_0123") + rec(wire.TAG_ARGV, b"/bin/true")


def test_wire_error_is_a_user_facing_kbd_error() -> None:
    err = WireError("x")
    assert isinstance(err, InvalidInput) and isinstance(err, KbdError)
    assert (err.code, err.exit_code, err.http_status) == ("protocol-error", 65, 400)


@given(requests())
def test_requests_round_trip(request: Request) -> None:
    body = encode_request(request)
    assert decode_request(body) == request
    assert encode_request(decode_request(body)) == body  # one request, one encoding


def test_a_known_request_has_known_bytes() -> None:
    r = Request("s_1", [b"sh", b"-c", b""], cwd=b"/w", env={"TERM": "xterm", "LANG": "C"}, as_principal="ops")
    assert encode_request(r) == (
        rec(1, b"s_1") + rec(2, b"sh") + rec(2, b"-c") + rec(2, b"") + rec(3, b"/w")
        + rec(4, b"LANG=C") + rec(4, b"TERM=xterm") + rec(5, b"ops")
    )  # fmt: skip
    assert decode_request(GOOD) == Request("s_0123", [b"/bin/true"])


def _raises_wire_error_only(body: bytes) -> Request | None:
    try:
        return decode_request(body)
    except WireError as exc:
        assert exc.message
        return None


@given(requests(), st.data())
def test_every_truncation_is_refused_or_a_shorter_valid_request(
    request: Request, data: st.DataObject
) -> None:
    body = encode_request(request)
    cut = data.draw(st.integers(0, len(body) - 1))
    got = _raises_wire_error_only(body[:cut])
    # A cut exactly between records may leave a valid, shorter request; never anything else.
    if got is not None:
        assert encode_request(got) == body[:cut]


@given(st.binary(max_size=300))
def test_random_bytes_raise_only_wire_error(body: bytes) -> None:
    _raises_wire_error_only(body)


@given(requests(), st.data())
def test_random_mutations_raise_only_wire_error(request: Request, data: st.DataObject) -> None:
    body = bytearray(encode_request(request))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(body) - 1))
        body[i] = data.draw(st.integers(0, 255))
    _raises_wire_error_only(bytes(body))


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b"", "no sid record"),
        (rec(1, b"s"), "argv is empty"),
        (GOOD[:-1], "truncated argv record at offset 11: declares 9 bytes, 8 follow"),
        (GOOD + b"\x02\x00\x00", "truncated record header at offset 25"),
        (GOOD + rec(8, b"x"), "unknown tag 0x08 at offset 25"),
        (GOOD + rec(7, b"\x78"), "flags 120 has unknown bits; allowed: 1 (strict), 2 (json)"),
        (GOOD + rec(7, b"\x01") + rec(7, b"\x01"), "flags given twice"),
        (GOOD + rec(7, b"\x01\x01"), "flags record at offset 25 is 2 bytes; it is one byte"),
        (GOOD + rec(0, b""), "unknown tag 0x00"),
        (GOOD + rec(1, b"s_2"), "sid given twice"),
        (GOOD + rec(3, b"/a") + rec(3, b"/b"), "cwd given twice"),
        (GOOD + rec(5, b"a") + rec(5, b"b"), "as given twice"),
        (GOOD + rec(6, b"/r") + rec(6, b"/r"), "root given twice"),
        (GOOD + rec(4, b"TERM=a") + rec(4, b"TERM=b"), "env TERM given twice"),
        (GOOD + rec(4, b"PATH=/bin"), "env names 'PATH'; only LANG, TERM may be passed"),
        (GOOD + rec(4, b"LANG"), "is not NAME=VALUE"),
        (GOOD + rec(4, b"LANG=\xff"), "env is not valid UTF-8"),
        (rec(1, b"s_\xc3") + rec(2, b"x"), "sid is not valid UTF-8 (byte 2)"),
        (GOOD + rec(5, b"\xed\xa0\x80"), "as is not valid UTF-8"),  # an encoded surrogate
        (rec(1, b"") + rec(2, b"x"), "sid must be 1 to 512 bytes"),
        (rec(1, b"s" * 513) + rec(2, b"x"), "sid must be 1 to 512 bytes of UTF-8, got 513"),
        (rec(1, b"s\x00") + rec(2, b"x"), "sid must not contain a NUL"),
        (rec(1, b"s") + rec(2, b""), "argv[0] must not be empty"),
        (GOOD + rec(2, b"a\x00b"), "argv[1] contains a NUL byte at offset 1"),
        (GOOD + rec(3, b""), "cwd must not be empty"),
        (GOOD + rec(3, b"/" * 4096), "cwd is 4096 bytes; at most 4095"),
        (GOOD + rec(6, b"/\x00"), "root contains a NUL"),
        (rec(1, b"s") + rec(2, b"x" * (wire.MAX_ARG_BYTES + 1)), "argv[0] is 131072 bytes"),
        (rec(1, b"s") + rec(2, b"x") * 4097, "argv has more than 4096 items"),
        (rec(1, b"s") + rec(2, b"x" * (4 << 20)), "at most 4194304 are allowed"),
    ],
)
def test_malformed_requests_name_what_is_wrong(body: bytes, says: str) -> None:
    with pytest.raises(WireError) as exc:
        decode_request(body)
    assert says in exc.value.message


def test_a_record_announcing_more_than_the_body_is_not_buffered() -> None:
    with pytest.raises(WireError, match="declares 4294967295 bytes, 0 follow"):
        decode_request(rec(1, b"s") + b"\x02\xff\xff\xff\xff")


@pytest.mark.parametrize(
    ("request_", "says"),
    [
        (Request("s", []), "argv is empty"),
        (Request("s", [b"x"] * 4097), "argv has 4097 items"),
        (Request("s", ["x"]), "argv[0] must be bytes, got str"),  # type: ignore[list-item]
        (Request("s", [b"x"], env={"HOME": "/root"}), "only LANG, TERM"),
        (Request("s", [b"x"], env={"LANG": "\udcff"}), "env LANG is not valid UTF-8"),
        (Request("s", [b"x"], env={"LANG": "x" * 1024}), "NAME=VALUE is at most 1024"),
        (Request("\udcff", [b"x"]), "sid holds a lone surrogate"),
        (Request("s", [b"x"], as_principal=""), "as must be 1 to 512 bytes"),
        (Request("s", [b"x"], cwd=b"\x00"), "cwd contains a NUL"),
        (Request("s", [b"y" * 100_000] * 50), "at most 4194304 are allowed (argv too long)"),
    ],
)
def test_the_client_cannot_encode_what_the_daemon_refuses(request_: Request, says: str) -> None:
    with pytest.raises(WireError) as exc:
        encode_request(request_)
    assert says in exc.value.message


# -- the HTTP head ------------------------------------------------------------------------------------


def test_request_head_is_what_the_front_door_sniffs_and_parses() -> None:
    body = encode_request(Request("s_1", [b"/bin/true"]))
    head = wire.request_head(len(body), token="kbd_abc")
    assert head.startswith(wire.SNIFF) and len(wire.SNIFF) == 14
    parsed = wire.parse_request_head(head + body)
    assert parsed is not None and parsed.size == len(head)
    assert wire.content_length(parsed) == len(body)
    assert parsed.headers["authorization"] == "Bearer kbd_abc"
    assert parsed.headers["upgrade"] == "kbd-exec/1"
    assert wire.parse_request_head(head[:-1]) is None  # incomplete: read more
    assert "authorization" not in wire.parse_request_head(wire.request_head(0)).headers  # type: ignore[union-attr]


@pytest.mark.parametrize("token", ["a\r\nX-Evil: 1", "", "tök", "a\x00"])
def test_a_token_cannot_inject_a_header(token: str) -> None:
    with pytest.raises(WireError, match="the token must be non-empty visible ASCII"):
        wire.request_head(1, token=token)


@pytest.mark.parametrize(
    ("head", "says"),
    [
        (b"GET /v1/exec HTTP/1.1\r\n\r\n", "the request line is 'GET /v1/exec HTTP/1.1'"),
        (b"POST /v1/exec HTTP/1.1\r\nUpgrade: h2c\r\n\r\n", "upgrade must be 'kbd-exec/1'"),
        (b"POST /v1/exec HTTP/1.1\r\nUpgrade: kbd-exec/1\r\n\r\n", "content-type must be"),
        (b"POST /v1/exec HTTP/1.1\r\nUpgrade: kbd-exec/1\r\nUpgrade: kbd-exec/1\r\n\r\n", "given twice"),
        (b"POST /v1/exec HTTP/1.1\r\nno colon\r\n\r\n", "malformed header line"),
        (b"POST /v1/exec HTTP/1.1\r\nX: \xff\r\n\r\n", "not ASCII"),
        (b"POST /v1/exec HTTP/1.1\r\n" + b"X: " + b"a" * (16 << 10), "exceed 16384 bytes"),
    ],
)
def test_bad_request_heads_are_refused(head: bytes, says: str) -> None:
    with pytest.raises(WireError) as exc:
        wire.parse_request_head(head)
    assert says in exc.value.message


@pytest.mark.parametrize(
    ("length", "says"),
    [(None, "content-length is missing"), ("-1", "not a decimal"), ("1e3", "not a decimal"),
     ("١٢", "the HTTP head is not ASCII"), (str((4 << 20) + 1), "at most 4194304"), ("9" * 11, "not a decimal")],
)  # fmt: skip
def test_content_length_is_strict(length: str | None, says: str) -> None:
    lines = [b"POST /v1/exec HTTP/1.1", b"Upgrade: kbd-exec/1", b"Content-Type: application/vnd.kbd.exec"]
    if length is not None:
        lines.append(b"Content-Length: " + length.encode())
    with pytest.raises(WireError) as exc:
        wire.parse_request_head(b"\r\n".join([*lines, b"", b""]))
    assert says in exc.value.message


def test_transfer_encoding_is_refused() -> None:
    head = wire.request_head(3).replace(b"\r\n\r\n", b"\r\nTransfer-Encoding: chunked\r\n\r\n")
    with pytest.raises(WireError, match="transfer-encoding is not allowed"):
        wire.parse_request_head(head)


def test_response_heads() -> None:
    status, head = wire.parse_response_head(wire.SWITCHING + b"\x11")  # type: ignore[misc]
    assert (status, head.headers["upgrade"], head.size) == (101, "kbd-exec/1", len(wire.SWITCHING))
    err = b"HTTP/1.1 404 Not Found\r\nx-kbd-exit: 66\r\ncontent-length: 2\r\n\r\n{}"
    status, head = wire.parse_response_head(err)  # type: ignore[misc]
    assert (status, head.headers["x-kbd-exit"]) == (404, "66")
    assert wire.parse_response_head(b"HTTP/1.1 200 OK\r\n") is None
    with pytest.raises(WireError, match="the status line is"):
        wire.parse_response_head(b"HTTP/1.0 2000\r\n\r\n")


@given(st.binary(max_size=200))
def test_random_heads_raise_only_wire_error(data: bytes) -> None:
    for parse in (wire.parse_request_head, wire.parse_response_head):
        with contextlib.suppress(WireError):
            parse(data)


# -- frames -------------------------------------------------------------------------------------------

texts = st.text(st.characters(codec="utf-8"), max_size=40)
to_client = st.one_of(
    texts.map(wire.notice_frame),
    st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1)).map(lambda t: wire.started_frame(*t)),
    st.integers(0, 255).map(wire.exit_frame),
    st.tuples(st.integers(0, 255), texts.filter(bool), texts, texts)
    .filter(lambda t: all("\x00" not in s for s in t[1:]))
    .map(lambda t: wire.error_frame(*t)),
)


def _cuts(data: bytes, points: list[int]) -> list[bytes]:
    bounds = [0, *sorted({p % (len(data) + 1) for p in points}), len(data)]
    return [data[a:b] for a, b in itertools.pairwise(bounds)]


@given(st.lists(to_client, max_size=8), st.lists(st.integers(0, 10_000), max_size=12))
def test_frames_survive_any_split(frames: list[bytes], points: list[int]) -> None:
    stream = b"".join(frames)
    reader = FrameReader(wire.TO_CLIENT)
    got = [f for chunk in _cuts(stream, points) for f in reader.feed(chunk)]
    assert [wire.frame(kind, payload) for kind, payload in got] == frames


def test_typed_frames_round_trip() -> None:
    assert wire.decode_notice(wire.notice_frame("WARNING: ü")[5:]) == "WARNING: ü"
    assert wire.decode_started(wire.started_frame(4242, 7)[5:]) == (4242, 7)
    assert wire.decode_exit(wire.exit_frame(130)[5:]) == 130
    payload = wire.error_frame(77, "permission-denied", "no", "ask")[5:]
    assert wire.decode_error(payload) == (77, "permission-denied", "no", "ask")
    for signum in (1, 2, 3, 15, 28):
        assert wire.decode_signal(wire.signal_frame(signum)[5:]) == signum


def test_a_huge_frame_is_refused_on_its_header() -> None:
    reader = FrameReader(wire.TO_CLIENT)
    with pytest.raises(WireError, match="NOTICE frame of 4294967295 bytes; it carries 0 to 65536"):
        reader.feed(b"\x10\xff\xff\xff\xff")
    # The reader is broken for good: the framing is lost.
    with pytest.raises(WireError, match="already broken"):
        reader.feed(wire.exit_frame(0))


@pytest.mark.parametrize(
    ("accept", "data", "says"),
    [
        (wire.TO_DAEMON, wire.exit_frame(0), "frame kind EXIT is not expected in this direction"),
        (wire.TO_CLIENT, wire.signal_frame(2), "frame kind SIGNAL is not expected"),
        (wire.TO_CLIENT, b"\x7f\x00\x00\x00\x00", "frame kind 0x7f is not expected"),
        (wire.TO_DAEMON, b"\x01\x00\x00\x00\x02\x02\x02", "SIGNAL frame of 2 bytes; it carries 1"),
        (wire.TO_CLIENT, b"\x11\x00\x00\x00\x07" + b"\x00" * 7, "STARTED frame of 7 bytes; it carries 8"),
        (wire.TO_CLIENT, b"\x12\x00\x00\x00\x00", "EXIT frame of 0 bytes; it carries 1"),
        (wire.TO_CLIENT, b"\x13\x00\x00\x00\x01\x45", "ERROR frame of 1 bytes; it carries 3 to 65536"),
    ],
)
def test_bad_frames_are_refused(accept: frozenset[int], data: bytes, says: str) -> None:
    with pytest.raises(WireError, match=says):
        FrameReader(accept).feed(data)


@pytest.mark.parametrize(
    ("decode", "payload", "says"),
    [
        (wire.decode_signal, b"\x09", "signal 9 is not forwarded"),
        (wire.decode_notice, b"\xff", "a NOTICE is not valid UTF-8"),
        (wire.decode_error, b"\x45a\x00b", "must hold code NUL message NUL hint"),
        (wire.decode_error, b"\x45\x00b\x00c", "with a code"),
        (wire.decode_error, b"\x45a\x00b\x00c\x00d", "must hold code NUL message NUL hint"),
        (wire.decode_error, b"\x45a\x00\xff\x00", "an ERROR frame is not valid UTF-8"),
    ],
)
def test_bad_payloads_are_refused(decode: object, payload: bytes, says: str) -> None:
    assert callable(decode)
    with pytest.raises(WireError, match=says):
        decode(payload)


def test_encoders_refuse_what_decoders_would() -> None:
    with pytest.raises(WireError, match="signal 9 is not forwarded"):
        wire.signal_frame(9)
    with pytest.raises(WireError, match="exit status 256"):
        wire.exit_frame(256)
    with pytest.raises(WireError, match="pid -1 does not fit"):
        wire.started_frame(-1, 0)
    with pytest.raises(WireError, match="must not contain NUL"):
        wire.error_frame(69, "x", "a\x00", "")
    with pytest.raises(WireError, match="NOTICE frame of 65537 bytes"):
        wire.notice_frame("x" * 65537)
    with pytest.raises(WireError, match="unknown frame kind 0x02"):
        wire.frame(2, b"")


def test_a_bad_kind_is_refused_on_its_first_byte() -> None:
    with pytest.raises(WireError, match="frame kind 0x7f is not expected"):
        FrameReader(wire.TO_CLIENT).feed(b"\x7f")


_DECODERS = {
    wire.SIGNAL: wire.decode_signal,
    wire.NOTICE: wire.decode_notice,
    wire.STARTED: wire.decode_started,
    wire.EXIT: wire.decode_exit,
    wire.ERROR: wire.decode_error,
}


@given(st.lists(st.binary(max_size=40), max_size=10))
def test_random_streams_raise_only_wire_error(chunks: list[bytes]) -> None:
    """Whatever the peer sends: frames (each decodable or WireError), a pending
    remainder, or WireError — never another exception, never a hang."""
    for accept in (wire.TO_CLIENT, wire.TO_DAEMON):
        reader = FrameReader(accept)
        try:
            for chunk in chunks:
                for kind, payload in reader.feed(chunk):
                    assert kind in accept
                    with contextlib.suppress(WireError):
                        _DECODERS[kind](payload)
        except WireError:
            pass


def test_importing_the_codec_loads_nothing_the_thin_client_cannot_afford() -> None:
    """The thin client runs under ``python3 -I -S``: the codec may add kbd's own
    modules, never another stdlib module (no struct, json, typing, dataclasses)."""
    code = (
        "import sys\nbefore = set(sys.modules)\nimport kbd.core.wire\n"
        "added = sorted(set(sys.modules) - before)\nimport json\nsys.stdout.write(json.dumps(added))"
    )
    r = subprocess.run(
        [sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    added = set(json.loads(r.stdout))
    # __future__ (every kbd module's `from __future__ import annotations`) was
    # preloaded by setuptools' editable finder; a host install does not have it.
    assert added <= {"kbd", "kbd.core", "kbd.errors", "kbd.core.wire", "errno", "__future__"}, added


@given(requests())
def test_body_and_head_together_parse_back(request: Request) -> None:
    body = encode_request(request)
    data = wire.request_head(len(body)) + body
    head = wire.parse_request_head(data)
    assert head is not None
    n = wire.content_length(head)
    assume(n == len(body))
    assert decode_request(data[head.size : head.size + n]) == request

"""The exec broker's wire format (docs/daemon.md "The exec broker"). Pure.

One connection to the daemon's socket carries one brokered command:

1. The client sends ``POST /v1/exec HTTP/1.1`` with ``Upgrade: kbd-exec/1``
   (:func:`request_head`) and a body of TLV records (:func:`encode_request`):
   ``tag:u8 len:u32be value``. Tags: ``0x01`` session ID (UTF-8, once),
   ``0x02`` one argv item (raw bytes, repeated, at least one), ``0x03`` cwd (raw
   bytes, at most once), ``0x04`` ``NAME=VALUE`` for ``LANG`` or ``TERM`` only
   (each at most once), ``0x05`` the ``--as`` principal (UTF-8, at most once),
   ``0x06`` the client's root path (raw bytes, at most once), ``0x07`` flags
   (one byte, at most once: 1 ``--strict-contributions``, 2 ``--json``).
2. The daemon answers an ordinary HTTP error, or ``101 Switching Protocols``
   (:data:`SWITCHING`) followed by frames ``kind:u8 len:u32be payload``
   (:func:`frame`, :class:`FrameReader`): SIGNAL from the client; NOTICE,
   STARTED, EXIT and ERROR from the daemon.

TLV rather than JSON because argv and paths are bytes, not text, and because
the thin client (``kbd exec`` through the daemon) must not import ``json`` or
``struct`` on its path: this module imports nothing but the error tree, whose
own imports (``errno``, ``os``) every Python start has already loaded. For
the same reason there are no dataclasses or ``typing`` here.

Everything malformed raises :class:`kbd.errors.WireError` naming what was wrong
and what is allowed, never another exception: the daemon reads these bytes from
any local user. Decoding is bounded: a length is checked against its limit
before anything is buffered for it.
"""

from __future__ import annotations

from kbd.errors import WireError

# -- the HTTP envelope ----------------------------------------------------------------------------

EXEC_PATH = "/v1/exec"
UPGRADE = "kbd-exec/1"
CONTENT_TYPE = "application/vnd.kbd.exec"
#: What the daemon's front door peeks (``MSG_PEEK``) to tell an exec request
#: from an ordinary API request: 14 bytes, the same on every exec connection.
SNIFF = b"POST " + EXEC_PATH.encode("ascii") + b" "
#: The daemon's answer once a command started; frames follow it.
SWITCHING = (
    b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: " + UPGRADE.encode("ascii") + b"\r\n"
    b"Connection: Upgrade\r\n\r\n"
)
#: Request line plus headers, as the daemon reads them before the body.
MAX_HEAD = 16 << 10

# -- the request body -----------------------------------------------------------------------------

TAG_SID = 0x01
TAG_ARGV = 0x02
TAG_CWD = 0x03
TAG_ENV = 0x04
TAG_AS = 0x05
TAG_ROOT = 0x06
TAG_FLAGS = 0x07
FLAG_STRICT = 0x01  # --strict-contributions: a refused staged contribution exits 65
FLAG_JSON = 0x02  # --json: the contributions report as one JSON line on stderr
_FLAGS = FLAG_STRICT | FLAG_JSON
_TAG_NAMES = {
    TAG_SID: "sid",
    TAG_ARGV: "argv",
    TAG_CWD: "cwd",
    TAG_ENV: "env",
    TAG_AS: "as",
    TAG_ROOT: "root",
    TAG_FLAGS: "flags",
}
_SINGLETONS = frozenset({TAG_SID, TAG_CWD, TAG_AS, TAG_ROOT, TAG_FLAGS})

MAX_BODY = 4 << 20
MAX_ARGV = 4096
#: Linux's MAX_ARG_STRLEN (32 pages) less the NUL: execve refuses a longer item.
MAX_ARG_BYTES = (32 * 4096) - 1
#: A session ID or principal ID: at most 128 characters (docs/on-disk.md "IDs") of up to 4 bytes.
MAX_ID_BYTES = 512
#: PATH_MAX less the NUL.
MAX_PATH_BYTES = 4095
MAX_ENV_BYTES = 1024
#: The only variables a client passes; the session's environment is built, never inherited.
ENV_NAMES = ("LANG", "TERM")
_RECORD_HEAD = 5


class Request:
    """What a client asks the broker to run. Plain data, compared by value.

    ``argv`` items, ``cwd`` and ``root`` are raw bytes (``os.fsencode``), as a
    path or argument on Linux is; ``sid``, ``as_principal`` and the ``env``
    values are text.
    """

    __slots__ = ("argv", "as_principal", "cwd", "env", "flags", "root", "sid")

    def __init__(
        self,
        sid: str,
        argv: list[bytes] | tuple[bytes, ...],
        *,
        cwd: bytes | None = None,
        env: dict[str, str] | None = None,
        as_principal: str | None = None,
        root: bytes | None = None,
        flags: int = 0,
    ) -> None:
        self.sid = sid
        self.flags = flags
        self.argv = tuple(argv)
        self.cwd = cwd
        self.env = dict(env or {})
        self.as_principal = as_principal
        self.root = root

    def _key(self) -> tuple[object, ...]:
        return (
            self.sid,
            self.argv,
            self.cwd,
            sorted(self.env.items()),
            self.as_principal,
            self.root,
            self.flags,
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Request) and self._key() == other._key()

    __hash__ = None  # type: ignore[assignment]  # mutable env: compared by value, never hashed

    def __repr__(self) -> str:
        return (
            f"Request(sid={self.sid!r}, argv={list(self.argv)!r}, cwd={self.cwd!r}, env={self.env!r}, "
            f"as_principal={self.as_principal!r}, root={self.root!r}, flags={self.flags!r})"
        )


def _u32(n: int) -> bytes:
    return n.to_bytes(4, "big")


def _record(tag: int, value: bytes) -> bytes:
    return bytes((tag,)) + _u32(len(value)) + value


def _text(value: bytes, what: str) -> str:
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise WireError(f"{what} is not valid UTF-8 (byte {exc.start}); it must be UTF-8 text") from None


def _check_id(value: object, what: str) -> None:
    if not isinstance(value, str):
        raise WireError(f"{what} must be text, got {type(value).__name__}")
    size = len(value.encode("utf-8", "surrogatepass"))
    if not 0 < size <= MAX_ID_BYTES:
        raise WireError(f"{what} must be 1 to {MAX_ID_BYTES} bytes of UTF-8, got {size}")
    if "\x00" in value:
        raise WireError(f"{what} must not contain a NUL byte")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise WireError(f"{what} holds a lone surrogate; it must be valid UTF-8 text") from None


def _check_bytes(value: object, what: str, limit: int, *, empty_ok: bool) -> None:
    if not isinstance(value, bytes):
        raise WireError(f"{what} must be bytes, got {type(value).__name__}")
    if len(value) > limit:
        raise WireError(f"{what} is {len(value)} bytes; at most {limit} are allowed")
    if not value and not empty_ok:
        raise WireError(f"{what} must not be empty")
    if b"\x00" in value:
        raise WireError(f"{what} contains a NUL byte at offset {value.index(0)}; none is allowed")


def _check_env(name: object, value: object) -> None:
    if name not in ENV_NAMES:
        raise WireError(f"env names {name!r}; only {', '.join(ENV_NAMES)} may be passed")
    if not isinstance(value, str):
        raise WireError(f"env {name} must be text, got {type(value).__name__}")
    try:
        raw = value.encode("utf-8")
    except UnicodeEncodeError:
        raise WireError(f"env {name} is not valid UTF-8 text") from None
    if len(raw) + len(name) + 1 > MAX_ENV_BYTES:
        raise WireError(f"env {name} is {len(raw)} bytes; NAME=VALUE is at most {MAX_ENV_BYTES}")
    if "\x00" in value:
        raise WireError(f"env {name} must not contain a NUL byte")


def check_request(request: Request) -> None:
    """Raise WireError unless ``request`` is within every rule of the format
    (both ends apply the same rules: a client never sends what the daemon refuses)."""
    _check_id(request.sid, "sid")
    if not request.argv:
        raise WireError("argv is empty; give the command to run (at least one item)")
    if len(request.argv) > MAX_ARGV:
        raise WireError(f"argv has {len(request.argv)} items; at most {MAX_ARGV} are allowed")
    for i, item in enumerate(request.argv):
        _check_bytes(item, f"argv[{i}]", MAX_ARG_BYTES, empty_ok=i > 0)
    if request.cwd is not None:
        _check_bytes(request.cwd, "cwd", MAX_PATH_BYTES, empty_ok=False)
    for name, value in request.env.items():
        _check_env(name, value)
    if request.as_principal is not None:
        _check_id(request.as_principal, "as")
    if request.root is not None:
        _check_bytes(request.root, "root", MAX_PATH_BYTES, empty_ok=False)
    if not isinstance(request.flags, int) or request.flags & ~_FLAGS or request.flags < 0:
        raise WireError(f"flags {request.flags!r} has unknown bits; allowed: 1 (strict), 2 (json)")


def encode_request(request: Request) -> bytes:
    """The TLV body for ``request``. Raises WireError for a request the daemon
    would refuse (see :func:`check_request`), including one over :data:`MAX_BODY`."""
    check_request(request)
    parts = [_record(TAG_SID, request.sid.encode("utf-8"))]
    parts += [_record(TAG_ARGV, item) for item in request.argv]
    if request.cwd is not None:
        parts.append(_record(TAG_CWD, request.cwd))
    for name in ENV_NAMES:  # a fixed order: the same request is always the same bytes
        if name in request.env:
            parts.append(_record(TAG_ENV, f"{name}={request.env[name]}".encode()))
    if request.as_principal is not None:
        parts.append(_record(TAG_AS, request.as_principal.encode("utf-8")))
    if request.root is not None:
        parts.append(_record(TAG_ROOT, request.root))
    if request.flags:
        parts.append(_record(TAG_FLAGS, bytes([request.flags])))
    body = b"".join(parts)
    if len(body) > MAX_BODY:
        raise WireError(f"the request is {len(body)} bytes; at most {MAX_BODY} are allowed (argv too long)")
    return body


def _records(body: bytes) -> list[tuple[int, int, bytes]]:
    """(offset, tag, value) of every record; the framing rules only."""
    out: list[tuple[int, int, bytes]] = []
    pos, end = 0, len(body)
    while pos < end:
        if end - pos < _RECORD_HEAD:
            raise WireError(f"truncated record header at offset {pos}: {end - pos} of 5 bytes")
        tag = body[pos]
        if tag not in _TAG_NAMES:
            raise WireError(f"unknown tag 0x{tag:02x} at offset {pos}; tags are 0x01 to 0x06")
        size = int.from_bytes(body[pos + 1 : pos + 5], "big")
        start = pos + _RECORD_HEAD
        if size > end - start:
            raise WireError(
                f"truncated {_TAG_NAMES[tag]} record at offset {pos}: declares {size} bytes, {end - start} follow"
            )
        out.append((pos, tag, body[start : start + size]))
        pos = start + size
    return out


def decode_request(body: bytes) -> Request:
    """Parse and check a TLV body. Raises WireError for anything malformed:
    oversized, truncated, an unknown tag, a repeated singleton, text that is not
    UTF-8, a value outside its limit, a missing sid or argv."""
    if len(body) > MAX_BODY:
        raise WireError(f"the request is {len(body)} bytes; at most {MAX_BODY} are allowed")
    seen: set[int] = set()
    sid: str | None = None
    argv: list[bytes] = []
    cwd = as_principal = root = None
    flags = 0
    env: dict[str, str] = {}
    for pos, tag, value in _records(body):
        what = _TAG_NAMES[tag]
        if tag in _SINGLETONS:
            if tag in seen:
                raise WireError(f"{what} given twice (again at offset {pos}); it may appear once")
            seen.add(tag)
        if tag == TAG_SID:
            sid = _text(value, "sid")
        elif tag == TAG_ARGV:
            if len(argv) == MAX_ARGV:
                raise WireError(f"argv has more than {MAX_ARGV} items")
            argv.append(value)
        elif tag == TAG_CWD:
            cwd = value
        elif tag == TAG_ENV:
            name, eq, text = _text(value, "env").partition("=")
            if not eq:
                raise WireError(f"env record at offset {pos} is not NAME=VALUE")
            if name in env:
                raise WireError(f"env {name} given twice; each variable may appear once")
            env[name] = text
        elif tag == TAG_AS:
            as_principal = _text(value, "as")
        elif tag == TAG_FLAGS:
            if len(value) != 1:
                raise WireError(f"flags record at offset {pos} is {len(value)} bytes; it is one byte")
            flags = value[0]
        else:
            root = value
    if sid is None:
        raise WireError("no sid record; the session ID is required")
    request = Request(sid, argv, cwd=cwd, env=env, as_principal=as_principal, root=root, flags=flags)
    check_request(request)
    return request


# -- the HTTP head ---------------------------------------------------------------------------------


def _header_value(value: str, what: str) -> str:
    # A CR, LF or other control byte in a header value would let a value end the
    # header and start another (header injection): only visible ASCII and spaces.
    if not value or any(not (" " <= ch <= "~") for ch in value):
        raise WireError(f"{what} must be non-empty visible ASCII")
    return value


def request_head(body_len: int, *, token: str | None = None) -> bytes:
    """The request line and headers that precede a body of ``body_len`` bytes;
    the thin client and ``kbd.client`` send exactly these bytes."""
    if not 0 <= body_len <= MAX_BODY:
        raise WireError(f"the request is {body_len} bytes; at most {MAX_BODY} are allowed")
    lines = [
        f"POST {EXEC_PATH} HTTP/1.1",
        "Host: kbd",
        f"Upgrade: {UPGRADE}",
        "Connection: Upgrade",
    ]
    if token is not None:
        lines.append(f"Authorization: Bearer {_header_value(token, 'the token')}")
    lines += [f"Content-Type: {CONTENT_TYPE}", f"Content-Length: {body_len}", "", ""]
    return "\r\n".join(lines).encode("ascii")


class Head:
    """A parsed HTTP head: ``start`` line, lower-cased ``headers`` (each at most
    once) and ``size``, the number of bytes up to and including the blank line."""

    __slots__ = ("headers", "size", "start")

    def __init__(self, start: str, headers: dict[str, str], size: int) -> None:
        self.start = start
        self.headers = headers
        self.size = size


def _parse_head(data: bytes, *, limit: int) -> Head | None:
    end = data.find(b"\r\n\r\n")
    if end < 0:
        if len(data) > limit:
            raise WireError(f"the request line and headers exceed {limit} bytes")
        return None
    if end + 4 > limit:
        raise WireError(f"the request line and headers exceed {limit} bytes")
    try:
        text = data[:end].decode("ascii")
    except UnicodeDecodeError:
        raise WireError("the HTTP head is not ASCII") from None
    start, *lines = text.split("\r\n")
    headers: dict[str, str] = {}
    for line in lines:
        name, colon, value = line.partition(":")
        name = name.lower()
        if not colon or not name or any(not (ch.isalnum() or ch in "-_") for ch in name):
            raise WireError(f"malformed header line {line[:64]!r}")
        if name in headers:
            raise WireError(f"header {name} given twice")
        headers[name] = _header_value(value.strip(" \t"), f"header {name}")
    return Head(start, headers, end + 4)


def parse_request_head(data: bytes) -> Head | None:
    """The head of an exec request, or None while ``data`` holds no complete head
    yet. Raises WireError for anything but an exec request this module would
    send: the request line, ``Upgrade``, ``Content-Type`` and a ``Content-Length``
    within :data:`MAX_BODY` are checked; ``Transfer-Encoding`` is refused."""
    head = _parse_head(data, limit=MAX_HEAD)
    if head is None:
        return None
    if head.start != f"POST {EXEC_PATH} HTTP/1.1":
        raise WireError(f"the request line is {head.start[:80]!r}; expected 'POST {EXEC_PATH} HTTP/1.1'")
    h = head.headers
    if h.get("upgrade") != UPGRADE:
        raise WireError(f"header upgrade must be {UPGRADE!r}")
    if h.get("content-type") != CONTENT_TYPE:
        raise WireError(f"header content-type must be {CONTENT_TYPE!r}")
    if "transfer-encoding" in h:
        raise WireError("transfer-encoding is not allowed; send content-length")
    content_length(head)
    return head


def content_length(head: Head) -> int:
    """The head's Content-Length: decimal digits, at most :data:`MAX_BODY`."""
    raw = head.headers.get("content-length")
    if raw is None:
        raise WireError("header content-length is missing")
    if not raw.isascii() or not raw.isdigit() or len(raw) > 10:
        raise WireError(f"header content-length {raw[:16]!r} is not a decimal number")
    n = int(raw)
    if n > MAX_BODY:
        raise WireError(f"the request is {n} bytes; at most {MAX_BODY} are allowed")
    return n


def parse_response_head(data: bytes) -> tuple[int, Head] | None:
    """(status, head) of the daemon's answer, or None while incomplete."""
    head = _parse_head(data, limit=MAX_HEAD)
    if head is None:
        return None
    version, _, rest = head.start.partition(" ")
    code = rest[:3]
    if version != "HTTP/1.1" or len(code) != 3 or not code.isdigit() or rest[3:4] not in ("", " "):
        raise WireError(f"the status line is {head.start[:80]!r}; expected 'HTTP/1.1 NNN ...'")
    return int(code), head


# -- frames -------------------------------------------------------------------------------------

SIGNAL = 0x01  # client -> daemon: u8 signal number
NOTICE = 0x10  # daemon -> client: one UTF-8 line for the client's stderr
STARTED = 0x11  # daemon -> client: u32 pid, u32 generation
EXIT = 0x12  # daemon -> client: u8 exit status (128+N for signal N)
ERROR = 0x13  # daemon -> client: u8 exit code, then code NUL message NUL hint
KIND_NAMES = {SIGNAL: "SIGNAL", NOTICE: "NOTICE", STARTED: "STARTED", EXIT: "EXIT", ERROR: "ERROR"}
#: What each end may receive.
TO_DAEMON = frozenset({SIGNAL})
TO_CLIENT = frozenset({NOTICE, STARTED, EXIT, ERROR})
#: SIGHUP, SIGINT, SIGQUIT, SIGTERM, SIGWINCH (Linux numbers; no ``signal`` import).
FORWARDED_SIGNALS = frozenset({1, 2, 3, 15, 28})
MAX_TEXT = 64 << 10
_FRAME_HEAD = 5
#: Each kind's payload size: exact, or (min, max).
_SIZES: dict[int, tuple[int, int]] = {
    SIGNAL: (1, 1),
    NOTICE: (0, MAX_TEXT),
    STARTED: (8, 8),
    EXIT: (1, 1),
    ERROR: (3, MAX_TEXT),
}


def _check_size(kind: int, size: int) -> None:
    if kind not in _SIZES:
        raise WireError(f"unknown frame kind 0x{kind:02x}; kinds are 0x01, 0x10 to 0x13")
    low, high = _SIZES[kind]
    if not low <= size <= high:
        want = f"{low}" if low == high else f"{low} to {high}"
        raise WireError(f"{KIND_NAMES[kind]} frame of {size} bytes; it carries {want}")


def frame(kind: int, payload: bytes) -> bytes:
    """``kind:u8 len:u32be payload``. Raises WireError for an unknown kind or a
    payload size that kind never has."""
    _check_size(kind, len(payload))
    return bytes((kind,)) + _u32(len(payload)) + payload


class FrameReader:
    """Cuts a byte stream into frames, across reads of any size.

    Only the kinds in ``accept`` are taken, and a header is checked before its
    payload is buffered, so a peer cannot make the reader hold more than one
    frame's bounded size. After a WireError the reader stays broken: the
    connection has lost its framing and must be closed.
    """

    def __init__(self, accept: frozenset[int]) -> None:
        self._accept = accept
        self._buf = bytearray()
        self._broken: WireError | None = None

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        """Every frame completed by ``data``, in order."""
        if self._broken is not None:
            raise WireError(f"the stream is already broken: {self._broken.message}")
        self._buf += data
        frames: list[tuple[int, bytes]] = []
        pos = 0
        try:
            while len(self._buf) > pos:
                kind = self._buf[pos]
                if kind not in self._accept:  # refused on its first byte, not after five
                    name = KIND_NAMES.get(kind, f"0x{kind:02x}")
                    raise WireError(f"frame kind {name} is not expected in this direction")
                if len(self._buf) - pos < _FRAME_HEAD:
                    break
                size = int.from_bytes(self._buf[pos + 1 : pos + 5], "big")
                _check_size(kind, size)
                if len(self._buf) - pos - _FRAME_HEAD < size:
                    break
                start = pos + _FRAME_HEAD
                frames.append((kind, bytes(self._buf[start : start + size])))
                pos = start + size
        except WireError as exc:
            self._broken = exc
            self._buf.clear()
            raise
        del self._buf[:pos]
        return frames


# -- typed frames ---------------------------------------------------------------------------------


def signal_frame(signum: int) -> bytes:
    if signum not in FORWARDED_SIGNALS:
        raise WireError(f"signal {signum} is not forwarded; only {sorted(FORWARDED_SIGNALS)} are")
    return frame(SIGNAL, bytes((signum,)))


def decode_signal(payload: bytes) -> int:
    _check_size(SIGNAL, len(payload))
    signum = payload[0]
    if signum not in FORWARDED_SIGNALS:
        raise WireError(f"signal {signum} is not forwarded; only {sorted(FORWARDED_SIGNALS)} are")
    return signum


def notice_frame(text: str) -> bytes:
    try:
        return frame(NOTICE, text.encode("utf-8"))
    except UnicodeEncodeError:
        raise WireError("a NOTICE must be valid UTF-8 text") from None


def decode_notice(payload: bytes) -> str:
    _check_size(NOTICE, len(payload))
    return _text(payload, "a NOTICE")


def started_frame(pid: int, generation: int) -> bytes:
    for what, n in (("pid", pid), ("generation", generation)):
        if not 0 <= n < 1 << 32:
            raise WireError(f"STARTED {what} {n} does not fit in 32 bits")
    return frame(STARTED, _u32(pid) + _u32(generation))


def decode_started(payload: bytes) -> tuple[int, int]:
    """(pid, generation)."""
    _check_size(STARTED, len(payload))
    return int.from_bytes(payload[:4], "big"), int.from_bytes(payload[4:], "big")


def exit_frame(status: int) -> bytes:
    if not 0 <= status <= 255:
        raise WireError(f"exit status {status} is outside 0 to 255")
    return frame(EXIT, bytes((status,)))


def decode_exit(payload: bytes) -> int:
    _check_size(EXIT, len(payload))
    return payload[0]


def error_frame(exit_code: int, code: str, message: str, hint: str) -> bytes:
    """A refusal after the upgrade: what ``boundary.guarded`` would print."""
    if not 0 <= exit_code <= 255:
        raise WireError(f"exit code {exit_code} is outside 0 to 255")
    if not code:
        raise WireError("an ERROR frame needs an error code")
    if any("\x00" in part for part in (code, message, hint)):
        raise WireError("an ERROR frame's code, message and hint must not contain NUL")
    try:
        text = "\x00".join((code, message, hint)).encode("utf-8")
    except UnicodeEncodeError:
        raise WireError("an ERROR frame must be valid UTF-8 text") from None
    return frame(ERROR, bytes((exit_code,)) + text)


def decode_error(payload: bytes) -> tuple[int, str, str, str]:
    """(exit code, code, message, hint)."""
    _check_size(ERROR, len(payload))
    parts = _text(payload[1:], "an ERROR frame").split("\x00")
    if len(parts) != 3 or not parts[0]:
        raise WireError("an ERROR frame must hold code NUL message NUL hint, with a code")
    return payload[0], parts[0], parts[1], parts[2]

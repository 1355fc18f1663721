"""What a command's Landlock layers refused, as the kernel reports it
(docs/sandbox.md "Refusals the kernel reports").

Since Linux 6.15 (Landlock ABI 7) Landlock writes an audit record for each access a
domain refuses, when kernel audit is on and the domain asked for it
(``LANDLOCK_RESTRICT_SELF_LOG_NEW_EXEC_ON``: kbd.sandbox.landlock_helper ``log``).
The records reach every socket subscribed to the audit netlink family's read-only
multicast group (``CAP_AUDIT_READ``), whether or not an audit daemon runs:

* ``LANDLOCK_ACCESS`` (1423): ``domain=ID blockers=fs.write_file path="/…"`` — one refusal;
* ``LANDLOCK_DOMAIN`` (1424): ``domain=ID status=allocated … pid=N`` the first time a
  domain refuses something (``pid``: the process that made it, numbered in the initial
  PID namespace), and ``status=deallocated denials=N`` when its last process is gone,
  with how many refusals it made in all (records the kernel dropped included).

A command's helper tells kbd its pid the same way (one byte on a socket with
``SO_PASSCRED``: the kernel translates the sender's pid into the reader's namespace,
so no process can claim another's), so kbd claims exactly the domains that helper made.
One :class:`Collector` per process buffers every Landlock record of the host (bounded);
a command claims its own when it has exited. Nothing here pretends: where the kernel
cannot report, :func:`unavailable` says why and no command claims anything.
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import socket
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from kbd.sandbox.landlock import landlock_abi

NETLINK_AUDIT = 9
AUDIT_GET = 1000
AUDIT_NLGRP_READLOG = 1  # the read-only multicast group (CAP_AUDIT_READ)
LANDLOCK_ACCESS, LANDLOCK_DOMAIN = 1423, 1424
NLMSG_ERROR = 2
NLM_F_REQUEST = 1
CAP_AUDIT_READ = 37
MIN_ABI = 7  # Landlock audit records: Linux 6.15
_NLMSG = struct.Struct("=IHHII")
_STATUS = struct.Struct("=8I")  # struct audit_status: mask … backlog (the fields kbd reads)
_UCRED = struct.Struct("=iII")

# Bounds on what is buffered for every Landlock user of the host (a command chooses its paths:
# at most MAX_ENTRIES x MAX_PATH characters of them are kept, about 8 MiB).
MAX_DOMAINS = 4096
MAX_DISTINCT = 256  # distinct refusals kept per domain; the rest are counted
MAX_ENTRIES = 16384  # distinct refusals kept in all
MAX_PATH = 512  # characters of a refused path kept (longer ones end with "…")
ENDED_KEEP = 120.0  # seconds a deallocated, unclaimed domain stays claimable
SETTLE = 0.05  # seconds to wait for the kernel's audit queue to empty at a command's end
DRAIN_BATCH = 256  # datagrams read per hold of the collector's lock
END_WAIT = 0.25  # seconds to wait for a refusing domain's final count once its command ended


@dataclass(frozen=True)
class Refused:
    """One distinct refusal: what was asked (Landlock's names: ``fs.write_file``,
    ``net.connect_tcp``, ``scope.signal`` …) and where (a path as the sandbox sees it,
    or the port or process for the network and scope rights), and how often."""

    blockers: tuple[str, ...]
    path: str | None
    detail: str | None
    count: int


@dataclass(frozen=True)
class Collected:
    """A command's refusals. ``lost``: refusals the kernel counted that kbd did not
    receive (audit's rate limit or backlog); ``final``: every refusing domain's end
    was seen, so the counts are complete."""

    refused: tuple[Refused, ...]
    lost: int
    final: bool
    #: Set when the kernel stopped reporting while the command ran (audit turned off).
    stopped: str | None = None

    @property
    def empty(self) -> bool:
        """Nothing to say: nothing refused, lost, or left unsaid."""
        return not self.refused and not self.lost and self.stopped is None


@dataclass(frozen=True)
class Mark:
    """Where a command's watch started: wall-clock time and the loss counters then."""

    since: float
    lost: int  # the kernel's count of audit records it dropped
    overflows: int
    evicted: int


@dataclass
class _Domain:
    pid: int | None = None
    uid: int | None = None
    born: float = 0.0  # the allocation record's time (wall clock, as the kernel stamps it)
    ended: float | None = None  # monotonic time of the deallocation record
    denials: int | None = None  # the kernel's count, from the deallocation record
    seen: dict[tuple[tuple[str, ...], str | None, str | None], int] = field(default_factory=dict)
    extra: int = 0  # refusals received beyond MAX_DISTINCT distinct ones


def unavailable() -> str | None:
    """Why this process cannot collect Landlock's reports, or None when it can."""
    try:
        status: tuple[int, ...] | OSError = audit_status()
    except OSError as exc:
        status = exc
    return why_unavailable(landlock_abi(), _has_capability(CAP_AUDIT_READ), status)


def why_unavailable(abi: int, can_read: bool, status: tuple[int, ...] | OSError) -> str | None:
    """The decision of :func:`unavailable`, from what it read."""
    if abi < MIN_ABI:
        return (
            f"the kernel's Landlock ABI is {abi or 'absent'}: refusal reports need ABI {MIN_ABI} (Linux 6.15)"
        )
    if not can_read:
        return "reading the kernel's audit records needs CAP_AUDIT_READ (commands brokered by the root daemon have it)"
    if isinstance(status, OSError):
        return f"cannot ask the kernel whether audit is on: {status.strerror}"
    if not status[1]:
        return "kernel audit is off (turn it on with `auditctl -e 1`, or boot with audit=1)"
    return None


def _has_capability(cap: int) -> bool:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> cap & 1)
    except (OSError, ValueError):
        pass
    return False


def audit_status() -> tuple[int, ...]:
    """The kernel's ``struct audit_status`` (AUDIT_GET: CAP_AUDIT_CONTROL, initial PID
    namespace): ``[1]`` enabled, ``[6]`` lost, ``[7]`` backlog."""
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, NETLINK_AUDIT) as sock:
        sock.settimeout(1.0)
        sock.send(_NLMSG.pack(_NLMSG.size, AUDIT_GET, NLM_F_REQUEST, 1, 0))
        data = sock.recv(65536)
    _, kind, _, _, _ = _NLMSG.unpack_from(data)
    if kind == NLMSG_ERROR:
        code = -struct.unpack_from("=i", data, _NLMSG.size)[0]
        raise OSError(code, os.strerror(code))
    if kind != AUDIT_GET or len(data) < _NLMSG.size + _STATUS.size:
        raise OSError(errno.EPROTO, "unexpected answer to AUDIT_GET")
    return _STATUS.unpack_from(data, _NLMSG.size)


# -- the records ------------------------------------------------------------------


def parse(text: str) -> tuple[float, dict[str, str]]:
    """An audit record's time and fields. Values the kernel did not trust (paths, names)
    are quoted, or hex when they hold a space, a quote or a control character."""
    stamp, _, body = text.partition("): ")
    when = 0.0
    if stamp.startswith("audit("):
        with contextlib.suppress(ValueError):
            when = float(stamp[6:].partition(":")[0])
    fields: dict[str, str] = {}
    for word in body.rstrip("\0\n").split(" "):
        key, eq, value = word.partition("=")
        if not eq:
            continue
        if len(value) >= 2 and value[0] == value[-1] == '"':
            value = value[1:-1]
        elif key in ("path", "name", "exe", "comm", "ocomm") and value and len(value) % 2 == 0:
            with contextlib.suppress(ValueError):
                value = os.fsdecode(bytes.fromhex(value))
        fields[key] = value
    return when, fields


def messages(data: bytes) -> list[tuple[int, str]]:
    """The (type, text) of each netlink message in one datagram."""
    out, off = [], 0
    while off + _NLMSG.size <= len(data):
        length, kind, _, _, _ = _NLMSG.unpack_from(data, off)
        if length < _NLMSG.size or off + length > len(data):
            break
        out.append((kind, data[off + _NLMSG.size : off + length].decode("utf-8", "replace")))
        off += (length + 3) & ~3
    return out


# -- the collector ----------------------------------------------------------------


class Buffer:
    """Landlock's records per domain, until a command claims its domains or the bounds drop
    them (pure: no I/O, no lock; :class:`Collector` feeds it)."""

    def __init__(self) -> None:
        self._domains: OrderedDict[str, _Domain] = OrderedDict()
        self._entries = 0  # distinct refusals kept, over every domain
        self._new = 0  # domains seen (for the sweep's rhythm)
        self.evicted = 0  # domains dropped before they ended: their commands' reports may miss refusals

    def __len__(self) -> int:
        return len(self._domains)

    def take(self, kind: int, text: str, *, now: float) -> None:
        """One record (``now``: monotonic time of its arrival)."""
        when, fields = parse(text)
        name = fields.get("domain")
        if not name or kind not in (LANDLOCK_ACCESS, LANDLOCK_DOMAIN):
            return
        dom = self._domains.get(name)
        if dom is None:
            dom = self._domains[name] = _Domain()
            self._bound(now)
        if kind == LANDLOCK_ACCESS:
            path = fields.get("path")
            if path is not None and len(path) > MAX_PATH:
                path = path[: MAX_PATH - 1] + "…"
            key = (tuple(fields.get("blockers", "").split(",")), path, _detail(fields))
            if key in dom.seen:
                dom.seen[key] += 1
            elif len(dom.seen) < MAX_DISTINCT and self._entries < MAX_ENTRIES:
                dom.seen[key] = 1
                self._entries += 1
            else:
                dom.extra += 1
        elif fields.get("status") == "allocated":
            with contextlib.suppress(ValueError):
                dom.pid, dom.uid = int(fields.get("pid", "")), int(fields.get("uid", ""))
            dom.born = when
        elif fields.get("status") == "deallocated":
            dom.ended = now
            with contextlib.suppress(ValueError):
                dom.denials = int(fields.get("denials", ""))

    def _bound(self, now: float) -> None:
        """Drop ended domains nobody claimed, then the oldest: swept every 64 new domains."""
        self._new += 1
        if self._new % 64 and len(self._domains) <= MAX_DOMAINS:
            return
        for name in [
            n for n, d in self._domains.items() if d.ended is not None and now - d.ended > ENDED_KEEP
        ]:
            self._entries -= len(self._domains.pop(name).seen)
        while len(self._domains) > MAX_DOMAINS:
            self._entries -= len(self._domains.popitem(last=False)[1].seen)
            self.evicted += 1  # a running command's domain may be among them

    def mine(self, pid: int, uid: int, since: float) -> list[str]:
        """The domains process ``pid`` of user ``uid`` made that refused something since ``since``
        (wall clock; a second's slack). The kernel records a domain's creator when the domain is
        made but writes the record at its first refusal: a domain another process made under a
        reused pid matches the pid, never another user's uid."""
        return [
            n for n, d in self._domains.items() if d.pid == pid and d.uid == uid and d.born >= since - 1.0
        ]

    def ended(self, names: list[str]) -> bool:
        return all(self._domains[n].denials is not None for n in names)

    def pop(self, names: list[str], *, final: bool, stopped: str | None = None) -> Collected:
        """Claim ``names``: their refusals merged, and how many the kernel counted but did not
        deliver (known only when ``final``: every domain's end was seen)."""
        domains = [self._domains.pop(n) for n in names]
        self._entries -= sum(len(d.seen) for d in domains)
        merged: dict[tuple[tuple[str, ...], str | None, str | None], int] = {}
        received = 0
        for d in domains:
            for k, count in d.seen.items():
                merged[k] = merged.get(k, 0) + count
            received += sum(d.seen.values()) + d.extra
        counted = sum(d.denials or 0 for d in domains)
        refused = tuple(Refused(b, p, x, n) for (b, p, x), n in merged.items())
        return Collected(refused, max(0, counted - received) if final else 0, final, stopped)


class Collector:
    """The host's Landlock records, read from the audit multicast into a :class:`Buffer`.
    Thread-safe; a daemon thread drains the socket so that a long command's early refusals
    are not lost to a full socket buffer."""

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, NETLINK_AUDIT)
        try:
            self._sock.bind((0, 1 << (AUDIT_NLGRP_READLOG - 1)))
            with contextlib.suppress(OSError):  # the forced size needs CAP_NET_ADMIN
                self._sock.setsockopt(socket.SOL_SOCKET, 33, 8 << 20)  # SO_RCVBUFFORCE
            self._sock.setblocking(False)
        except BaseException:
            self._sock.close()
            raise
        self._lock = threading.Lock()
        self._buffer = Buffer()
        self.overflows = 0  # times the socket overflowed: records lost to every command then running
        threading.Thread(target=self._pump, name="kbd-landlock-audit", daemon=True).start()

    def _pump(self) -> None:
        while True:
            try:
                select.select([self._sock], [], [])
            except (OSError, ValueError):
                return  # closed
            with self._lock:
                self._drain()

    def _drain(self, most: int = DRAIN_BATCH) -> bool:
        # Every recv happens under the lock: a record is in the buffer or still in the socket.
        # At most ``most`` datagrams per hold, so that a flood never holds the lock for long.
        # True once the socket is empty.
        for _ in range(most):
            try:
                data = self._sock.recv(1 << 16)
            except BlockingIOError:
                return True
            except OSError as exc:
                if exc.errno == errno.ENOBUFS:
                    self.overflows += 1
                    continue
                raise
            now = time.monotonic()
            for kind, text in messages(data):
                self._buffer.take(kind, text, now=now)
        return False

    def mark(self) -> Mark:
        """What a command's report compares at its end: losses counted from here on."""
        try:
            lost = audit_status()[6]
        except OSError:
            lost = 0
        return Mark(time.time(), lost, self.overflows, self._buffer.evicted)

    def claim(self, pid: int, uid: int, mark: Mark) -> Collected:
        """The refusals of the domains process ``pid`` of user ``uid`` made since ``mark``, once
        its command has ended: waits for the kernel's queue to empty, and for each refusing
        domain's final count (at most END_WAIT; a flood may make it longer, never unbounded)."""
        status = _settle()
        deadline = time.monotonic() + END_WAIT
        while True:
            if self._lock.acquire(timeout=END_WAIT):
                try:
                    emptied = self._drain()
                    if emptied and (again := _settle()) is not None:
                        # A record the kernel had dequeued but not yet delivered at the first
                        # look has arrived by now: one more look, one more drain.
                        status = again
                        emptied = self._drain()
                    late = time.monotonic() >= deadline
                    mine = self._buffer.mine(pid, uid, mark.since)
                    # Every domain's end record gives its final count; when the kernel dropped
                    # no audit record meanwhile, every refusal has arrived already (no wait).
                    unlost = status is not None and status[6] == mark.lost
                    final = emptied and (unlost or self._buffer.ended(mine))
                    if final or late:
                        stopped = self._losses(status, mark)
                        if not emptied and stopped is None:
                            stopped = "kbd's audit reader fell behind while the command ran: some refusals may be missing"
                        return self._buffer.pop(mine, final=final, stopped=stopped)
                finally:
                    self._lock.release()
            elif time.monotonic() >= deadline + END_WAIT:
                return Collected(
                    (), 0, False, "the audit records could not be read in time (a flood of them?)"
                )
            time.sleep(0.005)

    def _losses(self, status: tuple[int, ...] | None, mark: Mark) -> str | None:
        """Why the claimed refusals may be incomplete, or None."""
        if status is not None and not status[1]:
            return "kernel audit was turned off"
        if status is not None and status[6] > mark.lost:
            return (f"the kernel dropped {status[6] - mark.lost} audit records (of any process) while the command ran: "
                    "some refusals may be missing")  # fmt: skip
        if self.overflows > mark.overflows or self._buffer.evicted > mark.evicted:
            return "kbd's audit reader fell behind while the command ran: some refusals may be missing"
        return None


def _detail(fields: dict[str, str]) -> str | None:
    if "dest" in fields:  # net.connect_tcp: the port connected to
        return f"port {fields['dest']}"
    if "src" in fields:  # net.bind_tcp: the port bound
        return f"port {fields['src']}"
    if "opid" in fields:  # scope.signal: the target process
        return f"process {fields.get('ocomm', '?')}"
    return None


def _settle() -> tuple[int, ...] | None:
    """Until the kernel's audit queue is empty (records still queued when the command
    ended are then on their way to every subscriber), for at most SETTLE seconds;
    the last status read (None: unreadable)."""
    deadline = time.monotonic() + SETTLE
    status = None
    while time.monotonic() < deadline:
        try:
            status = audit_status()
        except OSError:
            return None
        if status[7] == 0:
            break
        time.sleep(0.001)
    return status


# -- the pid channel ----------------------------------------------------------------


def pid_channel() -> tuple[socket.socket, int]:
    """(reader, the helper's inheritable end): the helper's one byte tells the reader
    its pid and uid (:func:`sender`)."""
    reader, writer = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    reader.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
    reader.setblocking(False)
    return reader, writer.detach()


def sender(reader: socket.socket) -> tuple[int, int] | None:
    """The (pid, uid) of whoever wrote on the channel (None: nobody did, so no helper ran)."""
    try:
        _, anc, _, _ = reader.recvmsg(1, socket.CMSG_SPACE(_UCRED.size))
    except (BlockingIOError, OSError):
        return None
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(data) >= _UCRED.size:
            pid, uid, _ = _UCRED.unpack_from(data)
            return (pid, uid) if pid > 0 else None
    return None


_shared: Collector | None = None
_shared_lock = threading.Lock()


def shared() -> Collector | None:
    """This process's collector, started on first use; None where the kernel cannot report."""
    global _shared
    with _shared_lock:
        if _shared is None and unavailable() is None:
            try:
                _shared = Collector()
            except OSError:
                return None
        return _shared


__all__ = [
    "Collected",
    "Collector",
    "Mark",
    "Refused",
    "parse",
    "pid_channel",
    "sender",
    "shared",
    "unavailable",
]

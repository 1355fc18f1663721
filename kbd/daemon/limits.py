"""The HTTP layer's limits (docs/api.md "Limits"): how
long a request may take to arrive, how large its head may be, how many
connections a peer uid and everyone may hold, and the open-file limit that
makes room for them."""

from __future__ import annotations

import contextlib
import resource
from collections import Counter

# A local client sends its request line and headers in one write; five seconds
# is generous and bounds how long a half-sent request can hold a descriptor.
HEADER_TIMEOUT = 5.0
# The body of a request (at most a few MiB: see kbd.daemon.routes.MAX_BODY_BYTES) arrives
# in milliseconds over a local socket. Without a deadline, a request whose
# headers arrived but whose body never does holds its connection (one of the
# uid's capped slots) forever.
BODY_TIMEOUT = 10.0
# The request line and headers of an API request are a few hundred bytes (a
# bearer token, a path). The HTTP parser buffers a header until it ends, with
# no limit of its own: within the header timeout, one connection could make the
# daemon hold tens of MiB, and a uid's connections several GiB.
MAX_HEADER_BYTES = 64 * 1024
# A client that stops reading its answer (up to a 2 MiB file, or the event
# stream) makes the daemon hold the unsent bytes; 200 such connections held
# over 1 GiB for as long as they stayed open. An answer that makes no progress
# at all (the transport's buffer stays above its high-water mark) for this long
# is abandoned and the connection dropped.
WRITE_STALL_TIMEOUT = 15.0
KEEP_ALIVE_TIMEOUT = 5
# 64 concurrent API clients of one service principal are a budgeted load
# (docs/performance.md); four times that per uid leaves room, and needs several uids to
# reach the total cap. Descriptors the daemon needs besides connections (state
# files, locks, pinned folders, thread-pool work) are kept in reserve.
MAX_CONNECTIONS_PER_UID = 256
MAX_CONNECTIONS = 4096
# asyncio accepts up to BACKLOG connections per loop iteration before any of
# their connection_made runs (where the caps close them), so bursts of accepted
# descriptors need room beyond the cap: uvicorn's default of 2048 would let a
# flood reach EMFILE in a few iterations.
BACKLOG = 128
FD_RESERVE = 4 * BACKLOG + 256


# -- connection limits ------------------------------------------------------------------------


def raise_nofile_limit() -> int:
    """Raise the soft open-file limit to the hard one (a service's default soft
    limit of 1024 is soon exhausted by connections); the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
    return MAX_CONNECTIONS + FD_RESERVE if soft == resource.RLIM_INFINITY else soft


def connection_caps(nofile: int) -> tuple[int, int]:
    """The (total, per-uid) connection caps for an open-file limit of ``nofile``:
    never so many connections that accepting one more could fail with EMFILE,
    and no uid allowed more than a quarter of them."""
    total = max(16, min(MAX_CONNECTIONS, nofile - FD_RESERVE))
    return total, max(4, min(MAX_CONNECTIONS_PER_UID, total // 4))


class ConnectionLimits:
    """Counts open connections, in total and per peer uid (``None``: peer unknown).

    Only the event loop thread uses it (protocol callbacks), so it needs no lock.
    """

    def __init__(self, *, total: int, per_uid: int) -> None:
        self.total = total
        self.per_uid = per_uid
        self.open: Counter[int | None] = Counter()

    def admit(self, uid: int | None) -> bool:
        if sum(self.open.values()) >= self.total or self.open[uid] >= self.per_uid:
            return False
        self.open[uid] += 1
        return True

    def release(self, uid: int | None) -> None:
        self.open[uid] -= 1
        if self.open[uid] <= 0:
            del self.open[uid]

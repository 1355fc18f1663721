"""The change feed's persisted log: ``state/events.log`` (docs/daemon.md).

One JSON object a line, each event written with one ``write`` on an
``O_APPEND`` descriptor while holding the ``events`` lock under
``state/locks`` (:mod:`kbd.fs.locks`), so appenders in several processes never
interleave lines or issue one id twice. What each line may hold is decided by
the pure allow-list in :mod:`kbd.core.events`; this module only does the I/O.

Layout. Each log file starts with a header line ``{"_epoch", "_base"}``: the
epoch its ids carry and the last seq issued before the file began. The epoch is
drawn when a log is created, so a log that was deleted (or replaced by
something that is not a kbd log) starts a new epoch, and ids are never reused:
wherever continuity cannot be proven from the file itself, a new epoch is the
answer. At ``max_bytes`` the log is renamed to ``events.log.1`` (replacing the
previous one) and a new file continues the same epoch with ``_base`` = the
last seq. The files are 0640 in the 0750 state folder: they name workflows and
sessions, never file content.

Durability: appends are fsynced in batches, at most ``sync_interval`` seconds
after the write (a background thread), or at once with ``sync_interval=0``. A
crash can therefore lose the last few events or leave a torn last line. A line
without its newline is torn wherever it is read (never returned, never counted),
and the next append ends it with `` (torn)`` and a newline, so it stays
unreadable, then writes its own line (its seq is reused: no subscriber can have
seen the torn one's id).

Resuming: :meth:`EventLog.since` answers from an in-memory ring of the latest
events (``ring``), else from the two files (unless told not to: the daemon's
subscribers are served from the ring only), else with
:class:`kbd.core.events.Resync`. The ring holds what this instance appended or
followed; with ``prefill`` (the daemon) it also starts with the newest events
already in the files, read backwards (a ring's worth of lines, never the
whole log).
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import stat
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

from kbd.core.events import (
    Event,
    FieldValue,
    Replay,
    Resync,
    check_event,
    contiguous_from,
    format_id,
    header_line,
    make_event,
    parse_header,
    parse_id,
    parse_line,
    resume_from,
)
from kbd.errors import from_oserror
from kbd.fs.atomic import ensure_private_dir
from kbd.fs.locks import held

LOG_NAME = "events.log"
ROTATED_NAME = "events.log.1"
LOG_MODE = 0o640
# O_NONBLOCK: a FIFO planted at the log's name must not hang the opener (it is
# then refused as not a regular file); it changes nothing for a regular file.
_RW_FLAGS = os.O_RDWR | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
_RO_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
_CHUNK = 1 << 16
#: A header line is short; anything longer at the start of a file is not one.
_MAX_HEADER = 256
#: Ends a torn line before the next event. Not just a newline: a line cut right
#: before its newline is a complete JSON object, and a bare newline would make
#: it valid again (its seq is reused). A '(' is never valid JSON outside a
#: string, and inside one the line still has no closing quote and brace.
_TORN_END = b" (torn)\n"


def _read_at(fd: int, offset: int, size: int | None = None) -> bytes:
    """Bytes from ``offset`` to EOF (or ``size`` of them)."""
    chunks, pos = [], offset
    while size is None or pos - offset < size:
        want = _CHUNK if size is None else min(_CHUNK, size - (pos - offset))
        chunk = os.pread(fd, want, pos)
        if not chunk:
            break
        chunks.append(chunk)
        pos += len(chunk)
    return b"".join(chunks)


def _header_of(fd: int) -> tuple[str, int, int] | None:
    """(epoch, base, header length) of an open log file, or None when its first
    line is not a kbd header (or the file is not a regular file)."""
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        return None
    head = os.pread(fd, _MAX_HEADER, 0)
    end = head.find(b"\n")
    parsed = parse_header(head[:end]) if end >= 0 else None
    return None if parsed is None else (*parsed, end + 1)


def _last_seq(fd: int, *, epoch: str, start: int, end: int) -> int | None:
    """The seq of the last valid event of ``epoch`` in ``[start, end)``, read
    backwards, or None when there is none. Only newline-terminated lines count:
    one without its newline is torn, whatever it looks like."""
    carry, pos, first = b"", end, True
    while pos > start:
        step = min(_CHUNK, pos - start)
        pos -= step
        lines = (os.pread(fd, step, pos) + carry).split(b"\n")
        if first:
            lines.pop()  # after the last newline: empty, or a torn line
            first = False
        carry = lines.pop(0) if pos > start and lines else b""
        for line in reversed(lines):
            event = parse_line(line) if line else None
            if event is not None and parse_id(event.id) == (epoch, event.seq):
                return event.seq
    return None


def _tail_events(fd: int, *, epoch: str, start: int, end: int, last: int, n: int) -> list[Event]:
    """Up to ``n`` events of ``epoch`` in ``[start, end)`` (``end`` just past a
    newline), read backwards: the newest must be ``last`` and each older one
    the seq before (a gap ends the run). In order. Reads about ``n`` lines."""
    out: list[Event] = []
    carry, pos = b"", end
    while pos > start and len(out) < n:
        step = min(_CHUNK, pos - start)
        pos -= step
        lines = (os.pread(fd, step, pos) + carry).split(b"\n")
        carry = lines.pop(0) if pos > start else b""
        for line in reversed(lines):
            event = parse_line(line) if line else None
            if event is None or parse_id(event.id) != (epoch, event.seq):
                continue  # torn, foreign or another epoch's: skipped, as every reader does
            if event.seq != (out[-1].seq - 1 if out else last):
                return out[::-1]
            out.append(event)
            if len(out) == n:
                break
    return out[::-1]


def _after_last_newline(fd: int, *, start: int, end: int) -> int:
    """The offset just past the last newline in ``[start, end)``, or ``start``."""
    pos = end
    while pos > start:
        step = min(_CHUNK, pos - start)
        pos -= step
        at = os.pread(fd, step, pos).rfind(b"\n")
        if at >= 0:
            return pos + at + 1
    return start


class _Syncer:
    """fsyncs the log at most ``interval`` seconds after a write (a daemon
    thread, started on the first write): one fsync covers a burst of events."""

    def __init__(self, interval: float, sync: Callable[[], None]) -> None:
        self._interval = interval
        self._sync = sync
        self._cond = threading.Condition()
        self._due: float | None = None
        self._stopping = False
        self._thread: threading.Thread | None = None

    def mark(self) -> None:
        with self._cond:
            if self._due is None:
                self._due = time.monotonic() + self._interval
                self._cond.notify()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kbd-events-fsync", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and (self._due is None or self._due > time.monotonic()):
                    self._cond.wait(None if self._due is None else self._due - time.monotonic())
                if self._stopping:
                    return
                self._due = None
            # A failed fsync is retried by the next write's mark and by close();
            # the thread must not die of it (EIO on a full or failing disk).
            with contextlib.suppress(OSError):
                self._sync()

    def on_own_thread(self) -> bool:
        return self._thread is not None and self._thread is threading.current_thread()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join()


class EventLog:
    """The persisted event log of one kbd root (see the module docstring).

    Thread-safe within a process, and safe across processes through the lock.
    ``close()`` it (or use it as a context manager) to fsync the tail.
    """

    def __init__(
        self,
        state_dir: Path,
        *,
        ring: int = 4096,
        max_bytes: int = 8 << 20,
        sync_interval: float = 0.1,
        lock_timeout: float = 5.0,
        prefill: bool = False,
    ) -> None:
        if ring < 1 or max_bytes < 4096 or sync_interval < 0:
            raise ValueError("ring >= 1, max_bytes >= 4096 and sync_interval >= 0 are required")
        self.state_dir = state_dir
        self.path = state_dir / LOG_NAME
        self.rotated_path = state_dir / ROTATED_NAME
        self.max_bytes = max_bytes
        self._lock_timeout = lock_timeout
        self._ring: deque[Event] = deque(maxlen=ring)
        self._mutex = threading.RLock()
        self._fd: int | None = None
        self._identity: tuple[int, int] | None = None  # (st_dev, st_ino) of the file self._fd holds
        self._epoch = ""
        self._seq = 0
        self._header_len = 0
        self._offset = 0  # bytes of the current file already read (complete lines only)
        self._torn = False  # the current file ends inside a line (a crashed writer)
        self._syncer = _Syncer(sync_interval, self.sync) if sync_interval > 0 else None
        self._prefill = prefill
        self._closed = False
        try:
            ensure_private_dir(state_dir)
            with self._locked():
                self._follow(locked=True)
        except OSError as exc:
            raise from_oserror(exc, what="open the event log") from exc

    # -- public ----------------------------------------------------------------------------------

    @property
    def epoch(self) -> str:
        return self._epoch

    @property
    def last_id(self) -> str:
        """The id of the last event issued (``<epoch>-0`` when none yet)."""
        with self._mutex:
            return format_id(self._epoch, self._seq)

    def append(self, event_type: str, /, *, workflow_id: str | None, **fields: FieldValue) -> Event:
        """Persist one event and return it with its id. Raises
        :class:`kbd.core.events.EventRefused` for anything off the allow-list
        (nothing is written), Busy when the lock is not had in time, and the
        tree's error for an OSError (a full disk is NoSpace)."""
        return self.append_many([(event_type, workflow_id, fields)])[0]

    def append_many(self, items: Sequence[tuple[str, str | None, Mapping[str, FieldValue]]]) -> list[Event]:
        """Persist several events ``(type, workflow_id, fields)`` under one lock,
        in order, with consecutive ids (a watcher batch: the lock costs more than
        the write). All are checked first: one off the allow-list and none is
        written. Raises as :meth:`append`; on an error after a write began, the
        events written so far stay (each line is whole)."""
        for event_type, workflow_id, fields in items:
            check_event(event_type, workflow_id, fields)
        if self._closed:
            raise ValueError("append to a closed EventLog")
        try:
            with self._locked():
                self._follow(locked=True)
                return [self._write_one(*item) for item in items]
        except OSError as exc:
            raise from_oserror(exc, what="append to the event log") from exc

    def _write_one(self, event_type: str, workflow_id: str | None, fields: Mapping[str, FieldValue]) -> Event:
        """One event, with the lock held and the log followed to its end."""
        event, data = self._next(event_type, workflow_id, fields)
        if self._offset + len(data) > self.max_bytes and self._offset > self._header_len:
            self._rotate()
            self._follow(locked=True)
            event, data = self._next(event_type, workflow_id, fields)
        assert self._fd is not None
        written = os.write(self._fd, data)
        self._offset += written
        if written != len(data):  # only a full disk shortens a write to a regular file
            self._torn = True
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self._seq, self._torn = event.seq, False
        self._ring.append(event)
        if self._syncer is None:
            os.fsync(self._fd)
        else:
            self._syncer.mark()
        return event

    def since(self, last_id: str, *, files: bool = True) -> Replay | Resync:
        """The events issued after ``last_id``, in order, or Resync: a malformed
        id, another epoch (a restarted or recreated log), an id beyond what was
        issued, or one older than both files reach back (``too-old``).

        ``files=False``: from the ring only, so the answer costs at most the
        ring's size whatever the log holds; an id older than the ring reaches
        back is ``too-old`` (what the daemon gives subscribers: docs/daemon.md "The change feed")."""
        with self._mutex:
            self._follow(locked=False)
            first = resume_from(last_id, epoch=self._epoch, last_seq=self._seq)
            if isinstance(first, Resync):
                return first
            last, epoch = self._seq, self._epoch
            if first > last:
                return Replay(())
            if self._ring and self._ring[0].seq <= first:
                # The ring is contiguous (a gap clears it), so the wanted events are its tail.
                tail = tuple(itertools.islice(self._ring, first - self._ring[0].seq, None))
                if tail and tail[0].seq == first:
                    return Replay(tail)
                return Replay(tuple(e for e in self._ring if e.seq >= first))
            if not files:
                return Resync("too-old")
        return contiguous_from(self._scan_files(epoch), first, last)

    def recent(self, n: int) -> tuple[Event, ...]:
        """The newest ``n`` events the ring holds, in order (fewer when it holds
        fewer: it starts empty when the log is opened, and restarts after a gap)."""
        with self._mutex:
            self._follow(locked=False)
            return tuple(itertools.islice(self._ring, max(0, len(self._ring) - n), None))

    def sync(self) -> None:
        with self._mutex:
            if self._fd is not None:
                os.fsync(self._fd)

    def close(self) -> None:
        if self._syncer is not None and self._syncer.on_own_thread():
            # A finalizer the garbage collector runs on the fsync thread (see
            # kbd.service.events.LogSink), which may hold the mutex and cannot
            # join itself: close from another thread instead (closed for writers from now on).
            self._closed = True
            threading.Thread(target=self.close, name="kbd-events-close", daemon=True).start()
            return
        self._closed = True
        if self._syncer is not None:
            self._syncer.stop()
        with self._mutex:
            if self._fd is not None:
                with contextlib.suppress(OSError):
                    os.fsync(self._fd)
                os.close(self._fd)
                self._fd = None

    def __enter__(self) -> EventLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ---------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with (
            self._mutex,
            held(self.state_dir, "events", "log", timeout=self._lock_timeout, what="the event log"),
        ):
            yield

    def _next(
        self, event_type: str, workflow_id: str | None, fields: Mapping[str, FieldValue]
    ) -> tuple[Event, bytes]:
        event = make_event(
            event_type,
            epoch=self._epoch,
            seq=self._seq + 1,
            ns=time.time_ns(),
            workflow_id=workflow_id,
            fields=fields,
        )
        return event, (_TORN_END if self._torn else b"") + event.line()

    def _follow(self, *, locked: bool) -> list[Event]:
        """Bring fd, epoch, seq and ring up to date with the file at the path;
        return the events read. Holding the lock, repair what cannot be
        continued (no log, or not a kbd log) with a new epoch; without it, only read."""
        new: list[Event] = []
        for _ in range(4):  # the path changes at most a few times under our feet
            try:
                st = os.stat(self.path, follow_symlinks=False)
            except FileNotFoundError:
                st = None
            if st is not None and self._fd is not None and (st.st_dev, st.st_ino) == self._identity:
                new += self._read_new(locked=locked)
                return new
            if self._fd is not None:  # rotated, replaced or deleted: finish the old file first
                new += self._read_new(locked=False)
                os.close(self._fd)
                self._fd = self._identity = None
            if st is None or not stat.S_ISREG(st.st_mode) or not self._open_current():
                if not locked:
                    return new
                self._create()
        raise OSError(errno.EAGAIN, "the event log kept changing while it was opened")

    def _open_current(self) -> bool:
        """Open the file at the path; False when it is not a kbd log."""
        try:
            fd = os.open(self.path, _RW_FLAGS)
        except FileNotFoundError:
            return False
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENXIO):  # a symlink; a socket
                return False
            raise
        header = _header_of(fd)
        if header is None:
            os.close(fd)
            return False
        epoch, base, header_len = header
        st = os.fstat(fd)
        size = st.st_size
        last = _last_seq(fd, epoch=epoch, start=header_len, end=size)
        if epoch == self._epoch and max(base, last or 0) < self._seq:
            # Our epoch, yet behind what we issued (an old copy put back): continuing
            # would issue ids twice. Not continuable; holding the lock, a new epoch.
            os.close(fd)
            return False
        continues = epoch == self._epoch and base == self._seq
        self._fd, self._identity, self._header_len = fd, (st.st_dev, st.st_ino), header_len
        if continues:  # a rotation we followed: the ring stays contiguous, read the new file from its start
            self._offset = header_len
            return True
        # A log we did not follow to here (first open, another epoch, a missed
        # rotation): the ring restarts, and the seq continues from the file's last event.
        self._ring.clear()
        self._epoch, self._torn = epoch, False
        self._seq = max(base, last or 0)
        self._offset = _after_last_newline(fd, start=header_len, end=size)
        if self._prefill:
            self._fill_ring(fd, header_len, base)
        return True

    def _fill_ring(self, fd: int, header_len: int, base: int) -> None:
        """Fill the ring with the newest events already in the files (the
        current one, then the rotated one where it ends right before it):
        about a ring's worth of lines is read, however long the log."""
        n = self._ring.maxlen or 0
        events = _tail_events(fd, epoch=self._epoch, start=header_len, end=self._offset, last=self._seq, n=n)
        if len(events) < n and base > 0 and (events[0].seq - 1 if events else self._seq) == base:
            with contextlib.suppress(OSError):
                rfd = os.open(self.rotated_path, _RO_FLAGS)
                try:
                    header = _header_of(rfd)
                    if header is not None and header[0] == self._epoch:
                        end = _after_last_newline(rfd, start=header[2], end=os.fstat(rfd).st_size)
                        older = _tail_events(rfd, epoch=self._epoch, start=header[2], end=end, last=base,
                                             n=n - len(events))  # fmt: skip
                        events = older + events
                finally:
                    os.close(rfd)
        self._ring.extend(events)

    def _read_new(self, *, locked: bool) -> list[Event]:
        """Complete lines appended after ``_offset``. A trailing partial line is
        left for later, unless the lock is held: then nobody is writing, so it
        is torn for good and the next write starts a new line."""
        assert self._fd is not None
        data = _read_at(self._fd, self._offset)
        complete = data[: data.rfind(b"\n") + 1]
        new: list[Event] = []
        for line in complete.split(b"\n")[:-1]:
            event = parse_line(line) if line else None
            if event is None or parse_id(event.id) != (self._epoch, event.seq) or event.seq <= self._seq:
                continue
            if event.seq != self._seq + 1:  # a lost event: the ring must stay contiguous
                self._ring.clear()
            self._seq = event.seq
            self._ring.append(event)
            new.append(event)
        self._offset += len(complete)
        if locked and len(data) > len(complete):
            self._offset, self._torn = self._offset + len(data) - len(complete), True
        return new

    def _create(self) -> None:
        """A new log with a new epoch, put in place atomically (a reader never
        sees a log without its header). Called with the lock held."""
        self._install(header_line(os.urandom(4).hex(), 0), rotate=False)

    def _rotate(self) -> None:
        """Move the full log to events.log.1 and continue the epoch in a new
        file. A crash between the two renames leaves no log: the next opener
        starts a new epoch (subscribers resync; no id is reused)."""
        assert self._fd is not None
        os.fsync(self._fd)
        self._install(header_line(self._epoch, self._seq), rotate=True)

    def _install(self, header: bytes, *, rotate: bool) -> None:
        dfd = os.open(self.state_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            tmp = f".events-{os.urandom(8).hex()}.tmp"
            fd = os.open(
                tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd
            )
            try:
                os.write(fd, header)
                os.fchmod(fd, LOG_MODE)  # exactly 0640, whatever the umask
                os.fsync(fd)
            finally:
                os.close(fd)
            try:
                if rotate:
                    os.rename(LOG_NAME, ROTATED_NAME, src_dir_fd=dfd, dst_dir_fd=dfd)
                os.rename(tmp, LOG_NAME, src_dir_fd=dfd, dst_dir_fd=dfd)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=dfd)
                raise
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def _scan_files(self, epoch: str) -> list[Event]:
        """Every readable event of ``epoch`` in events.log.1 then events.log, in
        seq order (a torn or foreign line, or one out of order, is skipped)."""
        events: list[Event] = []
        for path in (self.rotated_path, self.path):
            try:
                fd = os.open(path, _RO_FLAGS)
            except OSError:
                continue
            try:
                header = _header_of(fd)
                if header is None or header[0] != epoch:
                    continue
                data = _read_at(fd, header[2])
            finally:
                os.close(fd)
            for line in data.split(b"\n")[:-1]:  # the part after the last newline is torn
                event = parse_line(line) if line else None
                if event is None or parse_id(event.id) != (epoch, event.seq):
                    continue
                if not events or event.seq > events[-1].seq:
                    events.append(event)
        return events

"""What the daemon tells its operator, as text (pure): the access log line,
journald's native datagram, and the Prometheus text exposition (format 0.0.4).

Everything here takes values and returns strings or bytes; the daemon's shell
(:mod:`kbd.daemon.access_log`, :mod:`kbd.daemon.journal`) does the timing, the counting hooks and
the sending. Values that reach these formats can come from a client (an HTTP
method, a principal's label, a path), so each format has one escaping function
and a test that no value can break out of its line or label.
"""

from __future__ import annotations

import math
import re
import struct
import threading
from bisect import bisect_left
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kbd import __version__
from kbd.errors import UsageError

# -- the access log -------------------------------------------------------------------------

# Anything but these is escaped: a value may never end the line, forge a field
# boundary (space) or an escape (backslash), whatever the log viewer splits on
# (str.splitlines() also splits on \x1c-\x1e, \x85, U+2028, U+2029: none is printable).
_PLAIN = re.compile(r"[!#-\[\]-~]+")  # printable ASCII except space, '"' and '\'
_SHORT = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\\": "\\\\", " ": "\\x20", '"': '\\"'}


def one_line(value: str) -> str:
    """``value`` as one space-free token of printable characters: backslash
    escapes for control and non-printable characters, space, quote and
    backslash (so the mapping is reversible and nothing forges a line or a
    field); ``-`` for an empty value."""
    if not value:
        return "-"
    if _PLAIN.fullmatch(value):
        return value
    return "".join(_escape_char(ch) for ch in value)


def _escape_char(ch: str) -> str:
    short = _SHORT.get(ch)
    if short is not None:
        return short
    if ch.isprintable():
        return ch
    code = ord(ch)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def access_line(*, principal: str | None, method: str, route: str, status: int, ms: float) -> str:
    """One request: ``PRINCIPAL METHOD ROUTE STATUS MSms`` (``-`` for no
    principal), each value escaped by :func:`one_line`."""
    who = "-" if principal is None else one_line(principal)
    return f"{who} {one_line(method)} {one_line(route)} {status} {ms:.2f}ms"


# -- journald's native protocol ------------------------------------------------------------

_FIELD = re.compile(r"[A-Z0-9][A-Z0-9_]*")
# Names already checked (a few fixed ones in practice): the check is per record otherwise.
_VALID_FIELDS: set[str] = set()


def journal_datagram(fields: Iterable[tuple[str, str]]) -> bytes:
    """The native protocol's datagram for ``fields`` (systemd's
    "Native Journal Protocol"): ``KEY=value\\n``, or for a value holding a
    newline the binary-safe form ``KEY\\n`` + its length (64-bit little endian)
    + the value + ``\\n``. A key must be uppercase letters, digits and ``_``,
    not starting with ``_`` (those are journald's own trusted fields):
    ValueError otherwise (the keys are the daemon's, never a client's)."""
    out = bytearray()
    text: list[str] = []  # consecutive KEY=value lines, encoded at once
    for key, value in fields:
        if key not in _VALID_FIELDS:
            if not _FIELD.fullmatch(key) or len(key) > 64:
                raise ValueError(f"not a journal field name: {key!r}")
            if len(_VALID_FIELDS) < 256:
                _VALID_FIELDS.add(key)
        if "\n" in value:
            out += "".join(text).encode("utf-8", "backslashreplace")
            text.clear()
            data = value.encode("utf-8", "backslashreplace")
            out += key.encode() + b"\n" + struct.pack("<Q", len(data)) + data + b"\n"
        else:
            text.append(f"{key}={value}\n")
    out += "".join(text).encode("utf-8", "backslashreplace")
    return bytes(out)


def syslog_priority(levelno: int) -> int:
    """A logging level as a syslog priority (journald's ``PRIORITY``)."""
    if levelno >= 50:
        return 2  # crit
    if levelno >= 40:
        return 3  # err
    if levelno >= 30:
        return 4  # warning
    if levelno >= 20:
        return 6  # info
    return 7  # debug


# -- Prometheus text exposition 0.0.4 ------------------------------------------------------

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# An API request over a local socket takes ~0.5-5 ms; a note write may wait
# for its notes mutex up to the lock timeout, an event stream lasts minutes.
DURATION_BUCKETS: tuple[float, ...] = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0, 60.0,
)  # fmt: skip
# The methods a metric label may name; any other becomes "other", so a client
# cannot create series at will (the route label is a template for the same reason).
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"})
UNMATCHED = "unmatched"  # the route label (and the log's route) of a path no route has


def metric_method(method: str) -> str:
    return method if method in METHODS else "other"


class RequestStats:
    """Request counts per (route, method, status) and durations per (route,
    status) in :data:`DURATION_BUCKETS`. Plain dicts, no lock: one thread (the
    daemon's event loop) observes and snapshots."""

    def __init__(self, buckets: Sequence[float] = DURATION_BUCKETS) -> None:
        self.buckets = tuple(buckets)
        self.counts: dict[tuple[str, str, int], int] = {}
        # (route, status) -> per-bucket counts (not cumulative; the last one is +Inf) and the sum
        self.hist: dict[tuple[str, int], list[int]] = {}
        self.sums: dict[tuple[str, int], float] = {}

    def observe(self, route: str, method: str, status: int, seconds: float) -> None:
        key = (route, metric_method(method), status)
        self.counts[key] = self.counts.get(key, 0) + 1
        hkey = (route, status)
        counts = self.hist.get(hkey)
        if counts is None:
            counts = self.hist[hkey] = [0] * (len(self.buckets) + 1)
        counts[bisect_left(self.buckets, seconds)] += 1
        self.sums[hkey] = self.sums.get(hkey, 0.0) + seconds

    def snapshot(self) -> RequestStats:
        """A copy that later observations leave alone."""
        copy = RequestStats(self.buckets)
        copy.counts = dict(self.counts)
        copy.hist = {k: list(v) for k, v in self.hist.items()}
        copy.sums = dict(self.sums)
        return copy


@dataclass(frozen=True)
class HostGauges:
    sessions_open: int
    commands_running: int
    registry_workflows: int
    watcher_up: bool | None  # None: no watcher runs (a daemon always has one)
    start_time: float


def escape_label(value: str) -> str:
    """A label value in the exposition format: backslash, double quote and
    newline escaped (the only escapes 0.0.4 defines)."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def number(value: float) -> str:
    """A sample value as the format spells it (``+Inf``, ``-Inf``, ``NaN``)."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if float(value).is_integer() and abs(value) < 2**53:
        return str(int(value))
    return repr(float(value))


def _labels(pairs: Mapping[str, str]) -> str:
    if not pairs:
        return ""
    return "{" + ",".join(f'{k}="{escape_label(v)}"' for k, v in pairs.items()) + "}"


def _family(name: str, kind: str, help_text: str) -> list[str]:
    return [f"# HELP {name} {escape_help(help_text)}", f"# TYPE {name} {kind}"]


def _gauge(name: str, help_text: str, value: float) -> list[str]:
    return [*_family(name, "gauge", help_text), f"{name} {number(value)}"]


def exposition(stats: RequestStats, gauges: HostGauges, ops: OpsStats | None = None) -> str:
    """The text exposition (0.0.4) of ``stats``, ``gauges`` and ``ops``: every
    family with HELP and TYPE, series sorted (a stable text for the same numbers)."""
    lines = _gauge("kbd_up", "1 while the daemon serves.", 1)
    lines += _family("kbd_build_info", "gauge", "Always 1; the labels say which kbd serves.")
    lines.append(f"kbd_build_info{_labels({'version': __version__})} 1")
    lines += _gauge("kbd_start_time_seconds", "When the daemon started (Unix time).", gauges.start_time)
    lines += _family(
        "kbd_requests_total", "counter", "API requests answered, by route template, method and status."
    )
    for (route, method, status), n in sorted(stats.counts.items()):
        lines.append(
            f"kbd_requests_total{_labels({'route': route, 'method': method, 'status': str(status)})} {n}"
        )
    lines += _histogram("kbd_request_duration_seconds", "API request durations, by route template and status.",
                        stats)  # fmt: skip
    lines += _gauge("kbd_sessions_open", "Open sessions.", gauges.sessions_open)
    lines += _gauge("kbd_commands_running", "Commands running in sessions.", gauges.commands_running)
    lines += _gauge("kbd_registry_workflows", "Workflows the registry knows.", gauges.registry_workflows)
    if gauges.watcher_up is not None:
        lines += _gauge("kbd_watcher_up", "1 while the file watcher is healthy, else 0 (verification by polling).",
                        1 if gauges.watcher_up else 0)  # fmt: skip
    lines += _ops_lines(ops if ops is not None else OpsStats())
    return "\n".join(lines) + "\n"


Labels = tuple[tuple[str, str], ...]  # a series' label pairs, in order


def _histogram(name: str, help_text: str, stats: RequestStats) -> list[str]:
    series: dict[Labels, tuple[Sequence[int], float]] = {
        (("route", route), ("status", str(status))): (counts, stats.sums[(route, status)])
        for (route, status), counts in stats.hist.items()
    }
    return _histogram_lines(name, help_text, stats.buckets, series)


def _histogram_lines(
    name: str,
    help_text: str,
    buckets: Sequence[float],
    series: Mapping[Labels, tuple[Sequence[int], float]],
) -> list[str]:
    """One histogram family: per series (its label pairs), the cumulative
    bucket counts, the sum and the count. ``series`` maps the labels to the
    per-bucket counts (not cumulative; the last one is +Inf) and the sum."""
    lines = _family(name, "histogram", help_text)
    bounds = [*(repr(float(b)) for b in buckets), "+Inf"]
    for pairs, (counts, total) in sorted(series.items()):
        base = dict(pairs)
        cumulative = 0
        for le, n in zip(bounds, counts, strict=True):
            cumulative += n
            lines.append(f"{name}_bucket{_labels({**base, 'le': le})} {cumulative}")
        lines.append(f"{name}_sum{_labels(base)} {number(total)}")
        lines.append(f"{name}_count{_labels(base)} {cumulative}")
    return lines


def _counter(name: str, help_text: str, label: str, counts: Mapping[str, int]) -> list[str]:
    lines = _family(name, "counter", help_text)
    lines += [f"{name}{_labels({label: value})} {n}" for value, n in sorted(counts.items())]
    return lines


# -- what the daemon did: commands, refusals, notes ------------------------------------------

# A brokered command runs from milliseconds (a `cat`) to hours (an agent's shell).
EXEC_BUCKETS: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0, 3600.0,
)  # fmt: skip
#: How a brokered command ended (the ``exit_class`` label): ``ok`` (status 0),
#: ``failed`` (any other status but a signal's), ``signalled`` (129 to 192: the
#: shell's 128 + the signal's number for a death by signal), ``refused`` (kbd did
#: not run it, or stopped it, with an error code), ``internal`` (an unexpected
#: failure of kbd's).
EXIT_CLASSES = ("ok", "failed", "signalled", "refused", "internal")
MAX_SIGNAL = 64  # SIGRTMAX on Linux
#: Refusal codes that mean the sandbox could not be set up (docs/errors.md).
SANDBOX_SETUP_CODES = frozenset({"sandbox-setup", "containment-unavailable", "grant-group-missing"})
#: The audit records (kbd.state.audit) that count, and for which label.
GATE_CODE = "injection-refused"


def exit_class(status: int) -> str:
    """The ``exit_class`` of a command that ran and ended with ``status``."""
    if status == 0:
        return "ok"
    return "signalled" if 128 < status <= 128 + MAX_SIGNAL else "failed"


class OpsStats:
    """What the daemon did since it started, for ``/v1/metrics``: brokered
    commands by exit class (count and duration), refusals by error code (every
    error answer of the API and the broker), sandbox set-up failures by code,
    note writes by how they were made and injection-gate refusals (both from
    the audit records the daemon appends). Labels are only ever error codes,
    exit classes and the write path's own words: no client chooses a series.
    Observed from worker and broker threads, hence the lock."""

    def __init__(self, buckets: Sequence[float] = EXEC_BUCKETS) -> None:
        self.buckets = tuple(buckets)
        self._lock = threading.Lock()
        self.execs: dict[str, list[int]] = {}  # exit class -> per-bucket counts (last: +Inf)
        self.exec_seconds: dict[str, float] = {}
        self.refusals: dict[str, int] = {}
        self.sandbox_failures: dict[str, int] = {}
        self.note_writes: dict[str, int] = {}
        self.gate_refusals = 0

    def exec_ended(self, klass: str, seconds: float) -> None:
        with self._lock:
            counts = self.execs.get(klass)
            if counts is None:
                counts = self.execs[klass] = [0] * (len(self.buckets) + 1)
            counts[bisect_left(self.buckets, seconds)] += 1
            self.exec_seconds[klass] = self.exec_seconds.get(klass, 0.0) + seconds

    def refused(self, code: str) -> None:
        with self._lock:
            self.refusals[code] = self.refusals.get(code, 0) + 1
            if code in SANDBOX_SETUP_CODES:
                self.sandbox_failures[code] = self.sandbox_failures.get(code, 0) + 1

    def audited(self, record: Mapping[str, Any]) -> None:
        """Count an audit record this process appended (kbd.state.audit.observe)."""
        event = record.get("event")
        if event == "note_written":
            how = record.get("how")
            key = how if isinstance(how, str) and how.isidentifier() and len(how) <= 32 else "other"
            with self._lock:
                self.note_writes[key] = self.note_writes.get(key, 0) + 1
        elif event == "note_refused" and record.get("code") == GATE_CODE:
            with self._lock:
                self.gate_refusals += 1

    def snapshot(self) -> OpsStats:
        with self._lock:
            copy = OpsStats(self.buckets)
            copy.execs = {k: list(v) for k, v in self.execs.items()}
            copy.exec_seconds = dict(self.exec_seconds)
            copy.refusals = dict(self.refusals)
            copy.sandbox_failures = dict(self.sandbox_failures)
            copy.note_writes = dict(self.note_writes)
            copy.gate_refusals = self.gate_refusals
        return copy


def _ops_lines(ops: OpsStats) -> list[str]:
    # Every exit class is shown, zero or not: a rate over a series that appears
    # late misses its first increase.
    execs = {klass: ops.execs.get(klass, [0] * (len(ops.buckets) + 1)) for klass in EXIT_CLASSES}
    lines = _counter("kbd_exec_total", "Brokered commands that ended, by exit class.", "exit_class",
                     {klass: sum(counts) for klass, counts in execs.items()})  # fmt: skip
    lines += _histogram_lines(
        "kbd_exec_duration_seconds", "How long brokered commands ran, by exit class.", ops.buckets,
        {(("exit_class", k),): (counts, ops.exec_seconds.get(k, 0.0)) for k, counts in execs.items()},
    )  # fmt: skip
    lines += _counter("kbd_refusals_total", "Error answers of the API and the exec broker, by error code.",
                      "code", ops.refusals)  # fmt: skip
    lines += _counter("kbd_sandbox_setup_failures_total", "Sandboxes that could not be set up, by error code.",
                      "code", ops.sandbox_failures)  # fmt: skip
    lines += _counter("kbd_note_writes_total", "Notes written through the write path, by how (history's word).",
                      "how", ops.note_writes)  # fmt: skip
    lines += _family("kbd_gate_refusals_total", "counter", "Note writes the injection gate refused.")
    lines.append(f"kbd_gate_refusals_total {ops.gate_refusals}")
    return lines


# -- which answer /v1/metrics gives -----------------------------------------------------------


def _qualities(accept: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for item in accept.split(","):
        media, *params = (p.strip() for p in item.split(";"))
        q = 1.0
        for param in params:
            name, _, value = param.partition("=")
            if name.strip().lower() == "q":
                try:
                    q = float(value)
                except ValueError:
                    q = 0.0
        if media:
            out[media.lower()] = max(q, out.get(media.lower(), 0.0))
    return out


def wants_prometheus(fmt: str | None, accept: str | None) -> bool:
    """Whether ``/v1/metrics`` answers in the Prometheus text format: asked by
    ``?format=prometheus`` (``json`` forces JSON; anything else is a usage
    error), else by an ``Accept`` header that lists ``text/plain`` explicitly,
    preferring it to an explicitly listed ``application/json`` (what
    Prometheus sends). JSON otherwise (``*/*``, no header, a tie)."""
    if fmt is not None:
        if fmt not in ("json", "prometheus"):
            raise UsageError(f"format must be 'json' or 'prometheus', not {fmt[:40]!r}",
                             hint="omit it for JSON, or pass format=prometheus")  # fmt: skip
        return fmt == "prometheus"
    if not accept:
        return False
    q = _qualities(accept)
    text = q.get("text/plain")
    json_q = q.get("application/json")
    return text is not None and text > 0 and (json_q is None or text > json_q)

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
from bisect import bisect_left
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

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


def exposition(stats: RequestStats, gauges: HostGauges) -> str:
    """The text exposition (0.0.4) of ``stats`` and ``gauges``: every family
    with HELP and TYPE, series sorted (a stable text for the same numbers)."""
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
    return "\n".join(lines) + "\n"


def _histogram(name: str, help_text: str, stats: RequestStats) -> list[str]:
    lines = _family(name, "histogram", help_text)
    bounds = [*(repr(float(b)) for b in stats.buckets), "+Inf"]
    for (route, status), counts in sorted(stats.hist.items()):
        base = {"route": route, "status": str(status)}
        cumulative = 0
        for le, n in zip(bounds, counts, strict=True):
            cumulative += n
            lines.append(f"{name}_bucket{_labels({**base, 'le': le})} {cumulative}")
        lines.append(f"{name}_sum{_labels(base)} {number(stats.sums[(route, status)])}")
        lines.append(f"{name}_count{_labels(base)} {cumulative}")
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

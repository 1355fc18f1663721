"""The pure formats of kbd.core.telemetry: the access line's escaping, journald's
native datagram, the Prometheus exposition (read back with the reference
parser, prometheus_client, and with a strict line grammar of format 0.0.4)."""

from __future__ import annotations

import math
import re
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from kbd.core import telemetry as t
from kbd.errors import UsageError

# -- the access line ---------------------------------------------------------------------------

_ESCAPE = re.compile(r"\\(x[0-9a-f]{2}|u[0-9a-f]{4}|U[0-9a-f]{8}|[nrt\\\"])")


def unescape(token: str) -> str:
    """The inverse of one_line (written independently of it)."""
    simple = {"n": "\n", "r": "\r", "t": "\t", "\\": "\\", '"': '"'}

    def one(m: re.Match[str]) -> str:
        code = m.group(1)
        return simple[code] if code in simple else chr(int(code[1:], 16))

    return _ESCAPE.sub(one, token)


@given(st.text(min_size=1))
def test_one_line_is_one_printable_token_and_reversible(value: str) -> None:
    token = t.one_line(value)
    assert token.isprintable() and " " not in token
    assert len(token.splitlines()) == 1
    assert unescape(token) == value


@pytest.mark.parametrize(
    ("value", "expected"),
    [("/v1/workflows/{wid}", "/v1/workflows/{wid}"), ("a b", "a\\x20b"), ("x\ny", "x\\ny"), ("\\", "\\\\"),
     ("\u2028", "\\u2028"), ("\x85", "\\x85"), ("é", "é"), ("", "-"), ('"', '\\"')],
)  # fmt: skip
def test_one_line_examples(value: str, expected: str) -> None:
    assert t.one_line(value) == expected


@given(principal=st.none() | st.text(), method=st.text(), route=st.text(), status=st.integers(100, 599),
       ms=st.floats(0, 1e6))  # fmt: skip
def test_access_line_has_five_fields_and_cannot_be_forged(
    principal: str | None, method: str, route: str, status: int, ms: float
) -> None:
    line = t.access_line(principal=principal, method=method, route=route, status=status, ms=ms)
    fields = line.split(" ")
    assert len(fields) == 5 and len(line.splitlines()) == 1, line
    assert fields[0] == ("-" if principal is None else t.one_line(principal))
    assert fields[3] == str(status) and fields[4] == f"{ms:.2f}ms"


def test_access_line_shape() -> None:
    line = t.access_line(principal="ops", method="GET", route="/v1/sessions/{sid}", status=200, ms=1.234)
    assert line == "ops GET /v1/sessions/{sid} 200 1.23ms"
    assert t.access_line(principal=None, method="GET", route=t.UNMATCHED, status=404, ms=0.5).startswith(
        "- GET"
    )


# -- journald ------------------------------------------------------------------------------------


def parse_datagram(data: bytes) -> list[tuple[str, bytes]]:
    """journald's native protocol, read as journald does."""
    out: list[tuple[str, bytes]] = []
    i = 0
    while i < len(data):
        nl = data.index(b"\n", i)
        line = data[i:nl]
        if b"=" in line:
            key, _, value = line.partition(b"=")
            out.append((key.decode(), value))
            i = nl + 1
        else:
            (size,) = struct.unpack("<Q", data[nl + 1 : nl + 9])
            value = data[nl + 9 : nl + 9 + size]
            assert data[nl + 9 + size : nl + 10 + size] == b"\n"
            out.append((line.decode(), value))
            i = nl + 10 + size
    return out


@given(st.lists(st.tuples(st.from_regex(r"[A-Z][A-Z0-9_]{0,20}", fullmatch=True), st.text())))
def test_journal_datagram_round_trips(fields: list[tuple[str, str]]) -> None:
    data = t.journal_datagram(fields)
    assert parse_datagram(data) == [(k, v.encode("utf-8", "backslashreplace")) for k, v in fields]


def test_journal_datagram_binary_safe_form_for_newlines() -> None:
    data = t.journal_datagram([("MESSAGE", "a\nb"), ("PRIORITY", "6")])
    assert data == b"MESSAGE\n" + struct.pack("<Q", 3) + b"a\nb\nPRIORITY=6\n"


@pytest.mark.parametrize("key", ["_PID", "message", "A=B", "A\nB", "", "X" * 65])
def test_journal_datagram_refuses_bad_keys(key: str) -> None:
    with pytest.raises(ValueError, match="not a journal field name"):
        t.journal_datagram([(key, "v")])


def test_syslog_priorities() -> None:
    assert [t.syslog_priority(n) for n in (10, 20, 30, 40, 50)] == [7, 6, 4, 3, 2]


# -- Prometheus ----------------------------------------------------------------------------------

_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_LABEL_VALUE = r'"(?:[^"\\\n]|\\[\\"n])*"'
_LABELS = rf"\{{(?:[a-zA-Z_][a-zA-Z0-9_]*={_LABEL_VALUE})(?:,[a-zA-Z_][a-zA-Z0-9_]*={_LABEL_VALUE})*\}}"
_VALUE = r"(?:[+-]?(?:[0-9]+(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?|\.[0-9]+)|[+-]Inf|NaN)"
SAMPLE = re.compile(rf"({_NAME})({_LABELS})? ({_VALUE})")
HELP = re.compile(rf"# HELP ({_NAME}) (?:[^\\\n]|\\[\\n])*")
TYPE = re.compile(rf"# TYPE ({_NAME}) (counter|gauge|histogram|summary|untyped)")


def strict_check(text: str) -> dict[str, str]:
    """Format 0.0.4, strictly: every line a HELP, TYPE or sample line; one
    HELP and one TYPE per family, before its samples; a family's samples
    together; histogram buckets cumulative, ending in +Inf equal to _count.
    The families' types."""
    assert text.endswith("\n") and "\n\n" not in text
    types: dict[str, str] = {}
    helped: set[str] = set()
    done: set[str] = set()
    current = ""
    buckets: dict[str, list[tuple[str, float]]] = {}
    counts: dict[str, float] = {}
    for line in text[:-1].split("\n"):
        if m := HELP.fullmatch(line):
            assert m.group(1) not in helped, line
            helped.add(m.group(1))
        elif m := TYPE.fullmatch(line):
            name = m.group(1)
            assert name not in types and name in helped, line
            if current:
                done.add(current)
            current, types[name] = name, m.group(2)
        else:
            m = SAMPLE.fullmatch(line)
            assert m, f"not a sample line: {line!r}"
            name, labels, value = m.group(1), m.group(2) or "", m.group(3)
            family = re.sub(r"_(bucket|sum|count)$", "", name) if types.get(current) == "histogram" else name
            assert family == current and family not in done, line
            if name.endswith("_bucket"):
                # le is the last label; a label value may itself hold ",}" or 'le="'
                # (only backslash, quote and newline are escaped), so cut at the end.
                le = re.search(r'(\{|,)le="([^"]*)"\}$', labels)
                assert le, line
                series = "" if le.group(1) == "{" else labels[: le.start()] + "}"
                buckets.setdefault(series, []).append((le.group(2), float(value)))
            elif name.endswith("_count") and types[current] == "histogram":
                counts[labels] = float(value)
    for series, seen in buckets.items():
        values = [v for _, v in seen]
        assert values == sorted(values) and seen[-1][0] == "+Inf", series
        les = [float(le) for le, _ in seen]
        assert les == sorted(les), series
        assert counts[series] == values[-1], series
    return types


def _gauges(**kw: object) -> t.HostGauges:
    base: dict[str, object] = {"sessions_open": 2, "commands_running": 1, "registry_workflows": 7,
                               "watcher_up": True, "start_time": 1700000000.5}  # fmt: skip
    return t.HostGauges(**{**base, **kw})  # type: ignore[arg-type]


def test_exposition_parses_and_numbers_match() -> None:
    stats = t.RequestStats()
    for seconds in (0.0004, 0.0007, 0.003, 0.003, 70.0):
        stats.observe("/v1/sessions/{sid}", "GET", 200, seconds)
    stats.observe("/v1/sessions/{sid}", "GET", 404, 0.001)
    stats.observe(t.UNMATCHED, "BREW", 404, 0.001)
    text = t.exposition(stats, _gauges())
    types = strict_check(text)
    assert types == {"kbd_up": "gauge", "kbd_build_info": "gauge", "kbd_start_time_seconds": "gauge",
                     "kbd_requests_total": "counter",
                     "kbd_request_duration_seconds": "histogram", "kbd_sessions_open": "gauge",
                     "kbd_commands_running": "gauge", "kbd_registry_workflows": "gauge",
                     "kbd_watcher_up": "gauge", **OPS_FAMILIES}  # fmt: skip
    families = {f.name: f for f in text_string_to_metric_families(text)}
    # The reference parser drops a counter's _total suffix from the family name.
    requests = {(s.labels["route"], s.labels["method"], s.labels["status"]): s.value
                for s in families["kbd_requests"].samples}  # fmt: skip
    assert requests == {("/v1/sessions/{sid}", "GET", "200"): 5, ("/v1/sessions/{sid}", "GET", "404"): 1,
                        ("unmatched", "other", "404"): 1}  # fmt: skip
    hist = {(s.name, s.labels.get("le")): s.value for s in families["kbd_request_duration_seconds"].samples
            if s.labels["route"] == "/v1/sessions/{sid}" and s.labels["status"] == "200"}  # fmt: skip
    assert hist[("kbd_request_duration_seconds_bucket", "0.0005")] == 1
    assert hist[("kbd_request_duration_seconds_bucket", "0.001")] == 2
    assert hist[("kbd_request_duration_seconds_bucket", "0.0025")] == 2
    assert hist[("kbd_request_duration_seconds_bucket", "0.005")] == 4
    assert hist[("kbd_request_duration_seconds_bucket", "60.0")] == 4
    assert hist[("kbd_request_duration_seconds_bucket", "+Inf")] == 5
    assert hist[("kbd_request_duration_seconds_count", None)] == 5
    assert math.isclose(hist[("kbd_request_duration_seconds_sum", None)], 70.0071)
    gauges = {name: families[name].samples[0].value for name in
              ("kbd_up", "kbd_sessions_open", "kbd_commands_running", "kbd_registry_workflows", "kbd_watcher_up",
               "kbd_start_time_seconds")}  # fmt: skip
    assert gauges == {"kbd_up": 1, "kbd_sessions_open": 2, "kbd_commands_running": 1, "kbd_registry_workflows": 7,
                      "kbd_watcher_up": 1, "kbd_start_time_seconds": 1700000000.5}  # fmt: skip


OPS_FAMILIES = {"kbd_exec_total": "counter", "kbd_exec_duration_seconds": "histogram",
                "kbd_refusals_total": "counter", "kbd_sandbox_setup_failures_total": "counter",
                "kbd_note_writes_total": "counter", "kbd_gate_refusals_total": "counter"}  # fmt: skip


def test_ops_stats_count_commands_refusals_and_audited_notes() -> None:
    ops = t.OpsStats()
    for klass, seconds in (
        ("ok", 0.02),
        ("ok", 0.02),
        ("failed", 3.0),
        ("signalled", 4000.0),
        ("refused", 0.005),
    ):
        ops.exec_ended(klass, seconds)
    for code in ("not-found", "not-found", "sandbox-setup", "grant-group-missing"):
        ops.refused(code)
    for record in ({"event": "note_written", "how": "write"}, {"event": "note_written", "how": "command"},
                   {"event": "note_written", "how": "write"}, {"event": "note_written", "how": "a b\n"},
                   {"event": "note_refused", "code": "injection-refused"},
                   {"event": "note_refused", "code": "quota-exceeded"}, {"event": "session_opened"}):  # fmt: skip
        ops.audited(record)
    before = ops.snapshot()
    ops.refused("busy")  # after the snapshot: not in it
    text = t.exposition(t.RequestStats(), _gauges(), before)
    assert strict_check(text).items() >= OPS_FAMILIES.items()
    fam = {f.name: f for f in text_string_to_metric_families(text)}
    assert {s.labels["exit_class"]: s.value for s in fam["kbd_exec"].samples} == {
        "ok": 2, "failed": 1, "signalled": 1, "refused": 1, "internal": 0}  # fmt: skip
    durations = {(s.name, s.labels["exit_class"], s.labels.get("le")): s.value
                 for s in fam["kbd_exec_duration_seconds"].samples}  # fmt: skip
    assert durations[("kbd_exec_duration_seconds_bucket", "ok", "0.025")] == 2
    assert durations[("kbd_exec_duration_seconds_bucket", "signalled", "3600.0")] == 0
    assert durations[("kbd_exec_duration_seconds_bucket", "signalled", "+Inf")] == 1
    assert durations[("kbd_exec_duration_seconds_count", "internal", None)] == 0
    assert {s.labels["code"]: s.value for s in fam["kbd_refusals"].samples} == {
        "not-found": 2, "sandbox-setup": 1, "grant-group-missing": 1}  # fmt: skip
    assert {s.labels["code"]: s.value for s in fam["kbd_sandbox_setup_failures"].samples} == {
        "sandbox-setup": 1, "grant-group-missing": 1}  # fmt: skip
    # A `how` that is not a plain word (the write path's own) is never a label of its own.
    assert {s.labels["how"]: s.value for s in fam["kbd_note_writes"].samples} == {
        "write": 2, "command": 1, "other": 1}  # fmt: skip
    assert fam["kbd_gate_refusals"].samples[0].value == 1
    assert ops.refusals["busy"] == 1 and "busy" not in before.refusals


@pytest.mark.parametrize(("status", "klass"), [(0, "ok"), (1, "failed"), (127, "failed"), (128, "failed"),
                                               (129, "signalled"), (137, "signalled"), (192, "signalled"),
                                               (193, "failed"), (255, "failed")])  # fmt: skip
def test_exit_class(status: int, klass: str) -> None:
    assert t.exit_class(status) == klass


def test_exposition_without_requests_or_watcher() -> None:
    text = t.exposition(t.RequestStats(), _gauges(watcher_up=None))
    types = strict_check(text)
    assert "kbd_watcher_up" not in types and "kbd_requests_total" in types
    assert "kbd_requests_total{" not in text


def test_bucket_boundary_is_inclusive() -> None:
    stats = t.RequestStats(buckets=(0.001, 0.01))
    stats.observe("r", "GET", 200, 0.001)
    stats.observe("r", "GET", 200, 0.0010001)
    assert stats.hist[("r", 200)] == [1, 1, 0]


@given(st.text())
def test_label_values_survive_the_reference_parser(value: str) -> None:
    stats = t.RequestStats()
    stats.observe(value, "GET", 200, 0.001)
    text = t.exposition(stats, _gauges())
    strict_check(text)
    [family] = [f for f in text_string_to_metric_families(text) if f.name == "kbd_requests"]
    assert family.samples[0].labels["route"] == value


def test_label_escapes() -> None:
    assert t.escape_label('a\\b"c\nd') == 'a\\\\b\\"c\\nd'
    assert t.escape_help("x\\y\nz") == "x\\\\y\\nz"


def test_numbers() -> None:
    assert [t.number(v) for v in (1.0, 0.5, float("inf"), float("-inf"), 3)] == [
        "1",
        "0.5",
        "+Inf",
        "-Inf",
        "3",
    ]
    assert t.number(float("nan")) == "NaN"


def test_snapshot_is_a_copy() -> None:
    stats = t.RequestStats()
    stats.observe("r", "GET", 200, 0.001)
    snap = stats.snapshot()
    stats.observe("r", "GET", 200, 0.001)
    assert snap.counts == {("r", "GET", 200): 1} and snap.hist[("r", 200)][1] == 1
    assert stats.counts == {("r", "GET", 200): 2}


# -- which answer ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fmt", "accept", "expected"),
    [
        (None, None, False),
        (None, "*/*", False),
        (None, "application/json", False),
        (None, "text/plain", True),
        (None, "text/plain;version=0.0.4", True),
        # What Prometheus 2.x sends.
        (
            None,
            "application/openmetrics-text;version=1.0.0;q=0.5,application/openmetrics-text;version=0.0.1;"
            "q=0.4,text/plain;version=0.0.4;q=0.3,*/*;q=0.2",
            True,
        ),
        (None, "application/json, text/plain", False),
        (None, "application/json;q=0.5, text/plain", True),
        (None, "text/plain;q=0", False),
        ("prometheus", "application/json", True),
        ("json", "text/plain", False),
    ],
)
def test_wants_prometheus(fmt: str | None, accept: str | None, expected: bool) -> None:
    assert t.wants_prometheus(fmt, accept) is expected


def test_bad_format_is_a_usage_error_naming_the_field() -> None:
    with pytest.raises(UsageError, match="format must be 'json' or 'prometheus', not 'xml'"):
        t.wants_prometheus("xml", None)

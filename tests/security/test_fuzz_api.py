"""No input makes the daemon answer 5xx (docs/api.md "Malformed requests"): every route, as
the running daemon's own ``/openapi.json`` lists it (a new route is covered
without touching this file), is called over the real Unix socket with
malformed and hostile values in each of its path, query and body fields and in
the headers routes read, and with bodies that are not JSON, not UTF-8 or not
an object. Every answer must be below 500 and, when it is an error, the
contract's envelope ``{"error": {"code", "message", "hint"}}``; the daemon
must log no traceback.

Two passes over one daemon: every field of every route with each value of
:data:`MALFORMED` (deterministic: the proof that each field's decoder is
covered), then hypothesis drawing whole requests per route, its example count
scaled from the loaded profile (tests/conftest.py: ``ci`` in CI, ``nightly``
for long runs). ``GET /v1/events`` is always asked with ``follow=false``: a
followed feed never ends by design (tests/integration/test_change_feed.py).
"""

from __future__ import annotations

import base64
import itertools
import json
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kbd.state.sessions import new_session_id
from tests.helpers import KbRoot
from tests.integration.daemon import Daemon, issue_tokens, serving

# Headers routes read themselves (not declared in the schema).
HEADERS = ("if-match", "last-event-id", "accept")
VERSION = "sha256:" + "0" * 64

#: One hostile value of every kind a decoder meets: non-ASCII and non-BMP text,
#: a lone surrogate (valid JSON, not encodable as UTF-8), NUL, control and
#: bidi characters, integers past every range and past Python's digit limit
#: for int(), floats, and values of the wrong JSON type.
MALFORMED: tuple[Any, ...] = (
    "é",
    "ü==",
    "\ud800",
    "a\udfffb",
    "\x00",
    "x\x00.md",
    "\u202e\n\t",
    "\U0001d518\U0001d52b\U0001d526",  # outside the BMP
    "9" * 5000,
    "-1",
    "",
    "../../../etc/passwd",
    "%2F",
    " ",
    10**5000,
    -(2**63) - 1,
    1e308,
    True,
    None,
    [],
    {"a": {"b": []}},
)
#: Bodies that are not the JSON object a route takes.
RAW_BODIES: tuple[bytes, ...] = (
    b"",
    b"{",
    b"\xff\xfe{}",
    b'{"a": "\xff"}',
    b"[]",
    b"null",
    b'"x"',
    b"[" * 100_000 + b"]" * 100_000,
    b'{"a": 1, "a": 2}',
    b"NaN",
    b"\x00",
)


@dataclass
class Route:
    method: str
    template: str
    path_params: tuple[str, ...]
    query: Mapping[str, dict[str, Any]]  # name → schema
    body: dict[str, Any] | None  # the resolved schema of the JSON body


@dataclass
class World:
    kb: KbRoot
    daemon: Daemon
    tokens: dict[str, str]
    sid: str  # alice's session on con
    bobs: str  # bob's session on hidden: alice may not see it
    routes: list[Route]
    schemas: dict[str, Any]
    clients: dict[str | None, httpx.Client]


def _resolve(schema: dict[str, Any], schemas: Mapping[str, Any]) -> dict[str, Any]:
    ref = schema.get("$ref")
    if isinstance(ref, str):
        resolved: dict[str, Any] = schemas[ref.rsplit("/", 1)[-1]]
        return resolved
    return schema


def routes_of(doc: Mapping[str, Any]) -> list[Route]:
    """Every (method, path) the daemon's own schema lists, with its fields."""
    schemas = doc["components"]["schemas"]
    out = []
    for template, ops in sorted(doc["paths"].items()):
        for method, op in sorted(ops.items()):
            params = op.get("parameters", [])
            body = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
            out.append(Route(
                method.upper(), template,
                tuple(p["name"] for p in params if p["in"] == "path"),
                {p["name"]: p.get("schema", {}) for p in params if p["in"] == "query"},
                None if body is None else _resolve(body, schemas),
            ))  # fmt: skip
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    """``src`` (owner bob, reader alice; ``con`` may write its notes), ``con``
    (owner alice) attaching it for writing, ``hidden`` (bob's alone: alice and
    dave cannot see it), an open session of alice's on ``con`` and one of
    bob's on ``hidden``. Values the fuzz draws name these, so requests get
    past "not found" into each route."""
    base = tmp_path_factory.mktemp("fuzz")
    kb = KbRoot.create(base / "root")
    kb.workflow("src", access={"owners": ["bob"], "readers": ["alice"], "allowed_kb_writers": ["con"]})
    kb.workflow("con", access={"owners": ["alice"]}, sources=[{"workflow_id": "src", "alias": "src",
                                                                "access": "write"}])  # fmt: skip
    kb.workflow("hidden", access={"owners": ["bob"]})
    sid = kb.open_session("con", kind="execution", kb_access="read-write", actor="alice")
    bobs = kb.open_session("hidden", kind="builder", kb_access="read", actor="bob")
    tokens = issue_tokens(kb.root, ["ops", "alice", "dave"])
    limit = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)  # to send integers past the limit the daemon's int() has
    try:
        with serving(kb.root, home=base / "home") as daemon:
            doc = daemon.client().get("/openapi.json").json()
            clients: dict[str | None, httpx.Client] = {None: daemon.client()}
            for pid, token in tokens.items():
                clients[pid] = daemon.client(token)
            yield World(kb, daemon, tokens, sid, bobs, routes_of(doc), doc["components"]["schemas"], clients)
    finally:
        sys.set_int_max_str_digits(limit)


# -- values ---------------------------------------------------------------------------


def plausible(world: World, name: str) -> list[Any]:
    """Values that get a field past its decoder: real names, a note path, base64, a version."""
    ids = ["src", "con", "hidden", "nope", world.sid, "s_0000", "alice", "carol", "ops"]
    by_name: dict[str, list[Any]] = {
        "path": ["notes/x.md", "x.md", "notes/fact.md", "context/a.md", ""],
        "content": ["hello\n"],
        "content_base64": [base64.b64encode(b"# T\nhello\n").decode(), "aGk="],
        "version": [VERSION], "expected_version": [VERSION, "none"], "against": [VERSION],
        "since": ["0a1b2c3d-1"], "access": ["read", "write"], "mode": ["read", "write"],
        "decision": ["approve", "reject"], "kind": ["builder", "execution", "user"],
        "kb_access": ["read", "read-write", "none"], "q": ["fact", "x AND y"], "limit": ["1", "5"],
        "format": ["prometheus", "json"], "follow": ["false"], "after": ["a.md"], "offset": ["0", "5"],
        "rid": ["1"], "action": ["enable", "disable", "remove", "token"], "uid": [4242], "login": ["root"],
        "documents": [[{"file": "a.md", "content_base64": "IyBUCg=="}]], "sources": [[]], "folder": ["docs"],
        "skipped": [[]], "pid": ["carol", "bob"],
    }  # fmt: skip
    return by_name.get(name, ids)


def value_for(world: World, name: str, schema: Mapping[str, Any]) -> st.SearchStrategy[Any]:
    """A field's value: plausible for its name or schema, or hostile."""
    resolved = _resolve(dict(schema), world.schemas)
    shaped: list[st.SearchStrategy[Any]] = [st.sampled_from(plausible(world, name))]
    if resolved.get("type") == "array" and isinstance(resolved.get("items"), dict):
        item = _resolve(resolved["items"], world.schemas)
        if item.get("type") == "object":
            shaped.append(st.lists(object_for(world, item), max_size=3))
    if resolved.get("type") == "object" and "properties" in resolved:
        shaped.append(object_for(world, resolved))
    hostile = st.one_of(st.sampled_from(MALFORMED), st.text(max_size=20), st.integers(), st.floats())
    return st.one_of(*shaped, hostile)


def object_for(world: World, schema: Mapping[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    props: dict[str, Any] = schema.get("properties", {})
    required = set(schema.get("required", []))
    return st.fixed_dictionaries(
        {k: value_for(world, k, v) for k, v in props.items() if k in required},
        optional={k: value_for(world, k, v) for k, v in props.items() if k not in required},
    )


# -- requests -------------------------------------------------------------------------


def text_of(value: Any) -> str:
    """A path or query value as text: JSON for anything that is not a string."""
    return value if isinstance(value, str) else json.dumps(value)


def encode(value: Any) -> str:
    # surrogatepass: a lone surrogate arrives as the bytes that are not UTF-8.
    return quote(text_of(value).encode("utf-8", "surrogatepass"), safe="")


@dataclass
class Request:
    route: Route
    who: str | None
    path: Mapping[str, Any]
    query: Mapping[str, Any]
    headers: Mapping[str, bytes]
    body: bytes | None

    def send(self, world: World) -> httpx.Response:
        url = self.route.template
        for name in self.route.path_params:
            url = url.replace("{" + name + "}", encode(self.path[name]))
        query = dict(self.query)
        if self.route.template == "/v1/events":
            query["follow"] = "false"  # a followed feed never ends
        if query:
            url += "?" + "&".join(f"{encode(k)}={encode(v)}" for k, v in query.items())
        headers: dict[bytes, bytes] = {k.encode(): v for k, v in self.headers.items()}
        if self.body is not None:
            headers[b"content-type"] = b"application/json"
        return world.clients[self.who].request(self.route.method, url, content=self.body, headers=headers)


def header_bytes(raw: bytes) -> bytes:
    """``raw`` as a header value HTTP can carry (h11 sends no control byte and
    no surrounding blank); bytes past ASCII stay."""
    return bytes(b for b in raw if b >= 0x20 and b != 0x7F).strip(b" ")[:4000]


def body_bytes(value: Any) -> bytes:
    # ensure_ascii: lone surrogates go out as \ud800 escapes (valid JSON, invalid once decoded).
    return json.dumps(value, ensure_ascii=True).encode()


def check(world: World, request: Request) -> None:
    r = request.send(world)
    where = (request.route.method, request.route.template, request.who, request.path, request.query,
             request.headers, (request.body or b"")[:300])  # fmt: skip
    assert r.status_code < 500, (where, r.status_code, r.text[:500])
    if r.status_code >= 400:
        doc = r.json()
        assert set(doc) == {"error"} and set(doc["error"]) == {"code", "message", "hint"}, (where, doc)
        assert all(isinstance(v, str) and v for v in doc["error"].values()), (where, doc)
        assert str(world.kb.root) not in r.text, (where, r.text)


def plain(world: World, route: Route) -> Request:
    """A request with a plausible value in every field (the first of each)."""
    path = {n: plausible(world, n)[0] for n in route.path_params}
    query = {n: plausible(world, n)[0] for n in route.query}
    body = None
    if route.body is not None:
        props = route.body.get("properties", {})
        body = body_bytes(
            {k: plausible(world, k)[0] for k in props if k in set(route.body.get("required", []))}
        )
    return Request(route, "ops", path, query, {}, body)


def test_the_schema_lists_routes_with_bodies_and_queries(world: World) -> None:
    """The enumeration sees what the fuzz must cover (a schema change that hid
    the fields would otherwise make the passes below vacuous)."""
    by = {(r.method, r.template): r for r in world.routes}
    assert len(by) >= 40
    assert by[("POST", "/v1/sessions/{sid}/notes")].body is not None
    assert by[("POST", "/v1/workflows/{wid}/import")].body is not None
    assert "limit" in by[("GET", "/v1/sessions/{sid}/search")].query


def test_each_field_of_each_route_with_each_malformed_value(world: World) -> None:
    for route in world.routes:
        base = plain(world, route)
        for name, value in itertools.product(route.path_params, MALFORMED):
            check(world, Request(route, "ops", {**base.path, name: value}, base.query, {}, base.body))
        for name, value in itertools.product(route.query, MALFORMED):
            check(world, Request(route, "ops", base.path, {**base.query, name: value}, {}, base.body))
        for value in MALFORMED:  # each route reads at most one of them: all at once
            raw = header_bytes(text_of(value).encode("utf-8", "surrogatepass"))
            check(world, Request(route, "ops", base.path, base.query, dict.fromkeys(HEADERS, raw), base.body))
        if route.body is None:
            continue
        fields = json.loads(base.body or b"{}")
        for name, value in itertools.product(route.body.get("properties", {}), MALFORMED):
            check(
                world, Request(route, "ops", base.path, base.query, {}, body_bytes({**fields, name: value}))
            )
        for raw in RAW_BODIES:
            check(world, Request(route, "ops", base.path, base.query, {}, raw))


#: What a malformed field is, for the comparison below (one of each kind of decoder's failure).
ORACLE_PROBES: tuple[Any, ...] = ("é", "\ud800", "x\x00.md", "9" * 5000, 10**5000, {"a": []})


def test_a_malformed_request_says_nothing_about_what_it_names(world: World) -> None:
    """For every route that names a workflow or a session, every malformed
    body or query field gets the same answer for one alice may not see (bob's
    ``hidden``, bob's session) as for one that does not exist: decoding comes
    before any lookup, and a lookup alice fails answers as for a missing one
    (docs/api.md "Malformed requests")."""
    missing = {"wid": "nope", "sid": new_session_id()}
    hidden = {"wid": "hidden", "sid": world.bobs}
    compared = 0
    for route in world.routes:
        named = [n for n in route.path_params if n in missing]
        props = (route.body or {}).get("properties", {})
        # A session named in the body (a child's parent) too; a workflow ID in a
        # body names a new workflow or a source, whose existence is not secret.
        parent = "parent" in props
        if not named and not parent:
            continue
        base = plain(world, route)
        fields = json.loads(base.body or b"{}")
        probes: list[tuple[Mapping[str, Any], dict[str, Any] | bytes | None]] = [
            ({**base.query, n: v}, fields if route.body is not None else None)
            for n in route.query for v in ORACLE_PROBES
        ]  # fmt: skip
        if route.body is not None:
            probes += [(base.query, {**fields, n: v}) for n in props for v in ORACLE_PROBES if n != "parent"]
            probes += [(base.query, raw) for raw in RAW_BODIES[:4]]
        for query, body in probes:
            answers = set()
            for target in (hidden, missing):
                path = {**base.path, **{n: target[n] for n in named}}
                sent: bytes | None = (
                    body
                    if not isinstance(body, dict)
                    else body_bytes({**body, "parent": target["sid"]} if parent else body)
                )
                r = Request(route, "alice", path, query, {}, sent).send(world)
                assert r.status_code < 500, (route.template, query, sent, r.text[:300])
                text = r.text
                for name in {*named, *(["sid"] if parent else [])}:
                    text = text.replace(target[name], "<named>")
                answers.add((r.status_code, text))
            assert len(answers) == 1, (route.method, route.template, query, str(body)[:200], answers)
            compared += 1
    assert compared > 100


def drawn(world: World, route: Route) -> st.SearchStrategy[Request]:
    """A whole request to ``route``: who asks, each path value, which query
    values and headers are sent and what they hold, a body (plausible or
    hostile fields, now and then raw bytes that are not one)."""

    @st.composite
    def build(draw: st.DrawFn) -> Request:
        who = draw(st.sampled_from([None, "ops", "alice", "dave"]), label="who")
        path = {n: draw(value_for(world, n, {"type": "string"}), label=n) for n in route.path_params}
        query = {
            n: draw(value_for(world, n, schema), label=n)
            for n, schema in route.query.items()
            if draw(st.booleans(), label=f"send {n}")
        }
        headers = {
            h: draw(st.binary(max_size=40).map(header_bytes), label=h)
            for h in HEADERS
            if draw(st.booleans(), label=f"send {h}")
        }
        body: bytes | None = None
        if route.body is not None:
            if draw(st.integers(0, 5), label="raw body?") == 0:
                body = draw(st.sampled_from(RAW_BODIES), label="raw body")
            else:
                body = body_bytes(draw(object_for(world, route.body), label="body"))
        return Request(route, who, path, query, headers, body)

    return build()


def test_hypothesis_drawn_requests_to_every_route(world: World) -> None:
    profile = settings.default
    assert profile is not None
    per_route = max(4, profile.max_examples // 25)  # ci: 8 a route; nightly: 200
    for route in world.routes:

        @settings(max_examples=per_route)
        @given(request=drawn(world, route))
        def one(request: Request) -> None:
            check(world, request)

        one()

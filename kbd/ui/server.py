"""The Knowledge page's server (docs/knowledge-page.md): assets and a JSON API on 127.0.0.1.

Every ``/api/*`` route is ONE :class:`kbd.ops.Op`, run through the backend
the CLI chose (on the root, or through the daemon) as the one principal
resolved when ``kbd ui`` started: the page can do exactly what that principal
could do with the CLI, and the operation re-checks every action. Refusals are
the daemon API's envelope and status (:func:`kbd.errors.http_answer`).

What reaches a route has passed :class:`Guard` first (outermost): the ``Host``
check, the cookie, and for changes the CSRF token and ``Origin``
(:mod:`kbd.ui.security` decides), and every answer leaves with the security
headers, whatever produced it.

The search runs in a read-only reviewer session (docs/sessions.md: a reader may open
reviewer kinds only) that the page opens per workflow on first use and closes
when the server stops (:class:`SearchSessions`).

The change feed (``/api/events``): through the daemon, its ``/v1/events``
relayed (it filters for the connection's principal); directly on the root, the
root's shared ``state/events.log`` followed in process with the daemon's own
visibility rule (:class:`kbd.service.changefeed.Feed`). Manifest events
(a detach, a hand edit of workflow.json) are written to that log by a running
daemon's watcher only, so without a daemon the page is told ``live: false``
and shows it (never silently stale); the stream says ``resync`` when a daemon
starts or stops meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.resources
import logging
import os
import re
import socket
import sys
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

import anyio
import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kbd import ops
from kbd.core.principals import Principal
from kbd.core.records import Record
from kbd.errors import InvalidInput, KbdError, NotFound, SessionClosed, Unavailable, http_answer
from kbd.ui import security

R = TypeVar("R", bound=Record)

if TYPE_CHECKING:
    from kbd.service import JsonObject
    from kbd.service.changefeed import Feed
    from kbd.service.search import SearchResult
    from kbd.service.workflows import WorkflowDetail


log = logging.getLogger("kbd.ui")

#: The session kind the search opens: read-only, and one a reader may open (docs/sessions.md).
SEARCH_KIND = "reviewer_strategic"
#: How often a direct-mode stream checks whether a daemon (the source of manifest events) runs.
LIVE_CHECK_INTERVAL = 2.0
#: EventSource reconnects this soon (ms) after a stream ends.
SSE_RETRY_MS = 500
#: ... and this late after the daemon refused the feed.
REFUSED_RETRY_MS = 15_000
MAX_BODY = 64 * 1024
GRACEFUL_SHUTDOWN = 2


# -- the page's state ------------------------------------------------------------------------


class TokenGate:
    """The one-time token and what it is exchanged for (one cookie, one CSRF token)."""

    def __init__(self) -> None:
        self.token = security.new_secret()
        self.csrf = security.new_secret()
        self.cookie: str | None = None  # None until the token is used
        self._mutex = threading.Lock()

    def exchange(self, given: str | None) -> str | None:
        """The cookie for a valid, unused token; None otherwise (the token works once)."""
        with self._mutex:
            if self.cookie is not None or not security.same(given, self.token):
                return None
            self.cookie = security.new_secret()
            return self.cookie


@dataclass
class Page:
    """One ``kbd ui`` server: who acts, through which backend, and its secrets."""

    via: ops.Backend
    principal: str
    workflow: str | None
    port: int = 0
    root: Path | None = None  # direct mode: the root (its event log, its daemon's socket)
    gate: TokenGate = field(default_factory=TokenGate)
    # Direct mode: Root and registry are not thread-safe (the daemon's state lock, here).
    lock: threading.RLock = field(default_factory=threading.RLock)
    stopping: asyncio.Event | None = None
    feed: Feed | None = None  # direct mode: the event log's follower (see _direct_feed)

    @property
    def mode(self) -> str:
        return "daemon" if isinstance(self.via, ops.Remote) else "direct"

    @property
    def as_(self) -> str | None:
        # On the root: every Op names the principal (as `--as P` would); through
        # the daemon the connection is the principal, and --as may not differ.
        return self.principal if isinstance(self.via, ops.Direct) else None

    def run(self, op: ops.Op[R]) -> R:
        """One operation as the page's principal (a worker thread)."""
        if isinstance(self.via, ops.Direct):
            with self.lock:
                # As the daemon does per request: a principal disabled since start-up is refused now.
                self.via.context.root.refresh()
                return self.via.run(op, as_=self.as_)
        return self.via.run(op, as_=self.as_)

    def live(self) -> bool:
        """Are manifest changes (hand edits included) reaching the feed now?"""
        if isinstance(self.via, ops.Remote):
            return True  # the daemon's feed, fed by its watcher
        return self.root is not None and ops.reachable(ops.socket_of(self.root))

    def url(self) -> str:
        return f"{security.origin_of(self.port)}/?token={self.gate.token}"


class SearchSessions:
    """The read-only sessions the search runs in: one per workflow, opened on
    first use as the page's principal, reused, closed by :meth:`close_all`."""

    def __init__(self, page: Page) -> None:
        self.page = page
        self._sids: dict[str, str] = {}
        self._mutex = threading.Lock()

    @property
    def open_ids(self) -> list[str]:
        with self._mutex:
            return list(self._sids.values())

    def _sid(self, wid: str) -> str:
        with self._mutex:
            sid = self._sids.get(wid)
            if sid is None:
                plan = self.page.run(ops.SessionOpen(wid, SEARCH_KIND, "read", None, None))
                if plan.session_id is None:
                    raise AssertionError("an opened session's plan names its session")
                sid = self._sids[wid] = plan.session_id
            return sid

    def search(
        self,
        wid: str,
        query: str,
        aliases: tuple[str, ...],
        limit: int | None,
        include_unreviewed: bool = False,
    ) -> SearchResult:
        for attempt in (1, 2):
            sid = self._sid(wid)
            try:
                return self.page.run(ops.Search(sid, query, aliases, limit, include_unreviewed))
            except (SessionClosed, NotFound) as err:
                # Closed or gone behind our back (`kbd session close`): open a new one, once.
                if attempt == 2 or not self._forget(wid, sid, err):
                    raise
        raise AssertionError("unreachable")

    def _forget(self, wid: str, sid: str, err: KbdError) -> bool:
        # Only the session itself gone (not-found); a workflow that is gone stays an error.
        if isinstance(err, NotFound) and err.code != "not-found":
            return False
        with self._mutex:
            if self._sids.get(wid) == sid:
                del self._sids[wid]
        return True

    def close_all(self) -> list[str]:
        """Close every session this page opened; the IDs closed (failures logged)."""
        with self._mutex:
            sids, self._sids = list(self._sids.values()), {}
        closed = []
        for sid in sids:
            try:
                self.page.run(ops.SessionClose(sid))
                closed.append(sid)
            except KbdError as err:
                print(f"kbd ui: could not close search session {sid}: {err.message}", file=sys.stderr)
        return closed


# -- the guard (outermost) ---------------------------------------------------------------------


def _refusal_response(refusal: security.Refusal, *, api: bool) -> Response:
    if api:
        body = {"error": {"code": refusal.code, "message": refusal.message, "hint": refusal.hint}}
        return JSONResponse(body, status_code=403)
    html = (
        "<!doctype html><html lang=en><head><meta charset=utf-8><title>kbd ui</title></head><body>"
        f"<h1>Refused</h1><p>{_html_text(refusal.message)}.</p><p>{_html_text(refusal.hint)}.</p></body></html>"
    )
    return Response(html, status_code=403, media_type="text/html; charset=utf-8")


def _html_text(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key == name:
            return str(value.decode("latin-1"))
    return None


class Guard:
    """Every request: the Host first (else 403 ``ui-host``, assets included);
    ``/api/*`` the cookie, and for changes the CSRF token and Origin. Every
    answer gets :data:`kbd.ui.security.HEADERS` (``/api/*`` also no-store)."""

    def __init__(self, app: ASGIApp, page: Page) -> None:
        self.app = app
        self.page = page

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = str(scope.get("path", ""))
        api = path == "/api" or path.startswith("/api/")
        extra = security.HEADERS + (security.API_HEADERS if api else ())

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                names = {k.encode() for k, _ in extra}
                kept = [(k, v) for k, v in message.get("headers", []) if bytes(k).lower() not in names]
                message["headers"] = kept + [(k.encode(), v.encode()) for k, v in extra]
            await send(message)

        refusal = self._refusal(scope, api)
        if refusal is not None:
            await _refusal_response(refusal, api=api)(scope, receive, send_with_headers)
            return
        raw = scope.get("raw_path") or b""
        if b"%2f" in raw.lower() or b"%5c" in raw.lower():
            # Routing sees the decoded path: an encoded '/' would reach another route (as in the daemon).
            err = NotFound("no name here contains '/' or '\\'", hint="check the name")
            await _error(err)(scope, receive, send_with_headers)
            return
        await self.app(scope, receive, send_with_headers)

    def _refusal(self, scope: Scope, api: bool) -> security.Refusal | None:
        if not security.host_ok(_header(scope, b"host"), self.page.port):
            return security.WRONG_HOST
        if not security.peer_ok(_peer_uid(scope, self.page.port), os.getuid()):
            return security.OTHER_USER
        if not api:
            return None
        return security.check_api(
            str(scope.get("method", "GET")),
            cookie=security.cookie_from(_header(scope, b"cookie"), self.page.port),
            session_cookie=self.page.gate.cookie,
            csrf=_header(scope, security.CSRF_HEADER.encode()),
            session_csrf=self.page.gate.csrf,
            origin=_header(scope, b"origin"),
            port=self.page.port,
        )


def _peer_uid(scope: Scope, port: int) -> int | None:
    """Who holds the client end of this connection (None: not known: refused)."""
    client = scope.get("client")
    if not client:
        return None
    try:
        table = Path("/proc/net/tcp").read_text(encoding="ascii", errors="replace")
    except OSError:
        return None
    return security.peer_uid(table, (str(client[0]), int(client[1])), port)


# -- answers -------------------------------------------------------------------------------------


def _error(err: KbdError) -> JSONResponse:
    status, envelope, headers = http_answer(err)
    return JSONResponse(envelope, status_code=status, headers=headers)


def _json(data: JsonObject) -> Response:
    return Response(orjson.dumps(data), media_type="application/json")


def _api(fn: Callable[[Request], Record | JsonObject]) -> Callable[[Request], Any]:
    """A route answering ``fn(request)`` (run on a worker thread: Ops block) as JSON, or its refusal."""

    async def endpoint(request: Request) -> Response:
        body: object = None
        if request.method in ("POST", "PUT", "PATCH"):
            raw = await request.body()
            if len(raw) > MAX_BODY:
                return _error(InvalidInput(f"request body over {MAX_BODY} bytes"))
            try:  # orjson refuses what is not UTF-8, lone surrogates, nesting past 1,024, numbers it cannot hold
                body = orjson.loads(raw) if raw else {}
            except orjson.JSONDecodeError as exc:
                return _error(InvalidInput(f"the request body is not JSON ({str(exc)[:200]})",
                                           hint="send one JSON object, in UTF-8"))  # fmt: skip
        request.state.body = body
        try:
            answer = await run_in_threadpool(fn, request)
            return _json(answer.to_json() if isinstance(answer, Record) else answer)
        except KbdError as err:
            return _error(err)
        except Exception:  # never a traceback or a host path to the page
            log.exception("kbd ui: internal error in %s %s", request.method, request.url.path)
            return _error(KbdError("an internal error occurred in kbd ui"))

    return endpoint


def body_fields(
    body: object, required: dict[str, type], optional: dict[str, type] | None = None
) -> dict[str, Any]:
    """The JSON object ``body``'s fields, each checked: present when required,
    of its type, and nothing unknown (the error names the field)."""
    optional = optional or {}
    if not isinstance(body, dict):
        raise InvalidInput("the request body must be a JSON object")
    if unknown := sorted(set(body) - set(required) - set(optional)):
        allowed = ", ".join(sorted({*required, *optional}))
        raise InvalidInput(f"unknown field(s) {', '.join(unknown)}", hint=f"allowed: {allowed}")
    out: dict[str, Any] = {}
    for name, kind in {**required, **optional}.items():
        if name not in body or body[name] is None:
            if name in required:
                raise InvalidInput(f"field {name!r} is required")
            continue
        if not isinstance(body[name], kind) or isinstance(body[name], bool) != (kind is bool):
            raise InvalidInput(f"field {name!r} must be a {kind.__name__}, not {type(body[name]).__name__}")
        out[name] = body[name]
    return out


def _param(request: Request, name: str) -> str:
    return str(request.path_params[name])


def _flag(value: str | None, name: str) -> bool:
    """A yes/no query parameter: absent or ``false`` is no, ``true`` is yes."""
    if value in (None, "", "false"):
        return False
    if value == "true":
        return True
    raise InvalidInput(f"{name} must be true or false, not {value[:40]!r}")


def _limit(value: str | None, name: str = "limit") -> int | None:
    """A query value as a whole number (the operation checks its range). At
    most 9 digits: int() refuses thousands of them with a ValueError, and no
    limit is that large."""
    if value is None or value == "":
        return None
    if not (value.isascii() and value.isdigit()) or len(value.lstrip("0")) > 9:
        raise InvalidInput(f"{name} must be a whole number (digits only, at most 9), not {value[:40]!r}")
    return int(value)


# -- the application ---------------------------------------------------------------------------


def assets_dir() -> Path:
    return Path(str(importlib.resources.files("kbd.ui") / "assets"))


def create_app(page: Page) -> ASGIApp:
    searches = SearchSessions(page)

    async def index(request: Request) -> Response:
        token = request.query_params.get("token")
        if token is not None:
            cookie = page.gate.exchange(token)
            if cookie is None:
                return _refusal_response(security.BAD_TOKEN, api=False)
            # The token leaves the address bar (and history) at once.
            return RedirectResponse(
                "/", status_code=303, headers={"set-cookie": security.cookie_header(cookie, page.port)}
            )
        given = security.cookie_from(request.headers.get("cookie"), page.port)
        if not security.same(given, page.gate.cookie):
            return _refusal_response(security.NO_COOKIE, api=False)
        return _asset_response("index.html")

    async def asset(request: Request) -> Response:
        return _asset_response(_param(request, "name"))

    def me(_: Request) -> JsonObject:
        return {"principal": page.principal, "csrf": page.gate.csrf, "workflow": page.workflow,
                "live": page.live(), "mode": page.mode}  # fmt: skip

    def workflows(_: Request) -> Record:
        return page.run(ops.WorkflowsList())

    def workflow(r: Request) -> JsonObject:
        shown = page.run(ops.WorkflowShow(_param(r, "wid")))
        return {**shown.to_json(), "rights": rights(shown)}

    def sources(r: Request) -> Record:
        if r.method == "POST":
            f = body_fields(r.state.body, {"workflow_id": str, "alias": str}, {"access": str})
            return page.run(
                ops.Attach(_param(r, "wid"), f["workflow_id"], f["alias"], f.get("access", "read"))
            )
        return page.run(ops.SourcesList(_param(r, "wid")))

    def source(r: Request) -> Record:
        wid, alias = _param(r, "wid"), _param(r, "alias")
        if r.method == "PATCH":
            f = body_fields(r.state.body, {"access": str}, {"expected_version": str})
            return _maybe_dry(r, ops.SetAccess(wid, alias, f["access"], f.get("expected_version")))
        return _maybe_dry(r, ops.Detach(wid, alias))

    def _maybe_dry(r: Request, op: ops.Op[Record]) -> Record:
        """``?dry_run=true``: the preview of ``op`` (docs/access.md "Previews"), shown in the page's
        confirmations; else ``op`` itself."""
        if _flag(r.query_params.get("dry_run"), "dry_run"):
            return page.run(ops.DryRun(op))
        return page.run(op)

    def why_attach(r: Request) -> Record:
        access = r.query_params.get("access", "read")
        return page.run(ops.WhyAttach(_param(r, "wid"), r.query_params.get("source", ""), access))

    def requests_(r: Request) -> Record:
        if r.method == "POST":
            f = body_fields(
                r.state.body, {"kind": str, "workflow_id": str, "consumer": str}, {"message": str}
            )
            return page.run(ops.RequestOpen(f["kind"], f["workflow_id"], f["consumer"], f.get("message")))
        return page.run(ops.RequestsList())

    def decision(r: Request) -> Record:
        f = body_fields(r.state.body, {"decision": str}, {"message": str})
        if f["decision"] not in ("approve", "decline"):
            raise InvalidInput(f"field 'decision' must be 'approve' or 'decline', not {f['decision'][:40]!r}")
        try:
            rid = int(_param(r, "rid"))
        except ValueError:
            raise InvalidInput("the request ID must be a number") from None
        return page.run(ops.RequestDecide(rid, f["decision"], f.get("message")))

    def candidates(r: Request) -> Record:
        return page.run(ops.Candidates(_param(r, "wid")))

    def writers(r: Request) -> Record:
        if r.method == "POST":
            f = body_fields(r.state.body, {"workflow_id": str})
            return page.run(ops.Grant(_param(r, "wid"), f["workflow_id"]))
        return page.run(ops.WritersList(_param(r, "wid")))

    def writer(r: Request) -> Record:
        return _maybe_dry(r, ops.Revoke(_param(r, "wid"), _param(r, "consumer")))

    def pending(r: Request) -> Record:
        return page.run(ops.NotesPending(_param(r, "wid")))

    def review(r: Request) -> Record:
        f = body_fields(r.state.body, {"path": str, "decision": str}, {"expected_version": str})
        decision = f["decision"]
        if decision != "approve" and decision != "reject":
            raise InvalidInput(f"field 'decision' must be 'approve' or 'reject', not {decision[:40]!r}")
        return page.run(ops.NotesReview(_param(r, "wid"), f["path"], decision, f.get("expected_version")))

    def rejected(r: Request) -> Record:
        return page.run(ops.NotesRejected(_param(r, "wid")))

    def unreject(r: Request) -> Record:
        number = _limit(_param(r, "rid"), "rejected id")
        if number is None:
            raise InvalidInput("the rejected note's id must be a whole number")
        return page.run(ops.NotesUnreject(_param(r, "wid"), number))

    def note_history(r: Request) -> Record:
        return page.run(ops.NoteLog(_param(r, "wid"), r.query_params.get("path", "")))

    def note_diff(r: Request) -> Record:
        q = r.query_params
        return page.run(ops.NoteDiff(_param(r, "wid"), q.get("path", ""), q.get("version") or None,
                                     q.get("against") or None))  # fmt: skip

    async def favicon(_: Request) -> Response:
        # The page names its icon (index.html); a browser that asks for the
        # conventional name anyway gets it too, never a 404 in its console.
        return _asset_response("icon.svg")

    def own_dir(r: Request) -> Record:
        q = r.query_params
        return page.run(
            ops.OwnLs(_param(r, "wid"), q.get("path", ""), _limit(q.get("limit")), q.get("after"))
        )

    def own_file(r: Request) -> Record:
        if r.method == "PUT":
            f = body_fields(r.state.body, {"path": str, "content": str}, {"expected_version": str})
            return page.run(
                ops.OwnWrite(_param(r, "wid"), f["path"], f["content"], f.get("expected_version"))
            )
        return page.run(ops.OwnRead(_param(r, "wid"), r.query_params.get("path", "")))

    def source_dir(r: Request) -> Record:
        q = r.query_params
        return page.run(ops.Ls(_param(r, "wid"), _param(r, "alias"), q.get("path", ""), _limit(q.get("limit")),
                               q.get("after")))  # fmt: skip

    def source_file(r: Request) -> Record:
        return page.run(ops.Read(_param(r, "wid"), _param(r, "alias"), r.query_params.get("path", "")))

    def search(r: Request) -> Record:
        q = r.query_params
        aliases = tuple(a for v in q.getlist("alias") for a in v.split(",") if a)
        unreviewed = _flag(q.get("include_unreviewed"), "include_unreviewed")
        return searches.search(_param(r, "wid"), q.get("q", ""), aliases, _limit(q.get("limit")), unreviewed)

    async def events(request: Request) -> Response:
        if request.method == "HEAD":
            # No stream: a HEAD's answer has no body, and an endless one never ends its
            # response (the generator ran, unseen, for as long as the connection lived).
            return Response(media_type="text/event-stream")
        last = request.headers.get("last-event-id") or None
        stream = _relay(page, last) if isinstance(page.via, ops.Remote) else _follow(page, last)
        return StreamingResponse(_until_stopped(stream, page), media_type="text/event-stream",
                                 headers={"x-accel-buffering": "no"})  # fmt: skip

    wf = "/api/workflows/{wid}"
    routes = [
        Route("/", index, methods=["GET"]),
        Route("/assets/{name}", asset, methods=["GET"]),
        Route("/favicon.ico", favicon, methods=["GET"]),
        Route("/api/me", _api(me), methods=["GET"]),
        Route("/api/workflows", _api(workflows), methods=["GET"]),
        Route(wf, _api(workflow), methods=["GET"]),
        Route(f"{wf}/sources", _api(sources), methods=["GET", "POST"]),
        Route(f"{wf}/sources/{{alias}}", _api(source), methods=["PATCH", "DELETE"]),
        Route(f"{wf}/candidates", _api(candidates), methods=["GET"]),
        Route(f"{wf}/why", _api(why_attach), methods=["GET"]),
        Route("/api/requests", _api(requests_), methods=["GET", "POST"]),
        Route("/api/requests/{rid}/decision", _api(decision), methods=["POST"]),
        Route(f"{wf}/writers", _api(writers), methods=["GET", "POST"]),
        Route(f"{wf}/writers/{{consumer}}", _api(writer), methods=["DELETE"]),
        Route(f"{wf}/notes/pending", _api(pending), methods=["GET"]),
        Route(f"{wf}/notes/review", _api(review), methods=["POST"]),
        Route(f"{wf}/notes/rejected", _api(rejected), methods=["GET"]),
        Route(f"{wf}/notes/rejected/{{rid}}/restore", _api(unreject), methods=["POST"]),
        Route(f"{wf}/notes/history", _api(note_history), methods=["GET"]),
        Route(f"{wf}/notes/diff", _api(note_diff), methods=["GET"]),
        Route(f"{wf}/own/dir", _api(own_dir), methods=["GET"]),
        Route(f"{wf}/own/file", _api(own_file), methods=["GET", "PUT"]),
        Route(f"{wf}/sources/{{alias}}/dir", _api(source_dir), methods=["GET"]),
        Route(f"{wf}/sources/{{alias}}/file", _api(source_file), methods=["GET"]),
        Route(f"{wf}/search", _api(search), methods=["GET"]),
        Route("/api/events", events, methods=["GET"]),
    ]

    async def not_found(request: Request, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 404)
        if status == 405:
            from kbd.errors import MethodNotAllowed

            return _error(MethodNotAllowed(f"{request.method} is not allowed on {request.url.path}"))
        return _error(NotFound(f"nothing is served at {request.url.path}", hint="see the page's API"))

    app = Starlette(routes=routes, exception_handlers={404: not_found, 405: not_found})
    app.state.searches = searches
    return Guard(app, page)


def rights(shown: WorkflowDetail) -> JsonObject:
    """What the page may offer on a workflow, from the operation's own answer
    (the operation re-checks every action anyway)."""
    return {"manage": shown.can_manage, "grant": shown.can_grant}


def _asset_response(name: str) -> Response:
    kind = security.asset_type(name)
    if kind is None:
        return _error(NotFound(f"no asset {name[:80]!r}"))
    try:
        data = (assets_dir() / name).read_bytes()
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return _error(NotFound(f"no asset {name[:80]!r}"))
    return Response(data, media_type=kind, headers={"cache-control": "no-cache"})


# -- the change feed ----------------------------------------------------------------------------

_EVENT_LINE = re.compile(rb"^event: [^\n]*\n", re.M)


def _frame(event_id: str | None, data: str) -> bytes:
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}data: {data}\n\n".encode()


def _resync_frame(reason: str) -> bytes:
    # No id: the browser keeps resuming from the last real event.
    return _frame(None, orjson.dumps({"type": "resync", "reason": reason, "at": _now()}).decode())


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


async def _until_stopped(frames: AsyncGenerator[bytes, None], page: Page) -> AsyncIterator[bytes]:
    """``frames`` until they end or the server stops: an open stream never holds up
    the shutdown (SIGTERM/SIGINT) waiting for its next event or ping."""
    stopping = page.stopping
    if stopping is None:  # not served by UiServer (no shutdown to wait for)
        async with contextlib.aclosing(frames):
            async for frame in frames:
                yield frame
        return
    stop = asyncio.ensure_future(stopping.wait())
    nxt: asyncio.Future[bytes] | None = None
    try:
        while True:
            nxt = asyncio.ensure_future(anext(frames))
            done, _ = await asyncio.wait({nxt, stop}, return_when=asyncio.FIRST_COMPLETED)
            if nxt not in done:
                return  # the server stops (finally: the pending step is cancelled)
            try:
                frame = nxt.result()
            except StopAsyncIteration:
                return
            nxt = None
            yield frame
    finally:
        stop.cancel()
        # Shielded: this runs under the request's cancelled scope too (the client
        # left). The pending step must finish unwinding before the generator is
        # closed (closing a generator that is still running fails).
        with anyio.CancelScope(shield=True):
            if nxt is not None and not nxt.done():
                nxt.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await nxt
            await frames.aclose()


async def _relay(page: Page, last: str | None) -> AsyncGenerator[bytes, None]:
    """The daemon's change feed for the connection's principal, re-framed as
    ``id:``/``data:`` (the page reads ``type`` from the JSON). A dropped
    upstream ends the stream; the browser reconnects with Last-Event-ID."""
    import httpx

    assert isinstance(page.via, ops.Remote)
    client = page.via.client
    headers = {"last-event-id": last} if last else {}
    if (auth := client.authorization()) is not None:
        headers["authorization"] = auth
    yield f"retry: {SSE_RETRY_MS}\n: kbd ui events\n\n".encode()
    transport = httpx.AsyncHTTPTransport(uds=str(client.socket_path))
    # No read timeout: the stream is idle between events (the daemon pings every 15 s).
    timeout = httpx.Timeout(15.0, read=None)
    try:
        async with (
            httpx.AsyncClient(transport=transport, base_url="http://kbd", timeout=timeout) as http,
            http.stream("GET", "/v1/events", params={"follow": "true"}, headers=headers) as r,
        ):
            if r.status_code >= 400:
                # The page refetches everything on a resync and EventSource reconnects after
                # `retry`: at the stream's 500 ms that was a refetch storm against the daemon
                # for as long as the refusal lasts (a disabled principal, a revoked token).
                yield f"retry: {REFUSED_RETRY_MS}\n\n".encode()
                yield _resync_frame("feed-refused")
                return
            async for item in _sse_items(r.aiter_lines(), page):
                yield item
    except (httpx.TransportError, OSError):
        yield b": the daemon's feed ended\n\n"


async def _sse_items(lines: AsyncIterator[str], page: Page) -> AsyncIterator[bytes]:
    event_id: str | None = None
    data: list[str] = []
    async for line in lines:
        if page.stopping is not None and page.stopping.is_set():
            return
        if not line:
            if data:
                yield _frame(event_id, "\n".join(data))
            event_id, data = None, []
        elif line.startswith(":"):
            yield b": ping\n\n"
        else:
            name, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if name == "id":
                event_id = value
            elif name == "data":
                data.append(value)


async def _follow(page: Page, last: str | None) -> AsyncGenerator[bytes, None]:
    """On the root: its shared event log, as the daemon's feed delivers it
    (visibility decided per event for the page's principal, now); a
    ``resync`` when a daemon starts or stops (whether manifest events flow)."""
    feed = _direct_feed(page)
    yield f"retry: {SSE_RETRY_MS}\n".encode()
    live = await run_in_threadpool(page.live)
    # The feed's generator is closed with this one (its subscriber leaves at once, not at collection).
    frames = cast("AsyncGenerator[bytes, None]", feed.stream(lambda: _principal_now(page), since=last,
                                                             follow=True, ping=LIVE_CHECK_INTERVAL))  # fmt: skip
    async with contextlib.aclosing(frames):
        async for chunk in frames:
            if page.stopping is not None and page.stopping.is_set():
                return
            if chunk.startswith(b":"):
                now = await run_in_threadpool(page.live)
                if now != live:
                    live = now
                    yield _resync_frame("live-changed")
                yield b": ping\n\n"
                continue
            yield _EVENT_LINE.sub(b"", chunk)


def _direct_feed(page: Page) -> Feed:
    """One in-process follower of the root's event log per page (made on first use)."""
    from kbd.service.changefeed import Feed
    from kbd.state.events import EventLog

    if page.feed is None:
        assert isinstance(page.via, ops.Direct)
        host = page.via.context.root
        page.feed = Feed(host, EventLog(host.config.state_dir, prefill=True), lock=page.lock)
    return page.feed


def _principal_now(page: Page) -> Principal | None:
    """The page's principal as principals.yaml says now (None: disabled or gone: the stream ends)."""
    assert isinstance(page.via, ops.Direct)
    root = page.via.context.root
    try:
        root.refresh()
        p = root.principals.get(page.principal)
    except KbdError:
        return None
    return p if p is not None and not p.disabled else None


# -- running it ----------------------------------------------------------------------------------


def bind(port: int) -> socket.socket:
    """A listening socket on 127.0.0.1:``port`` (0: a free one), never another address."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((security.BIND_HOST, port))
        sock.listen(64)
    except OSError as exc:
        sock.close()
        raise Unavailable(f"cannot listen on {security.BIND_HOST}:{port}: {exc.strerror}",
                          hint="choose another --port, or --port 0 for a free one") from None  # fmt: skip
    sock.set_inheritable(False)
    return sock


def resolve_principal(via: ops.Backend, as_: str | None) -> str:
    """Who the page acts as: the principal the CLI would act as (``--as``/$KBD_AS,
    else the caller's uid's; through the daemon the connection's)."""
    if isinstance(via, ops.Remote):
        via.check_as(as_)
        return via.whoami()
    assert isinstance(via, ops.Direct)
    actor = via.actor("mapped", as_)
    assert isinstance(actor, Principal), actor  # the "mapped" rule never yields the operator
    return actor.id


def serve(via: ops.Backend, *, root: Path, workflow: str | None, port: int, as_: str | None,
          open_browser: bool) -> None:  # fmt: skip
    """Serve the page until SIGINT/SIGTERM; close the sessions it opened; return."""
    import signal

    principal = resolve_principal(via, as_)
    page = Page(via, principal, workflow, root=root if isinstance(via, ops.Direct) else None)
    if workflow is not None:
        page.run(ops.WorkflowShow(workflow))  # a WF the principal cannot see: refused before serving
    sock = bind(port)
    page.port = sock.getsockname()[1]
    app = create_app(page)
    config = uvicorn.Config(app, log_level="warning", log_config=None, lifespan="off", access_log=False, server_header=False,
                            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN)  # fmt: skip
    server = UiServer(config, page=page)

    def stop(signum: int, frame: object) -> None:
        server.should_exit = True

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        # Listening already: the URL works as soon as it is printed.
        sys.stdout.write(page.url() + "\n")
        sys.stdout.flush()
        print(f"kbd ui: serving {principal}'s Knowledge page ({page.mode} mode); Ctrl-C stops it",
              file=sys.stderr, flush=True)  # fmt: skip
        if open_browser:
            _open_browser(page.url())
        asyncio.run(server.serve(sockets=[sock]))
    finally:
        closed = _searches(app).close_all()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        sock.close()
        if page.feed is not None:
            with contextlib.suppress(KbdError, OSError):
                page.feed.log.close()
        print(f"kbd ui: stopped (closed {len(closed)} search session(s))", file=sys.stderr, flush=True)


def _searches(app: ASGIApp) -> SearchSessions:
    inner = app.app if isinstance(app, Guard) else app
    found: SearchSessions = inner.state.searches  # type: ignore[attr-defined]
    return found


def _open_browser(url: str) -> None:
    import webbrowser

    try:
        opened = webbrowser.open(url, new=2)  # False: no browser found (a server, an ssh session)
        why = "no browser found"
    except Exception as exc:  # no browser is not an error: the URL is on stdout
        opened, why = False, type(exc).__name__
    if not opened:
        print(f"kbd ui: could not open a browser ({why}); open the URL above yourself", file=sys.stderr)


class UiServer(uvicorn.Server):
    """uvicorn's server, telling open event streams to end when it stops."""

    def __init__(self, config: uvicorn.Config, *, page: Page) -> None:
        super().__init__(config)
        self.page = page

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self.page.stopping = asyncio.Event()
        await super().startup(sockets)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self.page.stopping is not None:
            self.page.stopping.set()
        await super().shutdown(sockets)

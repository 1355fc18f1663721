"""The API's access log and request metrics: :class:`AccessLog`, a pure ASGI
middleware outermost in the application (outside the policy fast path and the
body limit, so every answer the application gives is seen).

For each HTTP request it logs one line through the ``kbd.access`` logger once
the response has ended (an event stream: when the stream ends) and counts it in
a :class:`kbd.core.telemetry.RequestStats` (on the event loop thread: no lock).
The line names the principal the request was authenticated as (``-`` when it
was not), the method, the route *template* (never the raw path: it carries IDs
and whatever a client put there; a path no route matches is logged as
``unmatched``), the status and the milliseconds (:func:`kbd.core.telemetry.access_line`).

The application tells the middleware what only it knows through the request's
:class:`AccessRecord` (``scope[ACCESS]``, a shared object, so a copied scope
still reaches it): :func:`note_principal` after authentication, and
:func:`note_route` where a request is answered without the router (the router
puts its route in ``scope["route"]`` itself).

Not seen here: answers the daemon's protocol gives before the application (a
connection over the caps, a header timeout, an unparsable request) and
connections the exec broker takes over.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kbd.core.telemetry import UNMATCHED, RequestStats, access_line

ACCESS = "kbd.access"
log = logging.getLogger("kbd.access")


class AccessRecord:
    """What the application learnt about one request, for its access line."""

    __slots__ = ("principal", "route")

    def __init__(self) -> None:
        self.principal: str | None = None
        self.route: str | None = None


def note_principal(scope: Scope, principal: str) -> None:
    """The request was authenticated as ``principal`` (no-op outside :class:`AccessLog`)."""
    record = scope.get(ACCESS)
    if record is not None:
        record.principal = principal


def note_route(scope: Scope, template: str) -> None:
    """The request is answered as route ``template`` without the router."""
    record = scope.get(ACCESS)
    if record is not None:
        record.route = template


#: Routes the framework serves itself: its router matches them (an endpoint is
#: in the scope) but names no route. They take no parameter, so the path is the
#: template.
FRAMEWORK_ROUTES = frozenset({"/openapi.json"})


def route_of(scope: Scope, record: AccessRecord) -> str:
    if record.route is not None:
        return record.route
    route = scope.get("route")
    path = getattr(route, "path", None)
    if isinstance(path, str):
        return path
    if scope.get("endpoint") is not None and scope.get("path") in FRAMEWORK_ROUTES:
        return str(scope["path"])
    return UNMATCHED


class AccessLog:
    def __init__(self, app: ASGIApp, *, stats: RequestStats) -> None:
        self.app = app
        self.stats = stats

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        record = AccessRecord()
        scope[ACCESS] = record
        # 500 unless a response starts: what uvicorn answers when the
        # application fails before starting one.
        status = 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            self._done(scope, record, status, time.perf_counter() - start)

    def _done(self, scope: Scope, record: AccessRecord, status: int, seconds: float) -> None:
        route = route_of(scope, record)
        method: str = scope.get("method", "")
        self.stats.observe(route, method, status, seconds)
        if log.isEnabledFor(logging.INFO):
            ms = seconds * 1000.0
            line = access_line(principal=record.principal, method=method, route=route, status=status, ms=ms)
            fields: dict[str, Any] = {
                "principal": record.principal,
                "route": route,
                "status": status,
                "ms": ms,
            }
            # Straight to the handlers: Logger.info would first walk the stack
            # for the caller's file and line (findCaller), a third of the cost
            # of a line, only to name this function every time.
            log.handle(log.makeRecord(log.name, logging.INFO, __file__, 0, line, (), None,
                                      extra={"kbd_access": fields}))  # fmt: skip

"""The daemon's HTTP API (docs/api.md): JSON over a Unix socket, under ``/v1``.

Every request except ``/v1/health`` is authenticated as one principal: a bearer
token (its SHA-256 must match a principal's ``token_sha256``) or, without an
``Authorization`` header, the peer's uid from ``SO_PEERCRED`` mapped through
principals.yaml (:mod:`kbd.service.auth`). Unknown and disabled principals get
401/403. Every route only parses, calls the operations layer the CLI calls too
(:mod:`kbd.service`), and answers its result's ``to_json()``. Errors are
``{"error": {"code", "message", "hint"}}``; unexpected exceptions are logged
and answered without details.

No request can hold up the others (docs/api.md "Limits"): the shared state lock is
held only for registry and session-store work, never for file reads, folder
listings, retries or notes-mutex waits, and a request that cannot get it within
``STATE_LOCK_WAIT`` is answered 503 ``busy`` with ``Retry-After``; note writes
wait for their source's notes mutex in their own small pool (``NOTE_WORKERS``)
behind a bounded queue, beyond which they are answered 503 at once; health and
whoami never need a worker thread.

Every request passes :class:`kbd.daemon.access_log.AccessLog` first (outermost): one
access line through the ``kbd.access`` logger and the request counters that
``GET /v1/metrics`` answers in the Prometheus text format when asked
(``?format=prometheus`` or ``Accept: text/plain``; JSON stays the default).

``GET /v1/events`` is the change feed (docs/daemon.md): Server-Sent Events from the
root's event log through :class:`kbd.service.changefeed.Feed`, which the
operations report to (``State.feed`` is put in ``Root.events``). The event log
is one per daemon: :attr:`State.event_log`, created here unless the daemon
passes its own to :func:`create_app`. A subscriber is admitted under the
stream caps (one more is 503 ``stream-limit``) and its backlog read, from the
daemon's in-memory ring only, before its stream starts (docs/daemon.md "The change feed").
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import inspect
import logging
import re
import threading
import time
import typing
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from typing import Annotated, Any, Literal
from urllib.parse import unquote

import anyio
import anyio.from_thread
import anyio.to_thread
import orjson
from fastapi import Depends, FastAPI, Header, Query, Request, Security
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.security import HTTPBearer
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kbd import ops
from kbd.core import telemetry
from kbd.core.events import parse_id
from kbd.core.history import version_of
from kbd.core.identifiers import ALIAS_RE, MAX_ID_LEN, RESERVED_ALIASES
from kbd.core.knowledge import MAX_LIMIT as MAX_SEARCH_LIMIT
from kbd.core.knowledge import MAX_QUERY_CHARS, MAX_QUERY_TERMS, QUERY_HELP, check_limit, match_expression
from kbd.core.plan import Plan
from kbd.core.policy import KINDS as POLICY_KINDS
from kbd.core.principals import MAX_UID, Principal
from kbd.core.records import Record, refs_under
from kbd.core.relpaths import MAX_LS_LIMIT
from kbd.core.strict import is_unicode
from kbd.daemon.access_log import AccessLog, note_principal, note_route
from kbd.errors import (
    NO_SPACE_ERRNOS,
    InvalidInput,
    KbdError,
    MethodNotAllowed,
    NotFound,
    Overloaded,
    PayloadTooLarge,
    PermissionDenied,
    Unauthenticated,
    UsageError,
    from_oserror,
    http_answer,
)
from kbd.service import JsonObject, admin, auth, own_kb
from kbd.service import browse as browse_ops
from kbd.service import history as history_ops
from kbd.service import importing as import_ops
from kbd.service import notes as note_ops
from kbd.service import principals as principal_ops
from kbd.service import search as search_ops
from kbd.service import sessions as session_ops
from kbd.service.changefeed import Feed, Subscription
from kbd.service.gauges import host_gauges
from kbd.service.root import Root
from kbd.service.sessions import RootSessions
from kbd.service.workflows import MAX_LABEL
from kbd.state.events import EventLog

log = logging.getLogger("kbd.api")
PEER_UID = "kbd.peer_uid"
EVENTS_PATH = "/v1/events"
# Normally the state lock is held for well under a millisecond; a request that
# waited this long is behind something pathological and is better told to retry.
STATE_LOCK_WAIT = 2.0
# Note writes may wait up to locks.timeout_seconds for a source's notes mutex
# (a write command can hold it for its whole run): a few threads of their own,
# a bounded queue, and a fast 503 beyond it, so they never park the pool that
# serves everything else.
NOTE_WORKERS = 4
NOTE_BACKLOG = 16


# -- request and response models ------------------------------------------------


def _not_unicode(value: object, where: str) -> str | None:
    """Where in a decoded JSON value there is text that is not Unicode: a lone
    surrogate, which JSON's ``\\u`` escapes can spell but nothing can store,
    encode or compare as a name. None when there is none."""
    if isinstance(value, str):
        if not is_unicode(value):
            return where or "the body"
    elif isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str) and not is_unicode(key):
                return f"a key in {where or 'the body'}"
            inner = f"{where}.{key}" if where else str(key)
            found = _not_unicode(item, inner)
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = _not_unicode(item, f"{where}[{i}]")
            if found is not None:
                return found
    return None


#: A note version as the server reads one (:func:`kbd.core.history.parse_version`):
#: ``sha256:`` and 64 lower-case hex digits, optionally in double quotes (an
#: entity tag), surrounding blanks ignored; ``NOTE_VERSION_OR_NONE`` also takes
#: ``none`` (the note must not exist yet).
NOTE_VERSION = r'^\s*(sha256:[0-9a-f]{64}|"sha256:[0-9a-f]{64}")\s*$'
NOTE_VERSION_OR_NONE = r'^\s*(sha256:[0-9a-f]{64}|"sha256:[0-9a-f]{64}"|none|"none")\s*$'
#: A note write's If-Match: a version, none, or * (any current version).
IF_MATCH = r'^\s*(sha256:[0-9a-f]{64}|"sha256:[0-9a-f]{64}"|none|"none"|\*)\s*$'
#: What _base64 decodes: standard base64, padded.
BASE64 = r"^([A-Za-z0-9+/]{4})*([A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?$"
#: An event id (:func:`kbd.core.events.parse_id`).
EVENT_ID = r"^[0-9a-f]{8}-(0|[1-9][0-9]{0,17})$"  # kbd.core.events: at most 18 digits
#: A search query (:func:`kbd.core.knowledge.match_expression`), as a string format: its
#: words are Unicode's (a pattern's ``\w`` is ASCII in some regex dialects, Unicode in others).
SEARCH_QUERY = {"type": "string", "format": "kbd-search-query", "minLength": 1, "maxLength": MAX_QUERY_CHARS,
                "description": f"1 to {MAX_QUERY_TERMS} words (runs of Unicode letters, digits and '_'): "
                               f"{QUERY_HELP} (docs/search.md \"Queries\")"}  # fmt: skip


def _schema(
    schema: dict[str, Any], *, nullable: bool = False, required: bool = False
) -> Callable[[dict[str, Any]], None]:
    """A field's JSON schema, exactly ``schema`` (what the server accepts, which
    the field's Python type may say more loosely: a query value read as text
    and checked by the operation, as the CLI's flag is). ``nullable``: a body
    field that may also be null; ``required``: a query parameter whose
    default the server refuses (see :meth:`_Api.openapi`)."""

    def replace(found: dict[str, Any]) -> None:
        keep: dict[str, Any] = {
            k: found[k] for k in ("title", "description", "default") if k in found and not required
        }
        found.clear()
        found.update(keep)
        found.update({"anyOf": [schema, {"type": "null"}]} if nullable else schema)
        if required:
            found[REQUIRED] = True

    return replace


# What the operations accept as a name, as string formats (docs/api.md "Malformed requests"):
# the rules are Unicode categories, which a pattern could only spell as
# thousands of ranges; each format's description says them.
ID_FORMAT = {"type": "string", "format": "kbd-id", "minLength": 1, "maxLength": MAX_ID_LEN,
             "not": {"enum": [".", ".."]},
             "description": "a workflow or principal ID (docs/on-disk.md): no control (Cc), format (Cf), line or "
                            "paragraph separator (Zl, Zp) or whitespace character, no '/' or '\\', not '.' or '..'"}  # fmt: skip
NEW_WORKFLOW_FORMAT = {**ID_FORMAT, "format": "kbd-new-workflow-id", "pattern": "^[^.]",
                       "description": "an ID (kbd-id) that does not start with '.' and is printable "
                                      "(str.isprintable: it is the label when none is given)"}  # fmt: skip
LABEL_FORMAT = {"type": "string", "format": "kbd-label", "minLength": 1, "maxLength": MAX_LABEL,
                "description": "printable characters (str.isprintable), not only blanks"}  # fmt: skip


#: Marks a parameter schema whose parameter must be given (taken out of the schema).
REQUIRED = "x-kbd-required"


def _tagged(answer: JsonObject, version: str, known: str | None, response: Response) -> JsonObject | Response:
    """A read whose strong ETag is the version of the bytes it holds (the
    note's version, docs/notes.md "Note history"): 304 without content when
    If-None-Match names it or is ``*`` (RFC 9110 §13.1.2), else the answer."""
    tag = f'"{version}"'
    if known is not None:
        names = {t.strip().removeprefix("W/") for t in known.split(",")}
        if "*" in names or tag in names:
            return Response(status_code=304, headers={"ETag": tag})
    response.headers["ETag"] = tag
    return answer


def _integral(value: Any) -> Any:
    # JSON has one number type: 3.0 is an integer to JSON Schema, and to this
    # server; "3", true and 3.5 are not (strict validation refuses them).
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


#: An integer field of a body: a JSON number with no fraction.
JsonInteger = Annotated[int, BeforeValidator(_integral)]
#: One change-feed event as /openapi.json documents the stream's items.
EVENT_SCHEMA = {"type": "object", "required": ["id", "event", "data"],
                "properties": {"id": {"type": "string", "pattern": EVENT_ID}, "event": {"type": "string"},
                               "data": {"type": "string", "contentMediaType": "application/json"}}}  # fmt: skip


class Strict(BaseModel):
    """A request body: no unknown field, every field of its declared JSON type
    (``"yes"`` is not a boolean, ``0`` neither), and only Unicode text in any
    field, nested ones included (docs/api.md "Malformed requests": checked before anything else)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _unicode_only(cls, data: Any) -> Any:
        where = _not_unicode(data, "")
        if where is not None:
            raise PydanticCustomError(
                "not_unicode",
                "{where} is not Unicode text: it has a lone surrogate (a \\ud800-\\udfff escape with no pair); "
                "send UTF-8 text, or bytes as base64 in a field that takes them",
                {"where": where},
            )
        return data


class AttachBody(Strict):
    workflow_id: str
    alias: str = Field(
        json_schema_extra=_schema(
            {"type": "string", "pattern": f"^{ALIAS_RE.pattern}$", "not": {"enum": sorted(RESERVED_ALIASES)}}
        )
    )
    access: Literal["read", "write"] = "read"


class ReplaceSourcesBody(Strict):
    # Checked by the operation, not here: its answer (which entry, which field)
    # is the one the CLI gives on the root, for any document.
    sources: Any = Field(
        description="the complete attachment list (a JSON array); [] detaches all",
        json_schema_extra={"type": "array", "items": {"type": "object"}},
    )
    expected_version: str | None = None


class AccessBody(Strict):
    access: str = Field(
        description="read or write (checked by the operation, as on the root)",
        json_schema_extra={"enum": ["read", "write"]},
    )
    expected_version: str | None = Field(
        default=None,
        description="the manifest version the change was decided on: refused (409) when it moved",
    )


class GrantBody(Strict):
    workflow_id: str


class CreateWorkflowBody(Strict):
    workflow_id: str = Field(json_schema_extra=_schema(NEW_WORKFLOW_FORMAT))
    label: str | None = Field(default=None, json_schema_extra=_schema(LABEL_FORMAT, nullable=True))
    owner: str | None = Field(default=None, description="the owning principal; default: the caller")


class OpenSessionBody(Strict):
    model_config = ConfigDict(json_schema_extra={"anyOf": [
        {"required": ["kind"], "properties": {"kind": {"type": "string"}}},
        {"required": ["parent"], "properties": {"parent": {"type": "string"}}},
    ]})  # fmt: skip

    workflow_id: str
    kind: str | None = Field(
        default=None,
        description="required unless parent is given (default: the parent's)",
        json_schema_extra=_schema({"enum": list(POLICY_KINDS)}, nullable=True),
    )
    kb_access: Literal["none", "read", "write", "read-write"] | None = None
    item_kb_write: bool | None = None
    parent: str | None = None


class ChildBody(Strict):
    kind: str | None = Field(
        default=None,
        description="empty or null: the parent's",
        json_schema_extra=_schema({"enum": ["", *POLICY_KINDS]}, nullable=True),
    )
    kb_access: Literal["none", "read", "write", "read-write"] | None = None
    item_kb_write: bool | None = None


class NoteBody(Strict):
    model_config = ConfigDict(json_schema_extra={"oneOf": [
        {"required": ["content"], "properties": {"content": {"type": "string"}}},
        {"required": ["content_base64"], "properties": {"content_base64": {"type": "string"}}},
    ]})  # fmt: skip

    alias: str
    path: str = Field(
        description="relative to the source's KB root, beneath notes/: notes/x.md (relative to "
        "notes/ is deprecated: accepted for one release, with a warning)",
        json_schema_extra={"minLength": 1},
    )
    content: str | None = Field(default=None, description="the note's text (or content_base64)")
    content_base64: str | None = Field(
        default=None, description="the note's bytes, base64 (the CLI sends these: text that is not UTF-8 is "
        "refused by the same checks as every note)", json_schema_extra=_schema({"type": "string",
                                                                                "pattern": BASE64}, nullable=True)
    )  # fmt: skip
    expected_version: str | None = Field(
        default=None,
        description="as the If-Match header: sha256:<hex>, or none (must not exist yet)",
        json_schema_extra=_schema({"type": "string", "pattern": NOTE_VERSION_OR_NONE}, nullable=True),
    )

    def data(self) -> bytes:
        if (self.content is None) == (self.content_base64 is None):
            raise InvalidInput("give exactly one of content and content_base64")
        if self.content is not None:
            try:
                return self.content.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise InvalidInput("content is not valid Unicode text") from exc
        return _base64(self.content_base64 or "", field="content_base64")


BASE64_ALLOWED = "standard base64 (A-Z, a-z, 0-9, + and /, padded with = to a multiple of 4 characters)"


def _base64(text: str, *, field: str) -> bytes:
    """``text`` decoded as standard base64, or InvalidInput naming ``field``,
    what is wrong and what is allowed. Checked for ASCII first: the decoder
    raises a bare ValueError (not binascii.Error) for anything else."""
    if not text.isascii():  # at C speed; the character named only when there is one
        bad = next(c for c in text if not c.isascii())
        raise InvalidInput(f"{field} is not base64: it contains {bad!r} (U+{ord(bad):04X}); it must be "
                           f"{BASE64_ALLOWED}", hint="encode the bytes with base64, e.g. `base64 -w0 FILE`")  # fmt: skip
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidInput(f"{field} is not base64 ({exc}); it must be {BASE64_ALLOWED}",
                           hint="encode the bytes with base64, e.g. `base64 -w0 FILE`") from None  # fmt: skip


class ImportDocument(Strict):
    file: str = Field(description="the document's name relative to the imported folder")
    content_base64: str = Field(
        description="its bytes, base64 (text that is not UTF-8 is skipped)",
        json_schema_extra={"pattern": BASE64},
    )


class ImportSkipped(Strict):
    file: str
    reason: str


class KbFileBody(Strict):
    path: str = Field(description="relative to the workflow's KB root, beneath context/ or notes/",
                      json_schema_extra={"minLength": 1})  # fmt: skip
    content: str = Field(description="the file's text (UTF-8; at most 1 MiB)")
    expected_version: str | None = Field(
        default=None,
        description="the version the editor read (none: the file must not exist yet); refused (412) when it "
        "changed since",
        json_schema_extra=_schema({"type": "string", "pattern": NOTE_VERSION}, nullable=True),
    )


class ImportBody(Strict):
    """Documents read by the caller (never a path: the daemon opens no folder for anyone)."""

    folder: str = Field(
        description="the imported folder's own name: the container of documents directly in it"
    )
    documents: list[ImportDocument]
    skipped: list[ImportSkipped] = Field(
        default_factory=list, description="what the reader passed over, and why"
    )
    dry_run: bool = False
    update: bool = False

    def docs(self) -> list[tuple[str, bytes]]:
        out: list[tuple[str, bytes]] = []
        for i, d in enumerate(self.documents):
            out.append((d.file, _base64(d.content_base64, field=f"documents[{i}].content_base64")))
        return out


class RestoreBody(Strict):
    path: str = Field(
        description="relative to the source's KB root: notes/...", json_schema_extra={"minLength": 1}
    )
    version: str | None = Field(
        default=None, json_schema_extra=_schema({"type": "string", "pattern": NOTE_VERSION}, nullable=True)
    )


class RevokeBody(Strict):
    immediate: bool = False


class AddPrincipalBody(Strict):
    model_config = ConfigDict(json_schema_extra={"oneOf": [
        {"required": ["uid"], "properties": {"uid": {"type": "integer"}}},
        {"required": ["login"], "properties": {"login": {"type": "string"}}},
    ]})  # fmt: skip

    id: str = Field(json_schema_extra=_schema(ID_FORMAT))
    uid: JsonInteger | None = Field(default=None, json_schema_extra=_schema(
        {"type": "integer", "minimum": 0, "maximum": MAX_UID}, nullable=True))  # fmt: skip
    login: str | None = Field(default=None, description="a login on this host, instead of uid")
    kind: Literal["user", "service"] = "user"
    admin: bool = False
    label: str | None = None


class ForceBody(Strict):
    force: bool = False


class ReviewBody(Strict):
    path: str = Field(
        description="relative to the source's KB root: notes/...", json_schema_extra={"minLength": 1}
    )
    decision: Literal["approve", "reject"]
    expected_version: str | None = Field(
        default=None,
        description="the version (digest) reviewed, required to approve: refused (412) when the note changed since",
        json_schema_extra=_schema({"type": "string", "pattern": NOTE_VERSION}, nullable=True),
    )


class CheckBody(Strict):
    path: str
    mode: Literal["read", "write"]


class WhyBody(Strict):
    path: str = Field(
        description="a host or sandbox path, ALIAS:RELPATH or $WORKFLOW_KB_<ALIAS>/RELPATH",
        json_schema_extra=_schema({"type": "string", "minLength": 1, "pattern": "^[^\\x00]+$"}),
    )
    mode: Literal["read", "write"] = "read"
    anonymous: bool = Field(
        default=False, description="name no principal and no unattached workflow (kb_why)"
    )


class WhyAttachBody(Strict):
    workflow_id: str = Field(description="the source workflow to attach")
    access: Literal["read", "write"] = "read"


#: An access request's message (kbd/service/requests.py): one line of plain text.
MESSAGE_FORMAT = {"type": "string", "maxLength": 500, "pattern": "^[^\\x00-\\x1f\\x7f-\\x9f]*$"}


class RequestBody(Strict):
    kind: Literal["read", "write"]
    workflow_id: str = Field(description="the source workflow asked", json_schema_extra=_schema(ID_FORMAT))
    consumer: str = Field(
        description="the consumer workflow it would admit", json_schema_extra=_schema(ID_FORMAT)
    )
    message: str | None = Field(default=None, description="one line for the source's owners",
                                json_schema_extra=_schema(MESSAGE_FORMAT, nullable=True))  # fmt: skip


class DecisionBody(Strict):
    decision: Literal["approve", "decline"]
    message: str | None = Field(default=None, description="one line for the requester",
                                json_schema_extra=_schema(MESSAGE_FORMAT, nullable=True))  # fmt: skip


class PreviewBody(Strict):
    manifest: str = Field(
        description="a workflow.json's text, as kbd preview read it from its file",
        json_schema_extra=_schema({"type": "string", "format": "kbd-workflow-json", "minLength": 2,
                                   "description": "a JSON object that kbd reads as a workflow.json "
                                                  "(docs/on-disk.md): refused with 400 otherwise"}),
    )  # fmt: skip


class ReadersBody(Strict):
    principals: list[str] = Field(
        description="principal IDs to add to (or remove from) access.readers",
        json_schema_extra=_schema({"type": "array", "items": ID_FORMAT, "minItems": 1, "maxItems": 50}),
    )


class ErrorBody(BaseModel):
    code: str
    message: str
    hint: str


class ErrorResponse(BaseModel):
    error: ErrorBody


class _EventStream(StreamingResponse):
    """``GET /v1/events``'s answer: its subscription (its queue and its slots
    under the stream caps) is closed however the response ends, also when the
    client leaves before the stream's first byte (the frames never start)."""

    def __init__(self, subscription: Subscription, frames: AsyncIterator[bytes], **kw: Any) -> None:
        super().__init__(frames, **kw)
        self.subscription = subscription

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.subscription.close()


# -- the application ------------------------------------------------------------------


class State:
    """Shared by all requests. Root and registry are not thread-safe: one lock.

    ``event_log`` is the daemon's one :class:`kbd.state.events.EventLog` (the
    given one, else opened here) and ``feed`` the change feed built on it,
    installed as ``host.events`` so every operation reports to it."""

    def __init__(self, host: Root, *, event_log: EventLog | None = None) -> None:
        self.host = host
        self.sessions = RootSessions(host)
        self.lock = threading.RLock()
        # prefill: subscribers are served from the ring only (docs/daemon.md "The change feed"), so it starts
        # with the newest events already in the log.
        self.event_log = event_log if event_log is not None else EventLog(host.config.state_dir, prefill=True)
        self.feed = Feed(host, self.event_log, lock=self.lock)
        host.events = self.feed
        self.started = time.time()
        self.counted = telemetry.OpsStats()  # commands, refusals, notes (docs/daemon.md "Metrics")
        self.requests: Counter[str] = Counter()
        # Per session: the last plan answered and its JSON (see policy_body).
        self.plan_json: dict[str, tuple[Plan, bytes]] = {}
        # Used on the event loop thread only.
        self.notes_in_flight = 0
        self._notes_limiter: anyio.CapacityLimiter | None = None

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """The state lock, or Overloaded after STATE_LOCK_WAIT: a worker thread
        never waits behind a stuck holder for long."""
        if not self.lock.acquire(timeout=STATE_LOCK_WAIT):
            raise Overloaded(f"the daemon's state is busy (waited {STATE_LOCK_WAIT:g}s)")
        try:
            yield
        finally:
            self.lock.release()

    def notes_limiter(self) -> anyio.CapacityLimiter:
        # Created on first use, inside the event loop that will run it.
        if self._notes_limiter is None:
            self._notes_limiter = anyio.CapacityLimiter(NOTE_WORKERS)
        return self._notes_limiter

    def authenticate(self, path: str, authorization: str | None, peer_uid: object) -> Principal:
        """The principal of a request to ``path`` (counted per route group),
        against the principals and config as they are now."""
        self.requests[path.split("/")[2] if path.count("/") >= 2 else "?"] += 1
        # Every request sees current principals and config (cheap: two stats).
        self.host.refresh()
        who = auth.authenticate(self.host.principals, authorization=authorization,
                                peer_uid=peer_uid if isinstance(peer_uid, int) else None)  # fmt: skip
        if isinstance(who, auth.NotAuthenticated):
            raise Unauthenticated(who.message, hint=who.hint)
        return who

    async def policy_body(self, sid: str, actor: Principal) -> bytes:
        """``GET /v1/sessions/{sid}``'s answer: the session's plan as ``actor``
        may use it now and the commands running in it. Runs on the event loop
        when the state lock is free; when another request holds it, the wait
        moves to a worker thread so the loop (health, other clients) never
        blocks on it."""

        def lookup() -> session_ops.SessionView:
            return session_ops.show(self.sessions, sid, actor=actor)

        def locked_lookup() -> session_ops.SessionView:
            with self.locked():
                return lookup()

        if self.lock.acquire(blocking=False):
            try:
                view = lookup()
            finally:
                self.lock.release()
        else:
            view = await run_in_threadpool(locked_lookup)
        return self.plan_bytes(sid, view.plan) + _running_tail(view)

    def plan_bytes(self, sid: str, plan: Plan) -> bytes:
        """``plan``'s JSON without its closing brace. A lookup that found
        everything as before answers the very same Plan object (the sessions'
        verified memo), so its JSON is serialised once per plan, not per request."""
        cached = self.plan_json.pop(sid, None)
        if cached is None or cached[0] is not plan:
            cached = (plan, orjson.dumps(plan.to_json())[:-1])
        self.plan_json[sid] = cached  # popped before: now the most recently used
        if len(self.plan_json) > PLAN_JSON_SESSIONS:
            del self.plan_json[next(iter(self.plan_json))]
        return cached[1]


# Sessions whose last plan's JSON is kept (least recently answered forgotten first).
PLAN_JSON_SESSIONS = 1024


def _running_tail(view: session_ops.SessionView) -> bytes:
    # SessionView.to_json() is the plan's object with "running" added last (the
    # plan has no such key): orjson writes it as the plan's members, then this.
    return b',"running":' + orjson.dumps([r.to_json() for r in view.running]) + b"}"


class PolicyFastPath:
    """``GET /v1/sessions/{sid}``, the policy lookup every execution host
    makes, answered without the framework's routing, request objects and
    dependency resolution (a fifth of its time): the same authentication
    (:meth:`State.authenticate`), the same lookup and the same answers — the
    plan as the route's ``Response``, a refusal as the KbdError handler's
    envelope; anything unexpected propagates to the same 500 handler. Every
    other request (methods, paths) goes to the application unchanged."""

    PREFIX = "/v1/sessions/"

    def __init__(self, app: ASGIApp, state: State) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or scope.get("method") != "GET" or not path.startswith(self.PREFIX):
            await self.app(scope, receive, send)
            return
        sid = path[len(self.PREFIX) :]
        if not sid or "/" in sid:
            await self.app(scope, receive, send)
            return
        authorization = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                authorization = value.decode("latin-1")
                break
        response: Response
        note_route(scope, "/v1/sessions/{sid}")
        try:
            actor = self.state.authenticate(path, authorization, scope.get(PEER_UID))
            note_principal(scope, actor.id)
            response = Response(await self.state.policy_body(sid, actor), media_type="application/json")
        except KbdError as err:
            self.state.counted.refused(err.code)
            response = _error(err)
        await response(scope, receive, send)


class OneSegmentIds:
    """Refuse a path with an encoded ``/`` (``%2F``) in it. The server decodes
    the path before routing, so ``GET /v1/workflows/con%2Fsources`` would be
    answered by the route for ``/v1/workflows/con/sources``: another resource
    than the one named. No workflow ID, alias, session ID or principal name
    contains ``/``, so such a name is one that does not exist (404, as on the
    root)."""

    def __init__(self, app: ASGIApp, *, counted: telemetry.OpsStats) -> None:
        self.app = app
        self.counted = counted

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        raw = scope.get("raw_path") if scope.get("type") == "http" else None
        if not raw or b"%2f" not in raw.lower():
            await self.app(scope, receive, send)
            return
        names = [unquote(s) for s in raw.decode("latin-1").split("/") if "%2f" in s.lower()]
        err = NotFound(f"nothing is named {names[0]!r}: workflow IDs, aliases, session IDs and principal "
                       "names never contain '/'", hint="check the name")  # fmt: skip
        self.counted.refused(err.code)
        await _error(err)(scope, receive, send)


class HeadAsGet:
    """``HEAD`` is ``GET`` without the content (RFC 9110 §9.3.2): the same
    status and headers, Content-Length included, and no body. A streamed
    answer (the change feed) ends with its headers: the route is told that
    the client left, as it would be for a GET whose client went away."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http" or scope.get("method") != "HEAD":
            await self.app(scope, receive, send)
            return
        done = anyio.Event()

        async def headers_only(message: Message) -> None:
            if done.is_set():
                return
            if message["type"] == "http.response.start":
                await send(message)
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                done.set()

        async def until_done() -> Message:
            if done.is_set():
                return {"type": "http.disconnect"}
            found: Message = {"type": "http.disconnect"}
            async with anyio.create_task_group() as group:

                async def client() -> None:
                    nonlocal found
                    found = await receive()
                    group.cancel_scope.cancel()

                group.start_soon(client)
                await done.wait()
                group.cancel_scope.cancel()
            return found

        await self.app({**scope, "method": "GET"}, until_done, headers_only)


def allowed_methods(app: ASGIApp, scope: Scope) -> str:
    """The ``Allow`` header of a 405: every method some route serves at this
    path (RFC 9110 §15.5.6), not only the first route's; HEAD wherever GET."""
    methods: set[str] = set()
    for route in getattr(app, "routes", ()):
        found, _ = route.matches({**scope, "type": "http"})
        if found != Match.NONE:
            methods.update(getattr(route, "methods", None) or ())
    if "GET" in methods:
        methods.add("HEAD")
    return ", ".join(sorted(methods))


#: ``Authorization: Bearer <token>``, as /openapi.json declares it; a peer whose
#: uid principals.yaml maps needs no header (docs/api.md "Malformed requests").
BEARER = HTTPBearer(
    scheme_name="bearer", auto_error=False,
    description="a principal's token (kbd principals token); without the header, the socket peer's uid "
    "as principals.yaml maps it",
)  # fmt: skip
#: A conditional GET of what the client already has (If-None-Match).
NOT_MODIFIED: dict[int | str, dict[str, Any]] = {
    304: {"description": "If-None-Match names the current version: no content",
          "headers": {"ETag": {"schema": {"type": "string"}}}},
}  # fmt: skip


MAX_BODY_BYTES = 4 * 1024 * 1024  # a note is at most 1 MiB; JSON escaping can grow it


class BodyLimit:
    """Refuse request bodies over MAX_BODY_BYTES before anything reads them (the
    body would otherwise be buffered, and authentication comes later): a
    Content-Length over the limit is answered 413 at once, and a chunked body is
    cut off as soon as it passes the limit."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", []):
            # A length with more digits than the limit is over it (and int() of thousands of digits raises).
            if name == b"content-length" and (
                not value.isdigit() or len(value) > len(str(MAX_BODY_BYTES)) or int(value) > MAX_BODY_BYTES
            ):
                await _too_large(send)
                return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            if message.get("type") == "http.request":
                seen += len(message.get("body", b""))
                if seen > MAX_BODY_BYTES:
                    raise _TooLarge
            return message

        try:
            await self.app(scope, limited, send)
        except _TooLarge:
            await _too_large(send)


class _TooLarge(Exception):
    pass


async def _too_large(send: Send) -> None:
    status, envelope, _ = http_answer(PayloadTooLarge(f"request body over {MAX_BODY_BYTES} bytes"))
    body = orjson.dumps(envelope)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})  # fmt: skip
    await send({"type": "http.response.body", "body": body})


#: HTTP statuses the framework raises itself → the tree's class for them.
HTTP_ERRORS: dict[int, type[KbdError]] = {400: InvalidInput, 404: NotFound, 405: MethodNotAllowed}


def _whole(text: str, *, field: str, top: int) -> int:
    """A query value as a whole number from 1 to ``top`` (UsageError naming
    ``field`` otherwise). Digits only ("²".isdigit(), but int("²") fails), and
    never more of them than ``top`` has: int() refuses thousands of digits with
    a ValueError, and no such number is in range anyway."""
    if not (text.isascii() and text.isdigit()) or len(text.lstrip("0")) > len(str(top)):
        raise UsageError(f"{field} must be a whole number from 1 to {top}, not {text[:80]!r}")
    return int(text)


def _ls_limit(limit: str | None) -> int | None:
    """A listing's ``limit`` query value as a number (the operation checks its range)."""
    if limit is None:
        return None
    return _whole(limit, field="limit", top=MAX_LS_LIMIT)


JSON_TYPES = {dict: "an object", list: "an array", str: "a string", int: "a number", float: "a number",
              bool: "a boolean", type(None): "null"}  # fmt: skip
SEND_JSON = "send one JSON object, in UTF-8"


def validation_message(errors: Sequence[Any]) -> str:
    """The first of the framework's validation errors, naming the field
    (``documents[0].file``; ``query parameter limit``), what is wrong and what
    is allowed, as pydantic says it (docs/api.md "Malformed requests")."""
    first: Mapping[str, Any] = errors[0] if errors else {}
    loc = list(first.get("loc", ()))
    part = loc.pop(0) if loc and loc[0] in ("body", "query", "path", "header") else "body"
    kind, msg = first.get("type"), str(first.get("msg", "invalid"))
    if kind == "json_invalid":
        error = (first.get("ctx") or {}).get("error", "not JSON")
        at = loc[0] if loc and isinstance(loc[0], int) else 0
        return f"the body is not JSON ({error} at character {at}): {SEND_JSON}"
    if kind == "not_unicode":
        return msg
    field = "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in loc).lstrip(".")
    if part == "body" and not field:
        if kind == "missing":
            return f"this route takes a JSON body: {SEND_JSON}"
        if kind == "model_attributes_type":
            return f"the body is {JSON_TYPES.get(type(first.get('input')), 'not JSON')}: {SEND_JSON}"
    where = field if part == "body" else f"{part} parameter {field}"
    return f"{where or 'the body'}: {msg}"


def body_problem(cause: BaseException | None) -> str | None:
    """What the framework met reading a JSON body it could not parse at all
    (it answers a bare "error parsing the body" for these): bytes that are not
    UTF-8, nesting too deep to parse, a number too long to read. None for
    anything else."""
    if isinstance(cause, UnicodeDecodeError):
        return f"the body is not UTF-8 (byte {cause.start} is {cause.object[cause.start]:#04x}): {SEND_JSON}"
    if isinstance(cause, RecursionError):
        return f"the body nests arrays or objects too deeply to read: {SEND_JSON}"
    if isinstance(cause, ValueError):  # e.g. a number of more digits than int() reads
        return f"the body cannot be read as JSON ({str(cause)[:200]}): {SEND_JSON}"
    return None


def _error(err: KbdError) -> JSONResponse:
    status, envelope, headers = http_answer(err)
    if isinstance(err, Unauthenticated):
        # RFC 9110 §11.6.1: a 401 names the scheme that would authenticate (RFC 6750).
        headers = {**headers, "WWW-Authenticate": "Bearer"}
    return JSONResponse(envelope, status_code=status, headers=headers)


#: Where /openapi.json keeps the schemas its operations refer to.
COMPONENTS = "#/components/schemas/"


class _Api(FastAPI):
    """The application, whose /openapi.json says what the server does (docs/api.md "Malformed requests"): a
    refused request is a 400 with the error envelope, never the
    framework's 422, and every route but health needs the bearer scheme (or the
    peer's uid on the socket, which OpenAPI cannot name)."""

    #: The results' schemas (kbd.core.records), by name, for components/schemas.
    record_schemas: dict[str, JsonObject]

    def openapi(self) -> dict[str, Any]:
        if self.openapi_schema is not None:
            return self.openapi_schema
        doc = super().openapi()
        for methods in doc.get("paths", {}).values():
            for op in methods.values():
                op.get("responses", {}).pop("422", None)
                for param in op.get("parameters", ()):
                    if param.get("schema", {}).pop(REQUIRED, False):
                        param["required"] = True
                        param["schema"].pop("default", None)
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        for name, schema in self.record_schemas.items():
            if name in schemas:  # a result and a pydantic model of one name: one would hide the other
                raise RuntimeError(f"/openapi.json: two schemas are named {name}")
            schemas[name] = refs_under(schema, COMPONENTS)
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        self.openapi_schema = doc
        return doc


#: The operations answered straight from the operations table (kbd/ops.py
#: :class:`kbd.ops.Route`), each with the body model that checks and documents
#: its request (its result documents itself).
SERVED: dict[type[ops.Op[Record]], type[Strict] | None] = {
    ops.WorkflowsList: None,
    ops.WorkflowShow: None,
    ops.SourcesList: None,
    ops.SetSources: ReplaceSourcesBody,
    ops.Attach: AttachBody,
    ops.Detach: None,
    ops.SetAccess: AccessBody,
    ops.Candidates: None,
    ops.WorkflowCreate: CreateWorkflowBody,
    ops.WritersList: None,
    ops.Grant: GrantBody,
    ops.Revoke: None,
    ops.SessionOpen: OpenSessionBody,
    ops.SessionEnv: None,
    ops.SessionClose: None,
    ops.NotesPending: None,
    ops.NotesReview: ReviewBody,
    ops.NotesRejected: None,
    ops.NotesUnreject: None,
    ops.Check: CheckBody,
    ops.Why: WhyBody,
    ops.WhyAttach: WhyAttachBody,
    ops.ReadersGrant: ReadersBody,
    ops.ReadersRevoke: ReadersBody,
    ops.PreviewManifest: PreviewBody,
    ops.RequestOpen: RequestBody,
    ops.RequestsList: None,
    ops.RequestDecide: DecisionBody,
    ops.PrincipalsList: None,
    ops.PrincipalAdd: AddPrincipalBody,
    ops.PrincipalToken: None,
}

#: The operations whose routes are written out below, and why: each asks for
#: something the table's plain "run it under the state lock" does not give.
OWN_HANDLER: dict[type[ops.Op[Record]], str] = {
    ops.SessionShow: "answered by PolicyFastPath before routing, from the cached plan",
    ops.SessionRevoke: "the termination waits out its grace period outside the state lock",
    ops.SessionList: "query parameters",
    ops.NoteWrite: "If-Match/If-None-Match, an ETag, and the notes mutex waited for in the notes pool",
    ops.NoteRestore: "the notes mutex waited for in the notes pool",
    ops.NoteLog: "query parameters",
    ops.NoteShow: "query parameters and an ETag",
    ops.NoteDiff: "query parameters",
    ops.Read: "query parameters, an ETag, the read outside the state lock",
    ops.OwnRead: "query parameters, an ETag, the read outside the state lock",
    ops.OwnWrite: "an ETag, and the notes or import lock waited for in the notes pool",
    ops.Ls: "query parameters, the listing outside the state lock",
    ops.OwnLs: "query parameters, the listing outside the state lock",
    ops.Import: "documents decoded from base64, the writes outside the state lock",
    ops.Search: "query parameters, the index read outside the state lock",
    ops.PrincipalChange: "the action is a path segment (an unknown one is 404)",
    ops.AuditChunk: "query parameters, read without the state lock",
    ops.Doctor: "admins only, on a fresh Root of the daemon's own root",
}


def serve_op(
    app: _Api, state: State, op: type[ops.Op[Record]], body: type[Strict] | None, actor: Any
) -> None:
    """Answer ``op``'s :class:`kbd.ops.Route` by running the operation under the
    state lock, as on a root the CLI uses itself (docs/architecture.md "Typed
    operations"): the path's names and the body (checked by ``body``, which
    documents it) make the operation, whose result documents itself
    (:meth:`kbd.core.records.Record.json_schema`); ``actor`` is the
    authenticating dependency."""
    route = op.route
    hints = typing.get_type_hints(op)
    params = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=hints[route.field_of(name)])
              for name in route.names]  # fmt: skip
    if body is not None:
        params.append(inspect.Parameter("body", inspect.Parameter.KEYWORD_ONLY, annotation=body))
    params.append(
        inspect.Parameter("actor", inspect.Parameter.KEYWORD_ONLY, annotation=Principal, default=actor)
    )
    if op.previewable:
        params.append(
            inspect.Parameter("dry_run", inspect.Parameter.KEYWORD_ONLY, annotation=bool, default=DRY_RUN)
        )
    wire_keys = tuple(route.body or ())

    def endpoint(**values: Any) -> JsonObject | JSONResponse:
        who: Principal = values.pop("actor")
        dry_run = values.pop("dry_run", False)
        if (checked := values.pop("body", None)) is not None:
            values.update({k: getattr(checked, k) for k in wire_keys})
        request = op.from_wire(values)
        with state.locked():
            ctx = ops.DirectContext(state.host, sessions=state.sessions)
            if dry_run:
                return JSONResponse(request.preview(ctx, who).to_json())  # 200: nothing was created
            return request.direct(ctx, who).to_json()

    endpoint.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    endpoint.__name__ = _snake(op.__name__)
    responses = answers(app, op.result(), route.status)
    if op.previewable:
        responses = with_preview(app, responses, route.status)
    app.add_api_route(route.path, endpoint, methods=[route.method], status_code=route.status, response_model=None,
                      responses=responses, name=endpoint.__name__)  # fmt: skip


#: ``?dry_run=true`` on every grant-changing route (docs/access.md "Previews").
DRY_RUN = Query(False, description="preview: answer what the change would do, and change nothing")


def with_preview(app: _Api, responses: dict[int | str, Any], status: int) -> dict[int | str, Any]:
    """``responses`` of a grant-changing route, with the 200 its ``?dry_run=true`` answers."""
    from kbd.service.preview import Preview

    preview = refs_under(Preview.json_schema(app.record_schemas), COMPONENTS)
    out = dict(responses)
    if status == 200:
        result = out[200]["content"]["application/json"]["schema"]
        out[200] = {**out[200], "content": {"application/json": {"schema": {"anyOf": [result, preview]}}}}
    else:
        out[200] = {
            "description": "The preview (dry_run=true)",
            "content": {"application/json": {"schema": preview}},
        }
    return out


def answers(
    app: _Api, result: type[Record], status: int = 200, more: Mapping[int | str, JsonObject] | None = None
) -> dict[int | str, Any]:
    """A route's ``responses``: ``result``'s schema (:meth:`kbd.core.records.Record.json_schema`,
    its nested records into components/schemas) for ``status``, and ``more``.
    The route answers the result's ``to_json()``, as the CLI's ``--json`` prints it."""
    schema = refs_under(result.json_schema(app.record_schemas), COMPONENTS)
    return {status: {"description": "Successful Response", "content": {"application/json": {"schema": schema}}},
            **(more or {})}  # fmt: skip


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def create_app(host: Root, *, event_log: EventLog | None = None) -> FastAPI:
    """The API over ``host``. ``event_log``: the daemon's event log, when it
    opened one itself (else :class:`State` opens it). Appends ``resync``
    (``restart``) for subscribers: whatever happened while no daemon watched
    is not in the log."""
    state = State(host, event_log=event_log)
    state.feed.resync("restart")
    app = _Api(
        title="kbd",
        version="1",
        description="Knowledge-base attachment daemon API (docs/api.md).",
        # FastAPI's /docs and /redoc pages load their code from a CDN; a host
        # service serves no page whose scripts come from the network
        # (docs/api.md "The schema").
        docs_url=None,
        redoc_url=None,
        responses={400: {"model": ErrorResponse, "description": "a request that cannot be decoded (docs/api.md \"Malformed requests\")"},
                   401: {"model": ErrorResponse, "description": "no or unknown credentials",
                         "headers": {"WWW-Authenticate": {"schema": {"type": "string", "const": "Bearer"}}}},
                   403: {"model": ErrorResponse}, 404: {"model": ErrorResponse}, 409: {"model": ErrorResponse},
                   503: {"model": ErrorResponse},
                   "default": {"model": ErrorResponse, "description": "any other refusal, in the same envelope"}},
    )  # fmt: skip
    app.record_schemas = {}
    app.state.kbd = state
    app.add_middleware(
        OneSegmentIds, counted=state.counted
    )  # innermost: the policy fast path never routes a '/' in an ID
    app.add_middleware(PolicyFastPath, state=state)  # inside BodyLimit (added after it: outermost)
    app.add_middleware(BodyLimit)
    app.add_middleware(HeadAsGet)
    # Outermost: the access log and request metrics see every answer the app gives.
    stats = telemetry.RequestStats()
    app.add_middleware(AccessLog, stats=stats)

    def refuse(err: KbdError) -> JSONResponse:
        state.counted.refused(err.code)
        return _error(err)

    @app.exception_handler(KbdError)
    async def _kbd_error(_: Request, err: KbdError) -> JSONResponse:
        return refuse(err)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return refuse(
            InvalidInput(validation_message(exc.errors()), hint="see /openapi.json for the request shape")
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # The framework's own refusals (no such route or method, a body it cannot
        # parse) in the tree's terms; 405 keeps the Allow header it must carry.
        cls = HTTP_ERRORS.get(exc.status_code, InvalidInput if exc.status_code < 500 else KbdError)
        unreadable = body_problem(exc.__cause__) if exc.status_code == 400 else None
        if unreadable is not None:
            response = refuse(InvalidInput(unreadable, hint="see /openapi.json for the request shape"))
        else:
            response = refuse(cls(str(exc.detail), hint="see /openapi.json for the routes"))
        if exc.status_code == 405:
            response.headers["Allow"] = allowed_methods(app, request.scope)
        return response

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        if isinstance(exc, OSError) and exc.errno in NO_SPACE_ERRNOS:
            return refuse(from_oserror(exc, what="complete the request"))
        log.exception("internal error")
        return refuse(KbdError("internal error"))

    Bearer = Security(BEARER)

    async def principal(request: Request, _: Any = Bearer) -> Principal:
        # BEARER only declares the scheme in /openapi.json; the header is read here.
        who = state.authenticate(request.url.path, request.headers.get("authorization"),
                                 request.scope.get(PEER_UID))  # fmt: skip
        note_principal(request.scope, who.id)
        return who

    Actor = Depends(principal)

    # First: /v1/principals/{pid}/token before the written-out /v1/principals/{pid}/{action}.
    for op, body in SERVED.items():
        serve_op(app, state, op, body, Actor)

    # Query values read as text and checked as the CLI's flags are (the same
    # answers); documented as what they accept.
    LsLimit = Query(
        None, json_schema_extra=_schema({"type": "integer", "minimum": 1, "maximum": MAX_LS_LIMIT})
    )
    Version = Query(None, json_schema_extra=_schema({"type": "string", "pattern": NOTE_VERSION}))
    # One parameter object per parameter name: the framework records the name it binds in it.
    Against = Query(None, json_schema_extra=_schema({"type": "string", "pattern": NOTE_VERSION}))
    After = Query(None, json_schema_extra=_schema({"type": "string", "minLength": 1}))
    RelPath = Query(json_schema_extra=_schema({"type": "string", "minLength": 1}))
    Known = Header(
        None, alias="If-None-Match", description="a version the client has (or *): 304 when current"
    )
    IfMatch = Header(None, alias="If-Match", description="the version the write expects, none, or * (any)",
                     json_schema_extra=_schema({"type": "string", "pattern": IF_MATCH}))  # fmt: skip
    IfNoneMatch = Header(None, alias="If-None-Match", description="*: the note must not exist yet",
                         json_schema_extra=_schema({"type": "string", "enum": ["*"]}))  # fmt: skip
    # ?alias=a&alias=b (or alias=a,b): the sources a search is narrowed to.
    Aliases = Query(default_factory=list)

    # health and whoami are async: they never wait for a worker thread.
    @app.get("/v1/health", response_model=None, responses=answers(app, admin.Health))
    async def health() -> JsonObject:
        return admin.health(state.host, started=state.started, now=time.time()).to_json()

    @app.get(
        "/v1/metrics",
        response_model=None,
        responses={200: {"content": {"application/json": {"schema": refs_under(
                                         admin.Metrics.json_schema(app.record_schemas), COMPONENTS)},
                                     telemetry.CONTENT_TYPE: {"schema": {"type": "string"}}},
                         "description": "JSON by default; the Prometheus text format (0.0.4) for "
                                        "?format=prometheus or an Accept header preferring text/plain"}},
    )  # fmt: skip
    def metrics(
        request: Request,
        fmt: str | None = Query(None, alias="format", json_schema_extra={"enum": ["json", "prometheus"]}),
        actor: Principal = Actor,
    ) -> JsonObject | Response:
        admin.may_see_metrics(actor=actor)  # a refusal never waits for the state lock
        if telemetry.wants_prometheus(fmt, request.headers.get("accept")):
            # The counters are the event loop's: copied there, never read while changing.
            counted = anyio.from_thread.run_sync(stats.snapshot)
            live = getattr(app.state, "live", None)
            with state.locked():
                gauges = host_gauges(state.sessions, watcher_up=None if live is None else bool(live.healthy),
                                     started=state.started)  # fmt: skip
            return Response(telemetry.exposition(counted, gauges, state.counted.snapshot()),
                            media_type=telemetry.CONTENT_TYPE)  # fmt: skip
        with state.locked():
            return admin.metrics(state.sessions, actor=actor, requests=dict(state.requests)).to_json()

    @app.get("/v1/whoami", response_model=None, responses=answers(app, auth.Identity))
    async def whoami(actor: Principal = Actor) -> JsonObject:
        return auth.Identity.of(actor).to_json()

    @app.get(
        "/v1/workflows/{wid}/sources/{alias}/file",
        response_model=None,
        responses=answers(app, ops.Read.result(), more=NOT_MODIFIED),
    )
    def read_file(
        wid: str,
        alias: str,
        response: Response,
        path: str = RelPath,
        actor: Principal = Actor,
        known: str | None = Known,
    ) -> JsonObject | Response:
        with state.locked():
            att = browse_ops.attachment(state.host, wid, alias, actor=actor)
        # The read (and the index reader's retries) outside the state lock.
        found = browse_ops.read_file(att, wid, alias, path)
        return _tagged(found.to_json(), version_of(found.data), known, response)

    @app.get(
        "/v1/workflows/{wid}/sources/{alias}/dir",
        response_model=None,
        responses=answers(app, ops.Ls.result()),
    )
    def list_dir(
        wid: str, alias: str, path: str = "", limit: str | None = LsLimit, after: str | None = After,
        actor: Principal = Actor,
    ) -> JsonObject:  # fmt: skip
        size = _ls_limit(limit)
        with state.locked():
            att = browse_ops.attachment(state.host, wid, alias, actor=actor)
        # The listing outside the state lock.
        return browse_ops.list_dir(att, wid, alias, path, limit=size, after=after).to_json()

    @app.get(
        "/v1/workflows/{wid}/kb/file",
        response_model=None,
        responses=answers(app, ops.OwnRead.result(), more=NOT_MODIFIED),
    )
    def read_own_file(
        wid: str, response: Response, path: str = RelPath, actor: Principal = Actor, known: str | None = Known
    ) -> JsonObject | Response:
        with state.locked():
            att = browse_ops.own_kb(state.host, wid, actor=actor)
        found = browse_ops.read_file(att, wid, None, path)
        return _tagged(found.to_json(), version_of(found.data), known, response)

    @app.get("/v1/workflows/{wid}/kb/dir", response_model=None, responses=answers(app, ops.OwnLs.result()))
    def list_own_dir(
        wid: str,
        path: str = "",
        limit: str | None = LsLimit,
        after: str | None = After,
        actor: Principal = Actor,
    ) -> JsonObject:
        size = _ls_limit(limit)
        with state.locked():
            att = browse_ops.own_kb(state.host, wid, actor=actor)
        return browse_ops.list_dir(att, wid, None, path, limit=size, after=after).to_json()

    @app.get(
        "/v1/workflows/{wid}/notes/history", response_model=None, responses=answers(app, ops.NoteLog.result())
    )
    def note_log(wid: str, path: str = RelPath, actor: Principal = Actor) -> JsonObject:
        with state.locked():
            return history_ops.log(state.host, wid, path, actor=actor).to_json()

    @app.get(
        "/v1/workflows/{wid}/notes/history/version",
        response_model=None,
        responses=answers(app, ops.NoteShow.result(), more=NOT_MODIFIED),
    )
    def note_version(wid: str, response: Response, path: str = RelPath, version: str | None = Version,
                     actor: Principal = Actor, known: str | None = Known) -> JsonObject | Response:  # fmt: skip
        with state.locked():
            found = history_ops.show(state.host, wid, path, actor=actor, version=version)
        return _tagged(found.to_json(), found.version, known, response)

    @app.get(
        "/v1/workflows/{wid}/notes/history/diff",
        response_model=None,
        responses=answers(app, ops.NoteDiff.result()),
    )
    def note_diff(
        wid: str,
        path: str = RelPath,
        version: str | None = Version,
        against: str | None = Against,
        actor: Principal = Actor,
    ) -> JsonObject:
        with state.locked():
            return history_ops.diff(
                state.host, wid, path, actor=actor, version=version, against=against
            ).to_json()

    @app.post(
        "/v1/workflows/{wid}/notes/history/restore",
        response_model=None,
        responses=answers(app, ops.NoteRestore.result()),
    )
    async def note_restore(wid: str, body: RestoreBody, actor: Principal = Actor) -> JsonObject:
        def prepare() -> history_ops.PreparedRestore:
            with state.locked():
                return history_ops.prepare_restore(
                    state.host, wid, body.path, actor=actor, version=body.version
                )

        prepared = await run_in_threadpool(prepare)
        # The notes mutex wait (up to the lock timeout) outside the state lock, in the notes pool.
        done = await anyio.to_thread.run_sync(
            history_ops.commit_restore, prepared, limiter=state.notes_limiter()
        )
        return done.to_json()

    @app.get("/v1/sessions", response_model=None, responses=answers(app, ops.SessionList.result()))
    def list_sessions(
        workflow_id: str | None = None, all: bool = False, actor: Principal = Actor
    ) -> JsonObject:
        with state.locked():
            return session_ops.list_sessions(
                state.sessions, actor=actor, workflow_id=workflow_id, include_closed=all
            ).to_json()

    @app.post(
        "/v1/sessions/{sid}/revoke", response_model=None, responses=answers(app, ops.SessionRevoke.result())
    )
    def revoke_session(sid: str, body: RevokeBody, actor: Principal = Actor) -> JsonObject:
        with state.locked():
            todo = session_ops.revocation(state.sessions, sid, actor=actor, immediate=body.immediate)
        # Termination waits out the grace period: outside the state lock.
        return session_ops.carry_out(state.sessions, todo).to_json()

    @app.get("/v1/sessions/{sid}", response_model=None, responses=answers(app, ops.SessionShow.result()))
    async def session_policy(sid: str, actor: Principal = Actor) -> Response:
        # Served by PolicyFastPath before routing; declared here for the
        # schema (and answered the same way should a request reach it). The
        # plan is already in the documented shape: no pydantic re-validation.
        return Response(await state.policy_body(sid, actor), media_type="application/json")

    @app.post("/v1/workflows/{wid}/import", response_model=None, responses=answers(app, ops.Import.result()))
    async def import_documents(wid: str, body: ImportBody, actor: Principal = Actor) -> JsonObject:
        docs = body.docs()

        def target() -> import_ops.Target:
            with state.locked():
                return import_ops.target(state.host, wid, actor=actor)

        found = await run_in_threadpool(target)
        # The writes (an fsync each) outside the state lock: other requests go on.
        result = await run_in_threadpool(
            import_ops.apply, found, docs, folder=body.folder, skipped=[(s.file, s.reason) for s in body.skipped],
            dry_run=body.dry_run, update=body.update,
        )  # fmt: skip
        return result.to_json()

    @app.post(
        "/v1/sessions/{sid}/children",
        response_model=None,
        status_code=201,
        responses=answers(app, ops.SessionOpen.result(), 201),
    )
    def open_child(sid: str, body: ChildBody, actor: Principal = Actor) -> JsonObject:
        with state.locked():
            plan = session_ops.open_child(state.sessions, sid, actor=actor, kind=body.kind,
                                          kb_access=body.kb_access, item_kb_write=body.item_kb_write)  # fmt: skip
            return plan.to_json()

    @app.post(
        "/v1/sessions/{sid}/notes",
        response_model=None,
        status_code=201,
        responses=answers(app, ops.NoteWrite.result(), 201),
    )
    async def write_note(sid: str, body: NoteBody, request: Request, response: Response,
                         actor: Principal = Actor, if_match: str | None = IfMatch,
                         if_none_match: str | None = IfNoneMatch) -> JsonObject:  # fmt: skip
        data = body.data()
        # If-Match: * asks for any current version, If-None-Match: * for none (RFC 9110 §13.1.1-2).
        must_exist = if_match is not None and if_match.strip() == "*"
        # The body's expected_version (the CLI's) and If-Match are both preconditions: each must hold.
        also = None if must_exist else if_match
        if if_none_match is not None and if_none_match.strip() != "*":
            raise UsageError(f"If-None-Match on a note write takes only *, not {if_none_match[:80]!r}",
                             hint="name the version you expect with If-Match")  # fmt: skip
        if state.notes_in_flight >= NOTE_WORKERS + NOTE_BACKLOG:
            raise Overloaded(f"{state.notes_in_flight} note writes are already waiting")

        def prepare() -> note_ops.PreparedNote:
            with state.locked():
                return note_ops.prepare(state.sessions, sid, body.alias, body.path, data, actor=actor,
                                        expected=body.expected_version, must_exist=must_exist,
                                        must_not_exist=if_none_match is not None, also_expected=also)  # fmt: skip

        state.notes_in_flight += 1
        try:
            prepared = await run_in_threadpool(prepare)
            # Outside the state lock and in the notes pool: waiting for the
            # notes mutex (up to the lock timeout, while a write command runs)
            # stalls neither other requests nor the shared worker threads.
            written = await anyio.to_thread.run_sync(note_ops.commit, prepared, limiter=state.notes_limiter())
            response.headers["ETag"] = f'"{written.version}"'
            return written.to_json()
        finally:
            state.notes_in_flight -= 1

    @app.put(
        "/v1/workflows/{wid}/kb/file", response_model=None, responses=answers(app, ops.OwnWrite.result())
    )
    async def write_own_file(
        wid: str, body: KbFileBody, response: Response, actor: Principal = Actor
    ) -> JsonObject:
        if state.notes_in_flight >= NOTE_WORKERS + NOTE_BACKLOG:
            raise Overloaded(f"{state.notes_in_flight} note writes are already waiting")

        def prepare() -> own_kb.PreparedEdit:
            with state.locked():
                return own_kb.prepare_own(state.sessions, wid, body.path, body.content.encode("utf-8"),
                                          actor=actor, expected=body.expected_version)  # fmt: skip

        state.notes_in_flight += 1
        try:
            prepared = await run_in_threadpool(prepare)
            # As a note write: the lock of notes/ or of the KB's import is waited for
            # outside the state lock, in the notes pool.
            written = await anyio.to_thread.run_sync(
                own_kb.commit_own, prepared, limiter=state.notes_limiter()
            )
            response.headers["ETag"] = f'"{written.version}"'
            return written.to_json()
        finally:
            state.notes_in_flight -= 1

    @app.get("/v1/sessions/{sid}/search", response_model=None, responses=answers(app, ops.Search.result()))
    def search(
        sid: str,
        q: str = Query("", json_schema_extra=_schema(SEARCH_QUERY, required=True)),
        alias: list[str] = Aliases,
        limit: str | None = Query(None, json_schema_extra=_schema({"type": "integer", "minimum": 1,
                                                                   "maximum": MAX_SEARCH_LIMIT})),
        include_unreviewed: bool = False, actor: Principal = Actor,
    ) -> JsonObject:  # fmt: skip
        # Checked in the CLI's order (query, limit, then the session), so both answer alike.
        match_expression(q)
        size = None
        if limit is not None:
            size = check_limit(_whole(limit, field="limit (--limit)", top=MAX_SEARCH_LIMIT))
        aliases = tuple(a for value in alias for a in value.split(",") if a)
        with state.locked():
            where = search_ops.scope(state.sessions, sid, aliases, actor=actor)
        # Refreshing and reading the index outside the state lock; the daemon's
        # searcher watches the KBs it searched (a write is found within ~0.1 s).
        state_dir = state.host.config.state_dir
        return search_ops.run(state_dir, where, q, limit=size, include_unreviewed=include_unreviewed,
                              searcher=search_ops.searcher_for(state_dir, watch=True)).to_json()  # fmt: skip

    @app.get(
        EVENTS_PATH,
        response_class=StreamingResponse,
        responses={
            200: {
                "content": {"text/event-stream": {"schema": EVENT_SCHEMA}},
                "description": "Server-Sent Events, each an event id, its type and its JSON",
            }
        },
    )
    async def events(
        request: Request,
        since: str | None = Query(None, json_schema_extra=_schema({"type": "string", "pattern": EVENT_ID})),
        follow: bool = True,
        actor: Principal = Actor,
    ) -> StreamingResponse:
        """The change feed: content-free notices (docs/daemon.md), each with ``id:``.
        Resumes after ``Last-Event-ID`` (or ``since``; the header wins); without
        either, live from now, or with ``follow=false`` the recent events. Each
        event is shown only if the caller may see its workflow when it is sent."""
        last = request.headers.get("last-event-id") or since
        if last is not None and parse_id(last) is None:
            field = "Last-Event-ID" if request.headers.get("last-event-id") else "since"
            raise InvalidInput(
                f"{field} must be an event id such as 0a1b2c3d-42 (8 hex digits, '-', a number), not {last[:80]!r}",
                hint="pass the id: of the last event you received",
            )
        authorization = request.headers.get("authorization")
        uid = request.scope.get(PEER_UID)

        def who() -> Principal | None:
            # Called under the state lock for every batch: a disabled principal
            # or a withdrawn token ends the stream at its next event.
            try:
                state.host.refresh()
                found = auth.authenticate(state.host.principals, authorization=authorization,
                                          peer_uid=uid if isinstance(uid, int) else None)  # fmt: skip
            except KbdError:
                return None
            return found if isinstance(found, Principal) else None

        del actor  # authenticated by the dependency; who() re-checks at every delivery
        # Admitted (or refused: StreamLimit, 503) and its backlog read before
        # the stream starts (docs/daemon.md "The change feed").
        subscription = await state.feed.open(
            who, since=last, follow=follow, uid=uid if isinstance(uid, int) else None
        )
        return _EventStream(
            subscription,
            state.feed.frames(subscription, who, follow=follow),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    # -- the root's administration, for admins (the CLI's principals, audit and doctor) --

    @app.post(
        "/v1/principals/{pid}/{action}",
        response_model=None,
        responses=with_preview(app, answers(app, ops.PrincipalChange.result()), 200),
    )
    def change_principal(pid: str, action: str, body: ForceBody, actor: Principal = Actor,
                         dry_run: bool = DRY_RUN) -> JsonObject:  # fmt: skip
        with state.locked():
            if dry_run and action in ("enable", "disable", "remove"):
                ctx = ops.DirectContext(state.host, sessions=state.sessions)
                change = ops.PrincipalChange(action, pid, body.force)  # type: ignore[arg-type]
                return change.preview(ctx, actor).to_json()
            if action == "enable":
                return principal_ops.enable(state.host, pid, actor=actor).to_json()
            if action == "disable":
                return principal_ops.disable(state.host, pid, force=body.force, actor=actor).to_json()
            if action == "remove":
                return principal_ops.remove(state.host, pid, force=body.force, actor=actor).to_json()
        raise NotFound(f"no principal action {action!r}", hint="actions: disable, enable, remove, token")

    @app.get("/v1/audit", response_model=None, responses=answers(app, ops.AuditChunk.result()))
    def audit(offset: int = 0, workflow: str | None = None, actor: Principal = Actor) -> JsonObject:
        # Who may read what is decided under the state lock (registry, sessions); the
        # log is append-only and read by offset outside it.
        with state.locked():
            scope = admin.audit_scope(state.sessions, actor=actor, workflow=workflow)
        return admin.audit_chunk(state.host, offset=offset, scope=scope).to_json()

    @app.get("/v1/doctor", response_model=None, responses=answers(app, ops.Doctor.result()))
    def doctor(workflow: str | None = None, actor: Principal = Actor) -> JsonObject:
        if not actor.enabled_admin:
            raise PermissionDenied(
                f"principal {actor.id!r} may not run the daemon's checks", hint="only admins may"
            )
        # A fresh Root of the daemon's own root, as `kbd doctor` on it would make.
        return admin.doctor(state.host.config.root, workflow_id=workflow).to_json()

    return app

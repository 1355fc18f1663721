"""Access requests (docs/access.md "Access requests"): a builder who meets ``write_not_granted`` or
``audience_denied`` asks the source's owners, who approve or decline.

- **Asking**: the consumer's managers (owners, editors, admins) ask for their workflow; the source
  must be one they may inspect (else the answer a missing workflow gets: a request never confirms a
  source exists). ``write``: a writer grant (``kbd writers grant``); ``read``: the consumer's whole
  audience admitted (``kbd readers grant`` of the members the source does not admit yet). A request
  for what is already so is refused, and one open request per (source, consumer, kind) may exist.
- **Deciding**: the source's owners and admins. Approval makes the grant through the very operation
  of ``kbd writers grant`` / ``kbd readers grant`` (its authorization, lock and audit record, which
  names the request), then marks the request approved; a refused grant leaves it pending.
- **Seeing**: a request is listed to the one who asked and to those who may decide it. Requests
  expire after kbd.yaml's ``requests.expire_days`` (default 14).
- Every change is audited (``request_opened|decided``) and announced on the change feed
  (``request.opened|decided``) to those who may see both workflows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kbd.core import audience
from kbd.core.events import format_at
from kbd.core.principals import Principal
from kbd.core.records import Record
from kbd.errors import InvalidInput, NotFound, PermissionDenied, RequestOpen, workflow_not_found
from kbd.fs.registry import Found
from kbd.service.root import Root
from kbd.state import requests as store

KINDS = ("read", "write")
MAX_MESSAGE = 500
DAY = 86_400.0


@dataclass(frozen=True)
class AccessRequest(Record):
    """One access request as its asker or a decider sees it."""

    request_id: int
    kind: Literal["read", "write"]
    source: str
    consumer: str
    requested_by: str
    message: str
    state: Literal["pending", "approved", "declined", "expired"]
    opened_at: str
    expires_at: str
    decided_by: str | None
    decided_at: str | None
    decision_message: str | None
    #: May the caller approve or decline it (a source owner or an admin, while it is pending)?
    can_decide: bool


@dataclass(frozen=True)
class RequestList(Record):
    requests: tuple[AccessRequest, ...]


def _at(seconds: float | None) -> str | None:
    return None if seconds is None else format_at(int(seconds * 1_000_000_000))


def _shown(row: store.RequestRow, *, can_decide: bool) -> AccessRequest:
    return AccessRequest(row.id, row.kind, row.source, row.consumer, row.requested_by, row.message,  # type: ignore[arg-type]
                         row.state, _at(row.opened_at) or "", _at(row.expires_at) or "", row.decided_by,  # type: ignore[arg-type]
                         _at(row.decided_at), row.decision_message, can_decide and row.state == "pending")  # fmt: skip


def _message(text: str | None, *, flag: str = "--message") -> str:
    text = (text or "").strip()
    if len(text) > MAX_MESSAGE:
        raise InvalidInput(f"{flag} is {len(text)} characters long; at most {MAX_MESSAGE} are allowed")
    if any(ord(ch) < 0x20 or 0x7F <= ord(ch) <= 0x9F for ch in text):
        raise InvalidInput(f"{flag} holds a control character (one line of plain text is allowed)")
    return text


def _may_decide(root: Root, actor: Principal, source_id: str) -> bool:
    found = root.registry.find(source_id)
    return isinstance(found, Found) and audience.can_grant_writers(actor, found.manifest)


def open_request(root: Root, kind: str, source_id: str, consumer_id: str, *, actor: Principal,
                 message: str | None = None) -> AccessRequest:  # fmt: skip
    """``actor`` asks ``source_id``'s owners to let ``consumer_id`` read (its whole audience) or write."""
    try:
        return _open(root, kind, source_id, consumer_id, actor=actor, message=message)
    except (InvalidInput, NotFound, PermissionDenied, RequestOpen) as err:
        root.audit_refusal("request_refused", err, actor=actor, action="open", kind=str(kind)[:10],
                           source=source_id[:200], consumer=consumer_id[:200])  # fmt: skip
        raise


def _open(root: Root, kind: str, source_id: str, consumer_id: str, *, actor: Principal,
          message: str | None) -> AccessRequest:  # fmt: skip
    from kbd.service.workflows import inspectable

    if kind not in KINDS:
        raise InvalidInput(f"kind {str(kind)[:20]!r} is not allowed; allowed: read, write")
    text = _message(message)
    consumer = inspectable(root, consumer_id, actor=actor).manifest
    if not audience.can_manage_sources(actor, consumer):
        raise PermissionDenied(f"{actor.id!r} may not ask for {consumer.id!r}: its owners, editors and admins may",
                               hint=f"ask an owner of {consumer.id}")  # fmt: skip
    found = root.registry.find(source_id)
    if not isinstance(found, Found):
        raise workflow_not_found(source_id)
    audience.require_inspectable(actor, found.manifest, source_id)
    source = found.manifest
    if source.id == consumer.id:
        raise InvalidInput(
            f"{consumer.id!r} is the source itself: a workflow already reads and writes its own KB"
        )
    if source.is_legacy:
        raise InvalidInput(f"{source.id!r} has no owner: nobody could decide a request "
                           f"({'it is account-visible' if kind == 'read' else 'no grant can open its notes/'})")  # fmt: skip
    if kind == "write" and consumer.id in source.access.allowed_kb_writers:
        raise InvalidInput(f"{source.id!r} already lets {consumer.id!r} write into its notes/",
                           hint=f"`kbd why attach {consumer.id} {source.id} --access write` says what else is missing")  # fmt: skip
    if kind == "read":
        if consumer.is_legacy:
            raise InvalidInput(f"{consumer.id!r} has no owner (account-visible): no reader grant admits everyone",
                               hint=f"give {consumer.id} an owner first (access.owners)")  # fmt: skip
        if audience.can_read(consumer, source, root.principals):
            raise InvalidInput(f"{source.id!r} already admits {consumer.id!r}'s whole audience")
    try:
        row = store.open_request(root.config.state_dir, kind=kind, source=source.id, consumer=consumer.id,
                                 by=actor.id, message=text, expires_in=root.config.request_expire_days * DAY)  # fmt: skip
    except store.Duplicate as dup:
        raise RequestOpen(f"request {dup.row.id} already asks {source.id!r} to let {consumer.id!r} {kind} "
                          f"(opened by {dup.row.requested_by!r})") from None  # fmt: skip
    root.audit("request_opened", actor=actor.id, request_id=row.id, kind=kind, source=source.id,
               consumer=consumer.id)  # fmt: skip
    root.events.emit("request.opened", workflow_id=source.id, consumer=consumer.id, request_id=row.id)
    return _shown(row, can_decide=audience.can_grant_writers(actor, source))


def list_requests(root: Root, *, actor: Principal) -> RequestList:
    """The requests ``actor`` made or may decide, newest first."""
    out = []
    for row in store.every(root.config.state_dir):
        decides = _may_decide(root, actor, row.source)
        if decides or row.requested_by == actor.id:
            out.append(_shown(row, can_decide=decides))
    return RequestList(tuple(out))


def decide(
    root: Root, rid: int, *, approve: bool, actor: Principal, message: str | None = None
) -> AccessRequest:
    """Approve (make the grant, then mark it) or decline request ``rid``: its source's owners and
    admins only. A request the actor may not see is not found."""
    try:
        return _decide(root, rid, approve=approve, actor=actor, message=message)
    except (InvalidInput, NotFound, PermissionDenied) as err:
        root.audit_refusal("request_refused", err, actor=actor, action="approve" if approve else "decline",
                           request_id=rid)  # fmt: skip
        raise


def _decide(root: Root, rid: int, *, approve: bool, actor: Principal, message: str | None) -> AccessRequest:
    from kbd.service import workflows

    text = _message(message)
    row = store.get(root.config.state_dir, rid)
    decides = row is not None and _may_decide(root, actor, row.source)
    if row is None or not (decides or row.requested_by == actor.id):
        raise NotFound(f"no access request {rid}", hint="`kbd requests list` shows the requests you may see")
    if not decides:
        raise PermissionDenied(f"only an owner of {row.source!r} (or an admin) decides request {rid}")
    if row.state != "pending":
        raise InvalidInput(f"request {rid} is {row.state} already: nothing to decide")
    if approve:
        if row.kind == "write":
            workflows.grant(root, row.source, row.consumer, actor=actor, request_id=rid)
        else:
            missing = _missing_readers(root, row.source, row.consumer)
            if missing:
                workflows.grant_readers(root, row.source, missing, actor=actor, request_id=rid)
    decided = store.decide(root.config.state_dir, rid, state="approved" if approve else "declined", by=actor.id,
                           message=text)  # fmt: skip
    if decided is None:  # decided or expired meanwhile: what it is now
        raise InvalidInput(f"request {rid} was decided or expired meanwhile")
    root.audit("request_decided", actor=actor.id, request_id=rid, decision=decided.state, kind=row.kind,
               source=row.source, consumer=row.consumer)  # fmt: skip
    root.events.emit("request.decided", workflow_id=row.source, consumer=row.consumer, request_id=rid)
    return _shown(decided, can_decide=True)


def _missing_readers(root: Root, source_id: str, consumer_id: str) -> tuple[str, ...]:
    """The members of the consumer's audience the source does not admit now."""
    source, consumer = root.workflow(source_id).manifest, root.workflow(consumer_id).manifest
    return audience.not_admitted(consumer, source, root.principals)

"""The one exception tree of kbd.

Every error a user can see is a :class:`KbdError`, and every one of them is
defined here. Each class carries a stable kebab-case ``code``, a process exit
code (docs/cli.md "Exit codes": 0 2 65 66 69 70 75 77) and an HTTP status, so the CLI and the
API turn any of them into the same answer without knowing the class::

    KbdError                        70  500  internal
    ├── UsageError                   2  400  usage                    bad command-line use
    │   └── MethodNotAllowed         2  405  method-not-allowed       no such method on an API route
    ├── InvalidInput                65  400  invalid-input
    │   ├── InvalidConfig           65  400  invalid-config           kbd.yaml / principals.yaml / policies
    │   ├── InvalidManifest         65  400  invalid-manifest         workflow.json field rules
    │   ├── ManifestUnreadable      65  400  manifest-unreadable
    │   ├── AmbiguousWorkflow       65  400  ambiguous-id             two folders claim one ID
    │   ├── SourceUnusable          65  400  source-unusable          new entry does not resolve (*)
    │   ├── InvalidPath             65  400  invalid-path             not a relative path inside a KB
    │   ├── InjectionRefused        65  400  injection-refused        a note that instructs its reader
    │   ├── QuotaExceeded           65  413  quota-exceeded           a source's notes/ quota
    │   ├── PayloadTooLarge         65  413  too-large                an API request body over the limit
    │   │   └── HeadersTooLarge     65  431  too-large                request line + headers over the cap
    │   ├── RequestTimeout          65  408  timeout                  API request headers too slow
    │   ├── UnsafeSocketFolder      65  400  unsafe-socket-folder
    │   ├── RootExists              65  400  root-exists              init over an existing root
    │   ├── WireError               65  400  protocol-error           malformed exec-broker bytes
    │   └── RootError               65  400  root-error               kbd root missing or unsafe
    ├── NotFound                    66  404  not-found                (also: what an outsider may not see)
    │   ├── WorkflowNotFound        66  404  workflow-not-found
    │   └── PathNotFound            66  404  path-not-found
    ├── Unavailable                 69  503  unavailable              sandbox / service missing
    │   ├── ContainmentUnavailable  69  503  containment-unavailable  no per-command cgroup
    │   ├── SandboxSetupError       69  503  sandbox-setup
    │   ├── GrantGroupMissing       69  503  grant-group-missing      sandbox.grant_group not on this host
    │   └── SourceUnavailable       69  409  source-unavailable       attached, not available now (*)
    ├── Busy                        75  409  busy                     lock timeout, retry
    │   ├── Overloaded              75  503  busy                     daemon overloaded (see below)
    │   │   └── StreamLimit         75  503  stream-limit             event streams or replays over a cap
    │   ├── VersionConflict         75  409  version-conflict         expected version is stale
    │   │   └── NoteVersionConflict 75  412  note-version-conflict    a note changed since that version
    │   ├── IndexUnreadable         75  409  index-unreadable         notes/_index.json mid-rewrite
    │   ├── WorkflowExists          75  409  workflow-exists          workflows create: ID or folder taken
    │   └── RequestOpen             75  409  request-open             an access request like it is open
    ├── NoSpace                     75  507  no-space                 disk or quota full (ENOSPC, EDQUOT)
    ├── PermissionDenied            77  403  permission-denied
    │   ├── PathRefused             77  403  path-refused             a link, '..', special file …
    │   ├── SessionClosed           77  410  session-closed
    │   └── Unauthenticated         77  401  unauthenticated          API: no or unknown credentials
    └── StateCorrupt                70  500  state-corrupt            state/sessions.db damaged

(*) The exit code and HTTP status of these two follow their ``reason`` through
the one table :data:`REASON_ERRORS`: ``not_found`` answers as NotFound (66,
404), ``audience_denied`` as PermissionDenied (77, 403); any other reason keeps
the class's own. A class that defines no ``code`` of its own (Overloaded,
HeadersTooLarge) is a transport variant of its parent: same code and exit code, another HTTP status.

Translation happens at choke points, never ad hoc: :func:`from_oserror` for an
``OSError`` (a full disk is ``no-space``, never "permission denied"),
:func:`kbd.state.sqlite.from_sqlite` for the SQLite stores' errors (kept
there so this module stays pure), and
:func:`workflow_not_found` / :func:`session_not_found` for the one answer given
both for what does not exist and for what the actor may not see (docs/access.md "Invisible is not found").

Only ``kbd.cli.commands`` and ``kbd.cli.entry`` (through :func:`kbd.cli.boundary.guarded`) and the
daemon (through :func:`http_answer`) turn these into output; nothing else calls
``sys.exit``. Messages never contain host paths unless the
caller already owns them (the CLI operator owns the root, so CLI-only messages
may name files). This module imports nothing beyond the standard library's
``errno`` and ``os``: it is on ``kbd exec``'s start-up path.
"""

from __future__ import annotations

import errno
import os

# The public surface (tests/unit/test_public_surface.py): the tree drawn above,
# and the table that gives two of its classes their reason's exit code. The
# translators and the HTTP answer are kbd's own choke points, not an API.
__all__ = [
    "REASON_ERRORS",
    "AmbiguousWorkflow",
    "Busy",
    "ContainmentUnavailable",
    "GrantGroupMissing",
    "HeadersTooLarge",
    "IndexUnreadable",
    "InjectionRefused",
    "InvalidConfig",
    "InvalidInput",
    "InvalidManifest",
    "InvalidPath",
    "KbdError",
    "ManifestUnreadable",
    "MethodNotAllowed",
    "NoSpace",
    "NotFound",
    "NoteVersionConflict",
    "Overloaded",
    "PathNotFound",
    "PathRefused",
    "PayloadTooLarge",
    "PermissionDenied",
    "QuotaExceeded",
    "RequestOpen",
    "RequestTimeout",
    "RootError",
    "RootExists",
    "SandboxSetupError",
    "SessionClosed",
    "SourceUnavailable",
    "SourceUnusable",
    "StateCorrupt",
    "StreamLimit",
    "Unauthenticated",
    "Unavailable",
    "UnsafeSocketFolder",
    "UsageError",
    "VersionConflict",
    "WireError",
    "WorkflowExists",
    "WorkflowNotFound",
]


class KbdError(Exception):
    """Base class: an error with a stable code, exit code, HTTP status and hint."""

    code = "internal"
    exit_code = 70
    http_status = 500
    default_hint = "this is a bug in kbd; please report it with the command you ran"
    # A specific reason code (``audience_denied``, ``not_owner`` …) for audit
    # records, when it says more than ``code``.
    reason: str | None = None

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint if hint is not None else self.default_hint

    def to_dict(self) -> dict[str, str]:
        return {"code": self.code, "message": self.message, "hint": self.hint}


# -- 2: usage -----------------------------------------------------------------------------------


class UsageError(KbdError):
    code = "usage"
    exit_code = 2
    http_status = 400
    default_hint = "see `kbd --help`"


class MethodNotAllowed(UsageError):
    code = "method-not-allowed"
    http_status = 405
    default_hint = "see /openapi.json for the routes"


# -- 65: invalid input --------------------------------------------------------------------------


class InvalidInput(KbdError):
    code = "invalid-input"
    exit_code = 65
    http_status = 400
    default_hint = "fix the input and try again"


class InvalidConfig(InvalidInput):
    code = "invalid-config"
    default_hint = "fix the named key in the named file; unknown keys are errors"


class InvalidManifest(InvalidInput):
    code = "invalid-manifest"
    default_hint = "fix the named field; the manifest was left unchanged"


class ManifestUnreadable(InvalidInput):
    code = "manifest-unreadable"
    default_hint = "repair the workflow.json by hand: `kbd validate FILE` lists every problem"


class AmbiguousWorkflow(InvalidInput):
    code = "ambiguous-id"
    default_hint = (
        "two folders claim this workflow ID; give the copied folder a new id in its "
        "workflow.json (kbd uses neither until then)"
    )


def _answer_as_reason(err: KbdError, reason: str) -> None:
    """Give ``err`` the exit code and HTTP status its ``reason`` calls for (see
    :data:`REASON_ERRORS`); other reasons keep the class's own."""
    err.reason = reason
    like = REASON_ERRORS.get(reason)
    if like is not None:
        err.exit_code, err.http_status = like.exit_code, like.http_status


class SourceUnusable(InvalidInput):
    """A new or changed attachment does not resolve, so it cannot be saved.
    Exit code and HTTP status follow ``reason`` (:data:`REASON_ERRORS`)."""

    code = "source-unusable"
    default_hint = "run `kbd sources candidates WF` to see sources this workflow may attach"

    def __init__(
        self, message: str, *, reason: str, hint: str | None = None, source: str | None = None
    ) -> None:
        super().__init__(message, hint=hint)
        self.source = source  # the source workflow ID the entry named, for the audit record
        _answer_as_reason(self, reason)


class InvalidPath(InvalidInput):
    code = "invalid-path"
    default_hint = "use a relative path inside the knowledge base, e.g. notes/_index.json"


class InjectionRefused(InvalidInput):
    code = "injection-refused"
    default_hint = (
        "contributed notes are reference data; rephrase the text so it does not instruct the reader"
    )

    def __init__(self, message: str, *, rule: str) -> None:
        super().__init__(message)
        self.rule = rule


class QuotaExceeded(InvalidInput):
    """A write would take (or a command left) a source's ``notes/`` over its quota
    (``notes_quota`` in kbd.yaml). 65, not 75: retrying does not help until the
    note is smaller or the source's owner frees space, so scripts must not loop.
    HTTP 413: the request's content does not fit."""

    code = "quota-exceeded"
    http_status = 413
    default_hint = (
        "write a smaller note, or ask the source's owner to remove notes or raise notes_quota in kbd.yaml"
    )


class PayloadTooLarge(InvalidInput):
    """An API request body over the daemon's limit, refused before it is read."""

    code = "too-large"
    http_status = 413
    default_hint = "notes are at most 1 MiB"


class HeadersTooLarge(PayloadTooLarge):
    """An API request whose line and headers exceed the daemon's cap (HTTP 431).
    The same ``too-large`` to a client, so it defines no code of its own."""

    http_status = 431
    default_hint = "send a shorter request"


class RequestTimeout(InvalidInput):
    """An API client that did not send its request headers in time (the daemon
    answers this itself, before the application)."""

    code = "timeout"
    http_status = 408
    default_hint = "send the whole request line and headers at once"


class UnsafeSocketFolder(InvalidInput):
    code = "unsafe-socket-folder"
    default_hint = (
        "put the socket in a folder owned by root or the daemon's user that only its owner can write (or "
        "one with the sticky bit, like /tmp), e.g. --socket /run/kbd/kbd.sock"
    )


class RootExists(InvalidInput):
    code = "root-exists"
    default_hint = "pass --force to rewrite kbd.yaml and principals.yaml, or choose another --root"


class WireError(InvalidInput):
    """Bytes on the exec broker's socket that break its wire format
    (:mod:`kbd.core.wire`): a truncated or oversized request, an unknown tag or
    frame kind, a repeated singleton, text that is not UTF-8. The peer's fault,
    so 65 / HTTP 400; the connection is closed after it."""

    code = "protocol-error"
    default_hint = "the client and the daemon must speak kbd-exec/1; use the kbd that runs the daemon"


class RootError(InvalidInput):
    code = "root-error"
    default_hint = "run `kbd init` to create a root, or pass --root / set KBD_ROOT"


# -- 66: not found ------------------------------------------------------------------------------


class NotFound(KbdError):
    code = "not-found"
    exit_code = 66
    http_status = 404
    default_hint = "check the name; `kbd workflows list` shows what exists"


class WorkflowNotFound(NotFound):
    code = "workflow-not-found"


class PathNotFound(NotFound):
    code = "path-not-found"
    default_hint = "list the folder with `kbd ls` to see what exists"


# -- 69: unavailable ----------------------------------------------------------------------------


class Unavailable(KbdError):
    code = "unavailable"
    exit_code = 69
    http_status = 503
    default_hint = "run `kbd doctor` to see what this host can enforce"


class ContainmentUnavailable(Unavailable):
    code = "containment-unavailable"
    default_hint = (
        "mount a writable cgroup v2 hierarchy (Linux >= 5.14) for kbd, or use the bubblewrap backend; "
        "see `kbd doctor`"
    )


class SandboxSetupError(Unavailable):
    code = "sandbox-setup"
    default_hint = "the plan's folders changed or are missing; run `kbd session show SID` and retry"


class GrantGroupMissing(Unavailable):
    code = "grant-group-missing"
    default_hint = (
        "create it with `groupadd --system NAME` (no members), or fix sandbox.grant_group in kbd.yaml"
    )


class SourceUnavailable(Unavailable):
    """The alias is attached but not available right now; ``reason`` says why.
    Exit code and HTTP status follow ``reason`` (:data:`REASON_ERRORS`)."""

    code = "source-unavailable"
    http_status = 409
    default_hint = "`kbd sources list WF` shows every attachment with its reason"

    def __init__(self, message: str, *, reason: str) -> None:
        super().__init__(message)
        _answer_as_reason(self, reason)


# -- 75: retry ----------------------------------------------------------------------------------


class Busy(KbdError):
    code = "busy"
    exit_code = 75
    http_status = 409
    default_hint = "another kbd process holds the lock; retry shortly"


class Overloaded(Busy):
    """Too much of one kind of work is waiting: retry shortly (HTTP 503 +
    Retry-After). The same ``busy`` to a client, so it defines no code of its own."""

    http_status = 503
    default_hint = "the daemon is busy; retry after the Retry-After delay"


class StreamLimit(Overloaded):
    """One more ``GET /v1/events`` than the daemon serves at once: a peer uid's
    streams, or the replays in progress (docs/daemon.md "The change feed"). Its own
    code, so a subscriber can tell "close your other streams" from "busy"."""

    code = "stream-limit"
    default_hint = "close event streams you no longer read, or retry after the Retry-After delay"


class VersionConflict(Busy):
    code = "version-conflict"
    default_hint = "the manifest changed since you read it; read it again and retry"


class NoteVersionConflict(VersionConflict):
    """``kbd notes write --expected-version V`` (API: ``If-Match``) when the
    note's current bytes are not version V. ``current``: the note's version now
    (``none`` when it does not exist), also in the message and, over HTTP, in
    the ``ETag`` header and the envelope's ``current_version``. 412
    Precondition Failed: the request's own precondition, not a busy server."""

    code = "note-version-conflict"
    http_status = 412
    default_hint = "read the note again (`kbd notes show`), merge, and write with its current version"

    def __init__(self, message: str, *, current: str, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.current = current

    def to_dict(self) -> dict[str, str]:
        out = super().to_dict()
        current = getattr(self, "current", None)  # unset on one rebuilt from a bare envelope
        if current is not None:
            out["current_version"] = current
        return out


class IndexUnreadable(Busy):
    code = "index-unreadable"
    default_hint = "the source may be rewriting its index; retry. This is not an empty knowledge base."


class WorkflowExists(Busy):
    code = "workflow-exists"
    default_hint = "pick another workflow ID; `kbd workflows list` shows the taken ones"


class RequestOpen(Busy):
    code = "request-open"
    default_hint = "wait for the source's owners to decide it: `kbd requests list` shows it"


class NoSpace(KbdError):
    """The filesystem (or the writer's disk quota) is full: ENOSPC, EDQUOT.

    75, like the temporary failure a mail server gives for a full spool (SMTP
    452, sysexits EX_TEMPFAIL): nothing was changed, nothing is wrong with the
    request or the caller's rights, and the same command succeeds once space is
    freed. Not 77 (the caller is not denied anything), not 65 (the input is
    fine: compare QuotaExceeded, where the note itself must shrink), not 70 (not
    a bug). Not a Busy: no Retry-After, since a full disk does not clear in a
    second. HTTP 507 Insufficient Storage."""

    code = "no-space"
    exit_code = 75
    http_status = 507
    default_hint = "the host's disk (or the writer's disk quota) is full; free space and retry"


# -- 77: permission denied ----------------------------------------------------------------------


class PermissionDenied(KbdError):
    code = "permission-denied"
    exit_code = 77
    http_status = 403
    default_hint = "ask an owner of the workflow (or an admin) to act, or to grant you a role"


class PathRefused(PermissionDenied):
    """A path that kbd will not open; ``why`` is a stable sub-reason."""

    code = "path-refused"
    default_hint = "name a path inside the knowledge base without '..', links or special files"

    def __init__(self, message: str, *, why: str, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.why = why


class SessionClosed(PermissionDenied):
    code = "session-closed"
    http_status = 410
    default_hint = "open a new session with `kbd session open`"


class Unauthenticated(PermissionDenied):
    code = "unauthenticated"
    http_status = 401
    default_hint = (
        "send `Authorization: Bearer <token>` (see `kbd principals token`) or connect as a mapped uid"
    )


# -- 70: internal -------------------------------------------------------------------------------


class StateCorrupt(KbdError):
    code = "state-corrupt"
    default_hint = (
        "state/sessions.db is damaged: stop kbd, move it aside (sessions must then be reopened); "
        "nothing was granted"
    )


#: reason code (docs/access.md) → the error whose exit code and HTTP status an error
#: carrying that reason answers with: an attachment whose source is missing is
#: "not found", one whose audience check failed is "permission denied".
REASON_ERRORS: dict[str, type[KbdError]] = {
    "not_found": NotFound,
    "audience_denied": PermissionDenied,
}


# -- translators: the choke points ---------------------------------------------------------------

NO_SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


def from_oserror(exc: OSError, *, what: str, hint: str | None = None) -> KbdError:
    """The tree's error for ``exc``, met while trying to ``what`` (a phrase such
    as ``"write 'a.md'"``; the message is ``cannot <what>: <strerror>``, never
    the OS's file name). A full disk or quota is NoSpace, never "permission
    denied"; EACCES/EPERM are PermissionDenied; ENOENT/ENOTDIR NotFound-like;
    a link or another mount PathRefused; EAGAIN/EINTR Busy; anything else an
    internal error (70), which is what an unexplained I/O failure is."""
    code = exc.errno or errno.EIO
    message = f"cannot {what}: {os.strerror(code)}"
    if code in NO_SPACE_ERRNOS:
        return NoSpace(message, hint=hint)
    if code in (errno.EACCES, errno.EPERM):
        return PermissionDenied(message, hint=hint)
    if code == errno.ENOENT:
        return NotFound(message, hint=hint)
    if code == errno.ENOTDIR:
        return PathNotFound(message, hint=hint)
    if code in (errno.ELOOP, errno.EXDEV, errno.EISDIR):
        why = {errno.ELOOP: "symlink", errno.EXDEV: "escape", errno.EISDIR: "not_file"}[code]
        return PathRefused(message, why=why, hint=hint)
    if code == errno.ENAMETOOLONG:
        return InvalidPath(message, hint=hint)
    if code in (errno.EAGAIN, errno.EINTR):
        return Busy(message, hint=hint or "it kept changing or was interrupted; retry")
    return KbdError(message, hint=hint or "check the host (`kbd doctor`) and the system log")


# -- what may not be seen is not there ------------------------------------------------------------


def workflow_not_found(wid: str, *, outsider: bool = False) -> WorkflowNotFound:
    """The answer for a workflow that does not exist — and, word for word, for one
    the actor may not see (``outsider``), so IDs cannot be probed (docs/access.md "Invisible is not found").
    Only the audit record (``reason`` ``not_visible``) tells the two apart."""
    err = WorkflowNotFound(f"no workflow with ID {wid!r} on this host")
    if outsider:
        err.reason = "not_visible"
    return err


def session_not_found(sid: str) -> NotFound:
    """The answer for a session that does not exist — and for one the actor may
    not use (a reader must not learn that an owner's session exists)."""
    return NotFound(f"no session {sid!r}", hint="`kbd session list` shows the sessions you may use")


# -- the HTTP answer -----------------------------------------------------------------------------

#: How long (seconds) a client is told to wait before it retries a Busy answer.
RETRY_AFTER_SECONDS = 1


def http_answer(err: KbdError) -> tuple[int, dict[str, dict[str, str]], dict[str, str]]:
    """The one HTTP answer to ``err``, wherever the daemon gives it (routes, the
    body limit, the connection layer's early answers): its status, the envelope
    ``{"error": {"code", "message", "hint"}}`` and the headers — ``Retry-After``
    when retrying shortly helps (Busy; a VersionConflict needs a fresh read
    first). The CLI's counterpart is :func:`kbd.cli.boundary.guarded`."""
    retry = isinstance(err, Busy) and not isinstance(err, VersionConflict)
    headers = {"Retry-After": str(RETRY_AFTER_SECONDS)} if retry else {}
    current = getattr(err, "current", None) if isinstance(err, NoteVersionConflict) else None
    if current is not None:
        headers["ETag"] = f'"{current}"'  # the version to send as If-Match after merging
    # A message may quote what the client sent: text that is not Unicode (a lone
    # surrogate from a JSON escape) is shown as its escape, never an unencodable answer.
    envelope = {k: v.encode("utf-8", "backslashreplace").decode("utf-8") for k, v in err.to_dict().items()}
    return err.http_status, {"error": envelope}, headers

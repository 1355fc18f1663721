"""The one exception tree of kbd.

Every error a user can see is a :class:`KbdError`. Each class carries a stable
kebab-case ``code``, a process exit code (DESIGN §6) and an HTTP status, so the
CLI and the API turn any of them into the same answer without knowing the class::

    KbdError                         70  internal
    ├── UsageError                   2   usage        bad command-line use
    ├── InvalidInput                 65  invalid-input
    │   ├── InvalidConfig            65  invalid-config     kbd.yaml / principals.yaml
    │   ├── InvalidManifest          65  invalid-manifest   workflow.json field rules
    │   ├── ManifestUnreadable       65  manifest-unreadable
    │   ├── AmbiguousWorkflow        65  ambiguous-id       two folders claim one ID
    │   └── SourceUnusable           65  source-unusable    new entry does not resolve
    ├── NotFound                     66  not-found
    │   └── WorkflowNotFound         66  workflow-not-found
    ├── Unavailable                  69  unavailable        sandbox / service missing
    ├── Busy                         75  busy               lock timeout, retry
    │   └── VersionConflict          75  version-conflict   expected version is stale
    ├── PermissionDenied             77  permission-denied
    │   └── AudienceDenied           77  audience-denied
    ├── QuotaExceeded                65  quota-exceeded     a source's notes/ quota
    ├── RootExists                   65  root-exists        init over an existing root
    └── RootError                    65  root-error         kbd root missing or unsafe

Only ``kbd.cli`` (and later the API) turn these into output; nothing else calls
``sys.exit``. Messages never contain host paths unless the caller already owns
them (the CLI operator owns the root, so CLI-only messages may name files).
"""

from __future__ import annotations


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


class UsageError(KbdError):
    code = "usage"
    exit_code = 2
    http_status = 400
    default_hint = "see `kbd --help`"


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
    default_hint = "repair the workflow.json by hand or restore it from a backup"


class AmbiguousWorkflow(InvalidInput):
    code = "ambiguous-id"
    default_hint = (
        "two folders claim this workflow ID; give the copied folder a new id in its "
        "workflow.json (kbd uses neither until then)"
    )


class SourceUnusable(InvalidInput):
    """A new or changed attachment does not resolve, so it cannot be saved.

    The exit code follows the reason: not found 66, audience denied 77, else 65.
    """

    code = "source-unusable"
    default_hint = "run `kbd sources candidates WF` to see sources this workflow may attach"

    def __init__(
        self, message: str, *, reason: str, hint: str | None = None, source: str | None = None
    ) -> None:
        super().__init__(message, hint=hint)
        self.reason = reason
        self.source = source  # the source workflow ID the entry named, for the audit record
        self.exit_code = {"not_found": 66, "audience_denied": 77}.get(reason, 65)
        self.http_status = {"not_found": 404, "audience_denied": 403}.get(reason, 400)


class NotFound(KbdError):
    code = "not-found"
    exit_code = 66
    http_status = 404
    default_hint = "check the name; `kbd workflows list` shows what exists"


class WorkflowNotFound(NotFound):
    code = "workflow-not-found"


class Unavailable(KbdError):
    code = "unavailable"
    exit_code = 69
    http_status = 503
    default_hint = "run `kbd doctor` to see what this host can enforce"


class Busy(KbdError):
    code = "busy"
    exit_code = 75
    http_status = 409
    default_hint = "another kbd process holds the lock; retry shortly"


class VersionConflict(Busy):
    code = "version-conflict"
    default_hint = "the manifest changed since you read it; read it again and retry"


class PermissionDenied(KbdError):
    code = "permission-denied"
    exit_code = 77
    http_status = 403
    default_hint = "ask an owner of the workflow (or an admin) to act, or to grant you a role"


class AudienceDenied(PermissionDenied):
    code = "audience-denied"
    default_hint = (
        "every owner, editor and reader of the consumer must be able to read the source; "
        "ask the source's owner to add them as readers"
    )


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


class RootExists(InvalidInput):
    code = "root-exists"
    default_hint = "pass --force to rewrite kbd.yaml and principals.yaml, or choose another --root"


class RootError(InvalidInput):
    code = "root-error"
    default_hint = "run `kbd init` to create a root, or pass --root / set KBD_ROOT"

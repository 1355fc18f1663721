"""Where a CLI command runs: on the root itself, or through its daemon (docs/multi-user.md "The CLI through the daemon").

Every command the CLI can send through the daemon is an :class:`Op` here: what
it asks, how the operations layer answers it on a root this process may use
(:meth:`Op.direct`), and the API request that asks the daemon the same
(:meth:`Op.http`, answered by the very same operation in :mod:`kbd.daemon.routes`). Both
answers are the operation's JSON (its typed result's ``to_json()``), so the CLI
formats one shape, and text, ``--json`` and exit codes cannot differ by mode.
Refusals are the same :mod:`kbd.errors` classes in both: raised here, or rebuilt
from the API's envelope by :func:`kbd.client.error_from`.

:func:`choose` decides the mode (pure); :func:`open_backend` makes the backend.
"""

from __future__ import annotations

import base64
import importlib
import os
import re
import stat
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Literal, Protocol, TypeVar
from urllib.parse import quote

from kbd.client import brokered
from kbd.core.layout import CONFIG_NAME, STATE_DIR
from kbd.core.principals import Actor, LocalOperator, Principal, named_principal
from kbd.core.records import Record
from kbd.errors import InvalidInput, KbdError, NotFound, PermissionDenied, Unavailable, UsageError
from kbd.service import JsonObject

if TYPE_CHECKING:
    import kbd.core.pathguard
    import kbd.core.plan
    import kbd.core.resolve
    import kbd.core.why
    import kbd.service.admin
    import kbd.service.browse
    import kbd.service.history
    import kbd.service.importing
    import kbd.service.notes
    import kbd.service.own_kb
    import kbd.service.preview
    import kbd.service.principals
    import kbd.service.requests
    import kbd.service.reviews
    import kbd.service.search
    import kbd.service.sessions
    import kbd.service.workflows
    from kbd.client import Client
    from kbd.service.root import Root
    from kbd.service.sessions import RootSessions

Mode = Literal["direct", "remote"]
#: Who acts in direct mode when neither --as nor $KBD_AS names a principal:
#: the principal mapped to the caller's uid, or the root's trusted operator
#: (session and principal commands: the root is the trust boundary).
ActorRule = Literal["mapped", "operator"]

SYSTEM_ROOT = Path(brokered.SYSTEM_ROOT)


#: An operation's result: a typed record (kbd.core.records), the same value in both modes.
R = TypeVar("R", bound=Record, covariant=True)


@dataclass(frozen=True)
class Request:
    """One API call: method, path (segments already quoted), JSON body, query."""

    method: str
    path: str
    body: JsonObject | None = None
    params: dict[str, str] | None = None


def segment(value: str) -> str:
    """``value`` as one URL path segment. An ID is never ``.`` or ``..``, but a
    typo must not reach another route: those are quoted too (the API decodes
    them back and refuses them as the direct mode does). An empty one cannot be
    a segment at all: :func:`check_names` refuses it in both modes first."""
    if value in (".", ".."):
        return "".join(f"%{b:02X}" for b in value.encode())
    return quote(value, safe="")


#: The fields of an Op that name something (a path segment through the daemon).
NAMES = {"wf": "workflow ID", "source": "source workflow ID", "consumer": "consumer workflow ID",
         "alias": "alias", "sid": "session ID", "name": "principal name"}  # fmt: skip


def check_names(op: Op[Any]) -> None:
    """An empty name is a usage error in both modes, as an empty ``--as`` is
    (docs/multi-user.md "The CLI through the daemon"): through the daemon it cannot even be sent (it was sent as
    ``%00``, a NUL the daemon then named and audited)."""
    if not op.names_in_path:
        return
    for name, what in NAMES.items():
        if getattr(op, name, None) == "":
            raise UsageError(f"the {what} is empty", hint="name one; an empty name never exists")


@dataclass(frozen=True)
class Route:
    """How an operation is asked through the API, spelled once for the client
    (:meth:`Op.http`) and the daemon (:mod:`kbd.daemon.routes` serves the
    operations of :data:`SERVED` from it; docs/architecture.md "Typed operations").

    ``path``'s ``{names}`` are filled from the operation's fields (``fields``
    maps a name to its field when they differ); ``body`` and ``query`` map each
    wire key to the field it carries (a None value is left out; in the query a
    True is ``true``, a False left out, a tuple joined with commas).
    """

    method: Literal["GET", "POST", "PUT", "PATCH", "DELETE"]
    path: str
    fields: Mapping[str, str] = field(default_factory=dict)
    body: Mapping[str, str] | None = None
    query: Mapping[str, str] = field(default_factory=dict)
    status: int = 200

    @property
    def names(self) -> tuple[str, ...]:
        """The path's ``{names}``, in order."""
        return tuple(_PLACEHOLDER.findall(self.path))

    def field_of(self, name: str) -> str:
        return self.fields.get(name, name)


_PLACEHOLDER = re.compile(r"\{([a-z_]+)\}")


def _query_value(value: object) -> str | None:
    if value is None or value is False or value == ():
        return None
    if value is True:
        return "true"
    if isinstance(value, tuple):
        return ",".join(map(str, value))  # aliases never hold a comma
    return str(value)


class Op(Generic[R]):
    """An operation: a frozen dataclass of its arguments, typed by its result
    (``class Attach(Op["kbd.core.resolve.Attachment"])``, named by its module
    so that the CLI through the daemon imports only the results it reads)."""

    actor_rule: ClassVar[ActorRule] = "mapped"
    #: Its names go into the API path (check_names); else into the query.
    names_in_path: ClassVar[bool] = True
    #: How the API asks it (see :class:`Route`).
    route: ClassVar[Route]
    #: It changes grants, and ``--dry-run`` (``?dry_run=true``) previews it (:class:`DryRun`).
    previewable: ClassVar[bool] = False

    def direct(self, ctx: DirectContext, actor: Actor) -> R:
        raise NotImplementedError

    def preview(self, ctx: DirectContext, actor: Actor) -> kbd.service.preview.Preview:
        """What :meth:`direct` would do, with nothing changed: the operation itself runs on a
        draft of the root that writes nothing (docs/access.md "Previews")."""
        from kbd.service import preview as _preview

        d = _preview.draft(ctx.root, lambda root: self.direct(DirectContext(root, ctx.refusal), actor))
        return _preview.effects(ctx.sessions, d, actor=actor)

    @classmethod
    def result(cls) -> type[R]:
        """The class of this operation's result (what the daemon's answer is read back as)."""
        found: type[R] | None = _RESULTS.get(cls)
        if found is None:
            (ref,) = typing.get_args(cls.__orig_bases__[0])  # type: ignore[attr-defined]
            module, _, name = ref.__forward_arg__.rpartition(".")
            found = _RESULTS[cls] = getattr(importlib.import_module(module), name)
        return found

    def http(self) -> Request:
        """The API request that asks the daemon this operation, from :attr:`route`."""
        route = self.route
        path = _PLACEHOLDER.sub(lambda m: segment(str(getattr(self, route.field_of(m.group(1))))), route.path)
        body: JsonObject | None = None
        if route.body is not None:
            body = {k: v for k, f in route.body.items() if (v := getattr(self, f)) is not None}
        params = {k: v for k, f in route.query.items() if (v := _query_value(getattr(self, f))) is not None}
        return Request(route.method, path, body, params or None)

    @classmethod
    def from_wire(cls, values: Mapping[str, object]) -> Op[R]:
        """The operation a request asks: ``values`` holds the path's names and
        the body's keys (already checked by the daemon's body model)."""
        route = cls.route
        wire = {route.field_of(n): n for n in route.names}
        wire.update({f: k for k, f in (route.body or {}).items()})
        kwargs = {f: values[k] for f, k in wire.items() if k in values}
        return cls(**kwargs)


_RESULTS: dict[type[Op[Any]], Any] = {}


class DirectContext:
    """The root this process uses itself, opened once per command. ``refusal``:
    why this process may not change it (None: it may), raised before the
    session store, which lives in the state it may not write, is opened."""

    def __init__(
        self, root: Root, refusal: KbdError | None = None, *, sessions: RootSessions | None = None
    ) -> None:
        self.root = root
        self.refusal = refusal
        # The daemon's own session store (kbd.daemon.routes serves operations on it); else opened when first used.
        self._sessions = sessions

    @property
    def sessions(self) -> RootSessions:
        if self.refusal is not None:
            raise self.refusal
        if self._sessions is None:
            from kbd.service.sessions import RootSessions

            self._sessions = RootSessions(self.root)
        return self._sessions


class Backend(Protocol):
    mode: Mode

    def run(self, op: Op[R], *, as_: str | None) -> R: ...

    def refresh(self) -> None: ...


class Direct:
    """Operations on a root this process may read and write itself."""

    mode: Mode = "direct"

    def __init__(self, root: Callable[[], Root], *, refusal: KbdError | None = None) -> None:
        self._open_root = root
        self._refusal = refusal
        self._ctx: DirectContext | None = None

    @property
    def context(self) -> DirectContext:
        if self._ctx is None:
            self._ctx = DirectContext(self._open_root(), self._refusal)
        return self._ctx

    def actor(self, rule: ActorRule, as_: str | None) -> Actor:
        from kbd.service import auth

        principals = self.context.root.principals
        env = os.environ.get("KBD_AS")
        if rule == "operator":
            return auth.named_or_operator(principals, flag=as_, env=env, operator=LocalOperator.current())
        return auth.named_or_mapped(principals, flag=as_, env=env, uid=os.getuid())

    def refresh(self) -> None:
        """Re-read the root's kbd.yaml and principals.yaml when they changed. A
        CLI command opens the root once and ends; a long-lived interface on it
        (``kbd mcp``) calls this before every operation, so a principal disabled
        a moment ago is refused at once, as the daemon refuses it."""
        if self._ctx is not None:
            self._ctx.root.refresh()

    def run(self, op: Op[R], *, as_: str | None) -> R:
        inner = op.op if isinstance(op, DryRun) else op  # a preview acts as its operation would
        check_names(inner)
        try:
            return op.direct(self.context, self.actor(inner.actor_rule, as_))
        except PermissionError:
            # A root this process may read but not change, and no daemon to
            # ask: the refusal says so (not an internal error); nothing was changed.
            if self._refusal is None:
                raise
            raise self._refusal from None


class Remote:
    """Operations the daemon performs for this process's principal: its peer
    uid's, or the one whose token it presents."""

    mode: Mode = "remote"

    def __init__(self, client: Client) -> None:
        self.client = client
        self._who: str | None = None

    def whoami(self) -> str:
        if self._who is None:
            self._who = str(self.client.whoami()["id"])
        return self._who

    def check_as(self, as_: str | None) -> None:
        """``--as``/``$KBD_AS`` through the daemon may only name the principal
        the connection is: the daemon never lets a caller act as someone else."""
        named = named_principal(as_, os.environ.get("KBD_AS"))
        if named is not None and named != self.whoami():
            raise PermissionDenied(
                f"through the kbd daemon you act as principal {self.whoami()!r} (your uid or token); "
                f"--as/KBD_AS names {named!r}",
                hint=f"present {named}'s token (KBD_TOKEN or --token-file), or leave --as out",
            )

    def refresh(self) -> None:
        """Nothing to re-read here: the daemon refreshes its root at every request."""

    def run(self, op: Op[R], *, as_: str | None) -> R:
        check_names(op.op if isinstance(op, DryRun) else op)
        self.check_as(as_)
        req = op.http()
        answer: JsonObject = self.client.request(req.method, req.path, json=req.body, params=req.params)
        try:
            return op.result().from_json(answer)
        except InvalidInput as err:
            raise Unavailable(
                f"the kbd daemon's answer to {req.method} {req.path} is not what this kbd reads: {err.message}",
                hint="the daemon may run another kbd version: compare kbd --version with the daemon's",
            ) from None


# -- the mode -----------------------------------------------------------------------------


def choose(*, socket_named: bool, root_usable: bool, daemon_reachable: Callable[[], bool]) -> Mode:
    """docs/multi-user.md "The CLI through the daemon": through the daemon when a socket is named (``--socket``,
    ``$KBD_SOCKET``); else on the root when this process may use it; else
    through the root's daemon when one answers; else on the root anyway, so the
    caller gets the root's own error (unreadable, missing)."""
    if socket_named:
        return "remote"
    if root_usable:
        return "direct"
    return "remote" if daemon_reachable() else "direct"


def root_usable(root: Path) -> bool:
    """May this process run commands on ``root`` itself? It must read its
    configuration and write its state (sessions, audit log); a service root
    (``root:kbd 0750``, state 0700) is usable by root only: everyone else goes
    through the daemon, the one writer."""
    return os.access(root / CONFIG_NAME, os.R_OK) and os.access(root / STATE_DIR, os.W_OK | os.X_OK)


def not_usable(root: Path, socket: Path) -> Unavailable:
    """Why a command that changes ``root`` cannot run: the root is not this
    process's to change (:func:`root_usable`) and no daemon answers for it."""
    return Unavailable(
        f"no kbd daemon answers at {socket}, and you may not use the root {root} yourself "
        f"(its {STATE_DIR}/ is not writable by you)",
        hint="ask the host's operator to start the daemon (kbd serve, or its systemd socket), "
        "or point KBD_SOCKET at it",
    )


def socket_of(root: Path) -> Path:
    from kbd.client import socket_of as of_root

    return of_root(root)


def reachable(path: Path) -> bool:
    """Something listens at ``path`` (or refuses us there: then the daemon's
    answer, 77, is the right one to give)."""
    import errno
    import socket

    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(5.0)
        s.connect(str(path))
    except PermissionError:
        return True
    except OSError as exc:
        return exc.errno == errno.EACCES
    finally:
        s.close()
    return True


def check_socket_owner(path: Path) -> None:
    """Refuse to send a token to a socket kbd found (not one the caller named)
    unless it belongs to root or to the caller: a root's kbd.yaml names its
    socket, and whoever controls that file must not collect the tokens of
    those who run kbd on it."""
    try:
        owner = os.lstat(path).st_uid
    except OSError:
        return  # nothing there: the connection fails with its own error, no token sent
    if owner not in (0, os.getuid()):
        raise PermissionDenied(
            f"the socket {path} belongs to uid {owner}, neither root nor you: kbd will not send your token there",
            hint="name the daemon's socket yourself with --socket (or KBD_SOCKET) if you trust it",
        )


def read_token_file(path: str) -> str:
    """The token in ``path`` (surrounding blanks stripped). Refused when empty,
    unreadable, or readable by every user (a token anyone can read is anyone's)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        raise NotFound(f"--token-file {path} does not exist") from None
    except OSError as exc:
        raise InvalidInput(f"--token-file {path}: cannot open it: {exc.strerror}",
                           hint="a regular file, not a symbolic link") from None  # fmt: skip
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InvalidInput(f"--token-file {path} is not a regular file")
        if st.st_mode & stat.S_IROTH:
            raise PermissionDenied(
                f"--token-file {path} is readable by every user (mode {stat.S_IMODE(st.st_mode):04o})",
                hint=f"chmod o-r {path}",
            )
        data = os.read(fd, 4097)
    finally:
        os.close(fd)
    token = data.decode("utf-8", "replace").strip()
    if not token or len(data) > 4096 or "\n" in token:
        raise InvalidInput(f"--token-file {path} must hold one token on one line (at most 4 KiB)")
    return token


def open_remote(socket_path: Path, *, token: str | None) -> Remote:
    from kbd.client import Client

    return Remote(Client(socket_path, token=token))


# -- the operations -----------------------------------------------------------------------
# One class per command, in the CLI's order. Each direct() is the call the API
# route makes for http(); keep the two in step (tests/integration/
# test_cli_remote.py runs every command both ways and compares the output).


def _principal(actor: Actor) -> Principal:
    # Management operations act as a principal: the "mapped" rule never yields the operator.
    assert isinstance(actor, Principal), actor
    return actor


@dataclass(frozen=True)
class WorkflowsList(Op["kbd.service.workflows.WorkflowList"]):
    route: ClassVar[Route] = Route("GET", "/v1/workflows")

    def direct(self, ctx: DirectContext, actor: Actor) -> kbd.service.workflows.WorkflowList:
        from kbd.service import workflows as _workflows

        return _workflows.list_workflows(ctx.root, actor=_principal(actor))


@dataclass(frozen=True)
class WorkflowCreate(Op["kbd.service.workflows.WorkflowCreated"]):
    route: ClassVar[Route] = Route(
        "POST", "/v1/workflows", body={"workflow_id": "wf", "label": "label", "owner": "owner"}, status=201
    )
    wf: str
    label: str | None
    owner: str | None

    def direct(self, ctx: DirectContext, actor: Actor) -> kbd.service.workflows.WorkflowCreated:
        from kbd.service import workflows as _workflows

        return _workflows.create(
            ctx.root, self.wf, label=self.label, owner=self.owner, actor=_principal(actor)
        )


@dataclass(frozen=True)
class WorkflowShow(Op["kbd.service.workflows.WorkflowDetail"]):
    route: ClassVar[Route] = Route("GET", "/v1/workflows/{wid}", {"wid": "wf"})
    wf: str

    def direct(self, ctx: DirectContext, actor: Actor) -> kbd.service.workflows.WorkflowDetail:
        from kbd.service import workflows as _workflows

        return _workflows.show(ctx.root, self.wf, actor=_principal(actor))


@dataclass(frozen=True)
class SourcesList(Op["kbd.service.workflows.SourcesView"]):
    route: ClassVar[Route] = Route("GET", "/v1/workflows/{wid}/sources", {"wid": "wf"})
    wf: str

    def direct(self, ctx: DirectContext, actor: Actor) -> kbd.service.workflows.SourcesView:
        from kbd.service import workflows as _workflows

        return _workflows.sources(ctx.root, self.wf, actor=_principal(actor))


@dataclass(frozen=True)
class Attach(Op["kbd.core.resolve.Attachment"]):
    previewable: ClassVar[bool] = True
    route: ClassVar[Route] = Route(
        "POST",
        "/v1/workflows/{wid}/sources",
        {"wid": "wf"},
        body={"workflow_id": "source", "alias": "alias", "access": "access"},
        status=201,
    )
    wf: str
    source: str
    alias: str
    access: str

    def direct(self, ctx: DirectContext, actor: Actor) -> kbd.core.resolve.Attachment:
        from kbd.service import workflows as _workflows

        return _workflows.attach(ctx.root, self.wf, self.source, alias=self.alias, access=self.access,
                                 actor=_principal(actor))  # fmt: skip


@dataclass(frozen=True)
class Detach(Op["kbd.service.workflows.Detached"]):
    previewable: ClassVar[bool] = True
    route: ClassVar[Route] = Route("DELETE", "/v1/workflows/{wid}/sources/{alias}", {"wid": "wf"})
    wf: str
    alias: str

    def direct(self, ctx: DirectContext, actor: Actor) -> kbd.service.workflows.Detached:
        from kbd.service import workflows as _workflows

        return _workflows.detach(ctx.root, self.wf, self.alias, actor=_principal(actor))


@dataclass(frozen=True)
class SetSources(Op["kbd.service.workflows.SourcesView"]):
    previewable: ClassVar[bool] = True
    route: ClassVar[Route] = Route(
        "PUT",
        "/v1/workflows/{wid}/sources",
        {"wid": "wf"},
        body={"sources": "sources", "expected_version": "expected_version"},
    )
    wf: str
    sources: Any  # the parsed JSON document, checked by the operation
    expected_version: str | None

    def direct(self, ctx: DirectContext, actor: Actor) -> kbd.service.workflows.SourcesView:
        from kbd.service import workflows as _workflows

        return _workflows.set_sources(ctx.root, self.wf, self.sources, actor=_principal(actor),
                                      expected_version=self.expected_version)  # fmt: skip

    def http(self) -> Request:
        body: JsonObject = {"sources": self.sources}
        if self.expected_version is not None:
            body["expected_version"] = self.expected_version
        return Request("PUT", f"/v1/workflows/{segment(self.wf)}/sources", body)


@dataclass(frozen=True)
class SetAccess(Op["kbd.core.resolve.Attachment"]):
    """Change one attachment's access (``kbd sources access``), atomically."""

    previewable: ClassVar[bool] = True
    route: ClassVar[Route] = Route(
        "PATCH",
        "/v1/workflows/{wid}/sources/{alias}",
        {"wid": "wf"},
        body={"access": "access", "expected_version": "expected_version"},
    )

    wf: str
    alias: str
    access: str
    expected_version: str | None

    def direct(self, ctx: DirectContext, actor: Actor) -> kbd.core.resolve.Attachment:
        from kbd.service import workflows as _workflows

        return _workflows.set_access(ctx.root, self.wf, self.alias, self.access, actor=_principal(actor),
                                     expected_version=self.expected_version)  # fmt: skip


@dataclass(frozen=True)
class Candidates(Op["kbd.service.workflows.CandidateList"]):
    route: ClassVar[Route] = Route("GET", "/v1/workflows/{wid}/candidates", {"wid": "wf"})
    wf: str

    def direct(self, ctx: DirectContext, actor: Actor) -> kbd.service.workflows.CandidateList:
        from kbd.service import workflows as _workflows

        return _workflows.candidates(ctx.root, self.wf, actor=_principal(actor))


@dataclass(frozen=True)
class WritersList(Op["kbd.service.workflows.WritersView"]):
    route: ClassVar[Route] = Route("GET", "/v1/workflows/{wid}/writers", {"wid": "source"})
    source: str

    def direct(self, ctx: DirectContext, actor: Actor) -> kbd.service.workflows.WritersView:
        from kbd.service import workflows as _workflows

        return _workflows.writers(ctx.root, self.source, actor=_principal(actor))


@dataclass(frozen=True)
class Grant(Op["kbd.service.workflows.WriterChange"]):
    previewable: ClassVar[bool] = True
    route: ClassVar[Route] = Route(
        "POST", "/v1/workflows/{wid}/writers", {"wid": "source"}, body={"workflow_id": "consumer"}
    )
    source: str
    consumer: str

    def direct(self, ctx: DirectContext, actor: Actor) -> kbd.service.workflows.WriterChange:
        from kbd.service import workflows as _workflows

        return _workflows.grant(ctx.root, self.source, self.consumer, actor=_principal(actor))


@dataclass(frozen=True)
class Revoke(Op["kbd.service.workflows.WriterChange"]):
    previewable: ClassVar[bool] = True
    route: ClassVar[Route] = Route("DELETE", "/v1/workflows/{wid}/writers/{consumer}", {"wid": "source"})
    source: str
    consumer: str

    def direct(self, ctx: DirectContext, actor: Actor) -> kbd.service.workflows.WriterChange:
        from kbd.service import workflows as _workflows

        return _workflows.revoke(ctx.root, self.source, self.consumer, actor=_principal(actor))


@dataclass(frozen=True)
class ReadersGrant(Op["kbd.service.workflows.ReadersChange"]):
    previewable: ClassVar[bool] = True
    route: ClassVar[Route] = Route(
        "POST", "/v1/workflows/{wid}/readers", {"wid": "wf"}, body={"principals": "principals"}
    )
    wf: str
    principals: tuple[str, ...]

    def direct(self, ctx: DirectContext, actor: Actor) -> kbd.service.workflows.ReadersChange:
        from kbd.service import workflows as _workflows

        return _workflows.grant_readers(ctx.root, self.wf, tuple(self.principals), actor=_principal(actor))


@dataclass(frozen=True)
class ReadersRevoke(Op["kbd.service.workflows.ReadersChange"]):
    previewable: ClassVar[bool] = True
    route: ClassVar[Route] = Route(
        "POST", "/v1/workflows/{wid}/readers/revoke", {"wid": "wf"}, body={"principals": "principals"}
    )
    wf: str
    principals: tuple[str, ...]

    def direct(self, ctx: DirectContext, actor: Actor) -> kbd.service.workflows.ReadersChange:
        from kbd.service import workflows as _workflows

        return _workflows.revoke_readers(ctx.root, self.wf, tuple(self.principals), actor=_principal(actor))


# -- access requests (docs/access.md "Access requests") --------------------------------------------


@dataclass(frozen=True)
class RequestOpen(Op["kbd.service.requests.AccessRequest"]):
    route: ClassVar[Route] = Route(
        "POST", "/v1/requests", body={"kind": "kind", "workflow_id": "source", "consumer": "consumer",
                                       "message": "message"}, status=201,
    )  # fmt: skip
    names_in_path: ClassVar[bool] = False
    kind: str
    source: str
    consumer: str
    message: str | None = None

    def direct(self, ctx: DirectContext, actor: Actor) -> kbd.service.requests.AccessRequest:
        from kbd.service import requests as _requests

        return _requests.open_request(ctx.root, self.kind, self.source, self.consumer, actor=_principal(actor),
                                      message=self.message)  # fmt: skip


@dataclass(frozen=True)
class RequestsList(Op["kbd.service.requests.RequestList"]):
    route: ClassVar[Route] = Route("GET", "/v1/requests")

    def direct(self, ctx: DirectContext, actor: Actor) -> kbd.service.requests.RequestList:
        from kbd.service import requests as _requests

        return _requests.list_requests(ctx.root, actor=_principal(actor))


@dataclass(frozen=True)
class RequestDecide(Op["kbd.service.requests.AccessRequest"]):
    route: ClassVar[Route] = Route(
        "POST", "/v1/requests/{rid}/decision", body={"decision": "decision", "message": "message"}
    )
    rid: int
    decision: Literal["approve", "decline"]
    message: str | None = None

    def direct(self, ctx: DirectContext, actor: Actor) -> kbd.service.requests.AccessRequest:
        from kbd.service import requests as _requests

        return _requests.decide(ctx.root, self.rid, approve=self.decision == "approve", actor=_principal(actor),
                                message=self.message)  # fmt: skip


@dataclass(frozen=True)
class SessionOpen(Op["kbd.core.plan.Plan"]):
    route: ClassVar[Route] = Route(
        "POST",
        "/v1/sessions",
        body={
            "workflow_id": "wf",
            "kind": "kind",
            "kb_access": "kb_access",
            "item_kb_write": "item_kb_write",
            "parent": "parent",
        },
        status=201,
    )
    wf: str
    kind: str | None
    kb_access: str | None
    item_kb_write: bool | None
    parent: str | None

    def direct(self, ctx: DirectContext, actor: Actor) -> kbd.core.plan.Plan:
        from kbd.service import sessions as _sessions

        return _sessions.open_session(ctx.sessions, self.wf, actor=_principal(actor), kind=self.kind,
                                      kb_access=self.kb_access, item_kb_write=self.item_kb_write,
                                      parent=self.parent)  # fmt: skip


@dataclass(frozen=True)
class SessionShow(Op["kbd.service.sessions.SessionView"]):
    route: ClassVar[Route] = Route("GET", "/v1/sessions/{sid}")
    actor_rule: ClassVar[ActorRule] = "operator"
    sid: str

    def direct(self, ctx: DirectContext, actor: Actor) -> kbd.service.sessions.SessionView:
        from kbd.service import sessions as _sessions

        return _sessions.show(ctx.sessions, self.sid, actor=actor)


@dataclass(frozen=True)
class SessionRevoke(Op["kbd.service.sessions.Revoked"]):
    route: ClassVar[Route] = Route("POST", "/v1/sessions/{sid}/revoke", body={"immediate": "immediate"})
    actor_rule: ClassVar[ActorRule] = "operator"
    sid: str
    immediate: bool

    def direct(self, ctx: DirectContext, actor: Actor) -> kbd.service.sessions.Revoked:
        from kbd.service import sessions as _sessions

        return _sessions.revoke(ctx.sessions, self.sid, actor=actor, immediate=self.immediate)


@dataclass(frozen=True)
class SessionEnv(Op["kbd.service.sessions.Environment"]):
    route: ClassVar[Route] = Route("GET", "/v1/sessions/{sid}/env")
    actor_rule: ClassVar[ActorRule] = "operator"
    sid: str

    def direct(self, ctx: DirectContext, actor: Actor) -> kbd.service.sessions.Environment:
        from kbd.service import sessions as _sessions

        return _sessions.environment(ctx.sessions, self.sid, actor=actor)


@dataclass(frozen=True)
class SessionList(Op["kbd.service.sessions.SessionList"]):
    route: ClassVar[Route] = Route(
        "GET", "/v1/sessions", query={"workflow_id": "wf", "all": "include_closed"}
    )
    actor_rule: ClassVar[ActorRule] = "operator"
    names_in_path: ClassVar[bool] = False
    wf: str | None
    include_closed: bool

    def direct(self, ctx: DirectContext, actor: Actor) -> kbd.service.sessions.SessionList:
        from kbd.service import sessions as _sessions

        return _sessions.list_sessions(ctx.sessions, actor=actor, workflow_id=self.wf,
                                       include_closed=self.include_closed)  # fmt: skip


@dataclass(frozen=True)
class SessionClose(Op["kbd.service.sessions.Closed"]):
    route: ClassVar[Route] = Route("DELETE", "/v1/sessions/{sid}")
    actor_rule: ClassVar[ActorRule] = "operator"
    sid: str

    def direct(self, ctx: DirectContext, actor: Actor) -> kbd.service.sessions.Closed:
        from kbd.service import sessions as _sessions

        return _sessions.close(ctx.sessions, self.sid, actor=actor)


@dataclass(frozen=True)
class Check(Op["kbd.core.pathguard.PathCheck"]):
    route: ClassVar[Route] = Route("POST", "/v1/sessions/{sid}/check", body={"path": "path", "mode": "mode"})
    actor_rule: ClassVar[ActorRule] = "operator"
    sid: str
    path: str
    mode: str

    def direct(self, ctx: DirectContext, actor: Actor) -> kbd.core.pathguard.PathCheck:
        from kbd.service import sessions as _sessions

        return _sessions.check(ctx.sessions, self.sid, self.path, self.mode, actor=actor)


@dataclass(frozen=True)
class DryRun(Op["kbd.service.preview.Preview"]):
    """``--dry-run`` of a grant-changing operation: its :meth:`Op.preview`, asked through the API as
    the same request with ``?dry_run=true`` (docs/access.md "Previews")."""

    op: Op[Any]

    def __post_init__(self) -> None:
        if not self.op.previewable:
            raise UsageError(f"{type(self.op).__name__} changes no grant: it has no --dry-run")

    def direct(self, ctx: DirectContext, actor: Actor) -> kbd.service.preview.Preview:
        return self.op.preview(ctx, actor)

    def http(self) -> Request:
        request = self.op.http()
        return Request(
            request.method, request.path, request.body, {**(request.params or {}), "dry_run": "true"}
        )


@dataclass(frozen=True)
class PreviewManifest(Op["kbd.service.preview.Preview"]):
    """``kbd preview FILE``: a hand-edited workflow.json, previewed (its bytes as read)."""

    route: ClassVar[Route] = Route("POST", "/v1/preview", body={"manifest": "manifest"})
    names_in_path: ClassVar[bool] = False
    manifest: str  # the file's text

    def direct(self, ctx: DirectContext, actor: Actor) -> kbd.service.preview.Preview:
        from kbd.service import preview as _preview

        return _preview.preview_manifest(ctx.sessions, self.manifest.encode("utf-8"), actor=actor)


@dataclass(frozen=True)
class Why(Op["kbd.core.why.Why"]):
    route: ClassVar[Route] = Route(
        "POST", "/v1/sessions/{sid}/why", body={"path": "path", "mode": "mode", "anonymous": "anonymous"}
    )
    actor_rule: ClassVar[ActorRule] = "operator"
    sid: str
    path: str
    mode: str
    anonymous: bool = False  # an agent's kb_why: no principal or unattached workflow named

    def direct(self, ctx: DirectContext, actor: Actor) -> kbd.core.why.Why:
        from kbd.service import why as _why

        return _why.why_path(
            ctx.sessions, self.sid, self.path, self.mode, actor=actor, anonymous=self.anonymous
        )


@dataclass(frozen=True)
class WhyAttach(Op["kbd.core.why.Why"]):
    route: ClassVar[Route] = Route(
        "POST", "/v1/workflows/{wid}/why", {"wid": "wf"}, body={"workflow_id": "source", "access": "access"}
    )
    wf: str
    source: str
    access: str = "read"

    def direct(self, ctx: DirectContext, actor: Actor) -> kbd.core.why.Why:
        from kbd.service import why as _why

        return _why.why_attach(ctx.root, self.wf, self.source, self.access, actor=_principal(actor))


@dataclass(frozen=True)
class NoteWrite(Op["kbd.service.notes.NoteWritten"]):
    route: ClassVar[Route] = Route("POST", "/v1/sessions/{sid}/notes", status=201)
    actor_rule: ClassVar[ActorRule] = "operator"
    sid: str
    alias: str
    relpath: str
    data: bytes
    expected: str | None = None  # --expected-version: a version, "none", or None (not asked)

    def direct(self, ctx: DirectContext, actor: Actor) -> kbd.service.notes.NoteWritten:
        from kbd.service import notes as _notes

        return _notes.write(ctx.sessions, self.sid, self.alias, self.relpath, self.data, actor=actor,
                            expected=self.expected)  # fmt: skip

    def http(self) -> Request:
        # The bytes as they are: the daemon decodes them with the same checks
        # (and the same refusal for text that is not UTF-8) as the direct write.
        body = {
            "alias": self.alias,
            "path": self.relpath,
            "content_base64": base64.b64encode(self.data).decode(),
        }
        if self.expected is not None:
            body["expected_version"] = self.expected
        return Request("POST", f"/v1/sessions/{segment(self.sid)}/notes", body)


# -- note history (docs/notes.md "Note history") ---------------------------------------------------------


@dataclass(frozen=True)
class NoteLog(Op["kbd.service.history.NoteLog"]):
    route: ClassVar[Route] = Route(
        "GET", "/v1/workflows/{wid}/notes/history", {"wid": "wf"}, query={"path": "relpath"}
    )
    wf: str
    relpath: str

    def direct(self, ctx: DirectContext, actor: Actor) -> kbd.service.history.NoteLog:
        from kbd.service import history as _history

        return _history.log(ctx.root, self.wf, self.relpath, actor=_principal(actor))


@dataclass(frozen=True)
class NoteShow(Op["kbd.service.history.NoteVersion"]):
    route: ClassVar[Route] = Route(
        "GET",
        "/v1/workflows/{wid}/notes/history/version",
        {"wid": "wf"},
        query={"path": "relpath", "version": "version"},
    )
    wf: str
    relpath: str
    version: str | None

    def direct(self, ctx: DirectContext, actor: Actor) -> kbd.service.history.NoteVersion:
        from kbd.service import history as _history

        return _history.show(ctx.root, self.wf, self.relpath, actor=_principal(actor), version=self.version)


@dataclass(frozen=True)
class NoteDiff(Op["kbd.service.history.NoteDiff"]):
    route: ClassVar[Route] = Route(
        "GET",
        "/v1/workflows/{wid}/notes/history/diff",
        {"wid": "wf"},
        query={"path": "relpath", "version": "version", "against": "against"},
    )
    wf: str
    relpath: str
    version: str | None
    against: str | None

    def direct(self, ctx: DirectContext, actor: Actor) -> kbd.service.history.NoteDiff:
        from kbd.service import history as _history

        return _history.diff(ctx.root, self.wf, self.relpath, actor=_principal(actor), version=self.version,
                             against=self.against)  # fmt: skip


@dataclass(frozen=True)
class NoteRestore(Op["kbd.service.history.NoteRestored"]):
    route: ClassVar[Route] = Route(
        "POST",
        "/v1/workflows/{wid}/notes/history/restore",
        {"wid": "wf"},
        body={"path": "relpath", "version": "version"},
    )
    wf: str
    relpath: str
    version: str | None

    def direct(self, ctx: DirectContext, actor: Actor) -> kbd.service.history.NoteRestored:
        from kbd.service import history as _history

        return _history.restore(
            ctx.root, self.wf, self.relpath, actor=_principal(actor), version=self.version
        )


@dataclass(frozen=True)
class Read(Op["kbd.service.browse.FileRead"]):
    route: ClassVar[Route] = Route(
        "GET", "/v1/workflows/{wid}/sources/{alias}/file", {"wid": "wf"}, query={"path": "relpath"}
    )
    wf: str
    alias: str
    relpath: str

    def direct(self, ctx: DirectContext, actor: Actor) -> kbd.service.browse.FileRead:
        from kbd.service import browse as _browse

        return _browse.read(ctx.root, self.wf, self.alias, self.relpath, actor=_principal(actor))


@dataclass(frozen=True)
class Ls(Op["kbd.service.browse.Listing"]):
    route: ClassVar[Route] = Route(
        "GET",
        "/v1/workflows/{wid}/sources/{alias}/dir",
        {"wid": "wf"},
        query={"path": "reldir", "limit": "limit", "after": "after"},
    )
    wf: str
    alias: str
    reldir: str
    limit: int | None
    after: str | None

    def direct(self, ctx: DirectContext, actor: Actor) -> kbd.service.browse.Listing:
        from kbd.service import browse as _browse

        return _browse.ls(ctx.root, self.wf, self.alias, self.reldir, actor=_principal(actor), limit=self.limit,
                          after=self.after)  # fmt: skip


#: The ALIAS that names the workflow's own KB in `kbd read`/`kbd ls`: never an alias (docs/on-disk.md "IDs").
OWN_KB = "."


@dataclass(frozen=True)
class OwnWrite(Op["kbd.service.own_kb.KbFileWritten"]):
    """Create or replace a file of the workflow's own ``context/`` or ``notes/``
    (its owners, editors and admins; the Knowledge page's editor)."""

    route: ClassVar[Route] = Route(
        "PUT", "/v1/workflows/{wid}/kb/file", {"wid": "wf"},
        body={"path": "relpath", "content": "text", "expected_version": "expected"},
    )  # fmt: skip

    wf: str
    relpath: str
    text: str
    expected: str | None = None

    def direct(self, ctx: DirectContext, actor: Actor) -> kbd.service.own_kb.KbFileWritten:
        from kbd.service import own_kb as _own

        return _own.write_own(ctx.sessions, self.wf, self.relpath, self.text.encode("utf-8"),
                              actor=_principal(actor), expected=self.expected)  # fmt: skip


@dataclass(frozen=True)
class OwnRead(Op["kbd.service.browse.FileRead"]):
    """A file of the workflow's own KB (``kbd read WF . RELPATH``)."""

    route: ClassVar[Route] = Route(
        "GET", "/v1/workflows/{wid}/kb/file", {"wid": "wf"}, query={"path": "relpath"}
    )

    wf: str
    relpath: str

    def direct(self, ctx: DirectContext, actor: Actor) -> kbd.service.browse.FileRead:
        from kbd.service import browse as _browse

        return _browse.read_own(ctx.root, self.wf, self.relpath, actor=_principal(actor))


@dataclass(frozen=True)
class OwnLs(Op["kbd.service.browse.Listing"]):
    """A folder of the workflow's own KB (``kbd ls WF . [RELDIR]``)."""

    route: ClassVar[Route] = Route(
        "GET",
        "/v1/workflows/{wid}/kb/dir",
        {"wid": "wf"},
        query={"path": "reldir", "limit": "limit", "after": "after"},
    )

    wf: str
    reldir: str
    limit: int | None
    after: str | None

    def direct(self, ctx: DirectContext, actor: Actor) -> kbd.service.browse.Listing:
        from kbd.service import browse as _browse

        return _browse.ls_own(ctx.root, self.wf, self.reldir, actor=_principal(actor), limit=self.limit,
                              after=self.after)  # fmt: skip


@dataclass(frozen=True)
class Import(Op["kbd.service.importing.ImportResult"]):
    """One batch of ``kbd import``: documents read by the CLI (as its caller),
    never a path for the daemon to open (:mod:`kbd.service.importing`)."""

    route: ClassVar[Route] = Route("POST", "/v1/workflows/{wid}/import", {"wid": "wf"})

    wf: str
    folder: str
    docs: tuple[tuple[str, bytes], ...]
    skipped: tuple[tuple[str, str], ...]
    dry_run: bool
    update: bool

    def direct(self, ctx: DirectContext, actor: Actor) -> kbd.service.importing.ImportResult:
        from kbd.service import importing as _importing

        # An import changes the root: on a root this process may only read, refuse (69) before reading it.
        if ctx.refusal is not None:
            raise ctx.refusal
        return _importing.import_docs(ctx.root, self.wf, self.docs, folder=self.folder, actor=_principal(actor),
                                      skipped=self.skipped, dry_run=self.dry_run, update=self.update)  # fmt: skip

    def http(self) -> Request:
        body: JsonObject = {
            "folder": self.folder,
            "documents": [{"file": f, "content_base64": base64.b64encode(d).decode()} for f, d in self.docs],
            "skipped": [{"file": f, "reason": r} for f, r in self.skipped],
            "dry_run": self.dry_run,
            "update": self.update,
        }
        return Request("POST", f"/v1/workflows/{segment(self.wf)}/import", body)


#: One import call's share of a large import: well under the API's body limit
#: (4 MiB, base64 and JSON escaping counted) and the operation's item cap.
IMPORT_BATCH_BYTES = 3 * 1024 * 1024
IMPORT_BATCH_ITEMS = 1_000


def import_batches(
    wf: str, folder: str, docs: list[tuple[str, bytes]], skipped: list[tuple[str, str]], *, dry_run: bool,
    update: bool,
) -> list[Import]:  # fmt: skip
    """``kbd import``'s calls, in order, in both modes alike (so the answers
    cannot differ by mode): each within IMPORT_BATCH_BYTES and
    IMPORT_BATCH_ITEMS; at least one, so even an empty folder is authorized
    and audited."""
    out: list[Import] = []
    cur_docs: list[tuple[str, bytes]] = []
    cur_skips: list[tuple[str, str]] = []
    size = 0

    def flush() -> None:
        nonlocal cur_docs, cur_skips, size
        out.append(Import(wf, folder, tuple(cur_docs), tuple(cur_skips), dry_run, update))
        cur_docs, cur_skips, size = [], [], 0

    items: list[tuple[int, tuple[str, bytes] | None, tuple[str, str] | None]] = [
        (-(-len(d) // 3) * 4 + 6 * len(f.encode()) + 64, (f, d), None) for f, d in docs
    ] + [(6 * (len(f.encode()) + len(r.encode())) + 64, None, (f, r)) for f, r in skipped]
    for cost, doc, skip in items:
        if (cur_docs or cur_skips) and (size + cost > IMPORT_BATCH_BYTES
                                        or len(cur_docs) + len(cur_skips) >= IMPORT_BATCH_ITEMS):  # fmt: skip
            flush()
        size += cost
        if doc is not None:
            cur_docs.append(doc)
        if skip is not None:
            cur_skips.append(skip)
    if cur_docs or cur_skips or not out:
        flush()
    return out


@dataclass(frozen=True)
class Search(Op["kbd.service.search.SearchResult"]):
    route: ClassVar[Route] = Route(
        "GET",
        "/v1/sessions/{sid}/search",
        query={
            "q": "query",
            "alias": "aliases",
            "limit": "limit",
            "include_unreviewed": "include_unreviewed",
        },
    )
    actor_rule: ClassVar[ActorRule] = "operator"
    sid: str
    query: str
    aliases: tuple[str, ...]
    limit: int | None
    include_unreviewed: bool

    def direct(self, ctx: DirectContext, actor: Actor) -> kbd.service.search.SearchResult:
        from kbd.service import search as _search

        return _search.search(ctx.sessions, self.sid, self.query, aliases=self.aliases, limit=self.limit,
                              include_unreviewed=self.include_unreviewed, actor=actor)  # fmt: skip


@dataclass(frozen=True)
class NotesPending(Op["kbd.service.reviews.Pending"]):
    route: ClassVar[Route] = Route("GET", "/v1/workflows/{wid}/notes/pending", {"wid": "wf"})
    wf: str

    def direct(self, ctx: DirectContext, actor: Actor) -> kbd.service.reviews.Pending:
        from kbd.service import reviews as _reviews

        return _reviews.pending(ctx.root, self.wf, actor=_principal(actor))


@dataclass(frozen=True)
class NotesRejected(Op["kbd.service.reviews.RejectedList"]):
    route: ClassVar[Route] = Route("GET", "/v1/workflows/{wid}/notes/rejected", {"wid": "wf"})
    wf: str

    def direct(self, ctx: DirectContext, actor: Actor) -> kbd.service.reviews.RejectedList:
        from kbd.service import reviews as _reviews

        return _reviews.rejected_notes(ctx.root, self.wf, actor=_principal(actor))


@dataclass(frozen=True)
class NotesUnreject(Op["kbd.service.reviews.Restored"]):
    route: ClassVar[Route] = Route(
        "POST", "/v1/workflows/{wid}/notes/rejected/{rid}/restore", {"wid": "wf", "rid": "rejected_id"}
    )
    wf: str
    rejected_id: int

    def direct(self, ctx: DirectContext, actor: Actor) -> kbd.service.reviews.Restored:
        from kbd.service import reviews as _reviews

        if ctx.refusal is not None:
            raise ctx.refusal
        return _reviews.restore_rejected(ctx.root, self.wf, self.rejected_id, actor=_principal(actor))


@dataclass(frozen=True)
class NotesReview(Op["kbd.service.reviews.Reviewed"]):
    route: ClassVar[Route] = Route(
        "POST",
        "/v1/workflows/{wid}/notes/review",
        {"wid": "wf"},
        body={"path": "relpath", "decision": "decision", "expected_version": "expected"},
    )
    wf: str
    relpath: str
    decision: Literal["approve", "reject"]
    expected: str | None = None

    def direct(self, ctx: DirectContext, actor: Actor) -> kbd.service.reviews.Reviewed:
        from kbd.service import reviews as _reviews

        return _reviews.review(ctx.root, self.wf, self.relpath, approve=self.decision == "approve",
                               actor=_principal(actor),
                               expected=self.expected)  # fmt: skip


# -- principals (the root's operator, or an admin) ---------------------------------------------


@dataclass(frozen=True)
class PrincipalsList(Op["kbd.service.admin.PrincipalList"]):
    route: ClassVar[Route] = Route("GET", "/v1/principals")
    actor_rule: ClassVar[ActorRule] = "operator"

    def direct(self, ctx: DirectContext, actor: Actor) -> kbd.service.admin.PrincipalList:
        from kbd.service import principals as _principals

        return _principals.listing(ctx.root, actor=actor)


@dataclass(frozen=True)
class PrincipalAdd(Op["kbd.service.principals.PrincipalChanged"]):
    route: ClassVar[Route] = Route(
        "POST",
        "/v1/principals",
        body={
            "id": "name",
            "kind": "kind",
            "admin": "admin",
            "uid": "uid",
            "login": "login",
            "label": "label",
        },
        status=201,
    )
    actor_rule: ClassVar[ActorRule] = "operator"
    name: str
    uid: int | None
    login: str | None
    kind: str
    admin: bool
    label: str | None

    def direct(self, ctx: DirectContext, actor: Actor) -> kbd.service.principals.PrincipalChanged:
        from kbd.service import principals as _principals

        return _principals.add(ctx.root, self.name, uid=self.uid, login=self.login, kind=self.kind,
                               admin=self.admin, label=self.label, actor=actor)  # fmt: skip


@dataclass(frozen=True)
class PrincipalChange(Op["kbd.service.principals.PrincipalChanged"]):
    """disable, enable, remove."""

    previewable: ClassVar[bool] = True
    route: ClassVar[Route] = Route(
        "POST", "/v1/principals/{pid}/{action}", {"pid": "name"}, body={"force": "force"}
    )

    actor_rule: ClassVar[ActorRule] = "operator"
    action: Literal["disable", "enable", "remove"]
    name: str
    force: bool = False

    def direct(self, ctx: DirectContext, actor: Actor) -> kbd.service.principals.PrincipalChanged:
        from kbd.service import principals as _principals

        if self.action == "enable":
            return _principals.enable(ctx.root, self.name, actor=actor)
        change = _principals.disable if self.action == "disable" else _principals.remove
        return change(ctx.root, self.name, force=self.force, actor=actor)


@dataclass(frozen=True)
class PrincipalToken(Op["kbd.service.principals.TokenIssued"]):
    route: ClassVar[Route] = Route("POST", "/v1/principals/{pid}/token", {"pid": "name"})
    actor_rule: ClassVar[ActorRule] = "operator"
    name: str

    def direct(self, ctx: DirectContext, actor: Actor) -> kbd.service.principals.TokenIssued:
        from kbd.service import principals as _principals

        return _principals.rotate_token(ctx.root, self.name, actor=actor)


# -- the audit log (the root's operator, an admin, or a workflow's owner) ---------------------------


@dataclass(frozen=True)
class AuditChunk(Op["kbd.service.admin.AuditChunk"]):
    """The records from byte ``offset`` of the log on and where the next chunk
    starts (the CLI selects records itself: :class:`kbd.service.admin.AuditFeed`).
    ``workflow``: for an actor who is no admin, the owned workflow whose records
    it reads (the server selects them)."""

    route: ClassVar[Route] = Route("GET", "/v1/audit", query={"offset": "offset", "workflow": "workflow"})

    actor_rule: ClassVar[ActorRule] = "operator"
    offset: int
    workflow: str | None = None

    def direct(self, ctx: DirectContext, actor: Actor) -> kbd.service.admin.AuditChunk:
        from kbd.service import admin as _admin

        scope = _admin.audit_scope(ctx.sessions, actor=actor, workflow=self.workflow)
        return _admin.audit_chunk(ctx.root, offset=self.offset, scope=scope)


@dataclass(frozen=True)
class Doctor(Op["kbd.service.admin.DoctorReport"]):
    """The daemon's checks of its root (admins): the server half of ``kbd doctor``."""

    route: ClassVar[Route] = Route("GET", "/v1/doctor", query={"workflow": "workflow"})

    actor_rule: ClassVar[ActorRule] = "operator"
    workflow: str | None

    def direct(self, ctx: DirectContext, actor: Actor) -> kbd.service.admin.DoctorReport:
        from kbd.service import admin as _admin

        return _admin.doctor(ctx.root.config.root, workflow_id=self.workflow)


def remote_doctor(remote: Remote, workflow: str | None) -> kbd.service.admin.DoctorReport:
    """``kbd doctor`` through the daemon: can this caller reach it, who is it
    there, and (admins) the daemon's own checks of its root."""
    from kbd.service.admin import DoctorCheck, DoctorReport, Health
    from kbd.service.auth import Identity

    checks: list[DoctorCheck] = []

    def check(name: str, ask: Callable[[], str]) -> bool:
        try:
            checks.append(DoctorCheck(name, True, ask()))
            return True
        except KbdError as err:
            checks.append(DoctorCheck(name, False, f"{err.code}: {err.message}"))
            return False

    def daemon() -> str:
        h = Health.from_json(remote.client.health(), "the daemon's health")
        return f"kbd daemon at {remote.client.socket_path}: host {h.host}, up {h.uptime_seconds}s"

    admin = False

    def principal() -> str:
        nonlocal admin
        me = Identity.from_json(remote.client.whoami(), "the daemon's whoami")
        admin = me.admin
        return f"you are principal {me.id} ({me.kind}{', admin' if admin else ''})"

    if check("daemon", daemon) and check("principal", principal) and admin:
        checks += remote.run(Doctor(workflow), as_=None).checks
    return DoctorReport(tuple(checks))

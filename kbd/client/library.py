"""The client library behind :mod:`kbd.client`: :class:`Client` and the
error mapping of the daemon's answers (docs in the package's docstring)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson

from kbd import errors
from kbd.client.brokered import chosen_root
from kbd.client.brokered import default_socket as default_socket_of
from kbd.errors import KbdError, Unavailable

# The public surface (tests/unit/test_public_surface.py); errors are kbd.errors'.
__all__ = ["Client", "default_socket", "error_from", "socket_of"]

#: Reconnection waits of :meth:`Client.events` (seconds), growing to the last one.
RECONNECT_BACKOFF = (0.1, 0.25, 0.5, 1.0, 2.0)


def _leaf_classes() -> dict[tuple[str, int], type[KbdError]]:
    """(code, HTTP status) → the most specific error class that answers so."""
    table: dict[tuple[str, int], type[KbdError]] = {}
    todo: list[type[KbdError]] = [KbdError]
    while todo:
        cls = todo.pop(0)
        table.setdefault((cls.code, cls.http_status), cls)
        todo.extend(cls.__subclasses__())
    return table


_BY_CODE_STATUS = _leaf_classes()
_BY_CODE = {code: cls for (code, _), cls in reversed(list(_BY_CODE_STATUS.items()))}
_REASON_EXIT = {cls.http_status: cls.exit_code for cls in errors.REASON_ERRORS.values()}


def refusal_error(code: str, message: str, hint: str, exit_code: int) -> KbdError:
    """The :mod:`kbd.errors` error for a refusal the exec broker framed (its
    code, words and exit code; the broker sends no HTTP status)."""
    cls = _BY_CODE.get(code, KbdError)
    out = cls.__new__(cls)
    KbdError.__init__(out, message, hint=hint or None)
    if cls.code != code:
        out.code = code
    out.exit_code = exit_code
    return out


def error_from(status: int, body: bytes) -> KbdError:
    """The :mod:`kbd.errors` error the daemon's answer ``{"error": {"code",
    "message", "hint"}}`` with HTTP ``status`` stands for: the class of that
    code (and status, where one code has several classes), with the daemon's
    message and hint and its exit code and status. An answer without the
    envelope is an internal error naming the status."""
    try:
        envelope = orjson.loads(body)
        err = envelope["error"]
        code, message, hint = str(err["code"]), str(err["message"]), str(err["hint"])
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return KbdError(f"the kbd daemon answered HTTP {status} without an error body")
    cls = _BY_CODE_STATUS.get((code, status)) or _BY_CODE.get(code, KbdError)
    out = cls.__new__(cls)  # some classes take more arguments; the daemon's text is all there is
    KbdError.__init__(out, message, hint=hint)
    out.http_status = status
    if cls.code != code:
        out.code = code  # a code this kbd does not know: keep the daemon's
    if cls.http_status != status and status in _REASON_EXIT:
        # An error that answers by its reason (errors.REASON_ERRORS): a source
        # not found is 404/66, an audience refusal 403/77.
        out.exit_code = _REASON_EXIT[status]
    return out


def default_socket(root: Path | None = None) -> Path:
    """``$KBD_SOCKET``, else the root's socket (:func:`socket_of`; the root:
    ``root``, else the one a command without ``--root`` uses)."""
    named = os.environ.get("KBD_SOCKET")
    if named:
        return Path(named)
    return socket_of(root if root is not None else Path(chosen_root(os.environ)))


def socket_of(root: Path) -> Path:
    """The socket of ``root``'s daemon: kbd.yaml's ``socket`` when readable, else
    the service's socket for the system root (whose kbd.yaml its users may not
    read), else ``<root>/state/run/kbd.sock``."""
    from kbd.fs.rootconfig import load_config

    try:
        return load_config(root).socket_path
    except KbdError:
        return Path(default_socket_of(str(root)))


def parse_sse(lines: Iterator[str]) -> Iterator[tuple[str | None, str, str]]:
    """(id, event type, data) of each Server-Sent Event in ``lines`` (comments
    and frames without data are skipped)."""
    event_id: str | None = None
    event_type = "message"
    data: list[str] = []
    for line in lines:
        if not line:
            if data:
                yield event_id, event_type, "\n".join(data)
            event_id, event_type = None, "message"
            data = []
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "id":
            event_id = value
        elif name == "event":
            event_type = value
        elif name == "data":
            data.append(value)


class Client:
    """A connection to one kbd daemon (thread-safe like an ``httpx.Client``).

    Every method returns the daemon's JSON (the docs/cli.md JSON shapes) or raises
    the :mod:`kbd.errors` class of its answer."""

    def __init__(
        self,
        socket_path: str | Path | None = None,
        *,
        token: str | None = None,
        root: Path | None = None,
        timeout: float = 15.0,
    ) -> None:
        self.socket_path = Path(socket_path) if socket_path is not None else default_socket(root)
        self._token = token if token is not None else os.environ.get("KBD_TOKEN") or None
        if self._token is not None:
            check_token(self._token.strip())
        self.timeout = timeout
        self._reached = False
        self._http = httpx.Client(
            # Plain HTTP over a Unix socket: no TLS ever, so no CA bundle to
            # load (verify=True costs every CLI call through the daemon ~20 ms).
            transport=httpx.HTTPTransport(uds=str(self.socket_path), verify=False),
            base_url="http://kbd",
            headers=self._headers(),
            timeout=timeout,
        )

    def authorization(self) -> str | None:
        """The ``Authorization`` header value this client sends (None: the peer uid authenticates)."""
        return f"Bearer {self._token.strip()}" if self._token else None

    def _headers(self) -> dict[str, str]:
        auth = self.authorization()
        return {"Authorization": auth} if auth else {}

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- requests -------------------------------------------------------------------------------

    def _unreachable(self, exc: Exception) -> KbdError:
        if isinstance(exc, PermissionError):
            if not os.access(self.socket_path.parent, os.X_OK):
                # connect() says EACCES for a closed folder on the way too: then
                # nobody can tell whether a daemon listens there at all.
                return errors.PermissionDenied(
                    f"cannot reach {self.socket_path}: a folder on its path is closed to you ({exc.strerror})",
                    hint="point KBD_SOCKET (or --socket) at the daemon's socket (a service host: /run/kbd/kbd.sock)",
                )
            return errors.PermissionDenied(
                f"the kbd daemon at {self.socket_path} refuses this user ({exc.strerror})",
                hint="ask the host's operator to add you to group kbd (then log in again)",
            )
        return Unavailable(
            f"no kbd daemon is reachable at {self.socket_path} ({type(exc).__name__}: {exc})",
            hint="start one with `kbd serve`, or point KBD_SOCKET at its socket",
        )

    def _probe(self) -> None:
        """Raise Unavailable unless the socket accepts a connection. Checked
        before the first call and before each event-stream (re)connection:
        httpcore leaks its socket when a Unix-socket connect fails (closed
        only when collected), and a host that retries must not pile them up."""
        import socket

        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.settimeout(self.timeout)
            probe.connect(str(self.socket_path))
        except OSError as exc:
            raise self._unreachable(exc) from None
        finally:
            probe.close()
        self._reached = True

    def request(
        self, method: str, path: str, *, json: Any = None, params: dict[str, str] | None = None
    ) -> Any:
        """One API call: its JSON answer, or the error it stands for."""
        if not self._reached:
            self._probe()
        try:
            r = self._http.request(method, path, json=json, params=params)
        except httpx.TransportError as exc:
            raise self._unreachable(exc) from None
        if r.status_code >= 400:
            raise error_from(r.status_code, r.content)
        try:
            answer = orjson.loads(r.content)
        except orjson.JSONDecodeError:
            answer = None
        if not isinstance(answer, dict):
            # Every API answer is a JSON object: this is some other program.
            raise Unavailable(
                f"the program at {self.socket_path} is not a kbd daemon "
                f"(it answered {method} {path} with HTTP {r.status_code} and no JSON object)",
                hint="point KBD_SOCKET (or --socket) at the kbd daemon's socket",
            )
        return answer

    def whoami(self) -> dict[str, Any]:
        out: dict[str, Any] = self.request("GET", "/v1/whoami")
        return out

    def health(self) -> dict[str, Any]:
        out: dict[str, Any] = self.request("GET", "/v1/health")
        return out

    # -- sessions ----------------------------------------------------------------------------

    def open_session(
        self,
        workflow_id: str,
        *,
        kind: str | None = None,
        kb_access: str | None = None,
        item_kb_write: bool | None = None,
        parent: str | None = None,
    ) -> dict[str, Any]:
        """Open a session (a copied child of ``parent`` when given); its plan."""
        body: dict[str, Any] = {"workflow_id": workflow_id}
        for name, value in (("kind", kind), ("kb_access", kb_access), ("item_kb_write", item_kb_write),
                            ("parent", parent)):  # fmt: skip
            if value is not None:
                body[name] = value
        out: dict[str, Any] = self.request("POST", "/v1/sessions", json=body)
        return out

    def show_session(self, sid: str) -> dict[str, Any]:
        """The session's plan rebuilt now, with the commands running in it."""
        out: dict[str, Any] = self.request("GET", f"/v1/sessions/{_segment(sid)}")
        return out

    plan = show_session

    def env(self, sid: str) -> dict[str, str]:
        """The variables a command of the session gets now (``WORKFLOW_KB_*`` …)."""
        return dict(self.show_session(sid)["env"])

    def close_session(self, sid: str) -> dict[str, Any]:
        """Close the session and its children; what they left running ends."""
        out: dict[str, Any] = self.request("DELETE", f"/v1/sessions/{_segment(sid)}")
        return out

    # -- events ------------------------------------------------------------------------------

    def exec(
        self,
        sid: str,
        argv: list[str],
        *,
        stdin: int = 0,
        stdout: int = 1,
        stderr: int = 2,
        cwd: str | None = None,
    ) -> int:
        """Run ``argv`` in session ``sid``'s sandbox through the exec broker, with
        ``stdin``/``stdout``/``stderr`` (descriptors this process owns) as its
        fds 0-2; the command runs as this process's uid, gid and groups. Returns
        its exit status (128+N for signal N). kbd's refusals raise the
        :mod:`kbd.errors` class of their code, with its exit code."""
        from kbd.client import brokered as thin
        from kbd.errors import WireError

        try:
            status = thin.call(
                str(self.socket_path), sid, argv, stdio=(stdin, stdout, stderr), cwd=cwd, token=self._token,
                notice=lambda line: None,
            )  # fmt: skip
        except thin.Refused as refused:
            raise refusal_error(refused.code, refused.message, refused.hint, refused.exit_code) from None
        except WireError as exc:
            raise Unavailable(
                f"the kbd daemon at {self.socket_path} broke the exec protocol: {exc}"
            ) from None
        except OSError as exc:
            raise self._unreachable(exc) from None
        if status is None:  # only for a default socket nobody listens on: never with explicit=True
            raise Unavailable(f"no kbd daemon is reachable at {self.socket_path}")
        return status

    def events(
        self, *, since: str | None = None, follow: bool = True, reconnect: bool = True
    ) -> Iterator[dict[str, Any]]:
        """The change feed (docs/daemon.md): each event as ``{"id", "type", "at", ...}``.

        With ``follow`` it never ends by itself: a dropped connection (a daemon
        restart) is resumed from the last id received, so nothing is missed or
        repeated; when the daemon cannot promise that, a ``resync`` event says
        to reload state. ``since``: the id to resume after. Without ``follow``:
        the events after ``since`` (or the recent ones), then it ends. Errors
        the daemon answers (401, 403, a malformed id) are raised, not retried,
        and so is a daemon that is not reachable at the first connection."""
        last = since
        failures = 0
        connected = False
        while True:
            try:
                for event in self._stream(last, follow):
                    connected = True
                    last = str(event["id"])
                    failures = 0
                    yield event
                connected = True
                if not follow:
                    return
            except Unavailable:
                if not (follow and reconnect and connected):
                    raise
            if not follow:
                return
            time.sleep(RECONNECT_BACKOFF[min(failures, len(RECONNECT_BACKOFF) - 1)])
            failures += 1

    def _stream(self, since: str | None, follow: bool) -> Iterator[dict[str, Any]]:
        self._probe()
        params = {"follow": "true" if follow else "false"}
        headers = {"Last-Event-ID": since} if since is not None else {}
        timeout = httpx.Timeout(self.timeout, read=None if follow else self.timeout)
        try:
            with self._http.stream("GET", "/v1/events", params=params, headers=headers, timeout=timeout) as r:
                if r.status_code >= 400:
                    raise error_from(r.status_code, r.read())
                for _, _, data in parse_sse(r.iter_lines()):
                    event: dict[str, Any] = orjson.loads(data)
                    yield event
        except httpx.TransportError as exc:
            raise self._unreachable(exc) from None


def check_token(token: str) -> None:
    """Refuse a token no principal can have before it is sent: a header cannot
    carry a control or non-ASCII character (the HTTP library would fail with
    the token in its message). The token itself is never echoed."""
    for i, ch in enumerate(token):
        if not "!" <= ch <= "~":
            raise errors.InvalidInput(
                f"the token (from $KBD_TOKEN or --token-file) has a character no token holds: "
                f"U+{ord(ch):04X} at position {i}",
                hint="a kbd token is printable ASCII without spaces, as `kbd principals token` printed it",
            )


def _segment(value: str) -> str:
    """One path segment: a session ID never contains '/', but a typo must not reach another route."""
    if "/" in value or value in ("", ".", ".."):
        raise errors.InvalidInput(f"session ID {value!r} is not a valid path segment")
    return value

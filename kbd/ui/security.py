"""The Knowledge page's web surface, decided (docs/knowledge-page.md): pure functions, no I/O.

A local web server is an attack surface reachable by every page the user's
browser opens and by every local process. What stands between them and the
principal's rights:

* **Host** must be exactly ``127.0.0.1:PORT`` (the bound address and port):
  a DNS-rebinding page (``evil.example`` resolving to 127.0.0.1) or a
  ``localhost:PORT`` alias is refused before anything else, assets included.
* A **one-time token** printed on stdout (only the user who started
  ``kbd ui`` sees it) is exchanged once for an ``HttpOnly``, ``SameSite=Strict``
  **cookie**; every ``/api/*`` request needs that cookie.
* Every **state-changing** request also needs the **CSRF** token (header
  ``X-KBD-CSRF``, learnt from ``/api/me`` by same-origin script only) and a
  same-origin **Origin** header: a form or ``fetch`` from another origin can
  send neither.
* The **peer** of every connection must be a process of the user who runs
  ``kbd ui`` (or root): 127.0.0.1 is shared by every local user, and a
  browser sends a host's cookies to every port of it, so another user's web
  server on 127.0.0.1 may learn the cookie, and another user may read the
  one-time URL from the browser's command line (``ps``). Neither can then
  connect as someone else (:func:`peer_uid` reads the kernel's socket table).
* Every answer carries a strict **Content-Security-Policy** (no inline script,
  no other origin) and the usual anti-framing/sniffing headers.

Secrets are compared in constant time (:func:`hmac.compare_digest`).
"""

from __future__ import annotations

import hmac
import re
import secrets
import socket
from dataclasses import dataclass

COOKIE_PREFIX = "kbd_ui_"
CSRF_HEADER = "x-kbd-csrf"
BIND_HOST = "127.0.0.1"

CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
    "font-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
#: On every answer, whatever its type (html, json, asset, error, event stream).
HEADERS: tuple[tuple[str, str], ...] = (
    ("content-security-policy", CSP),
    ("x-content-type-options", "nosniff"),
    ("referrer-policy", "no-referrer"),
    ("x-frame-options", "DENY"),
    ("cross-origin-opener-policy", "same-origin"),
    ("cross-origin-resource-policy", "same-origin"),
)
#: On every /api/* answer too: data is never kept by a cache.
API_HEADERS: tuple[tuple[str, str], ...] = (("cache-control", "no-store"),)

#: Methods that change something: they need the CSRF token and a same-origin Origin.
SAFE_METHODS = frozenset({"GET", "HEAD"})

ASSET_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
#: Content types by extension; anything else is not served.
ASSET_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
    ".ico": "image/x-icon",
    ".woff2": "font/woff2",
}


def new_secret() -> str:
    """32 random bytes, URL-safe (tokens, cookies, CSRF tokens)."""
    return secrets.token_urlsafe(32)


def same(given: str | None, expected: str | None) -> bool:
    """``given == expected`` in constant time; a missing value never matches."""
    if given is None or expected is None:
        return False
    return hmac.compare_digest(given.encode("utf-8", "surrogateescape"), expected.encode())


def origin_of(port: int) -> str:
    return f"http://{BIND_HOST}:{port}"


def host_ok(host: str | None, port: int) -> bool:
    """The ``Host`` header names exactly the bound address and port: not
    ``localhost``, not another port, not a name that resolves here (DNS rebinding)."""
    return host == f"{BIND_HOST}:{port}"


def peer_uid(tcp_table: str, client: tuple[str, int], server_port: int) -> int | None:
    """The uid owning the client end (``client``: its IPv4 address and port) of
    the connection to 127.0.0.1:``server_port``, from ``/proc/net/tcp``'s text;
    None: no such socket (gone, a time-wait remnant whose owner the kernel no
    longer keeps, or not IPv4)."""
    try:
        local = f"{int.from_bytes(socket.inet_aton(client[0]), 'little'):08X}:{client[1]:04X}"
    except OSError:
        return None
    remote = f"0100007F:{server_port:04X}"
    for line in tcp_table.splitlines()[1:]:
        cols = line.split()
        # sl local rem st tx:rx tr:when retrnsmt uid timeout inode ...; st 06 is TIME_WAIT
        if len(cols) >= 10 and cols[1] == local and cols[2] == remote and cols[3] != "06":
            return int(cols[7]) if cols[7].isdigit() else None
    return None


def peer_ok(uid: int | None, own_uid: int) -> bool:
    """The connection is this user's (or root's: root can read this process's
    memory anyway, so refusing it would protect nothing)."""
    return uid is not None and uid in (own_uid, 0)


@dataclass(frozen=True)
class Refusal:
    """Why a request is refused: a 403 with this code and message."""

    code: str
    message: str
    hint: str = "open the page through the URL `kbd ui` printed"


WRONG_HOST = Refusal(
    "ui-host",
    "this page answers only to the Host 127.0.0.1 with the port kbd ui bound",
    "open the URL `kbd ui` printed, exactly as printed (not localhost, not another name)",
)
OTHER_USER = Refusal(
    "ui-peer",
    "this page answers only to programs of the user who started kbd ui",
    "open the URL in your own browser, as the user who ran `kbd ui`",
)
NO_COOKIE = Refusal(
    "ui-unauthenticated",
    "this request carries no valid kbd ui cookie",
    "open the one-time URL `kbd ui` printed; if it was already used, run `kbd ui` again",
)
NO_CSRF = Refusal(
    "ui-csrf", "a change needs the X-KBD-CSRF header with the token from /api/me", "reload the page"
)
BAD_ORIGIN = Refusal(
    "ui-origin",
    "a change must come from the page itself (Origin: http://127.0.0.1:PORT)",
    "make the change from the page `kbd ui` serves",
)
BAD_TOKEN = Refusal(
    "ui-token",
    "this one-time link is not valid (already used, or wrong)",
    "run `kbd ui` again for a new link",
)


def check_api(
    method: str, *, cookie: str | None, session_cookie: str | None, csrf: str | None, session_csrf: str,
    origin: str | None, port: int,
) -> Refusal | None:  # fmt: skip
    """May this ``/api/*`` request (its Host already checked) proceed?
    ``session_cookie``: the cookie the token was exchanged for (None: not yet)."""
    if not same(cookie, session_cookie):
        return NO_COOKIE
    if method.upper() in SAFE_METHODS:
        return None
    if not same(csrf, session_csrf):
        return NO_CSRF
    # Origin "null" (a sandboxed frame, a file: page), another origin, or none: refused.
    if origin != origin_of(port):
        return BAD_ORIGIN
    return None


def asset_type(name: str) -> str | None:
    """The Content-Type to serve asset ``name`` with, or None: not an asset
    name (a path, ``..``, a dotfile, an unknown type) — never served."""
    if not ASSET_NAME.fullmatch(name) or ".." in name:
        return None
    dot = name.rfind(".")
    return ASSET_TYPES.get(name[dot:].lower()) if dot > 0 else None


def cookie_name(port: int) -> str:
    """``kbd_ui_PORT``: browsers keep cookies per host, not per port, so two
    ``kbd ui`` servers on 127.0.0.1 (two principals, two roots) would otherwise
    overwrite each other's cookie and log each other's pages out."""
    return f"{COOKIE_PREFIX}{port}"


def cookie_header(value: str, port: int) -> str:
    """The Set-Cookie for the session: script cannot read it (HttpOnly), no
    other site's request carries it (SameSite=Strict). No ``Secure``: the page
    is plain HTTP on loopback, where a Secure cookie would not be sent back."""
    return f"{cookie_name(port)}={value}; HttpOnly; SameSite=Strict; Path=/"


def cookie_from(header: str | None, port: int) -> str | None:
    """This server's cookie in a Cookie header (the last one wins as browsers send it once)."""
    if not header:
        return None
    wanted, found = cookie_name(port), None
    for part in header.split(";"):
        name, sep, value = part.strip().partition("=")
        if sep and name == wanted:
            found = value
    return found

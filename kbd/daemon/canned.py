"""Answers the daemon gives before (or without) the application: a complete
HTTP/1.1 response carrying the API's error envelope, and the canned ones the
protocol writes when a connection breaks a limit."""

from __future__ import annotations

import http

import orjson

from kbd.daemon.limits import BODY_TIMEOUT, HEADER_TIMEOUT, MAX_HEADER_BYTES
from kbd.errors import HeadersTooLarge, KbdError, Overloaded, RequestTimeout, http_answer


def error_response(err: KbdError, *, extra: dict[str, str] | None = None) -> bytes:
    """A complete HTTP/1.1 response with the API's answer to ``err`` (the one
    mapping, :func:`kbd.errors.http_answer`), closing the connection: for
    answers given before (or without) the application. ``extra``: more
    headers (the broker's ``x-kbd-exit``)."""
    code, envelope, headers = http_answer(err)
    headers = {**headers, **(extra or {})}
    body = orjson.dumps(envelope)
    status = http.HTTPStatus(code)
    lines = "".join(f"{name.lower()}: {value}\r\n" for name, value in headers.items())
    head = (
        f"HTTP/1.1 {status.value} {status.phrase}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n{lines}\r\n"
    )
    return head.encode("ascii") + body


OVER_CAP = error_response(
    Overloaded("too many open connections from this client", hint="close idle connections and retry")
)
HEADERS_TOO_SLOW = error_response(
    RequestTimeout(f"the request headers did not arrive within {HEADER_TIMEOUT:g}s")
)
HEADERS_TOO_LARGE = error_response(
    HeadersTooLarge(f"the request line and headers exceed {MAX_HEADER_BYTES} bytes")
)
BODY_TOO_SLOW = error_response(
    RequestTimeout(
        f"the request body did not arrive within {BODY_TIMEOUT:g}s",
        hint="send the whole request body at once",
    )
)

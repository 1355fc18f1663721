"""Adversarial review (docs/knowledge-page.md "Web-surface defences"), in a real Chromium: a browser keeps one cookie
jar per host, not per port, so every web server on 127.0.0.1 the user's browser
visits (another local user's, say) receives the page's cookie. Holding it must
not let another local user act as the page's principal."""

from __future__ import annotations

import contextlib
import http.server
import json
import subprocess
import threading
from collections.abc import Iterator
from typing import Any

from tests.browser import worlds
from tests.browser.conftest import World

NOBODY = 65534
CLIENT = """
import http.client, json, sys
port, path, cookie = int(sys.argv[1]), sys.argv[2], sys.argv[3]
c = http.client.HTTPConnection("127.0.0.1", port, timeout=15)
c.request("GET", path, headers={"Cookie": cookie})
r = c.getresponse()
print(json.dumps({"status": r.status, "body": r.read().decode(errors="replace")}))
"""


class _Recorder(http.server.BaseHTTPRequestHandler):
    seen: list[str]

    def do_GET(self) -> None:
        self.seen.append(self.headers.get("Cookie") or "")
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.end_headers()
        self.wfile.write(b"<!doctype html><title>another server</title><p>elsewhere</p>")

    def log_message(self, *args: Any) -> None:
        pass


@contextlib.contextmanager
def cookie_recorder() -> Iterator[tuple[str, list[str]]]:
    """Another web server on 127.0.0.1 (another port) recording the Cookie headers it receives."""
    seen: list[str] = []
    handler = type("Recorder", (_Recorder,), {"seen": seen})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", seen
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def test_a_cookie_another_port_received_serves_no_other_local_user(world: World) -> None:
    worlds.build(world.kb)
    ui, ctx, _ = world.open("alice", worlds.MAIN)
    with cookie_recorder() as (origin, seen):
        page = ctx.new_page()
        page.goto(f"{origin}/")
        page.close()
    name = f"kbd_ui_{ui.port}="
    leaked = [part.strip() for header in seen for part in header.split(";") if part.strip().startswith(name)]
    assert leaked, f"Chromium no longer sends 127.0.0.1's cookies to other ports? {seen}"
    out = subprocess.run(["/usr/bin/python3", "-I", "-c", CLIENT, str(ui.port), "/api/me", leaked[0]], user=NOBODY,
                         group=NOBODY, extra_groups=[], cwd="/", capture_output=True, timeout=30, check=True)  # fmt: skip
    answer = json.loads(out.stdout)
    assert answer["status"] == 403 and "csrf" not in answer["body"], answer
    assert json.loads(answer["body"])["error"]["code"] == "ui-peer", answer

"""Adversarial review of the Knowledge page's server (docs/knowledge-page.md "Web-surface defences"): the real `kbd ui` over real HTTP.

127.0.0.1 is shared by every local user of the host, and browsers keep one
cookie jar per host, not per port: whatever the page's secrets are, another
local user may come to hold them (the one-time URL is on the browser's command
line, visible to ``ps``; the cookie is sent to every server on 127.0.0.1 the
browser visits). These tests play that other user as a real process under
another uid, with the real secrets in hand.
"""

from __future__ import annotations

import json
import os
import pwd
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from kbd.ui import security
from tests.helpers import KbRoot
from tests.integration import daemon
from tests.integration.ui import Ui, serving_ui
from tests.system import test_builders_through_the_daemon as builders
from tests.system.test_builders_through_the_daemon import REPO, Host

pytestmark = pytest.mark.timeout(300)

#: Real Unix users (a builder, a stranger) and a daemon on a service root (the fixture of docs/multi-user.md "The permission model").
host = builders.host

NOBODY = 65534
#: One request from a process of uid NOBODY: prints the status, the Set-Cookie and the body.
CLIENT = """
import http.client, json, sys
port, path, cookie = int(sys.argv[1]), sys.argv[2], sys.argv[3]
c = http.client.HTTPConnection("127.0.0.1", port, timeout=15)
c.request("GET", path, headers={"Cookie": cookie} if cookie else {})
r = c.getresponse()
print(json.dumps({"status": r.status, "set_cookie": r.getheader("set-cookie"), "body": r.read().decode(errors="replace")}))
"""


def request_as(uid: int, ui: Ui, path: str, cookie: str = "") -> dict[str, object]:
    """GET ``path`` from a process of local user ``uid`` (its own primary group)."""
    if os.getuid() != 0:
        pytest.fail("these tests run as root, to start a process of another uid")
    gid = pwd.getpwuid(uid).pw_gid
    out = subprocess.run(["/usr/bin/python3", "-I", "-c", CLIENT, str(ui.port), path, cookie], user=uid,
                         group=gid, extra_groups=[], cwd="/", capture_output=True, timeout=30, check=True)  # fmt: skip
    answer: dict[str, object] = json.loads(out.stdout)
    return answer


def as_other_user(ui: Ui, path: str, cookie: str = "") -> dict[str, object]:
    """GET ``path`` from a process of another local user (uid 65534)."""
    return request_as(NOBODY, ui, path, cookie)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> KbRoot:
    kb = KbRoot.create(tmp_path_factory.mktemp("uireview") / "root")
    kb.workflow("wf", label="Work", access={"owners": ["alice"]})
    (kb.workflows / "wf" / "knowledgebase" / "notes" / "secret.md").write_text("alice's secret\n")
    return kb


@pytest.fixture
def alice(world: KbRoot) -> Iterator[Ui]:
    with serving_ui(world.root, "--as", "alice") as ui:
        yield ui


def test_another_local_user_cannot_spend_the_one_time_url(alice: Ui) -> None:
    # The URL leaks through the browser's argv (`ps` shows it to every local user): the race must not pay.
    stolen = as_other_user(alice, f"/?token={alice.token}")
    assert stolen["status"] == 403 and stolen["set_cookie"] is None, stolen
    assert "only to programs of the user who started kbd ui" in str(stolen["body"]), stolen
    # The owner's browser still logs in with it (login asserts the 303, the cookie and /api/me).
    alice.login()


def test_another_local_user_cannot_use_a_leaked_cookie(alice: Ui) -> None:
    c = alice.login()
    cookie = f"{security.cookie_name(alice.port)}={c.cookies.get(security.cookie_name(alice.port))}"
    # e.g. another user's server on 127.0.0.1:OTHER received it: the browser sends a host's cookies to every port.
    for path in ("/api/me", "/api/workflows/wf/own/file?path=notes/secret.md", "/"):
        r = as_other_user(alice, path, cookie)
        assert r["status"] == 403, (path, r)
        assert "secret" not in str(r["body"]) and alice.csrf not in str(r["body"]), r
    me = as_other_user(alice, "/api/me", cookie)
    assert json.loads(str(me["body"]))["error"]["code"] == "ui-peer", me
    # The owner (this process) is served as before.
    assert c.get("/api/workflows/wf/own/file", params={"path": "notes/secret.md"}).status_code == 200


def test_peer_uid_reads_the_client_end_of_the_connection() -> None:
    table = (
        "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
        "   0: 0100007F:1F90 0100007F:C350 01 00000000:00000000 00:00000000 00000000     0        0 11 1\n"
        "   1: 0100007F:C350 0100007F:1F90 01 00000000:00000000 00:00000000 00000000  1000        0 12 1\n"
        "   2: 0100007F:C351 0100007F:1F90 06 00000000:00000000 03:00000000 00000000     0        0 0 3\n"
    )
    lo = "127.0.0.1"
    assert security.peer_uid(table, (lo, 0xC350), 0x1F90) == 1000  # the client's socket, not the server's
    assert security.peer_uid(table, (lo, 0xC351), 0x1F90) is None  # time-wait: owner unknown
    assert security.peer_uid(table, (lo, 0xC352), 0x1F90) is None
    assert security.peer_uid(table, ("127.0.0.2", 0xC350), 0x1F90) is None  # another source address
    assert security.peer_uid(table, ("::1", 0xC350), 0x1F90) is None
    assert security.peer_ok(1000, 1000) and security.peer_ok(0, 1000)
    assert not security.peer_ok(1001, 1000) and not security.peer_ok(None, 1000)


def test_the_page_is_served_to_its_own_user(alice: Ui) -> None:
    with httpx.Client(base_url=alice.base, timeout=15) as c:
        assert c.get("/assets/app.js").status_code == 200


def test_head_on_the_event_stream_answers_and_the_connection_stays_usable(alice: Ui) -> None:
    c = alice.login()
    with httpx.Client(base_url=alice.base, cookies=c.cookies, timeout=5) as h:
        head = h.head("/api/events")
        assert head.status_code == 200 and head.headers["content-type"].startswith("text/event-stream"), head
        # Same keep-alive connection: the HEAD's response has ended, the next request is answered.
        assert h.get("/api/me").status_code == 200


def test_a_builder_s_page_serves_her_own_programs_and_not_another_user(host: Host) -> None:
    """`kbd ui` run by a real non-root builder (through the daemon): her own processes
    are served (her browser), a stranger holding her cookie is not, root is."""
    env = {"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", "PYTHONPATH": str(REPO), "LANG": "C.UTF-8",
           "KBD_ROOT": str(host.kb.root)}  # fmt: skip
    prefix = ["setpriv", "--reuid", str(host.builder), "--regid", str(pwd.getpwuid(host.builder).pw_gid),
              "--init-groups"]  # fmt: skip
    with serving_ui(host.kb.root, prefix=prefix, env=env, with_root=False, cwd="/") as ui:
        mine = request_as(host.builder, ui, f"/?token={ui.token}")
        assert mine["status"] == 303 and mine["set_cookie"], mine
        cookie = str(mine["set_cookie"]).split(";")[0]
        me = request_as(host.builder, ui, "/api/me", cookie)
        assert me["status"] == 200 and json.loads(str(me["body"]))["principal"] == "alice", me
        stolen = request_as(host.stranger, ui, "/api/me", cookie)
        assert stolen["status"] == 403 and json.loads(str(stolen["body"]))["error"]["code"] == "ui-peer", (
            stolen
        )
        with httpx.Client(base_url=ui.base, timeout=15) as root_client:  # root: allowed
            assert root_client.get("/api/me", headers={"Cookie": cookie}).status_code == 200


def test_a_refused_feed_is_not_retried_twice_a_second(tmp_path: Path) -> None:
    """Through the daemon, a principal disabled mid-session: the daemon refuses the feed;
    the stream says resync and ends, and tells EventSource to wait before reconnecting
    (each reconnect is a resync: the page refetches every panel from the daemon)."""
    kb = KbRoot.create(tmp_path / "root")
    kb.workflow("wf", access={"owners": ["bob"]})
    token_file = tmp_path / "bob.token"
    token_file.write_text(daemon.issue_tokens(kb.root, ["bob"])["bob"])
    os.chmod(token_file, 0o600)
    with (
        daemon.serving(kb.root) as served,
        serving_ui(kb.root, "--socket", str(served.sock), "--token-file", str(token_file)) as ui,
    ):
        c = ui.login()
        people = yaml.safe_load((kb.root / "principals.yaml").read_text())
        for p in people["principals"]:
            if p["id"] == "bob":
                p["disabled"] = True
        (kb.root / "principals.yaml").write_text(yaml.safe_dump(people))
        assert c.get("/api/workflows").status_code in (401, 403)
        with c.stream("GET", "/api/events", timeout=15) as r:
            text = "".join(r.iter_text())
        assert '"feed-refused"' in text, text
        retries = [int(line[len("retry: ") :]) for line in text.splitlines() if line.startswith("retry: ")]
        assert retries and retries[-1] >= 5000, text

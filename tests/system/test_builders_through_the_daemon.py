"""Non-root builders on a service root, with real Unix users (docs/multi-user.md).

The root is laid out as a service host's: ``root:G 0750`` with ``kbd.yaml``
``0640 root:G`` and ``state/`` ``0700 root`` — a member of group G may read
the configuration but not use the root itself. The daemon listens on a socket
of group G (0660) in a folder G may traverse. A builder runs plain ``kbd``
commands with no socket named: kbd sees it cannot use the root, finds the
daemon, and every command is answered there as her principal (peer uid).
"""

from __future__ import annotations

import contextlib
import grp
import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from tests.helpers import KbRoot
from tests.integration import daemon
from tests.mcp_client import initialize_lines, raw_exchange

REPO = Path(__file__).parents[2]
# Real users this module creates run kbd from this checkout.
pytestmark = pytest.mark.requires_reachable_checkout


@dataclass(frozen=True)
class Host:
    kb: KbRoot
    base: Path
    sock: Path
    group: str
    builder: int  # uid of the builder (principal alice, owner of "mine")
    stranger: int  # uid of a user not in the group (principal dave)


@contextlib.contextmanager
def _users() -> Iterator[tuple[str, int, int]]:
    tag = uuid.uuid4().hex[:8]
    group, builder, stranger = f"kbg{tag}", f"kbb{tag}", f"kbs{tag}"
    subprocess.run(["groupadd", group], check=True)
    made: list[str] = []
    try:
        for name, extra in ((builder, ["-G", group]), (stranger, [])):
            subprocess.run(["useradd", "--no-create-home", "--shell", "/bin/sh", *extra, name], check=True)
            made.append(name)
        yield group, pwd.getpwnam(builder).pw_uid, pwd.getpwnam(stranger).pw_uid
    finally:
        for name in made:
            subprocess.run(["userdel", name], check=False)
        subprocess.run(["groupdel", group], check=False)


@pytest.fixture(scope="module")
def host() -> Iterator[Host]:
    with _users() as (group, builder, stranger):
        gid = grp.getgrnam(group).gr_gid
        base = Path(tempfile.mkdtemp(prefix="kbd-builders-", dir="/tmp"))
        os.chmod(base, 0o755)  # noqa: S103 - the way to the socket folder, as / is
        try:
            kb = KbRoot.create(base / "root")
            run = base / "run"
            run.mkdir(mode=0o750)
            os.chown(run, 0, gid)
            sock = run / "kbd.sock"
            config = kb.root / "kbd.yaml"
            doc = yaml.safe_load(config.read_text())
            doc["socket"] = str(sock)
            config.write_text(yaml.safe_dump(doc))
            people = yaml.safe_load((kb.root / "principals.yaml").read_text())
            for entry in people["principals"]:
                entry.pop("uid", None)
                if entry["id"] == "alice":
                    entry["uid"] = builder
                if entry["id"] == "dave":
                    entry["uid"] = stranger
            (kb.root / "principals.yaml").write_text(yaml.safe_dump(people))
            kb.workflow("mine", access={"owners": ["alice"]})
            kb.workflow("lib", access={"owners": ["bob"], "readers": ["alice"]})
            kb.workflow(
                "theirs", access={"owners": ["bob"]}, sources=[{"workflow_id": "lib", "alias": "lib"}]
            )
            # The service layout: the group reads the config, nobody but root the rest.
            os.chown(kb.root, 0, gid)
            os.chmod(kb.root, 0o750)  # noqa: S103 - group G is the way in, as on a service host
            os.chown(config, 0, gid)
            os.chmod(config, 0o640)
            os.chmod(kb.root / "principals.yaml", 0o600)
            os.chmod(kb.root / "state", 0o700)
            with daemon.serving(kb.root, sock=sock, home=base / "home") as served:
                os.chown(served.sock, 0, gid)
                os.chmod(served.sock, 0o660)
                yield Host(kb, base, sock, group, builder, stranger)
        finally:
            shutil.rmtree(base, ignore_errors=True)


def _kbd(
    uid: int, *args: str, root: Path | None = None, env: dict[str, str] | None = None
) -> tuple[int, str, str]:
    """``kbd ARGS`` as user ``uid`` (its own groups), KBD_ROOT naming the root and no socket."""
    full = {"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", "PYTHONPATH": str(REPO), "LANG": "C.UTF-8"}
    if root is not None:
        full["KBD_ROOT"] = str(root)
    full.update(env or {})
    r = subprocess.run(
        ["setpriv", "--reuid", str(uid), "--regid", str(pwd.getpwuid(uid).pw_gid), "--init-groups",
         sys.executable, "-m", "kbd", *args],
        capture_output=True, env=full, timeout=60, check=False, cwd="/",
    )  # fmt: skip
    return r.returncode, r.stdout.decode(), r.stderr.decode()


def test_the_builder_cannot_use_the_root_herself(host: Host) -> None:
    code, _, err = _kbd(host.builder, "sources", "list", "mine", "--root", str(host.kb.root),
                        env={"KBD_NO_DAEMON": "1", "KBD_SOCKET": "/nonexistent.sock"})  # fmt: skip
    assert code == 69, err  # a named socket is never bypassed, not even for a root she can read
    code, _, err = _kbd(
        host.builder, "doctor", "--root", str(host.kb.root), env={"KBD_SOCKET": "/nonexistent.sock"}
    )
    assert code == 65 and "unavailable" in _, err


def test_a_builder_manages_her_own_workflow_through_the_daemon(host: Host) -> None:
    root = host.kb.root
    code, out, err = _kbd(host.builder, "sources", "list", "mine", "--json", root=root)
    assert code == 0, err
    assert orjson.loads(out) == {
        "workflow_id": "mine",
        "version": orjson.loads(out)["version"],
        "sources": [],
    }
    code, out, err = _kbd(host.builder, "sources", "attach", "mine", "lib", "--alias", "lib", root=root)
    assert code == 0, err
    assert out.startswith("attached lib to mine as lib\n"), out
    manifest = host.kb.read_manifest(host.kb.workflows / "mine")
    assert manifest["knowledgebase_sources"] == [{"workflow_id": "lib", "alias": "lib", "access": "read"}]
    # The same answer the root gives for her, byte for byte.
    here = host.kb.call("sources", "list", "mine", "--as", "alice")
    assert _kbd(host.builder, "sources", "list", "mine", root=root) == (0, here.out, here.err)
    code, out, err = _kbd(host.builder, "workflows", "list", "--json", root=root)
    assert code == 0 and {w["id"] for w in orjson.loads(out)["workflows"]} >= {"mine", "lib"}, err
    code, _, err = _kbd(host.builder, "sources", "detach", "mine", "lib", root=root)
    assert code == 0, err
    assert (
        "knowledgebase_sources" not in host.kb.read_manifest(host.kb.workflows / "mine")
        or not (host.kb.read_manifest(host.kb.workflows / "mine")["knowledgebase_sources"])
    )


def test_a_builder_cannot_manage_or_see_what_is_not_hers(host: Host) -> None:
    root = host.kb.root
    before = (host.kb.workflows / "theirs" / "workflow.json").read_bytes()
    code, _, err = _kbd(host.builder, "sources", "detach", "theirs", "lib", root=root)
    # theirs is invisible to alice: the same answer as a workflow that does not exist, no path in it.
    code2, _, err2 = _kbd(host.builder, "sources", "detach", "nosuch", "lib", root=root)
    assert (code, err.replace("theirs", "X")) == (code2, err2.replace("nosuch", "X")), (err, err2)
    assert code == 66
    code, _, err = _kbd(host.builder, "writers", "grant", "lib", "mine", root=root)
    assert code == 77 and "error[permission-denied]" in err, err
    for text in (err, err2):
        assert str(host.kb.root) not in text and "/workflows/" not in text and "Traceback" not in text
    assert (host.kb.workflows / "theirs" / "workflow.json").read_bytes() == before


def test_a_user_outside_the_group_cannot_reach_the_socket(host: Host) -> None:
    code, _, err = _kbd(host.stranger, "sources", "list", "mine", root=host.kb.root)
    assert code == 77, err
    assert "refuses this user" in err or "Permission denied" in err, err
    code, _, err = _kbd(host.stranger, "--socket", str(host.sock), "sources", "list", "mine")
    assert code == 77 and "Traceback" not in err, err


def test_the_builder_runs_doctor_and_events_through_the_daemon(host: Host) -> None:
    code, out, err = _kbd(host.builder, "doctor", root=host.kb.root)
    assert code == 0, out + err
    assert "ok   principal: you are principal alice (user)" in out, out
    code, out, err = _kbd(host.builder, "events", "--json", root=host.kb.root)
    assert code == 0, err
    code, _, err = _kbd(host.builder, "audit", root=host.kb.root)
    # The whole log is the admins'; an owner reads her own workflow's records (docs/access.md "The audit log").
    assert code == 77 and "audit records of workflows it owns" in err, err
    code, out, err = _kbd(host.builder, "audit", "--workflow", "mine", "--json", root=host.kb.root)
    assert code == 0, err
    events = json.loads(out)["events"]
    assert all("mine" in (e.get("workflow_id"), e.get("source"), e.get("consumer")) or e.get("session")
               for e in events), events  # fmt: skip
    code, _, err = _kbd(host.builder, "audit", "--workflow", "lib", root=host.kb.root)
    assert code == 77 and "does not own workflow 'lib'" in err, err  # she reads lib, bob owns it


def test_without_its_daemon_a_builder_reads_the_root_but_changes_nothing(host: Host) -> None:
    """A root she may read (its config and principals readable by the group, even
    her own workflow folder writable) but not use (state/ root's), and no daemon
    answers: reads run on the root; every change is refused as 69 naming both
    facts — it was an internal error (70) or a 'busy' session store (75, retry)."""
    gid = grp.getgrnam(host.group).gr_gid
    kb = KbRoot.create(host.base / "nodaemon")
    doc = yaml.safe_load((kb.root / "kbd.yaml").read_text())
    doc["socket"] = str(host.base / "nobody-listens" / "kbd.sock")
    (kb.root / "kbd.yaml").write_text(yaml.safe_dump(doc))
    people = yaml.safe_load((kb.root / "principals.yaml").read_text())
    for entry in people["principals"]:
        entry.pop("uid", None)
        if entry["id"] == "alice":
            entry["uid"] = host.builder
    (kb.root / "principals.yaml").write_text(yaml.safe_dump(people))
    kb.workflow("mine", access={"owners": ["alice"]})
    kb.workflow("lib", access={"owners": ["alice"]})
    for path in (kb.root, kb.workflows, kb.root / "kbd.yaml", kb.root / "principals.yaml"):
        os.chown(path, 0, gid)
        os.chmod(path, 0o750 if path.is_dir() else 0o640)
    os.chmod(kb.root / "state", 0o700)
    for path in [kb.workflows / "mine", *(kb.workflows / "mine").rglob("*")]:
        os.chown(path, host.builder, gid)
    manifest = (kb.workflows / "mine" / "workflow.json").read_bytes()
    (host.base / "none.json").write_text("[]")
    code, out, err = _kbd(host.builder, "sources", "list", "mine", "--json", root=kb.root)
    assert code == 0 and orjson.loads(out)["sources"] == [], err
    for args in (
        ["sources", "attach", "mine", "lib", "--alias", "lib"],
        ["sources", "set", "mine", "--file", str(host.base / "none.json")],
        ["session", "open", "mine", "--kind", "builder"],
        ["audit"],
    ):
        code, _, err = _kbd(host.builder, *args, root=kb.root)
        assert code == 69 and "no kbd daemon answers" in err and "not use the root" in err, (args, err)
        assert "Traceback" not in err
    assert (kb.workflows / "mine" / "workflow.json").read_bytes() == manifest


def test_a_token_goes_only_to_a_socket_of_root_or_the_caller(host: Host) -> None:
    """The root's kbd.yaml chose the socket: if someone else owns it, kbd keeps the token to itself."""
    os.chown(host.sock, host.stranger, -1)
    try:
        code, _, err = _kbd(
            host.builder, "sources", "list", "mine", root=host.kb.root, env={"KBD_TOKEN": "secret-tok"}
        )
        assert code == 77 and f"belongs to uid {host.stranger}" in err and "secret-tok" not in err, err
        # Named by the caller, it is the caller's choice (uid auth still works without a token).
        code, _, err = _kbd(host.builder, "--socket", str(host.sock), "sources", "list", "mine")
        assert code == 0, err
    finally:
        os.chown(host.sock, 0, -1)


def test_a_closed_folder_before_the_socket_is_named_as_such(host: Host) -> None:
    # The stranger cannot read kbd.yaml, so kbd tries <root>/state/run/kbd.sock behind a closed folder.
    code, _, err = _kbd(host.stranger, "sources", "list", "mine", root=host.kb.root)
    assert code == 77 and "a folder on its path is closed to you" in err and "KBD_SOCKET" in err, err


def test_a_builder_runs_kbd_mcp_through_the_daemon(host: Host) -> None:
    """`kbd mcp SID` run by the builder herself (docs/mcp.md): every tool call goes
    through the daemon as her principal, and answers what the root answers."""
    root = host.kb.root
    lib = host.kb.workflows / "lib" / "knowledgebase"
    (lib / "context" / "guide.md").write_text("# Guide\nwombat rules\n")
    assert _kbd(host.builder, "sources", "attach", "mine", "lib", "--alias", "lib", root=root)[0] == 0
    code, out, err = _kbd(host.builder, "session", "open", "mine", "--kind", "execution", "--kb-access", "read",
                          "--json", root=root)  # fmt: skip
    assert code == 0, err
    sid = orjson.loads(out)["session_id"]
    theirs = host.kb.open_session("theirs", kind="execution", kb_access="read", actor="bob")
    try:
        calls = [
            ("tools/list", {}),
            ("tools/call", {"name": "kb_read", "arguments": {"alias": "lib", "relpath": "context/guide.md"}}),
            ("tools/call", {"name": "kb_read", "arguments": {"alias": "lib", "relpath": "../workflow.json"}}),
        ]
        answers = _mcp(host.builder, root, sid, calls)
        assert {t["name"] for t in answers[1]["result"]["tools"]} == {"kb_sources", "kb_list", "kb_read",
                                                                      "kb_search", "kb_check", "kb_why"}  # fmt: skip
        read = answers[2]["result"]
        assert not read.get("isError") and "wombat rules" in read["content"][0]["text"], read
        assert read["content"][0]["text"].startswith("kbd file lib:context/guide.md")
        refused = answers[3]["result"]
        assert refused["isError"] and refused["content"][0]["text"].startswith("error[invalid-path]: ")
        # Another principal's session: nothing offered, and a call says why.
        stranger = _mcp(host.builder, root, theirs, [("tools/list", {}), ("tools/call", {"name": "kb_sources",
                                                                                  "arguments": {}})])  # fmt: skip
        assert stranger[1]["result"]["tools"] == []
        text = stranger[2]["result"]["content"][0]["text"]
        assert text.startswith(("error[permission-denied]", "error[not-found]")) and str(root) not in text, (
            text
        )
    finally:
        host.kb.call("session", "close", sid)
        host.kb.call("session", "close", theirs)
        assert _kbd(host.builder, "sources", "detach", "mine", "lib", root=root)[0] == 0


def _mcp(uid: int, root: Path, sid: str, calls: list[tuple[str, dict[str, Any]]]) -> dict[int, Any]:
    """``kbd mcp SID`` as user ``uid`` over raw JSON-RPC lines: the answers by id."""
    lines = initialize_lines()
    lines += [
        orjson.dumps({"jsonrpc": "2.0", "id": i, "method": m, "params": p})
        for i, (m, p) in enumerate(calls, 1)
    ]
    env = {"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", "PYTHONPATH": str(REPO), "LANG": "C.UTF-8"}
    argv = ["setpriv", "--reuid", str(uid), "--regid", str(pwd.getpwuid(uid).pw_gid), "--init-groups",
            sys.executable, "-m", "kbd", "--root", str(root), "mcp", sid]  # fmt: skip
    return raw_exchange(argv, lines, env=env)


def test_the_builder_s_knowledge_page_goes_through_the_daemon(host: Host) -> None:
    """docs/knowledge-page.md "Panels": `kbd ui` run by a real non-root builder acts as her principal through the
    daemon (she cannot use the root): its changes are the daemon's, its feed relays the
    daemon's (a hand edit arrives within 1 s), and SIGTERM closes the session it opened."""
    import threading
    import time

    from tests.integration.test_ui_server import read_events
    from tests.integration.ui import serving_ui
    from tests.waiting import wait_for

    root = host.kb.root
    env = {"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", "PYTHONPATH": str(REPO), "LANG": "C.UTF-8",
           "KBD_ROOT": str(root)}  # fmt: skip
    prefix = ["setpriv", "--reuid", str(host.builder), "--regid", str(pwd.getpwuid(host.builder).pw_gid),
              "--init-groups"]  # fmt: skip
    mine = host.kb.workflows / "mine"
    with serving_ui(root, prefix=prefix, env=env, with_root=False, cwd="/") as ui:
        c = ui.login()
        me = c.get("/api/me").json()
        assert (me["principal"], me["mode"], me["live"]) == ("alice", "daemon", True), me
        assert c.get("/api/workflows/mine").json()["rights"] == {"manage": True, "grant": True}
        assert c.get("/api/workflows/lib").json()["rights"] == {"manage": False, "grant": False}  # a reader
        assert c.get("/api/workflows/theirs").status_code == 404  # not hers to see
        r = ui.change(c, "POST", "/api/workflows/mine/sources", {"workflow_id": "lib", "alias": "lib"})
        assert r.status_code == 200, r.text
        assert [s["alias"] for s in host.kb.read_manifest(mine)["knowledgebase_sources"]] == ["lib"]
        r = ui.change(c, "POST", "/api/workflows/lib/sources", {"workflow_id": "mine", "alias": "mine"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "permission-denied", r.text
        assert c.get("/api/workflows/mine/search", params={"q": "lib"}).status_code == 200
        got: list[tuple[float, dict[str, object]]] = []
        following = threading.Event()
        t = threading.Thread(
            target=lambda: got.extend(read_events(c, time.monotonic() + 10, following=following))
        )
        t.start()
        wait_for(following.is_set, 10, "the page's event stream to follow the feed")
        edited = time.monotonic()
        host.kb.edit(mine, knowledgebase_sources=[])  # a hand detach
        t.join(timeout=30)
        assert got and got[0][1]["workflow_id"] == "mine", got
        assert got[0][0] - edited < 1.0, got[0][0] - edited
    sessions = orjson.loads(host.kb.cli("session", "list", "--all", "--json").out)["sessions"]
    assert [s for s in sessions if not s["closed"]] == [], sessions

"""`kbd principals add|disable|enable|remove|token|list` (docs/multi-user.md "Principals"): the real CLI on a
real root, the operator's principals.yaml kept
byte for byte outside the changed entry, every refusal leaving it
byte-identical, every change (and refusal) audited without a token, and a
running daemon honouring the change at its next request."""

from __future__ import annotations

import hashlib
import os
import pwd
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from kbd.state import audit
from tests.helpers import KbRoot
from tests.integration.daemon import clean_env, map_uid, serving
from tests.integration.test_cli_boundary import assert_error

COMMENTED = """\
# Principals of this host. Keep this header!

principals:
  # people
  - id: alice        # Alice
    kind: user
    uid: 4001

  - id: "ops"
    admin: true      # on call
    uid: 4002
  # services
  - id: svc
    kind: service
# end
"""


@pytest.fixture
def commented(kb: KbRoot) -> KbRoot:
    (kb.root / "principals.yaml").write_text(COMMENTED)
    return kb


def _file(kb: KbRoot) -> str:
    return (kb.root / "principals.yaml").read_text()


def _records(kb: KbRoot, *events: str) -> list[dict[str, Any]]:
    return [r for r in audit.read(kb.root / "state") if r["event"] in events]


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def test_token_rotation_keeps_the_operators_comments_and_layout(commented: KbRoot) -> None:
    """A bug once fixed (docs/multi-user.md "Principals"): `kbd principals token` rewrote the file from its
    parsed document and dropped every comment."""
    r = commented.cli("principals", "token", "alice")
    assert r.code == 0, r.err
    token = r.out.strip()
    assert token.startswith("kbd_") and r.out.count("\n") == 1
    assert _file(commented) == COMMENTED.replace(
        "    uid: 4001\n", f"    uid: 4001\n    token_sha256: {_quoted(_digest(token))}\n"
    )


def _quoted(digest: str) -> str:
    from kbd.core.principals_edit import render_scalar

    return render_scalar(digest)


def test_golden_each_command_changes_only_its_entry(commented: KbRoot) -> None:
    kb = commented
    assert kb.cli("principals", "add", "carol", "--uid", "4003", "--label", "Carol C.").code == 0
    assert kb.cli("principals", "disable", "alice").code == 0
    assert kb.cli("principals", "enable", "alice").code == 0
    token = kb.cli("principals", "token", "svc").out.strip()
    r = kb.cli("principals", "remove", "carol")
    assert r.code == 0, r.err
    assert kb.cli("principals", "add", "dave", "--user", "root", "--admin").code == 0
    assert (
        _file(kb)
        == f"""\
# Principals of this host. Keep this header!

principals:
  # people
  - id: alice        # Alice
    kind: user
    uid: 4001
    disabled: false

  - id: "ops"
    admin: true      # on call
    uid: 4002
  # services
  - id: svc
    kind: service
    token_sha256: {_quoted(_digest(token))}
  - id: dave
    kind: user
    admin: true
    uid: 0
# end
"""
    )


def test_each_command_says_what_it_did(commented: KbRoot) -> None:
    kb = commented
    r = kb.cli("principals", "add", "carol", "--uid", "4003", "--label", "Carol C.")
    assert (r.code, r.out) == (0, "added principal carol (user, uid 4003)\n")
    assert r.err == "kbd: note: uid 4003 has no passwd entry on this host\n"
    nobody = pwd.getpwnam("nobody").pw_uid
    r = kb.cli("principals", "add", "nob", "--user", "nobody", "--service")
    assert (r.code, r.out, r.err) == (0, f"added principal nob (service, uid {nobody} = nobody)\n", "")
    assert kb.cli("principals", "disable", "carol").out == "disabled principal carol\n"
    assert kb.cli("principals", "disable", "carol").out == "principal carol was already disabled\n"
    assert kb.cli("principals", "enable", "carol").out == "enabled principal carol\n"
    assert kb.cli("principals", "enable", "carol").out == "principal carol was already enabled\n"
    listed = kb.cli("principals", "list").out.splitlines()
    assert listed[3] == f"{'carol':<20} {'user':<8} uid=4003  Carol C."
    assert listed[0] == f"{'alice':<20} {'user':<8} uid=4001"
    assert kb.cli("principals", "remove", "carol").out == "removed principal carol\n"
    assert [p["id"] for p in yaml.safe_load(_file(kb))["principals"]] == ["alice", "ops", "svc", "nob"]


def test_json_answers(commented: KbRoot) -> None:
    kb = commented
    added = kb.cli("principals", "add", "carol", "--uid", "4003", "--admin", "--json").json()
    assert added == {"action": "add", "changed": True, "user": None, "principal": {
        "id": "carol", "kind": "user", "admin": True, "disabled": False, "uid": 4003, "has_token": False,
        "label": None}}  # fmt: skip
    assert kb.cli("principals", "disable", "carol", "--json").json()["principal"]["disabled"] is True
    again = kb.cli("principals", "disable", "carol", "--json").json()
    assert (again["action"], again["changed"]) == ("disable", False)
    issued = kb.cli("principals", "token", "carol", "--json").json()
    assert set(issued) == {"id", "token"} and issued["id"] == "carol"
    row = next(p for p in kb.cli("principals", "list", "--json").json()["principals"] if p["id"] == "carol")
    assert row == {"id": "carol", "kind": "user", "admin": True, "disabled": True, "uid": 4003, "has_token": True,
                   "label": None}  # fmt: skip
    removed = kb.cli("principals", "remove", "carol", "--json").json()
    assert (removed["action"], removed["principal"]["id"]) == ("remove", "carol")


# -- refusals: exact message, exit code, nothing written, audited -----------------------------

REFUSALS: dict[str, tuple[list[str], str, int, str]] = {
    "bad name": (["add", "a/b", "--uid", "5000"], "invalid-input", 65,
                 "NAME 'a/b' must not contain '/' or '\\' (an ID is not a path)"),
    "name with a space": (["add", "a b", "--uid", "5000"], "invalid-input", 65,
                          "NAME 'a b' must not contain whitespace: U+0020 SPACE at position 1 (an ID holds no "
                          "control, format, line-separator or whitespace characters)"),
    "duplicate name": (["add", "alice", "--uid", "5000"], "invalid-input", 65, "NAME 'alice' is already a principal"),
    "duplicate uid": (["add", "carol", "--uid", "4001"], "invalid-input", 65,
                      "--uid 4001 is already mapped to principal 'alice'; a uid maps to one principal"),
    "duplicate uid by login": (["add", "carol", "--user", "root"], "invalid-input", 65,
                               "--user root (uid 0) is already mapped to principal 'root0'; a uid maps to one "
                               "principal"),
    "uid out of range": (["add", "carol", "--uid", "4294967295"], "invalid-input", 65,
                         "--uid 4294967295 is out of range: a uid is from 0 to 4294967294"),
    "negative uid": (["add", "carol", "--uid", "-1"], "invalid-input", 65,
                     "--uid -1 is out of range: a uid is from 0 to 4294967294"),
    "unknown login": (["add", "carol", "--user", "no-such-login-kbd"], "invalid-input", 65,
                      "--user 'no-such-login-kbd' is not a user on this host"),
    "label with a line break": (["add", "carol", "--uid", "5000", "--label", "a\nb"], "invalid-input", 65,
                                "--label must not contain a control character: U+000A at position 1 (a label is "
                                "one line of text; spaces are allowed)"),
    "admin and service": (["add", "carol", "--uid", "5000", "--admin", "--service"], "usage", 2,
                          "pass at most one of --admin and --service: a service principal is never an admin"),
    "no uid": (["add", "carol"], "usage", 2, "pass exactly one of --uid N and --user LOGIN"),
    "uid and login": (["add", "carol", "--uid", "1", "--user", "root"], "usage", 2,
                      "pass exactly one of --uid N and --user LOGIN"),
    "disable unknown": (["disable", "nobody"], "not-found", 66, "unknown principal 'nobody'"),
    "enable unknown": (["enable", "nobody"], "not-found", 66, "unknown principal 'nobody'"),
    "remove unknown": (["remove", "nobody"], "not-found", 66, "unknown principal 'nobody'"),
    "token unknown": (["token", "nobody"], "not-found", 66, "unknown principal 'nobody'"),
    "disable the last admin": (["disable", "ops"], "invalid-input", 65,
                               "'ops' is the last enabled admin; disabling it would leave this host without one"),
    "remove the last admin": (["remove", "ops"], "invalid-input", 65,
                              "'ops' is the last enabled admin; removing it would leave this host without one"),
    "a non-admin acting": (["disable", "alice", "--as", "alice"], "permission-denied", 77,
                           "principal 'alice' may not manage principals"),
    "an empty --as": (["disable", "alice", "--as", ""], "usage", 2, "--as was given an empty principal"),
}  # fmt: skip
AUDITED = {k for k, (_, code, _, _) in REFUSALS.items() if code != "usage"}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_each_refusal_names_the_field_and_writes_nothing(commented: KbRoot, case: str) -> None:
    kb = commented
    path = kb.root / "principals.yaml"
    path.write_text(COMMENTED + "  - id: root0\n    uid: 0\n")  # the login root's uid, mapped
    before = path.read_bytes()
    args, code, exit_code, message = REFUSALS[case]
    r = kb.call("principals", *args)
    assert assert_error(r, code, exit_code) == message
    assert path.read_bytes() == before
    refused = _records(kb, "principal_refused")
    if case in AUDITED:
        (record,) = refused
        assert (record["action"], record["target"], record["code"]) == (args[0], args[1], code)
        assert record["message"] == message
    else:
        assert refused == []  # a usage error never reached the operation
    assert _records(kb, "principal_added", "principal_disabled", "principal_removed") == []


def test_force_disables_and_removes_the_last_admin(commented: KbRoot) -> None:
    kb = commented
    hint = kb.call("principals", "disable", "ops").err.splitlines()[1]
    assert hint == "hint: add or enable another admin first, or pass --force to disable it anyway"
    assert kb.call("principals", "disable", "ops", "--force").code == 0
    assert kb.call("principals", "enable", "ops").code == 0
    assert kb.call("principals", "add", "ops2", "--uid", "4010", "--admin").code == 0
    assert kb.call("principals", "disable", "ops").code == 0  # another admin is left
    assert kb.call("principals", "remove", "ops2").code == 65  # the last enabled one now
    assert kb.call("principals", "remove", "ops2", "--force").code == 0


def test_an_admin_principal_may_manage_principals(commented: KbRoot) -> None:
    r = commented.call("principals", "disable", "alice", "--as", "ops")
    assert r.code == 0, r.err
    (record,) = _records(commented, "principal_disabled")
    assert record["actor"] == "ops" and "actor_uid" not in record


LAYOUTS = {
    "flow style": "principals: [{id: alice, uid: 4001}, {id: ops, admin: true}]\n",
    "anchors": "principals:\n  - &a id: alice\n  - id: ops\n    admin: true\n",
    "a multi-line quoted value": 'principals:\n  - id: alice\n    label: "Alice\n      Liddell"\n  - id: ops\n    admin: true\n',
    "a block scalar": "principals:\n  - id: alice\n    label: >-\n      Alice\n  - id: ops\n    admin: true\n",
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_layout_it_cannot_edit_is_refused_byte_identical(kb: KbRoot, layout: str) -> None:
    path = kb.root / "principals.yaml"
    path.write_text(LAYOUTS[layout])
    before = path.read_bytes()
    for args in (["token", "alice"], ["disable", "alice"], ["add", "x", "--uid", "9"], ["remove", "alice"]):
        r = kb.call("principals", *args)
        assert r.code == 65 and "error[invalid-config]" in r.err, (args, r.err)
        assert path.read_bytes() == before
        assert "nothing was written" in r.err


def test_a_symlinked_principals_file_is_not_replaced(kb: KbRoot, tmp_path: Path) -> None:
    real = tmp_path / "elsewhere.yaml"
    real.write_text(COMMENTED)
    (kb.root / "principals.yaml").unlink()
    (kb.root / "principals.yaml").symlink_to(real)
    r = kb.call("principals", "disable", "alice")
    assert assert_error(r, "invalid-config", 65).endswith("is not a regular file (a symlink or special file); kbd "
                                                          "edits only a regular principals.yaml, so nothing was written")  # fmt: skip
    assert (kb.root / "principals.yaml").is_symlink() and real.read_text() == COMMENTED


def test_mode_and_owner_are_kept(commented: KbRoot) -> None:
    path = commented.root / "principals.yaml"
    os.chmod(path, 0o600)
    if os.geteuid() == 0:
        os.chown(path, 4321, 4322)
    assert commented.cli("principals", "add", "carol", "--uid", "4003").code == 0
    st = os.stat(path)
    assert stat.S_IMODE(st.st_mode) == 0o600
    if os.geteuid() == 0:
        assert (st.st_uid, st.st_gid) == (4321, 4322)


def test_every_change_is_audited_without_the_token(commented: KbRoot) -> None:
    kb = commented
    kb.cli("principals", "add", "carol", "--uid", "4003", "--label", "Carol C.")
    kb.cli("principals", "disable", "carol")
    kb.cli("principals", "enable", "carol")
    token = kb.cli("principals", "token", "carol").out.strip()
    kb.cli("principals", "remove", "carol")
    records = _records(kb, "principal_added", "principal_disabled", "principal_enabled", "principal_token_rotated",
                       "principal_removed")  # fmt: skip
    me = {"actor": f"local:{pwd.getpwuid(os.getuid()).pw_name}", "actor_uid": os.getuid()}
    assert [{k: v for k, v in r.items() if k != "ts"} for r in records] == [
        {"event": "principal_added", **me, "target": "carol",
         "fields": {"id": "carol", "kind": "user", "uid": 4003, "label": "Carol C."}},
        {"event": "principal_disabled", **me, "target": "carol", "fields": {"disabled": True}},
        {"event": "principal_enabled", **me, "target": "carol", "fields": {"disabled": False}},
        {"event": "principal_token_rotated", **me, "target": "carol", "fields": {"token_sha256": "rotated"}},
        {"event": "principal_removed", **me, "target": "carol", "fields": {}},
    ]  # fmt: skip
    log = (kb.root / "state" / "audit.log").read_text()
    assert token not in log and _digest(token) not in log


def test_concurrent_adds_all_land_and_keep_the_comments(commented: KbRoot) -> None:
    """Real processes at once: the principals lock serialises the edits, so no
    add overwrites another."""
    kb = commented
    env = clean_env()
    procs = [
        subprocess.Popen([sys.executable, "-m", "kbd", "--root", str(kb.root), "principals", "add", f"p{i}",
                          "--uid", str(5000 + i)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for i in range(6)
    ]  # fmt: skip
    for p in procs:
        _, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
    text = _file(kb)
    assert text.startswith(COMMENTED.removesuffix("# end\n")) and text.endswith("\n# end\n")
    ids = [p["id"] for p in yaml.safe_load(text)["principals"]]
    assert sorted(ids) == sorted(["alice", "ops", "svc", *(f"p{i}" for i in range(6))])


# -- the running daemon picks the change up -------------------------------------------------


def test_a_running_daemon_honours_cli_changes_at_the_next_request(commented: KbRoot) -> None:
    kb = commented
    kb.workflow("con", access={"owners": ["alice"]})
    first = kb.cli("principals", "token", "alice").out.strip()
    with serving(kb.root) as daemon:
        assert daemon.client(first).get("/v1/whoami").json()["id"] == "alice"
        second = kb.cli("principals", "token", "alice").out.strip()
        assert daemon.client(second).get("/v1/whoami").status_code == 200
        assert daemon.client(first).get("/v1/whoami").status_code == 401
        assert kb.cli("principals", "disable", "alice").code == 0
        r = daemon.client(second).get("/v1/workflows/con/sources")
        assert r.status_code == 403 and "disabled" in r.json()["error"]["message"]
        assert kb.cli("principals", "enable", "alice").code == 0
        assert daemon.client(second).get("/v1/workflows/con/sources").status_code == 200
        assert kb.cli("principals", "remove", "alice").code == 0
        assert daemon.client(second).get("/v1/whoami").status_code == 401
        assert kb.cli("principals", "add", "bob2", "--uid", "4100").code == 0
        bob = kb.cli("principals", "token", "bob2").out.strip()
        assert daemon.client(bob).get("/v1/whoami").json()["id"] == "bob2"


@pytest.mark.requires_bwrap
@pytest.mark.requires_landlock(abi=2)
def test_disabling_through_the_cli_ends_the_principals_running_commands(kb: KbRoot) -> None:
    """`kbd principals disable alice` while alice's brokered command runs: the
    daemon's pushed revocation terminates it, as a hand edit did before."""
    from tests.integration.test_live import Runner, of_type, set_revocation, wait_for

    kb.workflow("con", access={"owners": ["alice"]})
    set_revocation(kb.root, immediate=True, grace=0)
    sid = kb.open_session("con", kind="execution", kb_access="read", actor="alice")
    map_uid(kb.root, "alice", os.getuid())
    with serving(kb.root) as daemon:
        mine = Runner(kb, sid, socket=daemon.sock)
        try:
            (running,) = kb.cli("session", "show", sid, "--json").json()["running"]
            r = kb.cli("principals", "disable", "alice")
            assert r.code == 0, r.err
            wait_for(lambda: not mine.pids(), 5, "alice's command was terminated")
            wait_for(lambda: of_type(kb.root, "command.terminated", session_id=sid, pid=running["pid"]), 5,
                     "command.terminated")  # fmt: skip
            mine.proc.wait(timeout=30)
            refused = daemon.client().get("/v1/whoami")  # alice's uid, now disabled
            assert refused.status_code == 403 and "disabled" in refused.json()["error"]["message"]
        finally:
            mine.close()
        assert daemon.proc.poll() is None


def test_a_token_written_to_a_new_private_file_never_to_an_existing_one(kb: KbRoot, tmp_path: Path) -> None:
    out = tmp_path / "svc.token"
    r = kb.cli("principals", "token", "svc", "--output", str(out))
    assert r.code == 0 and str(out) in r.out and "mode 0600" in r.out, r.err
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    token = out.read_text().strip()
    assert token not in r.out + r.err  # never printed
    stored = next(p for p in kb.host().principals if p.id == "svc").token_sha256
    assert stored == hashlib.sha256(token.encode()).hexdigest()
    # An existing file (or a link to one) is refused before a token is issued: the current one keeps working.
    before = _file(kb)
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "elsewhere")
    for target in (out, link):
        again = kb.cli("principals", "token", "svc", "--output", str(target))
        assert again.code == 65 and "error[invalid-input]" in again.err, again.err
    assert _file(kb) == before and out.read_text().strip() == token and not (tmp_path / "elsewhere").exists()
    both = kb.cli("principals", "token", "svc", "--output", str(tmp_path / "new"), "--json")
    assert both.code == 2 and not (tmp_path / "new").exists() and _file(kb) == before

"""docs/multi-user.md "The permission model": the host permission model, with real Unix users.

A root made by ``kbd init --system --group G --grant-group GG`` (throwaway
groups), workflow folders made by ``kbd workflows create`` for their owners,
the real daemon on a socket of group G, and real users:

* ``bob`` (in G) builds the source workflows ``src`` (write grant), ``src2``
  (read grant) and ``priv`` (not attached);
* ``ann`` (in G) owns the consumer ``agentwf`` and runs commands through the
  broker (``kbd exec`` under ``setpriv``, as an execution host would);
* ``oz`` is in no kbd group.

Every command is run as its user; nothing is faked. The users, groups and the
root are removed afterwards.
"""

from __future__ import annotations

import contextlib
import grp
import json
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import orjson
import pytest
import yaml

from tests.integration import daemon

REPO = Path(__file__).parents[2]
# Real users this module creates run kbd from this checkout.
pytestmark = pytest.mark.requires_reachable_checkout


@dataclass(frozen=True)
class Host:
    base: Path
    root: Path
    group: str
    grant: str
    users: dict[str, pwd.struct_passwd]
    sid: str
    served: daemon.Daemon

    def wf(self, wid: str) -> Path:
        return self.root / "workflows" / wid


def _run(argv: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=90, check=False, **kw)  # type: ignore[call-overload, no-any-return]


def _kbd_root(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``kbd`` as root, directly on the root (the operator)."""
    env = {**daemon.clean_env(), "KBD_NO_DAEMON": "1"}
    return _run([sys.executable, "-m", "kbd", "--root", str(root), *args], env=env)


def _env(h: Host | None = None) -> dict[str, str]:
    env = {"HOME": "/", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "LANG": "C.UTF-8"}
    if h is not None:
        env["KBD_SOCKET"] = str(h.served.sock)
    return env


def as_user(
    h: Host, name: str, argv: list[str], stdin: int | None = None
) -> subprocess.CompletedProcess[str]:
    pw = h.users[name]
    return _run(
        ["setpriv", "--reuid", str(pw.pw_uid), "--regid", str(pw.pw_gid), "--init-groups", *argv],
        env=_env(h), cwd="/", stdin=stdin,
    )  # fmt: skip


def kbd_exec(h: Host, name: str, script: str) -> subprocess.CompletedProcess[str]:
    return as_user(h, name, [sys.executable, "-m", "kbd", "--root", str(h.root), "exec", h.sid, "--", "sh", "-c",
                             script])  # fmt: skip


def api_as(
    h: Host, name: str, method: str, route: str, body: object = None, token: str | None = None
) -> tuple[int, dict[str, object]]:
    """One API request over the daemon's socket from a process running as ``name``."""
    code = textwrap.dedent(
        """
        import json, sys, httpx
        method, route, body, token = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        with httpx.Client(transport=httpx.HTTPTransport(uds=sys.argv[5]), base_url="http://kbd") as c:
            r = c.request(method, route, json=body, headers=headers)
        print(json.dumps({"status": r.status_code, "body": r.json()}))
        """
    )
    r = as_user(
        h,
        name,
        [sys.executable, "-c", code, method, route, json.dumps(body), token or "", str(h.served.sock)],
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    return int(out["status"]), out["body"]


# -- the host ----------------------------------------------------------------------------


@contextlib.contextmanager
def _groups_and_users(tag: str) -> Iterator[tuple[str, str, dict[str, pwd.struct_passwd]]]:
    group, grant = f"kbg{tag}", f"kbgg{tag}"
    names = {"ann": f"kba{tag}", "bob": f"kbb{tag}", "oz": f"kbo{tag}"}
    made_users: list[str] = []
    try:
        subprocess.run(["groupadd", group], check=True)
        for key, login in names.items():
            extra = [] if key == "oz" else ["-G", group]
            subprocess.run(["useradd", "--no-create-home", "--shell", "/bin/sh", *extra, login], check=True)
            made_users.append(login)
        yield group, grant, {k: pwd.getpwnam(v) for k, v in names.items()}
    finally:
        for login in made_users:
            subprocess.run(["userdel", login], check=False)
        for g in (group, grant):
            subprocess.run(["groupdel", g], check=False, capture_output=True)


def _principals(root: Path, users: dict[str, pwd.struct_passwd]) -> None:
    path = root / "principals.yaml"
    doc = yaml.safe_load(path.read_text())
    doc["principals"] += [{"id": k, "kind": "user", "uid": pw.pw_uid} for k, pw in users.items()]
    doc["principals"].append({"id": "svc", "kind": "service"})
    path.write_text(yaml.safe_dump(doc, sort_keys=False))


def _edit_manifest(folder: Path, **access: list[str]) -> None:
    """As the operator: add readers (keeps the file's owner and mode)."""
    path = folder / "workflow.json"
    st = path.stat()
    doc = orjson.loads(path.read_bytes())
    doc["access"].update(access)
    path.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    os.chown(path, st.st_uid, st.st_gid)


def _put(path: Path, text: str, owner: pwd.struct_passwd) -> None:
    """A file its owner wrote (umask 022 as a builder's editor would: the group is inherited)."""
    path.write_text(text)
    os.chown(path, owner.pw_uid, -1)
    os.chmod(path, 0o644)


@pytest.fixture(scope="module")
def host() -> Iterator[Host]:
    tag = uuid.uuid4().hex[:6]
    base = Path(tempfile.mkdtemp(prefix="kbd-perm-", dir="/tmp"))
    os.chmod(base, 0o755)  # noqa: S103 - the users traverse it to the root, which is 0750 root:G
    try:
        with _groups_and_users(tag) as (group, grant, users):
            root = base / "root"
            r = _kbd_root(root, "init", "--system", "--group", group, "--grant-group", grant, "--host", "h")
            assert r.returncode == 0, r.stderr
            assert f"kbd: created group {grant} (groupadd --system)" in r.stderr
            _principals(root, users)
            for wid, owner in (("agentwf", "ann"), ("src", "bob"), ("src2", "bob"), ("priv", "bob")):
                r = _kbd_root(root, "workflows", "create", wid, "--owner", owner, "--as", "root")
                assert r.returncode == 0, r.stderr
            wf = root / "workflows"
            _edit_manifest(wf / "src", readers=["ann"])
            _edit_manifest(wf / "src2", readers=["ann"])
            _put(wf / "agentwf/knowledgebase/context/own.md", "own kb\n", users["ann"])
            _put(wf / "src/knowledgebase/context/info.md", "src context\n", users["bob"])
            _put(wf / "src2/knowledgebase/context/info2.md", "src2 context\n", users["bob"])
            _put(wf / "priv/knowledgebase/context/secret.md", "private secret\n", users["bob"])
            for args in (
                ["writers", "grant", "src", "agentwf", "--as", "bob"],
                ["sources", "attach", "agentwf", "src", "--alias", "src", "--access", "write", "--as", "ann"],
                ["sources", "attach", "agentwf", "src2", "--alias", "src2", "--as", "ann"],
            ):
                r = _kbd_root(root, *args)
                assert r.returncode == 0, (args, r.stderr)
            r = _kbd_root(root, "session", "open", "agentwf", "--kind", "execution", "--kb-access", "read-write",
                          "--as", "ann", "--json")  # fmt: skip
            assert r.returncode == 0, r.stderr
            sid = json.loads(r.stdout)["session_id"]
            run = base / "run"
            run.mkdir()
            with daemon.serving(root, sock=run / "kbd.sock") as served:
                gid = grp.getgrnam(group).gr_gid
                os.chown(run, -1, gid)
                os.chown(served.sock, -1, gid)
                yield Host(base, root, group, grant, users, sid, served)
    finally:
        shutil.rmtree(base, ignore_errors=True)


# -- the layout ----------------------------------------------------------------------------


def test_init_system_and_workflows_create_make_the_decided_layout(host: Host) -> None:
    gid, grant = grp.getgrnam(host.group).gr_gid, grp.getgrnam(host.grant).gr_gid
    assert grp.getgrgid(grant).gr_mem == []

    def owner_mode(p: Path) -> tuple[int, int, int]:
        st = os.lstat(p)
        return st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)

    assert owner_mode(host.root) == (0, gid, 0o750)
    assert owner_mode(host.root / "workflows") == (0, gid, 0o750)
    assert owner_mode(host.root / "state") == (0, 0, 0o700)
    assert owner_mode(host.root / "kbd.yaml") == (0, 0, 0o640)
    assert owner_mode(host.root / "principals.yaml") == (0, 0, 0o600)
    assert f"grant_group: {host.grant}" in (host.root / "kbd.yaml").read_text()
    bob = host.users["bob"].pw_uid
    src = host.wf("src")
    assert owner_mode(src) == (bob, grant, 0o2750)
    assert owner_mode(src / "knowledgebase") == (bob, grant, 0o2750)
    assert owner_mode(src / "knowledgebase/context") == (bob, grant, 0o2750)
    assert owner_mode(src / "knowledgebase/notes") == (bob, grant, 0o2770)
    assert owner_mode(src / "knowledgebase/notes/_index.json") == (bob, grant, 0o640)
    assert owner_mode(src / "workflow.json")[:2] == (bob, grant)
    manifest = orjson.loads((src / "workflow.json").read_bytes())
    assert manifest["id"] == "src" and manifest["access"]["owners"] == ["bob"]
    assert not [
        p for p in (host.root / "workflows").iterdir() if p.name.startswith(".")
    ]  # no temp folder left
    # Again: the layout is applied, the config kept.
    before = (host.root / "kbd.yaml").read_bytes()
    r = _kbd_root(host.root, "init", "--system", "--group", host.group, "--grant-group", host.grant)
    assert r.returncode == 0, r.stderr
    assert "kept its config" in r.stderr and (host.root / "kbd.yaml").read_bytes() == before


# -- the sandbox ---------------------------------------------------------------------------

INSIDE = """
cat knowledgebase/context/own.md && echo OWN
cat "$WORKFLOW_KB_SRC/context/info.md" && echo R-SRC
cat "$WORKFLOW_KB_SRC2/context/info2.md" && echo R-SRC2
echo contributed > "$WORKFLOW_KB_SRC/notes/by-ann.md" && echo W-NOTES
(echo x > "$WORKFLOW_KB_SRC/context/bad.md") 2>/dev/null || echo NO-CONTEXT
(echo x > "$WORKFLOW_KB_SRC/notes/_index.json") 2>/dev/null || echo NO-INDEX
(echo x > "$WORKFLOW_KB_SRC2/notes/bad.md") 2>/dev/null || echo NO-SRC2-NOTES
cat {priv}/knowledgebase/context/secret.md 2>/dev/null || echo NO-PRIV
chmod g+s "$WORKFLOW_KB_SRC/notes/by-ann.md" 2>/dev/null || echo NO-CHMOD-SGID
install -m 2755 /bin/true "$WORKFLOW_KB_SRC/notes/tool" 2>/dev/null || echo NO-INSTALL-SGID
"""


def test_a_sandboxed_command_uses_exactly_its_grants(host: Host) -> None:
    r = kbd_exec(host, "ann", INSIDE.format(priv=host.wf("priv")))
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n") == [
        "own kb", "OWN", "src context", "R-SRC", "src2 context", "R-SRC2", "W-NOTES", "NO-CONTEXT",
        "NO-INDEX", "NO-SRC2-NOTES", "NO-PRIV", "NO-CHMOD-SGID", "NO-INSTALL-SGID", "",
    ], r.stderr  # fmt: skip
    notes = host.wf("src") / "knowledgebase/notes"
    # Committed at exit through the daemon's write path (docs/notes.md "Staged contributions"): the note
    # belongs to notes/'s owner and group, 0660.
    made = os.stat(notes / "by-ann.md")
    assert (made.st_uid, made.st_gid) == (host.users["bob"].pw_uid, grp.getgrnam(host.grant).gr_gid)
    assert stat.S_IMODE(made.st_mode) == 0o660
    for name in ("by-ann.md", "tool"):
        if (notes / name).exists():
            assert not os.stat(notes / name).st_mode & 0o6000, name
    assert not (host.wf("src") / "knowledgebase/context/bad.md").exists()
    assert not (host.wf("src2") / "knowledgebase/notes/bad.md").exists()
    assert (notes / "_index.json").read_text() == "{}\n"


def test_outside_the_sandbox_the_agent_reads_no_knowledge_base(host: Host) -> None:
    for path in (
        host.wf("src") / "knowledgebase/context/info.md",
        host.wf("src2") / "knowledgebase/context/info2.md",
        host.wf("priv") / "knowledgebase/context/secret.md",
        host.wf("src") / "knowledgebase/notes/_index.json",
    ):
        r = as_user(host, "ann", ["cat", str(path)])
        assert r.returncode != 0 and "Permission denied" in r.stderr, (path, r.stdout, r.stderr)
    r = as_user(host, "ann", ["sh", "-c", f"echo x > {host.wf('src')}/knowledgebase/notes/outside.md"])
    assert r.returncode != 0 and "Permission denied" in r.stderr
    # Her own folder is hers.
    r = as_user(host, "ann", ["cat", str(host.wf("agentwf") / "knowledgebase/context/own.md")])
    assert r.returncode == 0 and r.stdout == "own kb\n", r.stderr


# A process outside the sandbox (same user) hands the sandboxed command a
# descriptor of workflows/ over a socket that is its stdin and stdout, and
# waits for one back. With the grant group a descriptor from outside could
# reach other users' folders (fstat, inotify: Landlock mediates neither), and
# one sent out (a write-granted notes/) would outlive a revocation. The
# command's stdio are pipes the daemon relays (docs/multi-user.md "Channels"): no
# descriptor crosses either way, and the bytes still do.
SENDER = """
import os, socket, subprocess, sys
a, b = socket.socketpair()
proc = subprocess.Popen(sys.argv[2:], stdin=b, stdout=b, stderr=subprocess.PIPE)
b.close()
fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)
socket.send_fds(a, [b"x"], [fd])
a.shutdown(socket.SHUT_WR)
got, fds = b"", []
while True:
    data, more, _, _ = socket.recv_fds(a, 4096, 4)
    if not data:
        break
    got, fds = got + data, fds + more
err = proc.stderr.read()
sys.stdout.write(got.decode() + f"FDS-BACK {len(fds)}\\n"); sys.stderr.write(err.decode())
sys.exit(proc.wait(timeout=60))
"""
RECEIVER = """
import os, socket, stat, sys
kinds = ["sock" if stat.S_ISSOCK(os.fstat(n).st_mode) else "fifo" if stat.S_ISFIFO(os.fstat(n).st_mode) else "other"
         for n in (0, 1)]
print(*kinds, flush=True)
print(sys.stdin.buffer.read().decode(), flush=True)
notes = os.open(os.environ["WORKFLOW_KB_SRC"] + "/notes", os.O_RDONLY | os.O_DIRECTORY)
try:
    socket.send_fds(socket.socket(fileno=os.dup(1)), [b"n"], [notes])
    print("SENT")
except OSError:
    print("NOT-SENT")
"""


def test_no_descriptor_crosses_the_commands_socket_stdio_either_way(host: Host) -> None:
    kbd = [
        sys.executable,
        "-m",
        "kbd",
        "--root",
        str(host.root),
        "exec",
        host.sid,
        "--",
        "python3",
        "-c",
        RECEIVER,
    ]
    r = as_user(host, "ann", [sys.executable, "-c", SENDER, str(host.root / "workflows"), *kbd])
    assert r.returncode == 0, r.stderr
    # stdin and stdout are pipes; the descriptor sent in stayed behind (only
    # its byte arrived), and none came back.
    assert r.stdout.split("\n") == ["fifo fifo", "x", "NOT-SENT", "FDS-BACK 0", ""], (r.stdout, r.stderr)


# Defense in depth behind the relay: no path the broker leaves hands a command
# a descriptor from outside any more, but were one to arrive (bubblewrap
# passes an inherited descriptor through), the inner Landlock layer
# ("confine") still opens nothing with the grant group through it. The
# sandbox is started here exactly as the broker starts it (the argv of
# kbd.sandbox.bwrap with confine, run as the caller plus the grant group), with
# one descriptor of workflows/ more.
OPENER = """
import os, sys
try:
    fd = os.open("priv/knowledgebase/context/secret.md", os.O_RDONLY, dir_fd=int(sys.argv[1]))
    print("LEAKED", os.read(fd, 100))
except PermissionError:
    print("CONFINED")
"""


def test_a_descriptor_from_outside_opens_nothing_with_the_grant_group(host: Host) -> None:
    from kbd.sandbox import bwrap
    from kbd.service.root import Root
    from kbd.service.sessions import RootSessions

    root = Root(host.root)
    plan = RootSessions(root).plan(host.sid, actor=root.actor("ann"))
    bwrap.prepare(plan)
    fds = bwrap.Fds()
    status_r, status_w = os.pipe()
    outside = os.open(host.root / "workflows", os.O_RDONLY | os.O_DIRECTORY)
    ann = host.users["ann"]
    try:
        argv = bwrap.build_argv(plan, ["python3", "-c", OPENER, str(outside)], cwd=plan.workflow_folder,
                                network="none", status_fd=status_w, fds=fds, confine=True)  # fmt: skip
        r = subprocess.run(argv, user=ann.pw_uid, group=ann.pw_gid, pass_fds=[*fds.handed, status_w, outside],
                           extra_groups=[grp.getgrnam(host.group).gr_gid, grp.getgrnam(host.grant).gr_gid],
                           capture_output=True, text=True, timeout=60, check=False, cwd="/")  # fmt: skip
    finally:
        fds.close()
        for fd in (status_r, status_w, outside):
            os.close(fd)
    assert (r.returncode, r.stdout) == (0, "CONFINED\n"), r.stderr


# The caller listens on a socket in her own workflow folder (which her sandbox
# binds): a command carrying the grant group makes no Unix socket to reach it
# (seccomp: socket(AF_UNIX) EAFNOSUPPORT, datagram pairs too); a stream pair
# inside the command still works.
LISTENER = """
import os, socket, subprocess, sys
path = sys.argv[1]
listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
listener.bind(path)
listener.listen(4)
dgram = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
dgram.bind(path + "-dgram")
try:
    r = subprocess.run(sys.argv[2:], capture_output=True, text=True, timeout=60)
    listener.setblocking(False)
    dgram.setblocking(False)
    try:
        listener.accept()
        heard = "CONNECTED"
    except BlockingIOError:
        heard = "NOTHING"
    try:
        dgram.recv(100)
        heard += " DATAGRAM"
    except BlockingIOError:
        heard += " NOTHING"
    sys.stdout.write(r.stdout + heard + "\\n"); sys.stderr.write(r.stderr)
    sys.exit(r.returncode)
finally:
    os.unlink(path)
    os.unlink(path + "-dgram")
"""
CONNECTOR = """
import errno, socket, sys
path = sys.argv[1]
def attempt(name, act):
    try:
        act()
        print(name + ":ok")
    except OSError as e:
        print(name + ":" + errno.errorcode[e.errno])
attempt("connect", lambda: socket.socket(socket.AF_UNIX, socket.SOCK_STREAM).connect(path))
attempt("sendto", lambda: socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM).sendto(b"x", path + "-dgram"))
attempt("dgram-pair-sendto", lambda: socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)[0].sendto(b"x", path + "-dgram"))
a, b = socket.socketpair()
a.sendall(b"pair")
print("stream-pair:" + b.recv(10).decode())
"""


def test_a_command_with_the_grant_group_cannot_reach_its_callers_unix_socket(host: Host) -> None:
    path = str(host.wf("agentwf") / "listen.sock")
    kbd = [sys.executable, "-m", "kbd", "--root", str(host.root), "exec", host.sid, "--",
           "python3", "-c", CONNECTOR, path]  # fmt: skip
    r = as_user(host, "ann", [sys.executable, "-c", LISTENER, path, *kbd])
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n") == [
        "connect:EAFNOSUPPORT", "sendto:EAFNOSUPPORT", "dgram-pair-sendto:EAFNOSUPPORT", "stream-pair:pair",
        "NOTHING NOTHING", "",
    ], (r.stdout, r.stderr)  # fmt: skip


# Still open (docs/multi-user.md "Channels", channels): the caller's own uid may trace
# her sandboxed command (it runs as her uid, in a user namespace she owns), so
# pidfd_getfd takes a descriptor it holds (a write-granted note) out of the
# sandbox. Strict: the day the command's user namespace and credentials shut
# its caller out, this passes and the mark must go.
THIEF = """
import ctypes, os, subprocess, sys
marker = sys.argv[1]
inner = 'exec 3>>"$WORKFLOW_KB_SRC/notes/held-' + marker + '.md"; echo ready; exec sleep ' + marker
p = subprocess.Popen([*sys.argv[2:], "sh", "-c", inner], stdout=subprocess.PIPE)
try:
    assert p.stdout.readline() == b"ready\\n"
    pids = []
    for entry in os.listdir("/proc"):
        try:
            argv = open(f"/proc/{entry}/cmdline", "rb").read().split(b"\\0")
        except OSError:
            continue
        if argv[0] in (b"sh", b"sleep") and any(marker.encode() in a for a in argv):
            pids.append(int(entry))
    assert len(pids) == 1, pids
    libc = ctypes.CDLL(None, use_errno=True)
    pidfd = libc.syscall(434, pids[0], 0)  # pidfd_open
    fd = libc.syscall(438, pidfd, 3, 0) if pidfd >= 0 else -1  # pidfd_getfd
    print("TAKEN" if fd >= 0 else "REFUSED")
finally:
    p.kill()
    p.wait()
"""


def test_the_caller_takes_no_descriptor_from_her_sandboxed_command(host: Host) -> None:
    marker = f"300.{uuid.uuid4().int % 10**9:09d}"
    kbd = [sys.executable, "-m", "kbd", "--root", str(host.root), "exec", host.sid, "--"]
    r = as_user(host, "ann", [sys.executable, "-c", THIEF, marker, *kbd])
    assert r.returncode == 0, r.stderr
    assert r.stdout == "REFUSED\n", r.stdout


# -- notes, the socket, creating workflows ---------------------------------------------------


def test_a_note_written_by_the_daemon_belongs_to_the_notes_folder(host: Host) -> None:
    status, body = api_as(host, "ann", "POST", f"/v1/sessions/{host.sid}/notes",
                          {"alias": "src", "path": "sub/from-daemon.md", "content": "a daemon note\n"})  # fmt: skip
    assert status == 201, body
    notes = host.wf("src") / "knowledgebase/notes"
    want = (host.users["bob"].pw_uid, grp.getgrnam(host.grant).gr_gid)
    st = os.stat(notes / "sub/from-daemon.md")
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (*want, 0o660)
    sub = os.stat(notes / "sub")
    assert (sub.st_uid, sub.st_gid, stat.S_IMODE(sub.st_mode)) == (*want, 0o2770)
    # The builder reads it outside; the agent only inside her sandbox.
    assert "a daemon note" in as_user(host, "bob", ["cat", str(notes / "sub/from-daemon.md")]).stdout
    r = kbd_exec(host, "ann", 'cat "$WORKFLOW_KB_SRC/notes/sub/from-daemon.md"')
    assert r.returncode == 0 and "a daemon note" in r.stdout, r.stderr


def test_a_user_outside_the_group_cannot_reach_the_socket(host: Host) -> None:
    r = kbd_exec(host, "oz", "true")
    assert r.returncode == 77, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr


def test_workflows_create_through_the_daemon(host: Host) -> None:
    status, body = api_as(host, "ann", "POST", "/v1/workflows", {"workflow_id": "ann-new", "label": "Ann's"})
    assert status == 201, body
    assert body["owners"] == ["ann"]
    st = os.stat(host.wf("ann-new"))
    assert (st.st_uid, st.st_gid) == (host.users["ann"].pw_uid, grp.getgrnam(host.grant).gr_gid)
    status, body = api_as(host, "ann", "GET", "/v1/workflows/ann-new")
    assert status == 200, body  # found at once
    status, body = api_as(host, "ann", "POST", "/v1/workflows", {"workflow_id": "ann-new"})
    assert status == 409 and body["error"]["code"] == "workflow-exists", body  # type: ignore[index]
    status, body = api_as(host, "ann", "POST", "/v1/workflows", {"workflow_id": "for-bob", "owner": "bob"})
    assert status == 403, body
    assert not host.wf("for-bob").exists()
    token = daemon.issue_tokens(host.root, ["svc"])["svc"]
    status, body = api_as(host, "ann", "POST", "/v1/workflows", {"workflow_id": "svc-wf"}, token=token)
    assert status == 403, body
    r = _kbd_root(host.root, "workflows", "create", "svc-wf2", "--as", "svc")
    assert r.returncode == 77, r.stderr
    assert not host.wf("svc-wf").exists() and not host.wf("svc-wf2").exists()
    r = _kbd_root(host.root, "workflows", "create", "for-bob", "--owner", "bob", "--as", "ann")
    assert r.returncode == 77, r.stderr
    r = _kbd_root(host.root, "audit", "--json")
    doc = json.loads(r.stdout)
    events = doc if isinstance(doc, list) else next(v for v in doc.values() if isinstance(v, list))
    refused = [e for e in events if e.get("event") == "workflow_create_refused"]
    assert {(e["actor"], e["workflow_id"]) for e in refused} >= {("ann", "for-bob"), ("svc", "svc-wf2")}, (
        refused
    )
    assert any(e.get("event") == "workflow_created" and e["workflow_id"] == "ann-new" for e in events)


# -- doctor ----------------------------------------------------------------------------------


def test_doctor_names_a_wrong_mode_and_a_member_of_the_grant_group(host: Host) -> None:
    r = _kbd_root(host.root, "doctor", "--json")
    checks = json.loads(r.stdout)["checks"]
    mine = [c for c in checks if c["check"] in ("grant group", "permissions")]
    assert mine == [
        {"check": "grant group", "ok": True, "detail": f"{host.grant}: exists, no members"},
        {"check": "permissions", "ok": True, "detail": mine[1]["detail"]},
    ], mine
    assert mine[1]["detail"].startswith("root and "), mine
    notes = host.wf("src2") / "knowledgebase/notes"
    os.chmod(notes, 0o2750)  # noqa: S103 - the mistake doctor must name
    subprocess.run(["gpasswd", "-a", host.users["oz"].pw_name, host.grant], check=True, capture_output=True)
    try:
        r = _kbd_root(host.root, "doctor")
        assert r.returncode == 65
        lines = r.stdout.splitlines()
        assert any(
            line.startswith("FAIL grant group:") and host.users["oz"].pw_name in line for line in lines
        ), r.stdout
        assert f"FAIL permissions: {notes}: group {host.grant}, mode 2750; want group {host.grant}, mode 2770; " \
               f"fix: chmod 2770 {notes}" in lines, r.stdout  # fmt: skip
    finally:
        subprocess.run(
            ["gpasswd", "-d", host.users["oz"].pw_name, host.grant], check=True, capture_output=True
        )
        os.chmod(notes, 0o2770)  # noqa: S103 - the layout's own mode


def test_doctor_names_an_interpreter_other_users_cannot_run(host: Host, tmp_path: Path) -> None:
    """A venv made from an interpreter under a folder only root may enter (pyenv's under /root): every
    other user gets "bad interpreter" from kbd, so doctor on a system root says so, naming the folder."""
    r = _kbd_root(host.root, "doctor", "--json")
    [install] = [c for c in json.loads(r.stdout)["checks"] if c["check"] == "install"]
    assert install["ok"] is True and "usable by every user" in install["detail"], install
    private = tmp_path / "pyenv"  # tmp_path's own parents are 0700 too: the first closed folder is named
    private.mkdir(mode=0o700)
    python = private / "python3"
    shutil.copy2(os.path.realpath(sys.executable), python)
    import site

    paths = [str(Path(__file__).parents[2]), *site.getsitepackages()]
    env = {**daemon.clean_env(), "KBD_NO_DAEMON": "1", "PYTHONPATH": os.pathsep.join(paths)}
    r = _run([str(python), "-m", "kbd", "--root", str(host.root), "doctor"], env=env)
    assert r.returncode == 65, r.stdout + r.stderr
    fail = [line for line in r.stdout.splitlines() if line.startswith("FAIL install:")]
    assert len(fail) == 1 and f"{python}: other users cannot reach it:" in fail[0], r.stdout
    assert "(no o+x)" in fail[0] and "make the venv from /usr/bin/python3" in fail[0], r.stdout


def test_a_checkout_other_users_cannot_reach_stops_the_run_once_saying_how(tmp_path: Path) -> None:
    """The README's test command run where the test users cannot reach the checkout (a clone under /root):
    one usage error up front naming the closed folder and the fix, not dozens of failures."""
    private = tmp_path / "root-home"
    private.mkdir(mode=0o700)
    python = private / "python3"
    shutil.copy2(os.path.realpath(sys.executable), python)
    import site

    env = {**daemon.clean_env(), "PYTHONPATH": os.pathsep.join([str(REPO), *site.getsitepackages()])}
    target = "tests/integration/test_exec_broker.py::test_an_unmapped_uid_is_refused_not_run_as_the_operator"
    r = _run(
        [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:cov", target],
        env=env,
        cwd=REPO,
    )
    assert r.returncode == 4, r.stdout + r.stderr  # pytest's usage error: nothing ran
    said = r.stdout + r.stderr
    assert said.count("the multi-user tests cannot run from here:") == 1, said
    assert f"{python}: other users cannot reach it:" in said and "such as /srv/kbd" in said, said


# -- failing closed ----------------------------------------------------------------------------


def test_a_grant_group_missing_at_use_refuses_the_command(host: Host) -> None:
    config = host.root / "kbd.yaml"
    before = config.read_text()
    config.write_text(before.replace(f"grant_group: {host.grant}", "grant_group: kbd-no-such-group-here"))
    try:
        r = kbd_exec(host, "ann", "echo RAN")
        assert r.returncode == 69, (r.returncode, r.stderr)
        assert "error[grant-group-missing]" in r.stderr and "kbd-no-such-group-here" in r.stderr, r.stderr
        assert "RAN" not in r.stdout
    finally:
        config.write_text(before)
    r = kbd_exec(host, "ann", "echo RAN")
    assert r.returncode == 0 and r.stdout == "RAN\n", r.stderr


def test_only_sandboxed_brokered_commands_get_the_grant_group() -> None:
    from kbd.errors import GrantGroupMissing
    from kbd.sandbox.start import grant_gid

    assert grant_gid("root", "bwrap", True) == 0
    assert grant_gid("root", "landlock", True) == 0
    assert grant_gid("root", "none", True) is None  # unsafe_no_sandbox: never
    assert grant_gid("root", "bwrap", False) is None  # in-process: this process's own groups
    assert grant_gid(None, "bwrap", True) is None  # no grant group: today's single-user host
    with pytest.raises(GrantGroupMissing):
        grant_gid("kbd-no-such-group-here", "bwrap", True)

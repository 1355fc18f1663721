"""A service root as its users meet it: ``kbd init --system`` in a folder
that is not ``/var/lib/kbd`` (so its users reach it only through
``KBD_SOCKET``), the real daemon on a socket of a throwaway group, and real
Unix users who run every command as themselves:

* ``ann`` owns the consumer ``agentwf``, which attaches bob's ``src`` with a
  write grant, and runs commands through the broker;
* ``bob`` owns ``src`` and grants (and revokes) ann's writes into its notes.

``folder_roots`` approves ``shared/``, where each user has a private (0700)
folder; ``agentwf`` asks for folder grants in ann's and in bob's.

The users, groups and the root are removed afterwards.
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

import orjson
import pytest
import yaml

from tests.integration import daemon

REPO = Path(__file__).parents[2]
pytestmark = [pytest.mark.requires_root, pytest.mark.requires_bwrap, pytest.mark.requires_reachable_checkout]


@dataclass(frozen=True)
class Host:
    base: Path
    root: Path
    users: dict[str, pwd.struct_passwd]
    sid: str
    served: daemon.Daemon

    def wf(self, wid: str) -> Path:
        return self.root / "workflows" / wid


def _run(argv: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=90, check=False, **kw)  # type: ignore[call-overload, no-any-return]


def _operator(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``kbd`` as root, directly on the root (the operator)."""
    return _run([sys.executable, "-m", "kbd", "--root", str(root), *args],
                env={**daemon.clean_env(), "KBD_NO_DAEMON": "1"})  # fmt: skip


def _user_argv(pw: pwd.struct_passwd, argv: list[str]) -> list[str]:
    return ["setpriv", "--reuid", str(pw.pw_uid), "--regid", str(pw.pw_gid), "--init-groups", *argv]


def _user_env(h: Host, **extra: str) -> dict[str, str]:
    """A user's environment: the daemon named by KBD_SOCKET, and no root named
    (HOME=/ has no kbd root, and this host has no /var/lib/kbd)."""
    return {"HOME": "/", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "LANG": "C.UTF-8",
            "KBD_SOCKET": str(h.served.sock), **extra}  # fmt: skip


def kbd_as(h: Host, name: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``kbd ARGS`` run as the user ``name``, through the daemon."""
    return _run(
        _user_argv(h.users[name], [sys.executable, "-m", "kbd", *args]), env=_user_env(h, **env), cwd="/"
    )


@contextlib.contextmanager
def _groups_and_users(tag: str) -> Iterator[tuple[str, str, dict[str, pwd.struct_passwd]]]:
    group, grant = f"kbs{tag}", f"kbsg{tag}"
    names = {"ann": f"ksa{tag}", "bob": f"ksb{tag}"}
    made: list[str] = []
    try:
        subprocess.run(["groupadd", group], check=True)
        for login in names.values():
            subprocess.run(
                ["useradd", "--no-create-home", "--shell", "/bin/sh", "-G", group, login], check=True
            )
            made.append(login)
        yield group, grant, {k: pwd.getpwnam(v) for k, v in names.items()}
    finally:
        for login in made:
            subprocess.run(["userdel", login], check=False)
        for g in (group, grant):
            subprocess.run(["groupdel", g], check=False, capture_output=True)


def _map_principals(root: Path, users: dict[str, pwd.struct_passwd]) -> None:
    path = root / "principals.yaml"
    doc = yaml.safe_load(path.read_text())
    doc["principals"] += [{"id": k, "kind": "user", "uid": pw.pw_uid} for k, pw in users.items()]
    path.write_text(yaml.safe_dump(doc, sort_keys=False))


def _share_folders(root: Path, shared: Path, users: dict[str, pwd.struct_passwd]) -> None:
    """``shared/`` (approved in kbd.yaml) holds each user's private folder:
    ``ann/mine`` and ``bob/secret``."""
    shared.mkdir(mode=0o755)
    for name, sub in (("ann", "mine"), ("bob", "secret")):
        pw = users[name]
        (shared / name / sub).mkdir(parents=True)
        (shared / name / sub / "f.txt").write_text(f"{name}'s\n")
        for p in (shared / name, shared / name / sub, shared / name / sub / "f.txt"):
            os.chown(p, pw.pw_uid, pw.pw_gid)
        (shared / name).chmod(0o700)
    config = root / "kbd.yaml"
    config.write_text(config.read_text().replace("folder_roots: [folders]", f"folder_roots: [{shared}]"))


def _ask_for_folders(manifest: Path, shared: Path) -> None:
    """As ann would edit her workflow.json: grants of her folder, of a folder
    inside bob's (that exists), of one inside bob's that does not, and of a
    missing one."""
    st = manifest.stat()
    doc = orjson.loads(manifest.read_bytes())
    doc["folder_access"] = [
        {"alias": "mine", "path": f"{shared}/ann/mine"},
        {"alias": "peek", "path": f"{shared}/bob/secret"},
        {"alias": "guess", "path": f"{shared}/bob/nothing"},
        {"alias": "gone", "path": f"{shared}/nobody"},
    ]
    manifest.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    os.chown(manifest, st.st_uid, st.st_gid)


@pytest.fixture(scope="module")
def host() -> Iterator[Host]:
    tag = uuid.uuid4().hex[:6]
    base = Path(tempfile.mkdtemp(prefix="kbd-sys-", dir="/tmp"))
    os.chmod(base, 0o755)  # noqa: S103 - the users traverse it to the root (0750 root:G)
    try:
        with _groups_and_users(tag) as (group, grant, users):
            root = base / "root"
            r = _operator(root, "init", "--system", "--group", group, "--grant-group", grant, "--host", "h")
            assert r.returncode == 0, r.stderr
            _map_principals(root, users)
            _share_folders(root, base / "shared", users)
            for wid, owner in (("agentwf", "ann"), ("src", "bob")):
                r = _operator(root, "workflows", "create", wid, "--owner", owner, "--as", "root")
                assert r.returncode == 0, r.stderr
            manifest = root / "workflows" / "src" / "workflow.json"
            st = manifest.stat()
            doc = orjson.loads(manifest.read_bytes())
            doc["access"]["readers"] = ["ann"]
            manifest.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
            os.chown(manifest, st.st_uid, st.st_gid)
            _ask_for_folders(root / "workflows" / "agentwf" / "workflow.json", base / "shared")
            for args in (
                ["writers", "grant", "src", "agentwf", "--as", "bob"],
                ["sources", "attach", "agentwf", "src", "--alias", "src", "--access", "write", "--as", "ann"],
            ):
                r = _operator(root, *args)
                assert r.returncode == 0, (args, r.stderr)
            run = base / "run"
            run.mkdir()
            with daemon.serving(root, sock=run / "kbd.sock") as served:
                gid = grp.getgrnam(group).gr_gid
                os.chown(run, -1, gid)
                os.chown(served.sock, -1, gid)
                h = Host(base, root, users, "", served)
                r = kbd_as(h, "ann", "session", "open", "agentwf", "--kind", "execution", "--kb-access",
                           "read-write", "--json")  # fmt: skip
                assert r.returncode == 0, r.stderr
                yield Host(base, root, users, json.loads(r.stdout)["session_id"], served)
    finally:
        shutil.rmtree(base, ignore_errors=True)


# -- folder grants -------------------------------------------------------------------------------


def test_folder_grants_are_opened_as_the_sessions_user(host: Host) -> None:
    """The daemon runs as root, but ann's grants are opened as ann: her own
    folder is granted; inside bob's 0700 folder, a path that exists and one
    that does not answer exactly as a missing folder does, so she learns
    nothing of bob's folder. The root's operator sees the same plan."""
    r = kbd_as(host, "ann", "session", "show", host.sid, "--json")
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    mine, peek, guess, gone = plan["folders"]
    assert (mine["alias"], mine["available"], mine["path"]) == ("mine", True, f"{host.base}/shared/ann/mine")
    unavailable = [{k: v for k, v in f.items() if k not in ("alias", "env")} for f in (peek, guess, gone)]
    assert unavailable[0] == unavailable[1] == unavailable[2], unavailable
    assert unavailable[0]["reason"] == "folder_unavailable" and unavailable[0]["available"] is False
    assert "knowledge base" not in unavailable[0]["message"] and "folder" in unavailable[0]["message"]
    operator = _operator(host.root, "session", "show", host.sid, "--json")
    assert operator.returncode == 0, operator.stderr
    seen = json.loads(operator.stdout)
    assert (seen["folders"], seen["generation"]) == (plan["folders"], plan["generation"])
    # The grant works in her sandbox; the others grant nothing.
    r = kbd_as(host, "ann", "--root", str(host.root), "exec", host.sid, "--", "sh", "-c",
               'cat "$WORKFLOW_FOLDER_MINE/f.txt"; echo "${WORKFLOW_FOLDER_PEEK-unset}"')  # fmt: skip
    assert (r.returncode, r.stdout) == (0, "ann's\nunset\n"), r.stderr


# -- revocation ------------------------------------------------------------------------------


def test_a_revoked_writer_stops_writing_at_once(host: Host) -> None:
    """``init --system`` writes ``revocation.immediate: true``: when bob revokes
    ann's write grant, her running command is ended, not left writing."""
    pw = host.users["ann"]
    script = 'echo started >> "$WORKFLOW_KB_SRC/notes/live.md" && echo up && exec cat'
    argv = [sys.executable, "-m", "kbd", "--root", str(host.root), "exec", host.sid, "--", "sh", "-c", script]
    with subprocess.Popen(_user_argv(pw, argv), env=_user_env(host), cwd="/", stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:  # fmt: skip
        try:
            assert proc.stdout is not None and proc.stderr is not None
            if proc.stdout.readline() != "up\n":
                proc.kill()
                raise AssertionError(proc.stderr.read())
            r = kbd_as(host, "bob", "writers", "revoke", "src", "agentwf")
            assert r.returncode == 0, r.stderr
            code = proc.wait(timeout=30)  # pushed revocation: 1 s plus the 5 s grace, at most
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert code == 128 + 15, (code, proc.stderr.read() if proc.stderr else "")
        r = kbd_as(host, "ann", "session", "show", host.sid, "--json")
        assert r.returncode == 0, r.stderr
        assert not [p for p in json.loads(r.stdout)["write"] if p.startswith(str(host.wf("src")))]
    r = kbd_as(host, "bob", "writers", "grant", "src", "agentwf")  # as it was, for the tests after
    assert r.returncode == 0, r.stderr


# -- kbd exec through KBD_SOCKET -------------------------------------------------------------


def test_exec_through_the_named_daemon_runs_on_its_root(host: Host) -> None:
    """ann names only the daemon (``KBD_SOCKET``): her ``kbd exec`` runs on the
    root that daemon serves, wherever it is, by the lean path and by click's."""
    for lead in ([], ["--socket", str(host.served.sock)]):
        r = kbd_as(host, "ann", *lead, "exec", host.sid, "--", "sh", "-c", 'echo "$WORKFLOW_KB_SRC"')
        assert (r.returncode, r.stdout) == (0, f"{host.wf('src')}/knowledgebase\n"), (lead, r.stderr)
    # A root she names is still checked: this daemon serves another one.
    r = kbd_as(host, "ann", "exec", host.sid, "--", "true", KBD_ROOT="/tmp")
    assert r.returncode == 69 and f"serves {host.root}, not /tmp" in r.stderr, r.stderr

"""What a command's Landlock layers refused, reported by the kernel (docs/sandbox.md
"Refusals the kernel reports"): real commands under the real kernel, whose audit records
kbd reads, maps to the plan and explains as ``kbd why`` does — in-process and brokered."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import features
from tests.helpers import KbRoot
from tests.integration import daemon
from tests.integration.hostusers import User, as_user, serving_for

pytestmark = [pytest.mark.requires_landlock_audit, pytest.mark.requires_bwrap]


@pytest.fixture(autouse=True)
def audit_on() -> Iterator[None]:
    features.enable_kernel_audit()
    yield


def configure(kb: KbRoot, old: str, new: str) -> None:
    cfg = kb.root / "kbd.yaml"
    text = cfg.read_text()
    assert old in text, old
    cfg.write_text(text.replace(old, new))


@pytest.fixture
def world(kb: KbRoot, exec_mode: str) -> KbRoot:
    kb.workflow("src", access={"owners": ["alice"], "allowed_kb_writers": ["con"]})
    kb.workflow(
        "con",
        access={"owners": ["alice"]},
        sources=[{"workflow_id": "src", "alias": "src", "access": "write"}],
    )
    return kb


def open_session(kb: KbRoot, kind: str, mode: str = "read") -> str:
    r = kb.call("session", "open", "con", "--kind", kind, "--kb-access", mode, "--as", "alice", "--json")
    assert r.code == 0, r.err
    return str(r.json()["session_id"])


def report_of(err: str) -> dict[str, Any]:
    (line,) = [x for x in err.splitlines() if x.startswith('{"denials"')]
    out: dict[str, Any] = json.loads(line)["denials"]
    return out


def refused_lines(err: str) -> list[str]:
    return [x for x in err.splitlines() if x.startswith("kbd: refused ")]


def by_path(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {d["path"]: d for d in report["refused"]}


def test_landlock_alone_reports_each_refusal_with_kbd_whys_reason(world: KbRoot) -> None:
    configure(world, "backend: auto", "backend: landlock")
    sid = open_session(world, "reviewer_strategic")
    src = world.workflows / "src"
    r = world.cli("exec", sid, "--json", "--", "sh", "-c",
                  f'echo x > "$WORKFLOW_KB_SRC/notes/fact.md"; cat {src}/workflow.json; '
                  f'cat {src}/workflow.json; echo done')  # fmt: skip
    assert (r.code, r.out) == (0, "done\n"), r.err
    report = report_of(r.err)
    assert report["reported"] is True and report["why_not"] is None, report
    seen = by_path(report)
    write = seen["$WORKFLOW_KB_SRC/notes/fact.md"]
    assert (write["action"], write["blockers"], write["count"]) == ("write", ["fs.write_file"], 1)
    assert write["why"] == f"kbd why {sid} '$WORKFLOW_KB_SRC/notes/fact.md' --mode write"
    hidden = seen[f"{src}/workflow.json"]
    assert (hidden["action"], hidden["code"], hidden["count"]) == ("read", "hidden", 2)
    # One line per distinct refusal, in the words kbd why uses, pointing at it.
    lines = refused_lines(r.err)
    assert (
        f"kbd: refused write $WORKFLOW_KB_SRC/notes/fact.md — {write['message']}; see {write['why']}"
    ) in lines
    assert (
        f"kbd: refused read {src}/workflow.json (2 times) — {hidden['message']}; see {hidden['why']}" in lines
    )
    # The pointer runs and gives the same reason first.
    for d in (write, hidden):
        argv = shlex.split(d["why"])[1:]
        asked = world.cli(*argv, "--json")
        assert asked.code == 77, asked.err
        assert asked.json()["reasons"][0]["code"] == d["code"], asked.out
    # And the audit keeps them.
    (event,) = [e for e in world.audit_events("sandbox_refusals") if e["session"] == sid]
    assert {x["path"] for x in event["refused"]} >= {"$WORKFLOW_KB_SRC/notes/fact.md", f"{src}/workflow.json"}


def test_nothing_pretends_where_there_is_no_landlock_layer(world: KbRoot) -> None:
    """A bubblewrap read plan has no Landlock layer: its mounts refuse (EROFS, ENOENT),
    which the kernel does not report, and kbd says so instead of an empty list."""
    sid = open_session(world, "reviewer_strategic")
    r = world.cli("exec", sid, "--json", "--", "sh", "-c", 'echo x > "$WORKFLOW_KB_SRC/notes/fact.md"')
    assert r.code != 0 and "Read-only file system" in r.err, r.err
    report = report_of(r.err)
    assert report["reported"] is False and report["refused"] == [], report
    assert "no Landlock layer" in report["why_not"]
    assert refused_lines(r.err) == []


def test_the_inner_layer_reports_what_it_keeps_out_of_contributed_notes(world: KbRoot) -> None:
    sid = open_session(world, "execution", "read-write")
    r = world.cli("exec", sid, "--json", "--", "sh", "-c",
                  'ln -s /etc/passwd "$WORKFLOW_KB_SRC/notes/l.md"; mkfifo "$WORKFLOW_KB_SRC/notes/f"; '
                  'echo ok > "$WORKFLOW_KB_SRC/notes/fine.md"; ls /proc/self/fd')  # fmt: skip
    assert r.code == 0, r.err
    # The pid channel is the helper's alone: closed before the command runs.
    assert sorted(r.out.split()) == ["0", "1", "2", "3"], r.out
    report = report_of(r.err)
    assert report["reported"] is True, report
    kinds = {d["action"]: d for d in report["refused"]}
    assert set(kinds) == {"create a symlink in", "create a FIFO in"}, report
    for d in kinds.values():
        assert (d["path"], d["code"]) == ("$WORKFLOW_KB_SRC/notes", "not_regular")
        assert "why" not in d  # kbd why would say the path is writable: the kind was refused
    assert "kbd: refused create a symlink in $WORKFLOW_KB_SRC/notes — only regular files" in r.err
    assert (world.workflows / "src" / "knowledgebase" / "notes" / "fine.md").read_text().endswith("---\nok\n")


def test_a_commands_own_landlock_layer_is_told_apart(world: KbRoot) -> None:
    """A command may sandbox itself further. Its own layer shares the helper's pid (the helper
    execs the command), so its refusals are claimed with kbd's, but never explained as kbd's
    rules: the plan allows those paths."""
    configure(world, "backend: auto", "backend: landlock")
    sid = open_session(world, "reviewer_strategic")
    hidden = f"{world.workflows}/src/workflow.json"
    own_layer = (
        "import ctypes,os\n"
        f"try: open({hidden!r})\n"  # refused by kbd's layer: src's own folder is never shared
        "except PermissionError: pass\n"
        "libc=ctypes.CDLL(None,use_errno=True)\n"
        "attr=(ctypes.c_uint64*3)(1<<2,0,0)\n"  # handles read_file ...
        "rs=libc.syscall(444,attr,ctypes.c_size_t(24),0)\n"
        "class Rule(ctypes.Structure): _pack_=1; _fields_=[('access',ctypes.c_uint64),('fd',ctypes.c_int32)]\n"
        "for p in ('/usr','/lib','/lib64'):\n"  # ... and allows it only here
        "    if os.path.exists(p): assert libc.syscall(445,rs,1,ctypes.byref(Rule(1<<2,os.open(p,os.O_PATH))),0)==0\n"
        "assert rs>=0 and libc.prctl(38,1,0,0,0)==0 and libc.syscall(446,rs,2)==0\n"  # LOG_NEW_EXEC_ON
        "os.execv('/usr/bin/cat',['cat','/etc/passwd'])\n"
    )
    r = world.cli("exec", sid, "--json", "--", "python3", "-I", "-S", "-c", own_layer)
    assert r.code == 1 and "cat: /etc/passwd: Permission denied" in r.err, r.err
    seen = by_path(report_of(r.err))
    assert seen[hidden]["code"] == "hidden", seen
    assert seen["/etc/passwd"]["code"] == "not_kbd_rule", seen
    assert "why" not in seen["/etc/passwd"]


def test_reports_can_be_turned_off(world: KbRoot) -> None:
    configure(world, "backend: auto", "backend: landlock")
    configure(world, "sandbox:\n", "sandbox:\n  report_denials: false\n")
    sid = open_session(world, "reviewer_strategic")
    r = world.cli("exec", sid, "--json", "--", "sh", "-c", f"cat {world.workflows}/src/workflow.json")
    assert r.code == 1
    report = report_of(r.err)
    assert (report["reported"], report["why_not"]) == (False, "sandbox.report_denials is off in kbd.yaml")
    assert refused_lines(r.err) == []
    assert "report_denials: false" in world.cli("doctor").out


def test_doctor_says_whether_the_kernel_reports(world: KbRoot) -> None:
    out = world.cli("doctor").out
    (line,) = [x for x in out.splitlines() if "refusal reports" in x]
    assert "available: kbd exec lists what Landlock refused" in line, line


def test_a_read_only_attachment_under_landlock_alone(world: KbRoot) -> None:
    """The README's example: a write session writing into a source attached read-only."""
    world.workflow("rts", access={"owners": ["alice"]})
    manifest = world.workflows / "con" / "workflow.json"
    doc = json.loads(manifest.read_text())
    doc["knowledgebase_sources"].append({"workflow_id": "rts", "alias": "rts", "access": "read"})
    manifest.write_text(json.dumps(doc))
    configure(world, "backend: auto", "backend: landlock")
    configure(world, "unsafe_landlock_writes: false", "unsafe_landlock_writes: true")
    sid = open_session(world, "execution", "read-write")
    r = world.cli("exec", sid, "--", "sh", "-c",
                  'echo x > "$WORKFLOW_KB_RTS/notes/fact.md"; echo x > "$WORKFLOW_KB_RTS/notes/a.md"')  # fmt: skip
    assert r.code == 2, r.err
    reason = "rts (rts) is attached read-only in con's workflow.json"
    # A file's own right names the file; a folder's (making an entry) names the folder only,
    # and kbd why is asked about a new note in it.
    assert refused_lines(r.err) == [
        f"kbd: refused create a file in $WORKFLOW_KB_RTS/notes — {reason}; "
        f"see kbd why {sid} '$WORKFLOW_KB_RTS/notes/new.md' --mode write",
        f"kbd: refused write $WORKFLOW_KB_RTS/notes/fact.md — {reason}; "
        f"see kbd why {sid} '$WORKFLOW_KB_RTS/notes/fact.md' --mode write",
    ], r.err


@pytest.mark.requires_reachable_checkout
def test_a_real_users_brokered_command_gets_its_own_report(user: User) -> None:
    """A non-root caller's command runs as her, in a user namespace root owns: the helper's pid
    and uid reach the daemon as the kernel sees them, the audit records name the same, and her
    report lists what her sandbox refused."""
    base = Path(tempfile.mkdtemp(prefix="kbd-refusals-", dir="/tmp"))
    try:
        os.chown(base, 0, user.group_gid)
        os.chmod(base, 0o750)  # noqa: S103 - the user's group is its only way in
        kb = KbRoot.create(base / "root")
        for folder in (kb.root, kb.workflows):
            os.chown(folder, 0, user.group_gid)
        kb.workflow("src", access={"owners": ["alice"], "allowed_kb_writers": ["con"]})
        kb.workflow("con", access={"owners": ["alice"]},
                    sources=[{"workflow_id": "src", "alias": "src", "access": "write"}])  # fmt: skip
        daemon.map_uid(kb.root, "alice", user.uid)
        sid = open_session(kb, "execution", "read-write")
        env = {k: v for k, v in os.environ.items() if not k.startswith("KBD_")}
        env.update(HOME="/", PATH="/usr/bin:/bin", PYTHONPATH=str(Path(__file__).parents[2]))
        argv = [sys.executable, "-m", "kbd", "--root", str(kb.root), "exec", sid, "--json", "--",
                "sh", "-c", 'ln -s /etc/passwd "$WORKFLOW_KB_SRC/notes/l.md"; id -u']  # fmt: skip
        with serving_for(kb, base, user) as served:
            r = as_user(user, argv, {**env, "KBD_SOCKET": str(served.sock)})
        err = r.stderr.decode()
        assert (r.returncode, r.stdout.decode()) == (0, f"{user.uid}\n"), err
        report = report_of(err)
        assert report["reported"] is True, report
        (refused,) = report["refused"]
        assert (refused["action"], refused["path"], refused["code"]) == (
            "create a symlink in", "$WORKFLOW_KB_SRC/notes", "not_regular"), report  # fmt: skip
        (event,) = [e for e in kb.audit_events("sandbox_refusals") if e["session"] == sid]
        assert event["refused"][0]["code"] == "not_regular"
    finally:
        shutil.rmtree(base, ignore_errors=True)

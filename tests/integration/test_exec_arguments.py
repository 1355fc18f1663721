"""``kbd exec`` has one argument grammar (:func:`kbd.cli.exec_grammar.parse_exec`): the lean
path (:mod:`kbd.cli.entry`, no click) and the click command (:mod:`kbd.cli.commands`) give the
same answer — output, error line, exit code — to every invocation, malformed
ones above all, and an option is never run as the command.

Both paths run for real, each in a process of its own (a case that slipped
through would start a sandbox, which does not belong in the test process).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kbd.cli.exec_grammar import ExecArgs, parse_exec
from kbd.errors import UsageError
from tests.helpers import KbRoot

# Runs every case of argv[2] (a JSON list of argvs) through the entry point named
# by argv[1], each in a forked child (every case exits), and prints each
# (exit code, stdout, stderr) as JSON: two interpreters for the whole table.
DRIVER = r"""
import json, os, sys, tempfile
lean = sys.argv[1] == "lean"
if lean:
    from kbd.cli.entry import main
else:
    from kbd.cli.commands import run as main
answers = []
for argv in json.loads(sys.argv[2]):
    out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
    pid = os.fork()
    if pid == 0:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        sys.argv = ["kbd", *argv]
        code = 0
        try:
            main()
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (exc.code is not None)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    out.seek(0)
    err.seek(0)
    answers.append([os.waitstatus_to_exitcode(status), out.read().decode(), err.read().decode()])
print(json.dumps(answers))
"""

EXEC_USAGE = "kbd exec SID [--cwd DIR] [--as P] [--strict-contributions] [--json] -- CMD [ARG...]"
SEE_HELP = "hint: see `kbd exec --help`\n"
NO_SUCH = "hint: " + EXEC_USAGE + " (the command's own options go after --)\n"

# (argv after `kbd --root R`, the exact stderr, exit code); SID stands for an open session.
MALFORMED = [
    (["exec"], "error[usage]: Missing argument 'SID'.\n" + SEE_HELP, 2),
    (["exec", "SID"], "error[usage]: Missing argument 'COMMAND...'.\n" + SEE_HELP, 2),
    (["exec", "SID", "--"], f"error[usage]: no command given\nhint: {EXEC_USAGE}\n", 2),
    (["exec", "SID", "--cwd", "."], f"error[usage]: no command given\nhint: {EXEC_USAGE}\n", 2),
    (["exec", "SID", "--cwd"], "error[usage]: Option '--cwd' requires an argument.\n" + SEE_HELP, 2),
    (["exec", "SID", "--cwd", "--", "touch", "m"], "error[usage]: Option '--cwd' requires an argument.\n" + SEE_HELP, 2),
    (["exec", "--cwd"], "error[usage]: Option '--cwd' requires an argument.\n" + SEE_HELP, 2),
    (["exec", "SID", "--as"], "error[usage]: Option '--as' requires an argument.\n" + SEE_HELP, 2),
    (["exec", "SID", "--bogus", "--", "touch", "m"], "error[usage]: No such option '--bogus'.\n" + NO_SUCH, 2),
    (["exec", "SID", "-x", "touch", "m"], "error[usage]: No such option '-x'.\n" + NO_SUCH, 2),
    (["exec", "--bogus", "SID", "--", "touch", "m"], "error[usage]: No such option '--bogus'.\n" + NO_SUCH, 2),
    (["exec", "SID", "--root", "/x", "--", "touch", "m"], "error[usage]: No such option '--root'.\n" + NO_SUCH, 2),
    (["exec", "SID", "--as=", "--", "touch", "m"],
     "error[usage]: --as was given an empty principal\n"
     "hint: pass --as PRINCIPAL with a principal's ID, or leave --as out\n", 2),
    (["exec", "nosuch", "--", "touch", "m"],
     "error[not-found]: no session 'nosuch'\nhint: `kbd session list` shows the sessions you may use\n", 66),
]  # fmt: skip


def _answers(path: str, cases: list[list[str]]) -> list[tuple[int, str, str]]:
    p = subprocess.run(
        [sys.executable, "-c", DRIVER, path, json.dumps(cases)],
        capture_output=True, timeout=120, check=True,
    )  # fmt: skip
    return [(code, out, err) for code, out, err in json.loads(p.stdout)]


def _case(kb: KbRoot, sid: str, args: list[str]) -> list[str]:
    return ["--root", str(kb.root), *(sid if a == "SID" else a for a in args)]


@pytest.fixture
def session(kb: KbRoot) -> str:
    kb.workflow("con", access={"owners": ["alice"]})
    return kb.open_session("con", kind="execution", kb_access="read", actor="alice")


def test_both_paths_refuse_every_malformed_exec_the_same_way(kb: KbRoot, session: str) -> None:
    cases = [_case(kb, session, args) for args, _, _ in MALFORMED]
    lean, click = _answers("lean", cases), _answers("click", cases)
    for (args, err, code), by_lean, by_click in zip(MALFORMED, lean, click, strict=True):
        assert by_lean == by_click, args
        assert by_lean == (code, "", err), args
    assert not (kb.workflows / "con" / "m").exists(), "an option was run as a command"


def test_both_paths_show_the_same_help(kb: KbRoot, session: str) -> None:
    cases = [
        _case(kb, session, a)
        for a in (["exec", "--help"], ["exec", "SID", "-h"], ["exec", "SID", "--cwd", ".", "--help"])
    ]
    lean, click = _answers("lean", cases), _answers("click", cases)
    assert lean == click
    for code, out, err in lean:
        assert (code, err) == (0, "")
        assert out.startswith("Usage: kbd exec [OPTIONS] SID COMMAND...\n") and "--cwd DIR" in out


def test_both_paths_answer_a_root_click_refuses_the_same_way(kb: KbRoot, session: str) -> None:
    cases = [
        ["--root=/etc/passwd", "exec", session, "--", "true"],
        ["--root=", "exec", session, "--", "true"],
    ]
    lean, click = _answers("lean", cases), _answers("click", cases)
    assert lean == click
    assert lean[0][0] == 2 and "Directory '/etc/passwd' is a file" in lean[0][2]


@pytest.mark.requires_bwrap
def test_both_paths_run_the_same_valid_invocations(kb: KbRoot, session: str) -> None:
    (kb.workflows / "con" / "sub").mkdir()
    forms = [
        ["exec", "SID", "--", "sh", "-c", "pwd; exit 3"],
        ["exec", "SID", "sh", "-c", "pwd; exit 3"],
        ["exec", "--cwd", "sub", "SID", "--", "sh", "-c", "pwd; exit 3"],
        ["exec", "SID", "--cwd=sub", "--as", "alice", "--", "sh", "-c", "pwd; exit 3"],
        ["exec", "--", "SID", "--cwd", "sub", "sh", "-c", "pwd; exit 3"],
    ]
    cases = [_case(kb, session, f) for f in forms]
    lean, click = _answers("lean", cases), _answers("click", cases)
    assert lean == click
    folder = kb.workflows / "con"
    assert [(code, out) for code, out, _ in lean] == [
        (3, f"{folder}\n"), (3, f"{folder}\n"), (3, f"{folder}/sub\n"), (3, f"{folder}/sub\n"), (3, f"{folder}/sub\n")
    ]  # fmt: skip


# -- the grammar itself ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "parsed"),
    [
        (["S", "--", "ls", "-l"], ExecArgs("S", ("ls", "-l"))),
        (["S", "ls", "-l"], ExecArgs("S", ("ls", "-l"))),
        (["S", "--cwd", "d", "--as", "p", "--", "ls"], ExecArgs("S", ("ls",), cwd="d", as_="p")),
        (["--cwd=d", "S", "--cwd=e", "ls"], ExecArgs("S", ("ls",), cwd="e")),
        (["S", "--", "--cwd", "x"], ExecArgs("S", ("--cwd", "x"))),
        (["S", "-", "x"], ExecArgs("S", ("-", "x"))),
        (["--", "--odd-sid", "ls"], ExecArgs("--odd-sid", ("ls",))),
        (["S", "--help"], None),
        (["-h"], None),
        (["S", "--", "--help"], ExecArgs("S", ("--help",))),
    ],
)
def test_exec_grammar(args: list[str], parsed: ExecArgs | None) -> None:
    assert parse_exec(args) == parsed


@pytest.mark.parametrize(
    ("args", "message"),
    [(args[1:], err.splitlines()[0].removeprefix("error[usage]: ")) for args, err, code in MALFORMED if code == 2
     and "--as was given" not in err],
)  # fmt: skip
def test_exec_grammar_refusals(args: list[str], message: str) -> None:
    with pytest.raises(UsageError) as info:
        parse_exec(args)
    assert info.value.message == message


def test_the_click_command_is_a_thin_delegator(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No second parser: the click command hands its raw arguments, untouched, to
    the one grammar (what that grammar answers is checked above, on both paths)."""
    from kbd.cli import app, commands

    seen: list[list[str]] = []

    def spy(args: list[str]) -> ExecArgs | None:
        seen.append(list(args))
        raise UsageError("spied")

    monkeypatch.setattr(app, "parse_exec", spy)  # ExecCommand's one parse
    argv = ["S", "--cwd", "d", "--weird", "--", "ls", "--as", "x"]
    with pytest.raises(SystemExit) as info:
        commands.run(["--root", str(tmp_path), "exec", *argv])
    assert (info.value.code, seen) == (2, [argv])

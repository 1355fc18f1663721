"""What a person expects of the `kbd` command itself (docs/cli.md "Global options"): bare
`kbd` shows the help, `--version`, global options after the command, and shell
completion (bash, zsh, fish) that completes workflow IDs, aliases, session IDs
and principals from the root, and completes nothing — quietly — from a root it
cannot read."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import KbRoot
from tests.integration.daemon import clean_env
from tests.integration.test_cli_boundary import assert_error

KBD = [sys.executable, "-m", "kbd"]


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*KBD, *args], capture_output=True, text=True, env=env or clean_env(), timeout=60,
                          check=False)  # fmt: skip


def test_bare_kbd_prints_the_help_on_stdout_and_succeeds() -> None:
    r = _run()
    assert (r.returncode, r.stderr) == (0, "")
    assert r.stdout.startswith("Usage: kbd [OPTIONS] [COMMAND] [ARGS]...\n")
    assert "principals" in r.stdout and "completion" in r.stdout


def test_version() -> None:
    r = _run("--version")
    assert r.returncode == 0 and r.stdout.startswith("kbd, version ")


@pytest.fixture
def world(kb: KbRoot) -> KbRoot:
    kb.workflow("src", access={"owners": ["bob"], "readers": ["alice"]})
    kb.workflow("con", access={"owners": ["alice"]}, sources=[{"workflow_id": "src", "alias": "docs"}])
    return kb


def test_root_may_follow_the_command(world: KbRoot) -> None:
    env = clean_env()  # no KBD_ROOT: without --root the default root (none here) would be used
    root = str(world.root)
    before = _run("--root", root, "sources", "list", "con", "--as", "alice", "--json", env=env)
    after = _run("sources", "list", "con", "--as", "alice", "--json", "--root", root, env=env)
    assert before.returncode == 0, before.stderr
    assert (after.returncode, after.stdout) == (0, before.stdout)
    listed = _run("principals", "list", "--root", root, env=env)
    assert listed.returncode == 0 and listed.stdout.startswith("alice ")
    # The later one wins, as for any repeated option.
    again = _run(
        "--root", "/nonexistent-kbd-root", "workflows", "list", "--as", "alice", "--root", root, env=env
    )
    assert again.returncode == 0, again.stderr


def test_json_may_come_before_the_command(world: KbRoot) -> None:
    a = world.cli("--json", "workflows", "list", "--as", "alice")
    b = world.cli("workflows", "list", "--as", "alice", "--json")
    assert (a.code, a.out) == (0, b.out) and a.json()["workflows"]


@pytest.mark.parametrize("args", [["serve"], ["exec", "s_x", "--", "true"], ["completion", "bash"]])
def test_global_json_for_a_command_without_json_output_is_a_usage_error(kb: KbRoot, args: list[str]) -> None:
    r = kb.cli("--json", *args)
    assert assert_error(r, "usage", 2) == f"`kbd {args[0]}` has no --json output"


@pytest.mark.parametrize("shell", ["bash", "zsh", "fish"])
def test_completion_prints_a_script_for_each_shell(shell: str) -> None:
    r = _run("completion", shell)
    assert r.returncode == 0 and r.stderr == ""
    assert "_KBD_COMPLETE" in r.stdout and f"{shell}_complete" in r.stdout


def test_completion_of_an_unknown_shell_is_a_usage_error() -> None:
    r = _run("completion", "tcsh")
    assert r.returncode == 2 and "'tcsh' is not one of 'bash', 'zsh', 'fish'" in r.stderr


def _complete(
    words: list[str], *, env: dict[str, str], user: int | None = None
) -> subprocess.CompletedProcess[str]:
    """What bash's completion function asks `kbd` for the last word of ``words``."""
    full = {
        **env,
        "_KBD_COMPLETE": "bash_complete",
        "COMP_WORDS": " ".join(words),
        "COMP_CWORD": str(len(words) - 1),
    }
    prefix = (
        ["setpriv", "--reuid", str(user), "--regid", str(user), "--clear-groups"] if user is not None else []
    )
    return subprocess.run([*prefix, *KBD], capture_output=True, text=True, env=full, timeout=60, check=False)


def _values(r: subprocess.CompletedProcess[str]) -> list[str]:
    assert (r.returncode, r.stderr) == (0, ""), r.stderr
    return [line.split(",", 1)[1] for line in r.stdout.splitlines() if line]


def test_completion_offers_workflows_aliases_sessions_and_principals(world: KbRoot) -> None:
    env = {**clean_env(), "KBD_ROOT": str(world.root)}
    sid = world.open_session("con", kind="execution", kb_access="read", actor="alice")
    assert _values(_complete(["kbd", "sources", "list", ""], env=env)) == ["con", "src"]
    assert _values(_complete(["kbd", "sources", "list", "s"], env=env)) == ["src"]
    assert _values(_complete(["kbd", "read", "con", ""], env=env)) == ["docs"]
    assert _values(_complete(["kbd", "notes", "write", sid, ""], env=env)) == ["docs"]
    assert _values(_complete(["kbd", "session", "show", ""], env=env)) == [sid]
    assert _values(_complete(["kbd", "exec", ""], env=env)) == [sid]
    assert _values(_complete(["kbd", "principals", "disable", "a"], env=env)) == ["alice"]
    assert _values(_complete(["kbd", "writers", "list", "--as", "o"], env=env)) == ["ops"]
    # The root named on the command line, before or after the command.
    bare = clean_env()
    assert _values(_complete(["kbd", "--root", str(world.root), "ls", ""], env=bare)) == ["con", "src"]
    assert _values(_complete(["kbd", "ls", "--root", str(world.root), ""], env=bare)) == ["con", "src"]


def test_bash_itself_completes_through_the_printed_script(world: KbRoot) -> None:
    script = _run("completion", "bash").stdout
    bindir = Path(sys.executable).parent
    assert (bindir / "kbd").exists(), "the kbd console script of this environment"
    env = {**clean_env(), "KBD_ROOT": str(world.root), "PATH": f"{bindir}:{os.environ['PATH']}"}
    probe = (
        script
        + '\nCOMP_WORDS=(kbd sources list ""); COMP_CWORD=3; _kbd_completion kbd; printf "%s\\n" "${COMPREPLY[@]}"\n'
    )
    r = subprocess.run(["bash", "--norc", "--noprofile", "-c", probe], capture_output=True, text=True, env=env,
                       timeout=60, check=False)  # fmt: skip
    assert (r.returncode, r.stderr) == (0, "") and r.stdout.split() == ["con", "src"]


def test_a_root_that_cannot_be_read_completes_nothing_quietly(world: KbRoot, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "kbd.yaml").write_text("host: [\n")
    for root in (broken, tmp_path / "missing"):
        env = {**clean_env(), "KBD_ROOT": str(root)}
        for words in (
            ["kbd", "sources", "list", ""],
            ["kbd", "session", "show", ""],
            ["kbd", "read", "con", ""],
        ):
            assert _values(_complete(words, env=env)) == []
    if os.geteuid() == 0:
        # A user who may not read the root (0750 root:root, as installed).
        os.chmod(world.root, 0o700)
        env = {**clean_env(), "KBD_ROOT": str(world.root), "HOME": str(tmp_path)}
        assert _values(_complete(["kbd", "sources", "list", ""], env=env, user=65534)) == []
        assert _values(_complete(["kbd", "principals", "token", ""], env=env, user=65534)) == []


@pytest.mark.parametrize("name", ["principals.yaml", "kbd.yaml"])
def test_a_fifo_for_a_config_file_is_refused_at_once_never_waited_on(world: KbRoot, name: str) -> None:
    """A FIFO in place of a config file (review finding): TAB must not hang the
    shell, and every command refuses it with a clear error instead of blocking
    (the daemon re-reads these files on each request)."""
    path = world.root / name
    path.unlink()
    os.mkfifo(path)
    env = {**clean_env(), "KBD_ROOT": str(world.root)}
    for words in (["kbd", "principals", "disable", ""], ["kbd", "sources", "list", ""]):
        assert _values(_complete(words, env=env)) == []  # subprocess.run's timeout would fail a hang
    r = subprocess.run([*KBD, "--root", str(world.root), "principals", "list"], capture_output=True, text=True,
                       env=clean_env(), timeout=30, check=False)  # fmt: skip
    assert r.returncode == 65, r.stderr
    assert f"{name} at {path} is not a regular file" in r.stderr

"""One libc module (kbd/fs/libc.py): libc is loaded in one place for the parent,
and the standalone Landlock helper's own copies of the kernel numbers equal it."""

from __future__ import annotations

import ast
import os
import threading
from pathlib import Path

import pytest

import kbd
from kbd.fs import libc
from kbd.sandbox import landlock_helper as helper

PACKAGE = Path(kbd.__file__).resolve().parent


def test_the_landlock_helper_numbers_equal_libc() -> None:
    """The helper runs inside the sandbox with no kbd imports, so it spells the
    numbers itself: each must be the one kbd.fs.libc names."""
    capset = libc.SYS_CAPSET_X86_64 if os.uname().machine == "x86_64" else libc.SYS_CAPSET_GENERIC
    assert {
        "SYS_CREATE_RULESET": libc.SYS_LANDLOCK_CREATE_RULESET,
        "SYS_ADD_RULE": libc.SYS_LANDLOCK_ADD_RULE,
        "SYS_RESTRICT_SELF": libc.SYS_LANDLOCK_RESTRICT_SELF,
        "SYS_CAPSET": capset,
        "CREATE_RULESET_VERSION": libc.LANDLOCK_CREATE_RULESET_VERSION,
        "PR_SET_NO_NEW_PRIVS": libc.PR_SET_NO_NEW_PRIVS,
        "PR_CAPBSET_DROP": libc.PR_CAPBSET_DROP,
        "PR_CAP_AMBIENT": libc.PR_CAP_AMBIENT,
        "PR_CAP_AMBIENT_CLEAR_ALL": libc.PR_CAP_AMBIENT_CLEAR_ALL,
        "PR_SET_SECCOMP": libc.PR_SET_SECCOMP,
        "SECCOMP_MODE_FILTER": libc.SECCOMP_MODE_FILTER,
    } == {
        "SYS_CREATE_RULESET": helper.SYS_CREATE_RULESET,
        "SYS_ADD_RULE": helper.SYS_ADD_RULE,
        "SYS_RESTRICT_SELF": helper.SYS_RESTRICT_SELF,
        "SYS_CAPSET": helper.SYS_CAPSET,
        "CREATE_RULESET_VERSION": helper.CREATE_RULESET_VERSION,
        "PR_SET_NO_NEW_PRIVS": helper.PR_SET_NO_NEW_PRIVS,
        "PR_CAPBSET_DROP": helper.PR_CAPBSET_DROP,
        "PR_CAP_AMBIENT": helper.PR_CAP_AMBIENT,
        "PR_CAP_AMBIENT_CLEAR_ALL": helper.PR_CAP_AMBIENT_CLEAR_ALL,
        "PR_SET_SECCOMP": helper.PR_SET_SECCOMP,
        "SECCOMP_MODE_FILTER": helper.SECCOMP_MODE_FILTER,
    }


def _cdll_sites() -> set[str]:
    sites = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call):
                func = node.func
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                if name in ("CDLL", "LoadLibrary", "find_library", "dlopen"):
                    sites.add(path.relative_to(PACKAGE).as_posix())
    return sites


def test_libc_is_loaded_in_one_place() -> None:
    """kbd/fs/libc.py for every parent-side module; the standalone helpers (the
    sandbox's Landlock helper, the daemon's launcher: both run as ``python3 -I
    -S`` with the standard library only) load their own."""
    assert _cdll_sites() == {"fs/libc.py", "sandbox/landlock_helper.py", "sandbox/launcher.py"}


def test_the_launcher_asks_for_the_parent_death_signal_by_its_kernel_number() -> None:
    from kbd.sandbox import launcher

    assert launcher.PR_SET_PDEATHSIG == 1  # include/uapi/linux/prctl.h


@pytest.mark.requires_root
def test_a_thread_opens_as_another_user_and_no_other_thread_does(traversable: Path) -> None:
    """``as_filesystem_user``: the call's own thread is checked as the user
    (uid, gid and supplementary groups), the process's other threads stay
    root meanwhile, and nothing of the user is left behind."""
    private = traversable / "private"  # root's, 0700
    private.mkdir(mode=0o700)
    grouped = traversable / "grouped"  # the group 4242's only
    grouped.mkdir()
    os.chown(grouped, 0, 4242)
    grouped.chmod(0o070)
    user_in, other_thread_ok = threading.Event(), threading.Event()

    def meanwhile() -> None:  # started by the main thread: root, while the call's thread is the user
        assert user_in.wait(30)
        os.listdir(private)
        other_thread_ok.set()

    def as_nobody() -> str:
        with pytest.raises(PermissionError):
            os.listdir(private)
        user_in.set()
        assert other_thread_ok.wait(30)
        return "done"

    other = threading.Thread(target=meanwhile)
    other.start()
    assert libc.as_filesystem_user(65534, 65534, [], as_nobody) == "done"
    assert libc.as_filesystem_user(65534, 65534, [4242], lambda: os.listdir(grouped)) == []
    with pytest.raises(PermissionError):
        libc.as_filesystem_user(65534, 65534, [], lambda: os.listdir(grouped))
    other.join()
    assert os.listdir(private) == [] and os.listdir(grouped) == []
    assert all(t.name != "kbd-as-user" for t in threading.enumerate())

"""Lowering a child's rlimits with ulimit (kbd/sandbox/limits.py): run the
steps in a real shell and read back what it got."""

from __future__ import annotations

import resource
import subprocess

from kbd.sandbox.limits import SHELL, lower, lowering_steps


def _after(steps: list[str], flag: str) -> list[str]:
    script = " && ".join([*steps, f"ulimit -S {flag}", f"ulimit -H {flag}"])
    return subprocess.run([SHELL, "-c", script], capture_output=True, text=True, check=True).stdout.split()


def test_limits_are_lowered_to_the_callers_never_raised() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert _after(lowering_steps({resource.RLIMIT_NOFILE: (100, 200)}), "-n") == ["100", "200"]
    # Higher than this process's: nothing to do (a child may never get more than its parent lends).
    assert lowering_steps({resource.RLIMIT_NOFILE: (resource.RLIM_INFINITY, resource.RLIM_INFINITY)}) == []
    assert _after(lowering_steps({resource.RLIMIT_NOFILE: (soft, hard)}), "-n") == [str(soft), str(hard)]


def test_sizes_are_counted_in_the_flags_units() -> None:
    steps = lowering_steps({resource.RLIMIT_FSIZE: (512 * 1000, 512 * 2000)})
    assert _after(steps, "-f") == ["1000", "2000"]


def test_lower_treats_infinity_as_the_highest() -> None:
    inf = resource.RLIM_INFINITY
    assert lower(inf, 5) == 5 and lower(5, inf) == 5 and lower(inf, inf) == inf and lower(3, 4) == 3

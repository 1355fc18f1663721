"""Lowering a child's rlimits with ulimit (kbd/sandbox/limits.py): run the
steps in a real shell and read back what it got."""

from __future__ import annotations

import resource
import subprocess

import pytest

from kbd.core.config import LimitsConfig
from kbd.sandbox.limits import SHELL, command_rlimits, lower, lowering_steps, shell_prefix


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


@pytest.mark.parametrize(
    "limits",
    [
        LimitsConfig(),
        LimitsConfig(file_size_max=10 << 20, open_files_max=100, address_space_max=3 << 30, cpu_time_max=60),
        LimitsConfig(
            file_size_max=1000, open_files_max=None, address_space_max=(1 << 30) + 1500
        ),  # rounded down
    ],
)
def test_command_rlimits_are_what_the_ulimit_step_sets(limits: LimitsConfig) -> None:
    """The helper's setrlimit pairs (a write plan) and the shell step (a read
    plan) give a command the same limits: read back from a real shell."""
    flags = {resource.RLIMIT_CORE: "-c", resource.RLIMIT_FSIZE: "-f", resource.RLIMIT_NOFILE: "-n",
             resource.RLIMIT_AS: "-v", resource.RLIMIT_CPU: "-t"}  # fmt: skip
    units = {resource.RLIMIT_CORE: 512, resource.RLIMIT_FSIZE: 512, resource.RLIMIT_AS: 1024}
    pairs = command_rlimits(limits)
    assert pairs[0] == (resource.RLIMIT_CORE, 0)
    shown = " && ".join(f"ulimit -S {flags[res]} && ulimit -H {flags[res]}" for res, _ in pairs)
    prefix = shell_prefix(limits)
    out = subprocess.run([*prefix, SHELL, "-c", shown], capture_output=True, text=True, check=True).stdout
    expected = [str(value // units.get(res, 1)) for res, value in pairs for _ in (0, 1)]
    assert out.split() == expected
    assert command_rlimits(None) == [] and shell_prefix(None)[-2:] == ['exec "$@"', "kbd-exec"]


def test_command_rlimits_never_exceed_the_hard_limits_the_command_starts_with() -> None:
    pairs = dict(command_rlimits(LimitsConfig(open_files_max=4096), {resource.RLIMIT_NOFILE: 1000}))
    assert pairs[resource.RLIMIT_NOFILE] == 1000

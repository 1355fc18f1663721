"""Resource limits every sandboxed command starts under (docs/sandbox.md "Resource limits").

kbd uses no ``preexec_fn``: the rlimits are set by a POSIX shell step that runs
right before the command, inside the sandbox, and then ``exec``s it — the same
``sh -c 'exec "$@"'`` step the bubblewrap backend already used to get
conventional exit codes. ``ulimit`` without ``-H``/``-S`` sets the soft *and*
hard limit, so the command cannot raise them again; core dumps are always off.
A write plan's command starts from the inner Landlock helper instead, which
sets the same limits (:func:`command_rlimits`) with ``setrlimit``: one exec less.
"""

from __future__ import annotations

import resource
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Mapping

    from kbd.core.config import LimitsConfig

SHELL = "/bin/sh"
# (ulimit flag, resource, unit the flag counts in). POSIX ulimit -f counts
# 512-byte blocks; -v counts KiB in dash, bash and busybox alike.
_RLIMITS = (
    ("file_size_max", "-f", resource.RLIMIT_FSIZE, 512),
    ("open_files_max", "-n", resource.RLIMIT_NOFILE, 1),
    ("address_space_max", "-v", resource.RLIMIT_AS, 1024),
    ("cpu_time_max", "-t", resource.RLIMIT_CPU, 1),
)


def ulimit_script(limits: LimitsConfig, hard: dict[int, int]) -> str:
    """The shell step: set each configured rlimit (never above the current hard
    limit ``hard[resource]``, which an unprivileged process cannot raise), then
    exec the command. Exit 69 if a limit cannot be set: never run unbounded."""
    steps = ["ulimit -c 0"]
    steps += [f"ulimit {flag} {max(1, value // unit)}" for flag, _, unit, value in _capped(limits, hard)]
    return " && ".join(steps) + ' || { echo "kbd: cannot set resource limits" >&2; exit 69; }; exec "$@"'


def command_rlimits(
    limits: LimitsConfig | None, hard: Mapping[int, int] | None = None
) -> list[tuple[int, int]]:
    """``(resource, value)``: what :func:`shell_prefix` sets, for a step that is
    not a shell — each to be set as soft *and* hard limit, in this order (core
    dumps off first). The write plan's Landlock helper applies them inside the
    sandbox; a launcher that ``setrlimit``s them before it execs bubblewrap
    could drop the shell step of a read plan too, but for that step's exit
    codes (127/126). Each value is rounded down to the unit ``ulimit`` counts
    in, so both give the command the same limits. ``hard``: as in
    :func:`shell_prefix`."""
    if limits is None:
        return []
    caps = {res: resource.getrlimit(res)[1] for _, _, res, _ in _RLIMITS}
    caps.update(hard or {})
    return [(resource.RLIMIT_CORE, 0)] + [
        (res, max(1, value // unit) * unit) for _, res, unit, value in _capped(limits, caps)
    ]


def _capped(limits: LimitsConfig, hard: Mapping[int, int]) -> list[tuple[str, int, int, int]]:
    """``(ulimit flag, resource, unit, value)`` of each configured limit, never
    above the hard limit ``hard[resource]`` (which an unprivileged process cannot raise)."""
    out = []
    for key, flag, res, unit in _RLIMITS:
        value = getattr(limits, key)
        if value is None:
            continue
        cap = hard.get(res, resource.RLIM_INFINITY)
        out.append((flag, res, unit, value if cap == resource.RLIM_INFINITY else min(value, cap)))
    return out


def shell_prefix(limits: LimitsConfig | None, hard: Mapping[int, int] | None = None) -> list[str]:
    """``sh -c SCRIPT kbd-exec``: put it in front of the command's argv.
    ``hard``: the hard limits the command starts with (default: this
    process's; the broker passes its caller's)."""
    if limits is None:
        return [SHELL, "-c", 'exec "$@"', "kbd-exec"]
    own = {res: resource.getrlimit(res)[1] for _, _, res, _ in _RLIMITS}
    return [SHELL, "-c", ulimit_script(limits, {**own, **(hard or {})}), "kbd-exec"]


# Every limit a POSIX shell's ulimit (dash, bash, busybox) can lower, with its
# flag and the unit that flag counts in.
_LOWERABLE = {
    resource.RLIMIT_NOFILE: ("-n", 1),
    resource.RLIMIT_FSIZE: ("-f", 512),
    resource.RLIMIT_AS: ("-v", 1024),
    resource.RLIMIT_CPU: ("-t", 1),
    resource.RLIMIT_STACK: ("-s", 1024),
    resource.RLIMIT_CORE: ("-c", 512),
    resource.RLIMIT_DATA: ("-d", 1024),
    resource.RLIMIT_MEMLOCK: ("-l", 1024),
    resource.RLIMIT_NPROC: ("-p", 1),
}


def lower(a: int, b: int) -> int:
    """The lower of two rlimit values (RLIM_INFINITY is the highest)."""
    inf = resource.RLIM_INFINITY
    if a == inf:
        return b
    if b == inf:
        return a
    return min(a, b)


def _count(value: int, unit: int) -> str:
    return "unlimited" if value == resource.RLIM_INFINITY else str(value // unit)


def lowering_steps(wanted: Mapping[int, tuple[int, int]]) -> list[str]:
    """The ``ulimit`` steps that bring this process's limits (which a child
    inherits) down to ``wanted`` (soft, hard) — never up: a process may lower
    its own limits without privilege, which is how the broker gives a command
    its caller's limits (the daemon has no CAP_SYS_RESOURCE to prlimit
    another user's process, and must not lend its own raised ones)."""
    steps: list[str] = []
    for res, (soft, hard) in sorted(wanted.items()):
        if res not in _LOWERABLE:
            continue
        flag, unit = _LOWERABLE[res]
        own_soft, own_hard = resource.getrlimit(res)
        new_hard = lower(hard, own_hard)
        new_soft = lower(lower(soft, own_soft), new_hard)
        if new_soft != own_soft:
            steps.append(f"ulimit -S {flag} {_count(new_soft, unit)}")
        if new_hard != own_hard:
            steps.append(f"ulimit -H {flag} {_count(new_hard, unit)}")
    return steps

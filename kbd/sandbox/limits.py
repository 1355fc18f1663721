"""Resource limits every sandboxed command starts under (issue 9 item 6).

kbd uses no ``preexec_fn``: the rlimits are set by a POSIX shell step that runs
right before the command, inside the sandbox, and then ``exec``s it — the same
``sh -c 'exec "$@"'`` step the bubblewrap backend already used to get
conventional exit codes. ``ulimit`` without ``-H``/``-S`` sets the soft *and*
hard limit, so the command cannot raise them again; core dumps are always off.
"""

from __future__ import annotations

import resource
from typing import TYPE_CHECKING

if TYPE_CHECKING:
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
    for key, flag, res, unit in _RLIMITS:
        value = getattr(limits, key)
        if value is None:
            continue
        cap = hard.get(res, resource.RLIM_INFINITY)
        if cap != resource.RLIM_INFINITY:
            value = min(value, cap)
        steps.append(f"ulimit {flag} {max(1, value // unit)}")
    return " && ".join(steps) + ' || { echo "kbd: cannot set resource limits" >&2; exit 69; }; exec "$@"'


def shell_prefix(limits: LimitsConfig | None) -> list[str]:
    """``sh -c SCRIPT kbd-exec``: put it in front of the command's argv."""
    if limits is None:
        return [SHELL, "-c", 'exec "$@"', "kbd-exec"]
    hard = {res: resource.getrlimit(res)[1] for _, _, res, _ in _RLIMITS}
    return [SHELL, "-c", ulimit_script(limits, hard), "kbd-exec"]

"""The pure parts of docs/sandbox.md "Process containment" and "Resource limits": the ``limits:`` section of kbd.yaml,
how cgroup hierarchies are found (hybrid and pure v2), which limit files a
command's cgroup gets, the rlimit shell step, and when a backend must refuse."""

from __future__ import annotations

import resource
from pathlib import Path
from typing import Any

import pytest

from kbd.core.config import LimitsConfig, parse_config
from kbd.errors import ContainmentUnavailable, InvalidConfig
from kbd.sandbox import cgroup
from kbd.sandbox.limits import ulimit_script


def config(limits: Any) -> LimitsConfig:
    return parse_config({"host": "h", "limits": limits}, root=Path("/r"), source="kbd.yaml").limits


def test_limits_defaults_are_safe() -> None:
    d = parse_config({"host": "h"}, root=Path("/r")).limits
    assert d.pids_max == 512 and d.memory_max == 4 << 30 and d.file_size_max == 1 << 30
    assert d.open_files_max == 4096 and d.tmpfs_size == 512 << 20 and d.cpu_weight == 50


def test_limits_parse_sizes_and_null() -> None:
    got = config({"memory_max": "2G", "file_size_max": 10 << 20, "tmpfs_size": "64MiB", "pids_max": None})
    assert (got.memory_max, got.file_size_max, got.tmpfs_size, got.pids_max) == (
        2 << 30,
        10 << 20,
        64 << 20,
        None,
    )
    assert config({"cpu_max": 1.5}).cpu_max == 1.5


@pytest.mark.parametrize(
    ("limits", "words"),
    [
        ({"pid_max": 10}, ["limits", "pid_max"]),  # a typo is an error, never a silent default
        ({"memory_max": "lots"}, ["limits.memory_max", "'lots'", "512M"]),
        ({"memory_max": "1K"}, ["limits.memory_max", "between 1M"]),
        ({"pids_max": 2}, ["limits.pids_max", "between 8"]),
        ({"pids_max": "100"}, ["limits.pids_max", "whole number"]),
        ({"cpu_weight": 0}, ["limits.cpu_weight", "between 1 and 10000"]),
        ({"open_files_max": True}, ["limits.open_files_max"]),
        ("none", ["limits"]),
    ],
)
def test_limits_are_validated_strictly(limits: Any, words: list[str]) -> None:
    with pytest.raises(InvalidConfig) as err:
        config(limits)
    for w in words:
        assert w in err.value.message, err.value.message


HYBRID = """\
30 25 0:26 / /sys/fs/cgroup ro,nosuid,nodev,noexec shared:9 - tmpfs tmpfs ro,mode=755
31 30 0:27 / /sys/fs/cgroup/unified rw,nosuid,nodev,noexec,relatime shared:10 - cgroup2 cgroup2 rw
40 30 0:36 / /sys/fs/cgroup/pids rw,nosuid,nodev,noexec,relatime shared:20 - cgroup cgroup rw,pids
41 30 0:37 / /sys/fs/cgroup/memory rw,nosuid,nodev,noexec,relatime shared:21 - cgroup cgroup rw,memory
"""
PURE_V2 = (
    "35 24 0:30 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:9 - cgroup2 cgroup2 rw,nsdelegate\n"
)
CONTAINER = "35 24 0:30 /docker/abc /sys/fs/cgroup ro,relatime - cgroup2 cgroup2 rw\n"


CO_MOUNTED = (
    "42 30 0:38 / /sys/fs/cgroup/cpu,cpuacct rw,relatime shared:22 - cgroup cgroup rw,cpu,cpuacct\n"
    "43 30 0:39 / /sys/fs/cgroup/blkio rw,relatime shared:23 - cgroup cgroup rw,blkio\n"
    "44 30 0:40 / /sys/fs/cgroup/memro ro,relatime shared:24 - cgroup cgroup ro,memory\n"
)


def test_hierarchies_are_detected_not_assumed() -> None:
    v1 = {"pids": "/sys/fs/cgroup/pids", "memory": "/sys/fs/cgroup/memory"}
    assert cgroup.parse_mounts(HYBRID) == ("/sys/fs/cgroup/unified", v1)
    assert cgroup.parse_mounts(PURE_V2) == ("/sys/fs/cgroup", {})
    # A read-only bind of a sub-cgroup (some containers) cannot hold kbd's subtree.
    assert cgroup.parse_mounts(CONTAINER) == (None, {})
    assert cgroup.parse_mounts(r"1 2 0:3 / /mnt/cg\040v2 rw - cgroup2 cgroup2 rw") == ("/mnt/cg v2", {})
    # cpu co-mounted with cpuacct; unwanted controllers and read-only mounts are ignored.
    assert cgroup.parse_mounts(CO_MOUNTED) == (None, {"cpu": "/sys/fs/cgroup/cpu,cpuacct"})


def test_own_cgroup_paths() -> None:
    text = "9:name=systemd:/\n8:pids:/user.slice\n4:memory:/x\n3:cpu,cpuacct:/y\n0::/user.slice/session-3.scope\n"
    assert cgroup.parse_own(text) == (
        "/user.slice/session-3.scope",
        {"pids": "/user.slice", "memory": "/x", "cpu": "/y"},
    )
    assert cgroup.parse_own("0::/\n") == ("/", {})


def test_limit_files_follow_the_available_controllers() -> None:
    lim = LimitsConfig(pids_max=64, memory_max=1 << 30, cpu_weight=50, cpu_max=1.5)
    assert cgroup.v2_files(lim, frozenset({"pids", "memory", "cpu"})) == {
        "pids.max": "64", "memory.max": str(1 << 30), "cpu.weight": "50", "cpu.max": "150000 100000"
    }  # fmt: skip
    assert cgroup.v2_files(lim, frozenset()) == {}
    # Hybrid host: the controllers bound to v1 bound the command through its v1 cgroups instead.
    assert cgroup.v1_files(lim, ("pids",)) == [("pids.max", "64")]
    assert cgroup.v1_files(LimitsConfig(pids_max=None), ("pids",)) == []
    assert cgroup.v1_files(lim, ("memory",)) == [
        ("memory.limit_in_bytes", str(1 << 30)),
        ("memory.memsw.limit_in_bytes", str(1 << 30)),  # swap cannot bypass it (written where present)
        ("memory.oom_control", "0"),  # the OOM killer ends the command, even if the parent disables it
    ]
    assert cgroup.v1_files(lim, ("cpu",)) == [
        ("cpu.shares", "512"),  # weight 50 of 100 -> 512 of 1024
        ("cpu.cfs_period_us", "100000"),
        ("cpu.cfs_quota_us", "150000"),
    ]
    assert cgroup.v1_files(LimitsConfig(cpu_weight=1, cpu_max=0.001), ("cpu",))[::2] == [
        ("cpu.shares", "10"),
        ("cpu.cfs_quota_us", "1000"),  # the kernel's minimum quota
    ]
    assert cgroup.v1_files(LimitsConfig(memory_max=None, cpu_weight=None), ("memory", "cpu")) == []


def test_command_cgroup_names_are_checked() -> None:
    h = cgroup.Hierarchy("/sys/fs/cgroup/kbd", "/sys/fs/cgroup", frozenset(), (), None)
    assert (
        h.path("s_0123456789abcdef0123.42.deadbeef")
        == "/sys/fs/cgroup/kbd/s_0123456789abcdef0123.42.deadbeef"
    )
    for bad in ("../x", "s_0123456789abcdef0123.42.deadbeef/..", "", "kbd"):
        assert h.path(bad) is None


def test_only_the_landlock_backend_refuses_without_containment() -> None:
    for subreaper in (False, True):
        assert cgroup.uncontained_problem("bwrap", "no cgroup2", subreaper=subreaper) is None  # PID namespace
        assert cgroup.uncontained_problem("none", "no cgroup2", subreaper=subreaper) is None  # already warns
    assert cgroup.uncontained_problem("landlock", "no cgroup2", subreaper=True) is None  # the fallback
    problem = cgroup.uncontained_problem("landlock", "no cgroup2", subreaper=False)
    assert problem is not None and "no cgroup2" in problem and "refusing" in problem
    assert ContainmentUnavailable("x").exit_code == 69


def test_the_rlimit_step_sets_hard_limits_within_the_callers() -> None:
    inf = resource.RLIM_INFINITY
    lim = LimitsConfig(file_size_max=10 << 20, open_files_max=4096, address_space_max=None, cpu_time_max=60)
    script = ulimit_script(lim, {resource.RLIMIT_NOFILE: 1024, resource.RLIMIT_FSIZE: inf})
    assert script.startswith("ulimit -c 0 && ulimit -f 20480 && ulimit -n 1024 && ulimit -t 60 ||")
    assert script.endswith('exec "$@"') and "-v" not in script


def _v1(controller: str, *, usable: bool = True) -> cgroup.V1:
    mount = f"/v1/{controller}"
    if usable:
        return cgroup.V1((controller,), mount, f"{mount}/kbd", mount)
    return cgroup.V1((controller,), mount, None, None, "cannot use /v1/x/kbd: Read-only file system")


def test_doctor_never_claims_a_limit_without_a_command_cgroup() -> None:
    lim = LimitsConfig()
    hybrid = cgroup.Hierarchy("/u/kbd", "/u", frozenset(), (_v1("pids"),), None)
    assert cgroup.enforcement(lim, hybrid)["pids_max"].startswith("enforced: cgroup v1")
    assert cgroup.enforcement(lim, hybrid)["memory_max"].startswith("not enforceable here")
    none = cgroup.Hierarchy(None, None, frozenset(), (_v1("pids"),), "no cgroup2")
    assert all(
        cgroup.enforcement(lim, none)[k].startswith("not enforceable here")
        for k in ("pids_max", "memory_max", "cpu_weight")
    )
    pure = cgroup.Hierarchy("/c/kbd", "/c", frozenset({"pids", "memory", "cpu"}), (), None)
    assert cgroup.enforcement(lim, pure)["memory_max"] == f"enforced: cgroup v2 memory controller ({4 << 30})"


def test_doctor_reports_memory_and_cpu_enforced_through_v1() -> None:
    lim = LimitsConfig(cpu_max=1.5)
    hybrid = cgroup.Hierarchy("/u/kbd", "/u", frozenset(), (_v1("pids"), _v1("memory"), _v1("cpu")), None)
    got = cgroup.enforcement(lim, hybrid)
    assert got["memory_max"] == f"enforced: cgroup v1 memory hierarchy at /v1/memory ({4 << 30})"
    assert got["cpu_weight"] == "enforced: cgroup v1 cpu hierarchy at /v1/cpu (50)"
    assert got["cpu_max"] == "enforced: cgroup v1 cpu hierarchy at /v1/cpu (1.5)"


def test_a_configured_limit_fails_closed_when_its_v1_hierarchy_is_unusable() -> None:
    broken = cgroup.Hierarchy("/u/kbd", "/u", frozenset(), (_v1("pids"), _v1("memory", usable=False)), None)
    problem = cgroup.v1_problem(LimitsConfig(), broken)
    assert problem is not None and "limits.memory_max" in problem and "Read-only" in problem
    assert cgroup.enforcement(LimitsConfig(), broken)["memory_max"].startswith("REFUSED")
    # Lifted (null), the unusable controller is not needed: nothing to refuse.
    assert cgroup.v1_problem(LimitsConfig(memory_max=None), broken) is None
    cpu = cgroup.Hierarchy("/u/kbd", "/u", frozenset(), (_v1("cpu", usable=False),), None)
    assert "limits.cpu_weight" in (cgroup.v1_problem(LimitsConfig(), cpu) or "")
    assert "limits.cpu_max" in (cgroup.v1_problem(LimitsConfig(cpu_weight=None, cpu_max=2), cpu) or "")
    assert cgroup.v1_problem(LimitsConfig(cpu_weight=None), cpu) is None

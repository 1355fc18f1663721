"""The kbd root: where it is, and the rules of its config file (docs/on-disk.md).

Root precedence, highest first: ``--root`` argument → ``KBD_ROOT`` →
``$XDG_DATA_HOME/kbd`` → ``~/.local/share/kbd``. ``kbd.yaml`` (read by
:mod:`kbd.fs.rootconfig`) is validated strictly: an unknown key is an error
naming the key and the file, so a typo can never silently leave a safety switch
at its default.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kbd.core.identifiers import id_problem
from kbd.core.layout import CONFIG_NAME, STATE_DIR
from kbd.core.strict import (
    check_keys,
    expect_bool,
    expect_choice,
    expect_mapping,
    expect_number,
    expect_str,
    expect_str_list,
)
from kbd.errors import InvalidConfig

NETWORK_MODES = ("none", "host")
BACKENDS = ("auto", "bwrap", "landlock")


def default_root(environ: dict[str, str] | None = None) -> Path:
    env = os.environ if environ is None else environ
    if env.get("KBD_ROOT"):
        return Path(env["KBD_ROOT"])
    xdg = env.get("XDG_DATA_HOME")
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "kbd"
    return Path(env.get("HOME") or os.path.expanduser("~")) / ".local" / "share" / "kbd"


@dataclass(frozen=True)
class SandboxConfig:
    backend: str = "auto"
    network: str = "none"
    # Landlock alone cannot keep notes/_index.json read-only inside a writable
    # notes/ (docs/sandbox.md "Landlock alone"): write grants need an explicit, loudly named opt-in.
    unsafe_landlock_writes: bool = False
    unsafe_no_sandbox: bool = False
    # A group with no members that the daemon adds to the commands it sandboxes
    # (never to unsafe_no_sandbox ones): workflow folders are group-owned by it,
    # so a grant is usable at the Unix level only inside a sandbox. A name, kept
    # as text: the gid is looked up when a command starts (the core stays pure).
    grant_group: str | None = None
    # Report what a command's Landlock layers refused, where the kernel can (docs/sandbox.md
    # "Refusals the kernel reports"); false: kbd never asks Landlock to log.
    report_denials: bool = True


# Group names as groupadd accepts them (shadow-utils' default rule), checked
# without ``re``: the exec path parses this file and pays for every import.
_GROUP_FIRST = frozenset("abcdefghijklmnopqrstuvwxyz_")
_GROUP_REST = _GROUP_FIRST | frozenset("0123456789-")


def is_group_name(name: str) -> bool:
    return 0 < len(name) <= 32 and name[0] in _GROUP_FIRST and all(c in _GROUP_REST for c in name)


# notes_quota.max_files also bounds the post-command audit's walk of a notes/
# (it visits at most max_files + 1 entries), so its maximum keeps that bounded.
MAX_QUOTA_FILES = 50_000


@dataclass(frozen=True)
class NotesQuota:
    """Per source ``notes/``: bytes of regular files, and entries of any kind
    (files, folders, links: an inode quota)."""

    max_bytes: int = 256 * 1024 * 1024
    max_files: int = 10_000


@dataclass(frozen=True)
class NoteHistory:
    """Retention of note history (``note_history:`` in kbd.yaml; docs/notes.md "Note history"). Per note: at
    most ``max_versions`` versions, whose distinct
    contents add up to at most ``max_bytes``. Per source, across all its notes
    (deleted ones included): at most ``source_max_versions`` versions and
    ``source_max_bytes`` bytes, None meaning twice the source's
    ``notes_quota`` (``max_files``, ``max_bytes``) — see :meth:`source_caps`.
    The oldest go first; the newest version of a note that is still in
    ``notes/`` is always kept. A deleted note's history is dropped
    ``deleted_days`` after kbd first finds the note gone."""

    max_versions: int = 100
    max_bytes: int = 64 * 1024 * 1024
    source_max_versions: int | None = None
    source_max_bytes: int | None = None
    deleted_days: int = 30

    def source_caps(self, quota: NotesQuota) -> tuple[int, int]:
        """(versions, bytes) one source's whole history may keep: the settings,
        or twice what its ``notes/`` may hold."""
        versions = self.source_max_versions if self.source_max_versions is not None else 2 * quota.max_files
        size = self.source_max_bytes if self.source_max_bytes is not None else 2 * quota.max_bytes
        return versions, size


MAX_HISTORY_VERSIONS = 100_000
MAX_SOURCE_HISTORY_VERSIONS = 1_000_000
MAX_DELETED_DAYS = 3650


@dataclass(frozen=True)
class LimitsConfig:
    """Per-command resource limits (``limits:`` in kbd.yaml). None = no limit.

    The cgroup ones apply where the controller is usable (``kbd doctor`` says
    which); the rlimits always apply, and core dumps are always off. Sandboxed
    commands run as uid 0, which RLIMIT_NPROC exempts: ``pids_max`` is the
    fork-bomb bound, so it is not offered as an rlimit.
    """

    pids_max: int | None = 512  # cgroup pids.max (v2 or v1): processes + threads of one command
    memory_max: int | None = 4 << 30  # cgroup memory.max (v1: memory.limit_in_bytes + memsw), bytes
    cpu_weight: int | None = 50  # cgroup cpu.weight, 100 = ordinary (v1: cpu.shares = w*1024/100)
    cpu_max: float | None = None  # cgroup cpu.max (v1: cfs quota/period) in CPUs (1.5 = 1.5 cores)
    file_size_max: int | None = 1 << 30  # RLIMIT_FSIZE, bytes
    open_files_max: int | None = 4096  # RLIMIT_NOFILE
    address_space_max: int | None = None  # RLIMIT_AS, bytes (off: memory_max is the better bound)
    cpu_time_max: int | None = None  # RLIMIT_CPU, seconds
    tmpfs_size: int | None = 512 << 20  # the sandbox's /tmp and /dev/shm (bubblewrap), bytes


@dataclass(frozen=True)
class Config:
    root: Path
    host: str
    workflow_roots: tuple[Path, ...]
    folder_roots: tuple[Path, ...] = ()
    socket: Path | None = None
    lock_timeout: float = 10.0
    revoke_grace: float = 5.0
    revoke_immediately: bool = False
    request_expire_days: int = 14
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    notes_quota: NotesQuota = field(default_factory=NotesQuota)
    note_history: NoteHistory = field(default_factory=NoteHistory)
    limits: LimitsConfig = field(default_factory=LimitsConfig)

    @property
    def state_dir(self) -> Path:
        return self.root / STATE_DIR

    @property
    def socket_path(self) -> Path:
        return self.socket if self.socket is not None else self.state_dir / "run" / "kbd.sock"


_TOP_KEYS = (
    "host",
    "workflow_roots",
    "folder_roots",
    "socket",
    "locks",
    "sandbox",
    "revocation",
    "requests",
    "notes_quota",
    "note_history",
    "limits",
)

_SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE_KEYS = ("memory_max", "file_size_max", "address_space_max", "tmpfs_size")
_COUNT_KEYS = {"pids_max": (8, 1 << 22), "open_files_max": (64, 1 << 20), "cpu_time_max": (1, 1 << 31)}
_LIMIT_KEYS = (*_SIZE_KEYS, *_COUNT_KEYS, "cpu_weight", "cpu_max")
_MIN_SIZE = 1 << 20  # below 1 MiB nothing useful runs (a shell, the helper)


def _size(value: object, *, where: str, source: str) -> int:
    """Bytes from an integer or a string like ``512M`` / ``4G`` (binary units)."""
    allowed = "an integer number of bytes or a string like 512M or 4G (units K, M, G, T)"
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise InvalidConfig(f"{source}: {where} must be {allowed}, or null for no limit")
    if isinstance(value, str):
        text = value.strip().upper().removesuffix("B").removesuffix("I")
        digits, unit = (text[:-1], text[-1]) if text[-1:] in _SIZE_UNITS else (text, "")
        if not digits.isascii() or not digits.isdigit():
            raise InvalidConfig(f"{source}: {where} must be {allowed}, got {value!r}")
        value = int(digits) * _SIZE_UNITS[unit]
    if not _MIN_SIZE <= value <= 1 << 50:
        raise InvalidConfig(f"{source}: {where} must be between 1M and 1P bytes, got {value}")
    return int(value)


def _count(value: object, *, where: str, source: str, minimum: int, maximum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidConfig(f"{source}: {where} must be a whole number or null, got {value!r}")
    if not minimum <= value <= maximum:
        raise InvalidConfig(f"{source}: {where} must be between {minimum} and {maximum}, got {value}")
    return value


def parse_limits(data: object, *, source: str) -> LimitsConfig:
    """The ``limits:`` section; a missing key keeps its safe default, ``null`` lifts it."""
    doc = expect_mapping(data, where="limits", source=source)
    check_keys(doc, allowed=_LIMIT_KEYS, where="limits", source=source)
    values: dict[str, Any] = {}
    for key, raw in doc.items():
        where = f"limits.{key}"
        if raw is None:
            values[key] = None
        elif key in _SIZE_KEYS:
            values[key] = _size(raw, where=where, source=source)
        elif key in _COUNT_KEYS:
            lo, hi = _COUNT_KEYS[key]
            values[key] = _count(raw, where=where, source=source, minimum=lo, maximum=hi)
        elif key == "cpu_weight":
            values[key] = _count(raw, where=where, source=source, minimum=1, maximum=10000)
        else:  # cpu_max
            values[key] = expect_number(raw, where=where, source=source, minimum=0.01, maximum=4096)
    return LimitsConfig(**values)


def _abs_under(root: Path, value: str, *, where: str, source: str) -> Path:
    if not value or "\x00" in value:
        raise InvalidConfig(f"{source}: {where} must be a non-empty path without NUL")
    p = Path(value)
    return p if p.is_absolute() else root / p


def parse_config(data: object, *, root: Path, source: str = CONFIG_NAME) -> Config:
    """Validate the parsed kbd.yaml document. Raises InvalidConfig."""
    doc = expect_mapping(data, where="", source=source)
    check_keys(doc, allowed=_TOP_KEYS, where="", source=source)
    if "host" not in doc:
        raise InvalidConfig(f"{source}: missing required key host (this execution host's name)")
    host = expect_str(doc["host"], where="host", source=source)
    if problem := id_problem(host):
        raise InvalidConfig(f"{source}: host {problem}")
    roots_raw = expect_str_list(
        doc.get("workflow_roots", ["workflows"]), where="workflow_roots", source=source
    )
    if not roots_raw:
        raise InvalidConfig(f"{source}: workflow_roots must name at least one folder")
    roots = tuple(_abs_under(root, r, where="workflow_roots", source=source) for r in roots_raw)
    folder_raw = expect_str_list(doc.get("folder_roots", []), where="folder_roots", source=source)
    folders = tuple(_abs_under(root, r, where="folder_roots", source=source) for r in folder_raw)
    for f in folders:
        if f == Path("/"):
            raise InvalidConfig(f"{source}: folder_roots must not contain / (that approves everything)")
    sock = None
    if doc.get("socket") is not None:
        sock = _abs_under(
            root,
            expect_str(doc["socket"], where="socket", source=source),
            where="socket",
            source=source,
        )

    locks = expect_mapping(doc.get("locks", {}), where="locks", source=source)
    check_keys(locks, allowed=("timeout_seconds",), where="locks", source=source)
    timeout = expect_number(
        locks.get("timeout_seconds", 10),
        where="locks.timeout_seconds",
        source=source,
        minimum=0,
        maximum=3600,
    )

    sb = expect_mapping(doc.get("sandbox", {}), where="sandbox", source=source)
    check_keys(
        sb,
        allowed=(
            "backend",
            "network",
            "unsafe_landlock_writes",
            "unsafe_no_sandbox",
            "grant_group",
            "report_denials",
        ),
        where="sandbox",
        source=source,
    )
    backend = expect_choice(sb.get("backend", "auto"), BACKENDS, where="sandbox.backend", source=source)
    network = expect_choice(sb.get("network", "none"), NETWORK_MODES, where="sandbox.network", source=source)
    sandbox = SandboxConfig(
        backend=backend,
        network=network,
        unsafe_landlock_writes=expect_bool(
            sb.get("unsafe_landlock_writes", False),
            where="sandbox.unsafe_landlock_writes",
            source=source,
        ),
        unsafe_no_sandbox=expect_bool(
            sb.get("unsafe_no_sandbox", False), where="sandbox.unsafe_no_sandbox", source=source
        ),
        grant_group=_grant_group(sb.get("grant_group"), source=source),
        report_denials=expect_bool(
            sb.get("report_denials", True), where="sandbox.report_denials", source=source
        ),
    )

    quota = _notes_quota(doc.get("notes_quota", {}), source=source)
    rv = expect_mapping(doc.get("revocation", {}), where="revocation", source=source)
    check_keys(rv, allowed=("immediate", "grace_seconds"), where="revocation", source=source)
    rq = expect_mapping(doc.get("requests", {}), where="requests", source=source)
    check_keys(rq, allowed=("expire_days",), where="requests", source=source)
    return Config(
        root=root,
        host=host,
        workflow_roots=roots,
        folder_roots=folders,
        socket=sock,
        lock_timeout=timeout,
        revoke_grace=expect_number(
            rv.get("grace_seconds", 5),
            where="revocation.grace_seconds",
            source=source,
            minimum=0,
            maximum=600,
        ),
        revoke_immediately=expect_bool(
            rv.get("immediate", False), where="revocation.immediate", source=source
        ),
        request_expire_days=_count(
            rq.get("expire_days", 14), where="requests.expire_days", source=source, minimum=1, maximum=365
        ),
        sandbox=sandbox,
        notes_quota=quota,
        note_history=_note_history(doc.get("note_history", {}), source=source),
        limits=parse_limits(doc.get("limits", {}), source=source),
    )


def _grant_group(raw: object, *, source: str) -> str | None:
    if raw is None:
        return None
    name = expect_str(raw, where="sandbox.grant_group", source=source)
    if not is_group_name(name):
        raise InvalidConfig(
            f"{source}: sandbox.grant_group must be a group name (lower-case letters, digits, _ and -, "
            f"starting with a letter or _, at most 32 characters), not {name!r}"
        )
    return name


def _notes_quota(raw: object, *, source: str) -> NotesQuota:
    nq = expect_mapping(raw, where="notes_quota", source=source)
    check_keys(nq, allowed=("max_bytes", "max_files"), where="notes_quota", source=source)
    values = {}
    for key, top in (("max_bytes", 1 << 40), ("max_files", MAX_QUOTA_FILES)):
        value = nq.get(key, getattr(NotesQuota, key))
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= top:
            raise InvalidConfig(
                f"{source}: notes_quota.{key} must be a whole number from 1 to {top}, not {value!r}"
            )
        values[key] = value
    return NotesQuota(**values)


def _note_history(raw: object, *, source: str) -> NoteHistory:
    nh = expect_mapping(raw, where="note_history", source=source)
    keys = ("max_versions", "max_bytes", "source_max_versions", "source_max_bytes", "deleted_days")
    check_keys(nh, allowed=keys, where="note_history", source=source)
    values: dict[str, int] = {}
    bounds = {
        "max_versions": (1, MAX_HISTORY_VERSIONS, ""),
        "max_bytes": (1, 1 << 40, ""),
        "source_max_versions": (1, MAX_SOURCE_HISTORY_VERSIONS, " (default: twice notes_quota.max_files)"),
        "source_max_bytes": (1, 1 << 40, " (default: twice notes_quota.max_bytes)"),
        "deleted_days": (0, MAX_DELETED_DAYS, " (days a deleted note's history is kept; 0: until kbd "
                                              "finds it deleted)"),
    }  # fmt: skip
    for key in keys:
        if key not in nh:
            continue
        value = nh[key]
        low, top, default = bounds[key]
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= top:
            raise InvalidConfig(
                f"{source}: note_history.{key} must be a whole number from {low} to {top}{default}, "
                f"not {value!r}"
            )
        values[key] = value
    return NoteHistory(**values)

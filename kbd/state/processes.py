"""Running commands (docs/sandbox.md "Process containment"): the record each ``kbd exec`` keeps of the
command it runs. Ending those commands (session close, ``session revoke
--immediate``) is :mod:`kbd.sandbox.trees`'s, composed by the service layer
(:func:`kbd.service.sessions.running_commands`).

One small file per running command under ``<state>/procs/<sid>/``: written
without a database transaction or fsync, because it is advisory (every reader
re-checks that the process is still the same one) and sits on the exec path of
every shell command.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kbd.core.layout import BROKER_NAME
from kbd.core.records import JsonObject, Keys, Record

# Where a long-lived process keeps its spare record files: a name no session
# ID can take, so no reader of a session's records ever lists it.
SPARES = ".spare"


@dataclass(frozen=True)
class ProcessRow(Record):
    """The record of one running command. Its JSON is written by hand (docs/architecture.md "Typed
    operations"): it leaves out the session, the cgroup, liveness and the principal."""

    session_id: str
    pid: int
    pgid: int
    generation: int
    started_at: float
    argv: list[str]
    cgroup: str | None = None  # the per-command cgroup's name (kbd.sandbox.cgroup)
    alive: bool = True  # False: the main process is gone, its cgroup still holds processes
    # The principal the command was authorized as (None: the trusted local
    # operator): when it is disabled or loses its role, the daemon ends the command.
    principal: str | None = None

    def to_json(self) -> JsonObject:
        return {"pid": self.pid, "pgid": self.pgid, "generation": self.generation,
                "started_at": self.started_at, "argv": self.argv}  # fmt: skip

    @classmethod
    def from_json(cls, data: object, where: str = "") -> ProcessRow:
        """The record ``data`` spells; the session it runs in is unknown (empty), the rest defaults."""
        k = PROCESS_KEYS.read(cls, data, where)
        return cls("", k["pid"], k["pgid"], k["generation"], k["started_at"], k["argv"])

    @classmethod
    def json_schema(cls, defs: dict[str, JsonObject] | None = None) -> JsonObject:
        return PROCESS_KEYS.schema(cls, defs)


def process_keys() -> dict[str, Any]:
    """The keys of a running command's JSON and their types (see :class:`ProcessRow`)."""
    return {"pid": int, "pgid": int, "generation": int, "started_at": float, "argv": list[str]}


PROCESS_KEYS = Keys(process_keys)


class RunningCommands:
    """The records of commands running in a root's sessions, at ``<state>/procs``."""

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / "procs"
        # Empty files made ahead of time by a long-lived process (the daemon):
        # creating a file allocates an inode, which costs ~0.5 ms on some
        # hosts' disks; writing and renaming a spare costs ~0.06 ms, and a
        # brokered command's record is on its critical path.
        self._spares: list[Path] = []

    def make_spare(self) -> None:
        """One more empty record file for this process's next :meth:`add`
        (call it where the time does not count)."""
        folder = self.path / SPARES
        folder.mkdir(parents=True, exist_ok=True, mode=0o750)
        path = folder / f"{os.getpid()}.{os.urandom(6).hex()}"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o640)
        os.close(fd)
        self._spares.append(path)

    def drop_spares(self) -> None:
        """Remove this process's spares, and those of processes that are gone."""
        self._spares.clear()
        with contextlib.suppress(FileNotFoundError):
            for name in os.listdir(self.path / SPARES):
                owner = name.split(".", 1)[0]
                if owner == str(os.getpid()) or not os.path.exists(f"/proc/{owner}"):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(self.path / SPARES / name)

    def _write(self, path: Path, data: bytes) -> None:
        """Write the record at ``path``: through a spare when there is one."""
        while self._spares:
            try:
                spare = self._spares.pop()
            except IndexError:  # another thread took the last one
                break
            try:
                fd = os.open(spare, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
                try:
                    os.write(fd, data)
                finally:
                    os.close(fd)
                os.rename(spare, path)
                return
            except OSError:  # swept away meanwhile: try the next, or create
                continue
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o640)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)

    def _folder(self, sid: str) -> Path:
        return self.path / sid

    def add(
        self,
        sid: str,
        *,
        pid: int,
        generation: int,
        argv: list[str],
        started_at: float | None = None,
        principal: str | None,
        cgroup: str | None = None,
        broker: bool = False,
    ) -> None:
        """Record a running command; ``cgroup`` names the per-command cgroup that
        holds its whole process tree (kbd.sandbox.cgroup), so that close and
        revoke from another process can kill all of it; ``principal`` is who it
        was authorized as (None: the local operator; required, so a caller that
        forgets it fails loudly instead of exempting the command from revocation). ``broker``: the daemon
        started it in one of its launcher's stub cgroups (``b_…``), whose name
        cannot say the session."""
        folder = self._folder(sid)
        folder.mkdir(parents=True, exist_ok=True, mode=0o750)
        record = {"pid": pid, "pgid": pid, "generation": generation, "started_at": started_at or time.time(),
                  "boot_id": _boot_id(), "start_ticks": _start_ticks(pid), "argv": argv, "cgroup": cgroup,
                  "principal": principal}  # fmt: skip
        if broker:
            record["broker"] = True
        self._write(folder / f"{pid}.json", json.dumps(record).encode())

    def remove(self, sid: str, pid: int) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._folder(sid) / f"{pid}.json")

    def of_session(self, sid: str) -> list[ProcessRow]:
        """The records of ``sid`` made in this boot: ``alive`` when the recorded
        process is still the same one (boot ID and start time match: a recycled
        PID is never reported as alive). A record whose process is gone is
        returned (``alive`` False) only when it names a cgroup, whose tree may
        still run: the service asks :mod:`kbd.sandbox.trees` (when the recording
        ``kbd exec`` was killed, its PID must not be signalled)."""
        out = []
        try:
            names = os.listdir(self._folder(sid))
        except FileNotFoundError:
            return []
        for name in names:
            try:
                with open(self._folder(sid) / name, "rb") as fh:
                    r = json.loads(fh.read())
                cg = r.get("cgroup")
                if not (isinstance(cg, str) and (cg.startswith(f"{sid}.") or _stub_cgroup(r, cg))):
                    cg = None  # only this session's own command cgroups (or the daemon's stub's)
                who = r.get("principal")
                row = ProcessRow(sid, int(r["pid"]), int(r["pgid"]), int(r["generation"]), float(r["started_at"]),
                                 [str(a) for a in r["argv"]], cgroup=cg,
                                 principal=who if isinstance(who, str) else None)  # fmt: skip
            except (OSError, ValueError, KeyError, TypeError):
                continue
            if r.get("boot_id") != _boot_id():
                continue
            if r.get("start_ticks", -1) != -1 and r["start_ticks"] == _start_ticks(row.pid):
                out.append(row)
            elif row.cgroup is not None:
                out.append(replace(row, alive=False))
        return out


def _stub_cgroup(record: dict[str, object], name: str) -> bool:
    """A stub cgroup of the daemon's launcher, named in a record the daemon
    wrote (records are kbd-written; the state folder is 0750)."""
    return record.get("broker") is True and BROKER_NAME.fullmatch(name) is not None


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            return fh.read().strip()
    except OSError:
        return ""


def _start_ticks(pid: int) -> int:
    """Process start time in clock ticks since boot (/proc/PID/stat field 22):
    with the boot ID it tells a recorded process from a recycled PID."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read()
    except OSError:
        return -1
    return int(data.rsplit(b")", 1)[1].split()[19])

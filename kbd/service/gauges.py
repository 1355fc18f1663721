"""The host's state as numbers for the Prometheus metrics (operators only:
:func:`kbd.service.admin.may_see_metrics` decides who may ask)."""

from __future__ import annotations

from kbd.core.telemetry import HostGauges
from kbd.service.sessions import RootSessions, running_commands


def host_gauges(sessions: RootSessions, *, watcher_up: bool | None, started: float) -> HostGauges:
    """Open sessions, the commands running in them (each record re-checked:
    a finished command is not counted), the workflows the registry knows.
    The caller holds the daemon's state lock."""
    rows = sessions.store.rows()
    running = sum(len(running_commands(sessions.commands, row.id)) for row in rows)
    workflows = len(list(sessions.host.registry.ids()))
    return HostGauges(sessions_open=len(rows), commands_running=running, registry_workflows=workflows,
                      watcher_up=watcher_up, start_time=started)  # fmt: skip

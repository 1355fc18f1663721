"""The click commands, one module per command group (:mod:`kbd.cli.app` holds
the root group, the shared options and output). Importing this package
registers every command on :data:`kbd.cli.app.main`; then each command also
takes the global options after its name."""

from __future__ import annotations

from kbd.cli.app import accept_global_options, main, run
from kbd.cli.commands import (
    browse,
    frontends,
    host,
    notes,
    principals,
    readers,
    requests,
    sessions,
    sources,
    units,
    why,
    workflows,
    writers,
)

accept_global_options(main)

__all__ = [
    "browse",
    "frontends",
    "host",
    "main",
    "notes",
    "principals",
    "readers",
    "requests",
    "run",
    "sessions",
    "sources",
    "units",
    "why",
    "workflows",
    "writers",
]

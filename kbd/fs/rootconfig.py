"""The root's two config files on disk: reading ``kbd.yaml`` and
``principals.yaml`` (through the parse cache of :mod:`kbd.fs.datafiles`). What
each file may say is decided by the pure rules of :mod:`kbd.core.config` and
:mod:`kbd.core.principals`; a new token is :func:`kbd.service.principals.rotate_token`."""

from __future__ import annotations

from pathlib import Path

from kbd.core.config import Config, parse_config
from kbd.core.layout import CACHE_DIR, CONFIG_NAME, PRINCIPALS_NAME, STATE_DIR
from kbd.core.principals import Principals, parse_principals
from kbd.errors import RootError
from kbd.fs.datafiles import read_yaml_cached


def load_config(root: Path) -> Config:
    """Load ``<root>/kbd.yaml``. Raises RootError when the root has no config."""
    if not root.is_dir():
        raise RootError(f"kbd root {root} does not exist")
    path = root / CONFIG_NAME
    # Resolve the root once for display and canonical paths; the root is operator
    # configuration, trusted like a git repository's location.
    resolved = root.resolve()
    return read_yaml_cached(
        path,
        what=CONFIG_NAME,
        cache=root / STATE_DIR / CACHE_DIR / f"{CONFIG_NAME}.json",
        parse=lambda data: parse_config(data, root=resolved, source=str(path)),
    )


def load_principals(root: Path) -> Principals:
    path = root / PRINCIPALS_NAME
    return read_yaml_cached(
        path,
        what=PRINCIPALS_NAME,
        cache=root / STATE_DIR / CACHE_DIR / f"{PRINCIPALS_NAME}.json",
        parse=lambda data: parse_principals(data, source=str(path)),
    )

"""The root's two config files on disk: reading ``kbd.yaml`` and
``principals.yaml`` (through the parse cache of :mod:`kbd.fs.datafiles`) and
rewriting a principal's token. What each file may say is decided by the pure
rules of :mod:`kbd.core.config` and :mod:`kbd.core.principals`."""

from __future__ import annotations

import hashlib
from pathlib import Path

from kbd.core.config import Config, parse_config
from kbd.core.layout import CACHE_DIR, CONFIG_NAME, PRINCIPALS_NAME, STATE_DIR
from kbd.core.principals import Principals, parse_principals
from kbd.core.strict import load_yaml
from kbd.errors import NotFound, RootError
from kbd.fs.datafiles import read_text, read_yaml_cached


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


def issue_token(root: Path, pid: str, *, timeout: float) -> str:
    """Give ``pid`` a new bearer token: store only its SHA-256 in principals.yaml
    (atomically, under a lock) and return the token, which is shown once."""
    import secrets

    import yaml

    from kbd.fs.atomic import write_atomic
    from kbd.fs.locks import held  # filelock: only for writers, never on the exec path

    path = root / PRINCIPALS_NAME
    with held(root / STATE_DIR, "principals", str(path), timeout=timeout, what=PRINCIPALS_NAME):
        text = read_text(path, what=PRINCIPALS_NAME)
        doc = load_yaml(text, source=str(path))
        parse_principals(doc, source=str(path))  # refuse to rewrite an invalid file
        for entry in doc["principals"]:
            if entry["id"] == pid:
                break
        else:
            raise NotFound(f"unknown principal {pid!r}", hint="add it to principals.yaml first")
        token = "kbd_" + secrets.token_urlsafe(32)
        entry["token_sha256"] = hashlib.sha256(token.encode()).hexdigest()
        write_atomic(path, yaml.safe_dump(doc, sort_keys=False).encode(), mode=0o640)
    return token

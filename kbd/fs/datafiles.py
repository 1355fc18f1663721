"""Reading the YAML files kbd validates, and finding the data files it ships.

The rules that validate each document are pure functions in ``kbd/core``
(:func:`kbd.core.policy.parse_policy`, :func:`kbd.core.injection.parse_rules`,
...); this module only reads: a file's text, a YAML document through a JSON
parse cache (so ``kbd exec`` never imports YAML), and the two shipped policy
tables (``policies/consumer_kinds.yaml``, ``policies/injection.yaml``), each
parsed once per process.
"""

from __future__ import annotations

import functools
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from kbd.core.layout import CACHE_DIR, racy
from kbd.core.policy import KindPolicy, kind, parse_policy
from kbd.core.strict import load_yaml
from kbd.errors import InvalidConfig, RootError

if TYPE_CHECKING:
    from kbd.core.injection import Rule

KINDS_NAME = "consumer_kinds.yaml"
INJECTION_NAME = "injection.yaml"

T = TypeVar("T")


def read_text(path: Path, *, what: str) -> str:
    """The UTF-8 text of ``path``: RootError when it is missing (a root without
    its config), InvalidConfig when it cannot be read or decoded, or is not a
    regular file (a FIFO must not hang the daemon's refresh or a shell's TAB
    completion; a device is no config)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK)
    except FileNotFoundError as exc:
        raise RootError(f"{what} not found at {path}") from exc
    except OSError as exc:
        raise InvalidConfig(f"{what} at {path} is unreadable: {exc}") from exc
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise InvalidConfig(
                f"{what} at {path} is not a regular file", hint="replace it with the file itself"
            )
        os.set_blocking(fd, True)
        with open(fd, encoding="utf-8", closefd=False) as fh:
            return fh.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidConfig(f"{what} at {path} is unreadable: {exc}") from exc
    finally:
        os.close(fd)


def _plain(value: object) -> bool:
    """Only JSON-native values are cached: a YAML date or tag must be re-parsed
    (and rejected) exactly as the first time, never smuggled through as text."""
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    if isinstance(value, list):
        return all(_plain(v) for v in value)
    return value is None or isinstance(value, str | bool | int | float)


def read_yaml_cached(path: Path, *, what: str, cache: Path | None, parse: Callable[[Any], T]) -> T:
    """``parse`` applied to the YAML document at ``path``, which comes from a JSON
    cache under state/ when the file's stat signature is unchanged (``kbd exec``
    then never imports YAML).

    The cache only skips YAML parsing: ``parse`` validates the document every
    time. A document that ``parse`` rejects is never cached, so refusing a bad
    config leaves the root byte-identical.
    """
    import json
    import time

    try:
        st = os.stat(path)
    except FileNotFoundError as exc:
        raise RootError(f"{what} not found at {path}") from exc
    except OSError as exc:
        raise InvalidConfig(f"{what} at {path} is unreadable: {exc.strerror}") from exc
    sig = [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]
    fresh = not racy(st, time.time_ns())
    if cache is not None and fresh:
        try:
            with open(cache, "rb") as fh:
                doc = json.loads(fh.read())
            if doc.get("sig") == sig:
                return parse(doc["data"])
        except (OSError, ValueError, AttributeError, KeyError):
            pass
    data = load_yaml(read_text(path, what=what), source=str(path))
    parsed = parse(data)
    if cache is not None and fresh and _plain(data):
        from kbd.fs.atomic import ensure_private_dir, write_atomic

        try:
            ensure_private_dir(cache.parent)
            write_atomic(cache, json.dumps({"sig": sig, "data": data}).encode(), mode=0o640)
        except OSError:
            pass  # an unwritable cache only costs speed
    return parsed


def data_path(package: str, folder: str, name: str) -> Path:
    """A shipped data file: in the installed package (``kbd.<package>``), else in
    the source tree's top-level ``folder`` (editable installs)."""
    source_tree = Path(__file__).resolve().parents[2] / folder / name
    if source_tree.exists():
        return source_tree  # a source checkout (editable install): no importlib.resources import
    import importlib.resources

    return Path(str(importlib.resources.files(f"kbd.{package}").joinpath(name)))


def policy_path(name: str) -> Path:
    return data_path("policies", "policies", name)


_cache_dir: Path | None = None


def use_cache(state_dir: Path) -> None:
    """Let :func:`consumer_kinds` keep its parsed YAML under ``state/cache`` (speeds ``kbd exec``)."""
    global _cache_dir
    _cache_dir = state_dir / CACHE_DIR


@functools.cache
def consumer_kinds() -> dict[str, KindPolicy]:
    """The consumer-kind table of ``policies/consumer_kinds.yaml``, validated."""
    cache = _cache_dir / f"{KINDS_NAME}.json" if _cache_dir is not None else None
    return read_yaml_cached(
        policy_path(KINDS_NAME),
        what=f"policies/{KINDS_NAME}",
        cache=cache,
        parse=lambda data: parse_policy(data, source=f"policies/{KINDS_NAME}"),
    )


def consumer_kind(name: str) -> KindPolicy:
    """The policy of consumer kind ``name``; InvalidInput for an unknown kind."""
    return kind(consumer_kinds(), name)


@functools.cache
def injection_rules() -> tuple[Rule, ...]:
    """The injection gate's rules from ``policies/injection.yaml``, validated."""
    # Imported here: the gate's module builds tables at import, which only
    # writers of notes need (never ``kbd exec`` before its command runs).
    from kbd.core.injection import parse_rules

    return read_yaml_cached(
        policy_path(INJECTION_NAME),
        what=f"policies/{INJECTION_NAME}",
        cache=None,
        parse=lambda data: parse_rules(data, source=f"policies/{INJECTION_NAME}"),
    )

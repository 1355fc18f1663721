"""Shared fixtures. Every test builds its own temporary root; none touches a real
kbd root or the user's home (HOME, XDG_* and KBD_* are pointed into tmp)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from tests.helpers import KbRoot

settings.register_profile(
    "ci",
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    print_blob=True,
)
settings.register_profile(
    "dev",
    max_examples=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.register_profile(
    "nightly",
    max_examples=5000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True)
def _isolated_env(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path_factory.mktemp("home")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("XDG_DATA_HOME", str(home / ".local" / "share"))
    for var in ("KBD_ROOT", "KBD_AS"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def kb(tmp_path: Path) -> Iterator[KbRoot]:
    """An initialised root with principals alice, bob, carol, dave (users), root-admin
    ``ops`` (admin), ``svc`` (service) and disabled ``mallory``; no workflows."""
    yield KbRoot.create(tmp_path / "root")

"""Shared fixtures. Every test builds its own temporary root; none touches a real
kbd root or the user's home (HOME, XDG_* and KBD_* are pointed into tmp)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from tests import features
from tests.helpers import EXEC_MODES, KbRoot, exec_mode_for

# The throwaway host user fixture (``user``) for the multi-user tests of any folder.
pytest_plugins = ["tests.integration.hostusers"]

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
# `make check` (README "Development"): the same properties, fewer examples, so
# the unit tier stays well inside its minute; `make test` keeps "ci".
settings.register_profile(
    "quick",
    max_examples=20,
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


def pytest_configure(config: pytest.Config) -> None:
    for marker, needs in features.PROBES.items():
        config.addinivalue_line("markers", f"{marker}: {needs}; skipped only where the host lacks it")
    config.addinivalue_line(
        "markers",
        "in_process_only(why): a test of the in-process exec's own mechanics (its cgroup preparation, a "
        "killed recorder); in a module parametrized over exec_mode it runs in_process only",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Drop the brokered variant of ``in_process_only`` tests (never a skip: the
    test does not exist on a path whose mechanics it does not describe)."""
    kept: list[pytest.Item] = []
    dropped: list[pytest.Item] = []
    for item in items:
        callspec = getattr(item, "callspec", None)
        brokered = callspec is not None and callspec.params.get("exec_mode") == "brokered"
        (dropped if brokered and item.get_closest_marker("in_process_only") else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
    # A checkout other users cannot reach is not a host that lacks a feature: it is fixable, so
    # the run stops once, up front, saying how (not dozens of failures about a virtualenv).
    wanted = os.geteuid() == 0 and any(i.get_closest_marker("requires_reachable_checkout") for i in items)
    if wanted and (why := features.missing_reachable_checkout()) is not None:
        raise pytest.UsageError(f"the multi-user tests cannot run from here: {why}")


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Skip a ``requires_*`` test only where a real probe shows the host lacks the
    feature, with the probe's reason; under KBD_REQUIRE_ALL_FEATURES=1 (CI) fail
    instead, so no security test silently stops running."""
    for marker in features.PROBES:
        mark = item.get_closest_marker(marker)
        if mark is None:
            continue
        why = features.missing(marker, int(mark.kwargs.get("abi", 1)))
        if why is None:
            continue
        if features.require_all():
            pytest.fail(f"{marker}: {why} ({features.REQUIRE_ALL_ENV}=1: this host must provide it)", False)
        pytest.skip(f"{marker}: {why}")


@pytest.fixture(autouse=True)
def _isolated_env(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path_factory.mktemp("home")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("XDG_DATA_HOME", str(home / ".local" / "share"))
    for var in ("KBD_ROOT", "KBD_AS"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture(scope="module", params=EXEC_MODES)
def exec_mode(request: pytest.FixtureRequest) -> str:
    """How `kbd exec` runs: in-process, or brokered by a real daemon (docs/daemon.md).
    A module that uses it runs every test on both paths; its module-scoped
    worlds wrap themselves in :func:`tests.helpers.exec_mode_for`."""
    return str(request.param)


@pytest.fixture
def kb(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[KbRoot]:
    """An initialised root with principals alice, bob, carol, dave (users), root-admin
    ``ops`` (admin), ``svc`` (service) and disabled ``mallory``; no workflows.
    In a test that uses ``exec_mode``, its `kbd exec` calls run in that mode."""
    root = KbRoot.create(tmp_path / "root")
    if "exec_mode" not in request.fixturenames:
        yield root
        return
    with exec_mode_for(root, request.getfixturevalue("exec_mode")):
        yield root

"""The unit tests mirror the package (docs/architecture.md "Layers"): a module under
``tests/unit/<package>/`` is ``test_<module>.py`` for a module ``kbd/<package>/<module>.py``
that exists, so a reader finds a module's tests by its path and a moved or
renamed module cannot leave its tests under a stale name. Tests of a property
that spans modules stay at the top of ``tests/unit/`` under a name that says
what they protect."""

from __future__ import annotations

from pathlib import Path

import kbd

UNIT = Path(__file__).resolve().parent
PACKAGE = Path(kbd.__file__).resolve().parent


def test_every_mirrored_test_module_names_an_existing_module() -> None:
    mirrored = sorted(p for p in UNIT.glob("*/test_*.py"))
    assert mirrored, "no mirrored unit tests found"
    stale = [
        str(p.relative_to(UNIT))
        for p in mirrored
        if not (PACKAGE / p.parent.name / f"{p.stem.removeprefix('test_')}.py").is_file()
    ]
    assert stale == [], f"unit tests named after no module of kbd/: {stale}"


def test_every_mirrored_folder_is_a_package_of_kbd() -> None:
    folders = sorted(p.name for p in UNIT.iterdir() if p.is_dir() and p.name != "__pycache__")
    assert [f for f in folders if not (PACKAGE / f / "__init__.py").is_file()] == []
    assert all((UNIT / f / "__init__.py").is_file() for f in folders)

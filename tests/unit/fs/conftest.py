"""Fixtures of the kbd/fs tests."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def traversable() -> Iterator[Path]:
    """A fresh folder every user may traverse (pytest's tmp_path lies beneath a
    0700 one), for a test that opens files as another user."""
    base = Path(tempfile.mkdtemp(prefix="kbd-fs-", dir="/tmp"))
    os.chmod(base, 0o755)  # noqa: S103 - another user traverses it
    try:
        yield base
    finally:
        shutil.rmtree(base)

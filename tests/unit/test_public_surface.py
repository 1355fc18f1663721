"""kbd's declared public surface: ``__all__`` of the host library
(kbd/client/, defined in kbd/client/library.py) and of the error tree (kbd/errors/). Every name there exists,
is documented (its own docstring, or named in its module's docstring, as the
error classes are in the tree drawn there), and the error tree is exported
whole, so a host can catch any error kbd raises by a name kbd promises."""

from __future__ import annotations

import inspect
import re
from types import ModuleType

import pytest

from kbd import client, errors
from kbd.errors import KbdError

SURFACES = [client, errors]


def _documented(module: ModuleType, name: str) -> bool:
    value = getattr(module, name)
    own = value.__dict__.get("__doc__") if inspect.isclass(value) else getattr(value, "__doc__", None)
    if (inspect.isclass(value) or inspect.isfunction(value)) and own and own.strip():
        return True
    return re.search(rf"\b{re.escape(name)}\b", module.__doc__ or "") is not None


@pytest.mark.parametrize("module", SURFACES, ids=lambda m: m.__name__)
def test_every_exported_name_exists_and_is_documented(module: ModuleType) -> None:
    exported = module.__all__
    assert len(set(exported)) == len(exported), "a name is exported twice"
    assert [n for n in exported if not hasattr(module, n)] == []
    assert [n for n in exported if not _documented(module, n)] == []
    # Defined in the package, not re-exported from elsewhere: the surface is its own.
    for name in exported:
        value = getattr(module, name)
        if inspect.isclass(value) or inspect.isfunction(value):
            assert value.__module__.startswith(module.__name__), name


def test_the_whole_error_tree_is_exported() -> None:
    tree = {n for n, v in vars(errors).items() if inspect.isclass(v) and issubclass(v, KbdError)}
    assert tree <= set(errors.__all__), sorted(tree - set(errors.__all__))


def test_the_client_docstring_uses_only_the_surface() -> None:
    """The usage example at the top of kbd/client/ imports what __all__ promises."""
    assert client.__doc__ is not None
    imported = re.findall(r"from kbd\.client import (\w+)", client.__doc__)
    assert imported and set(imported) <= set(client.__all__), imported


def test_the_client_package_exports_what_its_library_defines() -> None:
    """kbd.client imports its library lazily (the lean exec path imports the
    package for kbd.client.brokered and must not pay for httpx): both promise
    the same names."""
    from kbd.client import library

    assert client.__all__ == library.__all__

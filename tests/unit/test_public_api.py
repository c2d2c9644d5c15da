"""The public surface: the package root, ``slurm_ckpt.dcp``, ``slurm_ckpt.sharded`` and the
integration modules; each ``__all__`` says exactly what it is, and docs/api.md lists it."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import types
from pathlib import Path

import pytest

import slurm_ckpt
import slurm_ckpt.integrations

INCLUDED_PRIVATE = {"__version__"}


def test_all_is_sorted_and_lists_every_public_name() -> None:
    for name in slurm_ckpt.__all__:
        getattr(slurm_ckpt, name)  # the lazily imported ones too
    assert set(slurm_ckpt.__all__) <= set(dir(slurm_ckpt))
    public = {
        name
        for name, value in vars(slurm_ckpt).items()
        if (not name.startswith("_") or name in INCLUDED_PRIVATE)
        and not isinstance(value, types.ModuleType)  # submodules are imported, not exported
        and name != "annotations"  # from __future__ import annotations
    }
    assert slurm_ckpt.__all__ == sorted(slurm_ckpt.__all__)
    assert len(set(slurm_ckpt.__all__)) == len(slurm_ckpt.__all__)
    assert set(slurm_ckpt.__all__) == public


def test_every_exported_name_resolves_and_is_documented() -> None:
    for name in slurm_ckpt.__all__:
        obj = getattr(slurm_ckpt, name)
        if callable(obj):
            assert obj.__doc__, f"slurm_ckpt.{name} has no docstring"


def test_design_names_are_exported() -> None:
    from slurm_ckpt import Checkpointer

    for attr in ("save", "save_async", "load_latest", "preempted"):
        assert hasattr(Checkpointer, attr)


# The public subpackages: the docs send users to them, so they are held to the same rule.
SUBPACKAGES = ["slurm_ckpt.dcp", "slurm_ckpt.sharded"]
INTEGRATIONS = sorted(m.name for m in pkgutil.iter_modules(slurm_ckpt.integrations.__path__) if not m.name.startswith("_"))
API_DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"


def _bound_public_names(module: types.ModuleType) -> set[str]:
    return {
        name
        for name, value in vars(module).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType) and name != "annotations"
    }


def _check_all(module: types.ModuleType, public: set[str]) -> None:
    assert module.__all__ == sorted(module.__all__), f"{module.__name__}.__all__ is not sorted"
    assert set(module.__all__) == public, f"{module.__name__}.__all__ is not its public names"
    doc = API_DOC.read_text()
    for name in module.__all__:
        obj = getattr(module, name)
        assert obj.__doc__, f"{module.__name__}.{name} has no docstring"
        assert f"`{name}`" in doc, f"{module.__name__}.{name} is not listed in docs/api.md"


@pytest.mark.parametrize("name", SUBPACKAGES)
def test_a_public_subpackage_exports_exactly_its_public_names(name: str) -> None:
    module = importlib.import_module(name)
    assert module.__doc__ and "internal" in module.__doc__  # says which of its modules are not API
    _check_all(module, _bound_public_names(module))
    assert f"`{name}`" in API_DOC.read_text()


def test_the_integrations_package_names_each_public_module_and_exports_none() -> None:
    pkg = slurm_ckpt.integrations
    assert pkg.__all__ == []  # importing one would import its framework
    assert _bound_public_names(pkg) == set()
    assert INTEGRATIONS
    for name in INTEGRATIONS:
        assert f"slurm_ckpt.integrations.{name}" in (pkg.__doc__ or "")
        assert f"`slurm_ckpt.integrations.{name}`" in API_DOC.read_text()


@pytest.mark.parametrize("name", INTEGRATIONS)
def test_an_integration_exports_the_classes_and_functions_it_defines(name: str) -> None:
    module = pytest.importorskip(f"slurm_ckpt.integrations.{name}")
    # Its framework's names are imported into it; what it defines itself is its API.
    defined = {
        n
        for n, v in vars(module).items()
        if not n.startswith("_") and (inspect.isclass(v) or inspect.isfunction(v)) and v.__module__ == module.__name__
    }
    _check_all(module, defined)


def test_every_top_level_name_is_listed_in_the_api_docs() -> None:
    doc = API_DOC.read_text()
    assert [n for n in slurm_ckpt.__all__ if f"`{n}`" not in doc] == []

"""The package root is the only public surface, and ``__all__`` says exactly what it is."""

from __future__ import annotations

import types

import slurm_ckpt

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

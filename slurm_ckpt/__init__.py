"""slurm-ckpt: crash-safe, fast, Slurm-aware checkpointing.

The package root is the public surface::

    from slurm_ckpt import Checkpointer
    ckpt = Checkpointer()
    state = ckpt.load_latest()
    ckpt.save(state, step=n)

with three public subpackages, each with its own ``__all__``:
:mod:`slurm_ckpt.dcp` (a DCP storage backend), :mod:`slurm_ckpt.sharded`
(DTensor states at any world size) and :mod:`slurm_ckpt.integrations`
(Lightning, Hugging Face). Every other module is internal.
"""

from __future__ import annotations

import typing

from .config import Config, load_config, parse_size
from .errors import (
    CheckpointCorrupt,
    ConfigError,
    LockHeld,
    NoCheckpoint,
    NoSpace,
    ShardError,
    SlurmCkptError,
    SlurmError,
    SnapshotChanged,
    StorageError,
    StorageHung,
    UnsafeLoad,
    UnsupportedValue,
)

if typing.TYPE_CHECKING:
    from .checkpointer import Checkpointer, SaveHandle
    from .loopstate import ResumableSampler, rng_state, set_rng_state

__version__ = "0.3.0"

# name -> the module that defines it.
_LAZY = {
    "Checkpointer": "checkpointer",
    "ResumableSampler": "loopstate",
    "SaveHandle": "checkpointer",
    "rng_state": "loopstate",
    "set_rng_state": "loopstate",
}


def __getattr__(name: str) -> typing.Any:
    # Imported on first use: the Checkpointer brings in the engine and the
    # stores, the loop state brings in torch, and the node hooks, which run
    # before every job, use neither.
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})

__all__ = [
    "CheckpointCorrupt",
    "Checkpointer",
    "Config",
    "ConfigError",
    "LockHeld",
    "NoCheckpoint",
    "NoSpace",
    "ResumableSampler",
    "SaveHandle",
    "ShardError",
    "SlurmCkptError",
    "SlurmError",
    "SnapshotChanged",
    "StorageError",
    "StorageHung",
    "UnsafeLoad",
    "UnsupportedValue",
    "__version__",
    "load_config",
    "parse_size",
    "rng_state",
    "set_rng_state",
]

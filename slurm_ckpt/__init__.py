"""slurm-ckpt: crash-safe, fast, Slurm-aware checkpointing.

The package root is the only public surface::

    from slurm_ckpt import Checkpointer
    ckpt = Checkpointer()
    state = ckpt.load_latest()
    ckpt.save(state, step=n)
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
    UnsafeLoad,
    UnsupportedValue,
)

if typing.TYPE_CHECKING:
    from .checkpointer import Checkpointer, SaveHandle

__version__ = "0.1.0"

_LAZY = ("Checkpointer", "SaveHandle")


def __getattr__(name: str) -> typing.Any:
    # Imported on first use: the Checkpointer brings in the engine and the
    # stores, and the node hooks, which run before every job, never use it.
    if name in _LAZY:
        from . import checkpointer

        value = getattr(checkpointer, name)
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
    "SaveHandle",
    "ShardError",
    "SlurmCkptError",
    "SlurmError",
    "SnapshotChanged",
    "StorageError",
    "UnsafeLoad",
    "UnsupportedValue",
    "__version__",
    "load_config",
    "parse_size",
]

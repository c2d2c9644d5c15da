"""slurm-ckpt: crash-safe, fast, Slurm-aware checkpointing.

The package root is the only public surface::

    from slurm_ckpt import Checkpointer
    ckpt = Checkpointer()
    state = ckpt.load_latest()
    ckpt.save(state, step=n)
"""

from __future__ import annotations

from .checkpointer import Checkpointer, SaveHandle
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

__version__ = "0.1.0"

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

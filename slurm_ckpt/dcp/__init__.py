"""A ``torch.distributed.checkpoint`` (DCP) storage backend with slurm-ckpt's guarantees.

::

    import torch.distributed.checkpoint as dcp
    from slurm_ckpt.dcp import StorageReader, StorageWriter

    dcp.save(state, storage_writer=StorageWriter(run_dir, step=step))
    dcp.load(state, storage_reader=StorageReader(run_dir))   # the newest valid checkpoint

What DCP's own ``FileSystemWriter`` does not give, and these do: a checkpoint
appears whole or not at all (temp dir, fsync of every file, manifest last,
atomic rename, fsync of the run dir); every file and every block of every
stored chunk has a crc32 that loads verify; a run dir of ``step-N``
checkpoints with newest-valid discovery and retention, which ``slurm-ckpt
ls``, ``verify`` and ``resume`` understand; the engine's parallel ``O_DIRECT``
writes. Loads reshard to any world size through DCP's planner, and each rank
reads only the blocks holding its part of each tensor.

The public names are the two in ``__all__``, imported from ``slurm_ckpt.dcp``;
its modules (``chunks``, ``index``, ``plain``, ``plan``, ``ranged``,
``reader``, ``writer``) are internal and may change between releases. The on-disk layout
is described in ``index.py`` and in the docs' on-disk format page. Importing
this package imports torch.
"""

from __future__ import annotations

from .reader import StorageReader
from .writer import StorageWriter

__all__ = ["StorageReader", "StorageWriter"]

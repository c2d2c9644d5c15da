"""``python -m bench`` (``slurm-ckpt bench`` in a checkout): our engine against torch.save, DCP, safetensors, the raw disk
and, for background saves, the memcpy floor.

Everything runs in one process, on one directory, interleaved: repetition 1
of every method, then repetition 2, and so on, so a disk that speeds up or
slows down during the run (shared machines do) affects every method alike.
Within a repetition the methods run in an order shuffled anew each time
(seeded, so a run can be repeated), so that no method always follows the same
one, whatever that one leaves behind: a disk still busy with its buffered
writes, or memory it has just freed, which on a VM whose balloon reports free
memory to the host is fast to fault in again only for a short while.
Each figure is the median of the repetitions, and is only ever shown as a
ratio to another figure measured in the same run.

The state is shaped like a transformer plus its Adam state (``state.py``).
Before each load the page cache is dropped (``/proc/sys/vm/drop_caches`` as
root, else ``POSIX_FADV_DONTNEED`` on the files), so loads read the disk.
A background save's stall is set against the sync save and against the floor
of an exact snapshot: one memcpy of the state into a reused buffer.

Modules: ``run`` (the methods and their order), ``state`` (what is saved),
``disk`` (the raw limit, the cold cache), ``peers`` (torch.save, DCP,
safetensors), ``report`` (the table and chart), ``scripts`` (what the
scripts here share), ``sharded`` (``--sharded``: an FSDP2 state over
several ranks against ``dcp.save``/``dcp.load``).
"""

from __future__ import annotations

from .report import format_table, plot
from .run import Result, run_bench

__all__ = ["Result", "format_table", "plot", "run_bench"]

"""Snapshot modes: how ``save_async`` keeps later changes out of the checkpoint.

:func:`choose_mode` decides, from facts the engine gathers, and one module per
mode makes the job (``engine/job.py``) that the commit writes:

``sync``     (``Checkpointer.save``) the tensors in place: the caller waits.
``copy``     a copy into the staging buffer before returning (``auto``'s usual choice).
``fork``     a forked child writes from a copy-on-write image (``auto`` when no copy fits).
``overlap``  opt-in: the large tensors copied behind the trainer, under a guard.
"""

from __future__ import annotations

from .choice import Facts, choose_mode
from .copy import copy_job
from .fork import fork_job
from .overlap import overlap_job
from .sync import sync_job

__all__ = ["Facts", "choose_mode", "copy_job", "fork_job", "overlap_job", "sync_job"]

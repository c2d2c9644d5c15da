"""The synchronous save (``Checkpointer.save``): written from the trainer's tensors in place.

The caller waits for the write, so nothing needs freezing: the tensors are
written from their own memory (``writer.py``). A non-contiguous tensor is
made contiguous first, and CUDA tensors go through the staging buffer, as
``copy`` does, since they must reach host memory to be written.
"""

from __future__ import annotations

from ...store.codec import EncodedState, TensorEntry
from ..job import ImageJob, WriteImage
from ..layout import plan_file
from ..staging import Staging, is_cuda

__all__ = ["contiguous", "sync_job"]


def sync_job(enc: EncodedState, staging: Staging, write: WriteImage) -> ImageJob:
    """A job writing ``enc``'s tensors where they are (CUDA ones: from staging)."""
    if any(is_cuda(e.tensor) for e in enc.tensors):
        return ImageJob(enc, staging.capture(enc.tensors), write, "sync")
    enc.tensors = [contiguous(e) for e in enc.tensors]
    return ImageJob(enc, plan_file(enc.tensors), write, "sync")  # plan_file puts enc.tensors in file order


def contiguous(e: TensorEntry) -> TensorEntry:
    """``e``, or a copy of it whose tensor is contiguous (the file holds tensors packed)."""
    t = e.tensor
    if t.is_contiguous():
        return e
    return TensorEntry(e.key, t.contiguous(), e.dtype, e.shape)

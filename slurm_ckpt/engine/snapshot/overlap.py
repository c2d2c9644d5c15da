"""The opt-in ``overlap`` snapshot: copy the small tensors, return, copy the large ones behind the trainer.

The large tensors are copied into the staging buffer on a thread while the
trainer runs its next forward and backward pass. ``optimizer.step()`` waits
for the copy by itself; an in-place torch op on a large tensor that ends
before the copy does fails the save (``guard.py``, which also says what the
guard cannot see). CPU tensors only: ``choose_mode`` stages CUDA ones.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ...errors import SnapshotChanged
from ...store.codec import EncodedState
from .. import guard
from ..job import ImageJob, WriteImage
from ..layout import FileImage
from ..staging import Pair, Staging, copy_pairs

__all__ = ["overlap_job"]

log = logging.getLogger("slurm_ckpt")


def overlap_job(enc: EncodedState, staging: Staging, write: WriteImage, caught: Callable[[], None]) -> ImageJob:
    """A job whose large tensors are still being copied when this returns.

    ``caught`` is called when the copy finds a tensor changed while it ran,
    before the save fails with :class:`SnapshotChanged`.
    """
    image, pairs = staging.prepare(enc.tensors)
    # Small tensors now: the buffers that kernels change without a version
    # bump are among them, and together they are a sliver of the bytes.
    now: list[Pair] = []
    later: list[Pair] = []
    for e, dst in pairs:
        (later if e.nbytes >= guard.SMALL and guard.trackable(e.tensor) else now).append((e, dst))
    copy_pairs(now)
    keys = [e.key for e, _ in later]
    tensors = [e.tensor for e, _ in later]
    before = guard.versions(tensors)

    def stage() -> FileImage:
        copy_pairs(later)
        moved = guard.changed(keys, tensors, before)
        if moved:
            caught()
            log.warning("tensor %r changed in place while a save was copying it, outside "
                        "optimizer.step(); from now on saves copy the state before returning", moved[0])  # fmt: skip
            raise SnapshotChanged(
                f"{len(moved)} tensor(s) changed in place while save_async was still copying them, "
                f"outside optimizer.step(), e.g. {moved[0]!r}: the checkpoint would mix old and new "
                "values, so it is not committed and the previous one stays the newest. Later saves "
                "copy the state before save_async returns. To keep overlapping, call ckpt.fence() "
                "before changing tensors outside optimizer.step(); or drop engine.snapshot: overlap "
                "for the default (auto), which captures the state before save_async returns"
            )
        return image

    return ImageJob(enc, stage, write, "overlap")

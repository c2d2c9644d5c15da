"""The ``copy`` snapshot (``auto``'s usual choice): the state copied into staging before ``save_async`` returns.

The copy goes into the engine's staging buffer, kept and reused between saves
(pinned when CUDA is present, one sync for all device-to-host copies;
``staging.py``). The stall is one memory copy of the state; the extra memory
is one copy of the state, for the life of the job.
"""

from __future__ import annotations

from ...store.codec import EncodedState
from ..job import ImageJob, WriteImage
from ..staging import Staging

__all__ = ["copy_job"]


def copy_job(enc: EncodedState, staging: Staging, write: WriteImage, mode: str = "copy") -> ImageJob:
    """A job writing ``enc``'s tensors from a copy in ``staging``, made before this returns."""
    # The job keeps the image, not enc: no reference to the trainer's tensors.
    return ImageJob(enc, staging.capture(enc.tensors), write, mode)

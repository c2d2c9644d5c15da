"""The fast checkpoint engine: parallel O_DIRECT writes, async snapshots, parallel reads.

It plugs into the store's commit protocol as the ``write`` function passed to
``commit()`` and as the reader passed to ``load_state()``; the protocol itself
(fsync, manifest last, rename, fsync parent) is unchanged. Files are the same
safetensors layout the reference writer produces, so each path reads the other's.

Snapshot modes for ``save_async`` (``engine.snapshot``). The default ones
capture the state before ``save_async`` returns, so the checkpoint holds the
state as it was then, whatever the trainer does next; the opt-in ones return
before that and need the trainer's help (``docs/async.md``).

``auto``  (default) ``copy``, unless a staging buffer would not fit in the
          memory left (the job's cgroup limit included): then ``fork``.
          CUDA tensors are always copied.
``copy``  copy into a staging buffer that is kept and reused between saves
          (pinned when CUDA is present, one sync for all device-to-host
          copies). The stall is one memory copy of the state; the extra
          memory is one copy of the state, for the life of the job.
``fork``  a forked child writes from a copy-on-write image (``forked.py``).
          The stall is copying the process's page tables, which grows with
          the whole process's memory, not the state's; afterwards every page
          the trainer writes while the child is still writing is copied by a
          page fault, which costs far more than the copy it saved (measured
          in ``slurm-ckpt bench``). It needs no standing extra memory.
``overlap`` opt-in: copy the small tensors, return, and copy the large ones
          into the staging buffer on a thread, behind the trainer's next
          forward and backward pass. ``optimizer.step()`` waits for the copy
          by itself; an in-place torch op on a large tensor that ends before
          the copy does fails the save (``guard.py``). Blind to writes that
          torch does not count (``.data``, NumPy views) and to an op still
          running when the copy ends: the trainer must not change large
          tensors other than through ``optimizer.step()`` before the fence.
          CPU tensors only.
``lazy``  opt-in: return at once and copy in the background, unguarded. The
          trainer must call ``handle.fence()`` (or ``Checkpointer.fence()``)
          before it next changes the tensors in place, typically before
          ``optimizer.step()``.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..config import SNAPSHOTS, EngineConfig
from ..errors import SnapshotChanged
from ..store.codec import EncodedState, encode_state
from ..store.manifest import Manifest
from ..store.tensorfile import FileRecord
from ..store.writer import load_state
from . import guard
from .forked import ForkedWriter, frozen_by_fork
from .handle import SaveHandle
from .job import ForkJob, ImageJob, SaveJob, ThreadCopyJob
from .layout import FileImage, plan_file
from .reader import READ_DEPTH, read_tensor_file
from .staging import Pair, Staging, available_memory, copy_pairs, is_cuda
from .writer import write_image

__all__ = ["MODES", "Engine", "SaveHandle", "SaveJob", "default_threads", "gc_paused"]

log = logging.getLogger("slurm_ckpt")

MODES = SNAPSHOTS


def default_threads() -> int:
    """I/O threads when ``engine.threads`` is 0: two per core, 2 to 8.

    Each thread alternates CPU work (gather, crc32) and a blocking write, so
    two per core keep both the cores and the device busy.
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(2, min(8, 2 * cores))


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause Python's cyclic GC while a state's many small objects are built.

    A training process tracks hundreds of thousands of objects (torch alone),
    so full collections triggered by the allocations of encoding thousands of
    tensors can cost more than the encoding itself, and each walks every
    object. Nothing built here is cyclic garbage, so nothing is lost by waiting.
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _keep(t: Any) -> Any:
    return t.detach()


class Engine:
    """Writes and reads checkpoints' tensor data; one per run dir writer."""

    def __init__(self, cfg: EngineConfig | None = None) -> None:
        self.cfg = cfg or EngineConfig()
        self.staging = Staging(pin=self.cfg.pin_memory)
        self._streams: dict[Any, Any] = {}
        self._overlap_ok = True  # opt-in overlap: until it caught a tensor changed while copied

    @property
    def threads(self) -> int:
        return self.cfg.threads or default_threads()

    def write_image(self, path: Path, image: FileImage) -> FileRecord:
        return write_image(path, image, threads=self.threads, chunk=self.cfg.chunk_size, direct=self.cfg.direct_io)

    def job(self, state: Any, *, allow_pickle: bool = False, mode: str = "sync") -> SaveJob:
        """Capture ``state`` for writing. ``mode`` is ``sync`` or a snapshot mode.

        When this returns, later changes to the state cannot reach the
        checkpoint, except in the opt-in ``overlap`` and ``lazy`` modes, whose
        copies run after it (see the module's docstring).
        """
        if mode == "auto":
            mode = self.cfg.snapshot
        if mode not in ("sync", *MODES):
            raise ValueError(f"unknown snapshot mode {mode!r}; use one of {', '.join(MODES)}")
        with gc_paused():
            return self._job(state, allow_pickle, mode)

    def _job(self, state: Any, allow_pickle: bool, mode: str) -> SaveJob:
        enc = encode_state(state, allow_pickle=allow_pickle, prepare=_keep)
        cuda = any(is_cuda(e.tensor) for e in enc.tensors)
        if mode == "auto":
            # Only modes that capture the state before returning: the default
            # must hold the state save_async saw, whatever the trainer does next.
            fits = cuda or self._staging_fits(enc.nbytes) or not hasattr(os, "fork")
            mode = "copy" if fits else "fork"
        if mode in ("fork", "overlap") and cuda:
            log.debug("state has CUDA tensors: staging them instead of using %s", mode)
            mode = "copy"
        if mode == "overlap" and not self._overlap_ok:
            mode = "copy"
        if mode == "lazy":
            return self._lazy(enc)
        if mode == "overlap":
            return self._overlap(enc)
        if mode == "copy" or (mode == "sync" and cuda):
            # The job keeps the image, not enc: no reference to the trainer's tensors.
            return ImageJob(enc, self.staging.capture(enc.tensors), self.write_image, mode)
        enc.tensors = [_contiguous(e) for e in enc.tensors]
        if mode == "fork":
            enc.tensors = frozen_by_fork(enc.tensors)
        image = plan_file(enc.tensors)  # puts enc.tensors in file order
        if mode == "sync":
            return ImageJob(enc, image, self.write_image, mode)
        try:
            writer = ForkedWriter(image, threads=self.threads, chunk=self.cfg.chunk_size, direct=self.cfg.direct_io)
        except OSError as e:  # ENOMEM under strict overcommit, EAGAIN at the process limit
            log.warning("cannot fork the background writer (%s); copying the state instead", e)
            return ImageJob(enc, self.staging.capture(enc.tensors), self.write_image, "copy")
        return ForkJob(enc, writer)

    def _staging_fits(self, nbytes: int) -> bool:
        """Whether a staging copy fits in memory (with a quarter to spare)."""
        need = nbytes - self.staging.capacity
        return need <= 0 or need * 5 // 4 <= available_memory()

    def _lazy(self, enc: EncodedState) -> SaveJob:
        streams: dict[Any, Any] = {}
        devices = {e.tensor.device for e in enc.tensors if is_cuda(e.tensor)}
        if devices:
            import torch

            for dev in devices:
                # The copies run on a side stream that first waits for the work
                # the trainer queued before this save (what produced the tensors).
                side = self._streams.setdefault(dev, torch.cuda.Stream(device=dev))
                side.wait_stream(torch.cuda.current_stream(dev))
                streams[dev] = side
        entries = list(enc.tensors)

        def stage() -> FileImage:
            return self.staging.capture(entries, streams=streams)

        return ThreadCopyJob(enc, stage, self.write_image, mode="lazy")

    def _overlap(self, enc: EncodedState) -> SaveJob:
        image, pairs = self.staging.prepare(enc.tensors)
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
                self._overlap_ok = False
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

        return ThreadCopyJob(enc, stage, self.write_image, mode="overlap", guarded=True)

    def load(
        self,
        ckpt: Path,
        man: Manifest,
        *,
        map_location: Any = None,
        trusted: bool = False,
        mmap: bool = False,
        into: Any = None,
    ) -> Any:
        """The state of a committed checkpoint, read in parallel and verified as read.

        Tensors come back as ``torch.load`` gives them (``store/codec/``);
        with ``mmap``, on windows of the mapped files. ``into``: a state shaped
        like the saved one whose tensors are loaded into, in place where the
        reader can (see ``reader``), matched by where they sit in it.
        """
        if into is not None and mmap:
            raise ValueError("into= and mmap=True do not mix: mmap maps the file, into= reads into your tensors")
        import torch

        # Reads are kept READ_DEPTH deep, not by cores; but a mapped file's threads are
        # not waiting on reads: each checksums the mapping, on a core.
        threads = self.threads if mmap else self.cfg.threads or READ_DEPTH
        read = functools.partial(read_tensor_file, threads=threads, chunk=self.cfg.chunk_size, use_mmap=mmap)
        # no_grad: into= may hold parameters, which need grad (named_parameters()),
        # and are copied into as load_state_dict copies into them.
        with gc_paused(), torch.no_grad():
            return load_state(ckpt, man, map_location=map_location, trusted=trusted, read=read, into=into)


def _contiguous(e: Any) -> Any:
    t = e.tensor
    if t.is_contiguous():
        return e
    from ..store.codec import TensorEntry

    return TensorEntry(e.key, t.contiguous(), e.dtype, e.shape)

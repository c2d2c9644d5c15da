"""The fast checkpoint engine: parallel O_DIRECT writes, async snapshots, parallel reads.

It plugs into the store's commit protocol as the ``write`` function passed to
``commit()``, and reads for ``load.py``, which owns a load; the protocol itself
(fsync, manifest last, rename, fsync parent) is unchanged. Files are the same
safetensors layout the reference writer produces, so each path reads the other's.

Snapshot modes for ``save_async`` (``engine.snapshot``; ``snapshot/``). The
default ones capture the state before ``save_async`` returns, so the
checkpoint holds the state as it was then, whatever the trainer does next;
the opt-in one returns before that and needs the trainer's help
(``docs/async.md``).

``auto``  (default) ``copy``, unless a staging buffer would not fit in the
          memory left (the job's cgroup limit included): then ``fork``.
          CUDA tensors are always copied.
``copy``  copy into a staging buffer that is kept and reused between saves
          (pinned when CUDA is present, one sync for all device-to-host
          copies). The stall is one memory copy of the state; the extra
          memory is one copy of the state, for the life of the job.
``fork``  a forked child writes from a copy-on-write image (``snapshot/fork.py``).
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
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from typing import Any

from ..config import SNAPSHOTS, EngineConfig
from ..store.codec import encode_state, gc_paused
from ..store.load import Loader, ReadFn
from ..store.manifest import Manifest
from ..store.tensorfile import FileRecord
from .handle import SaveHandle
from .job import SaveJob
from .layout import FileImage
from .reader import READ_DEPTH, read_tensor_file
from .snapshot import Facts, choose_mode, copy_job, fork_job, overlap_job, sync_job
from .staging import Staging, available_memory, is_cuda
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


def _keep(t: Any) -> Any:
    return t.detach()


class Engine:
    """Writes and reads checkpoints' tensor data; one per run dir writer."""

    def __init__(self, cfg: EngineConfig | None = None) -> None:
        self.cfg = cfg or EngineConfig()
        self.staging = Staging(pin=self.cfg.pin_memory)
        self._overlap_ok = True  # opt-in overlap: until it caught a tensor changed while copied

    @property
    def threads(self) -> int:
        return self.cfg.threads or default_threads()

    def write_image(self, path: Path, image: FileImage) -> FileRecord:
        return write_image(path, image, threads=self.threads, chunk=self.cfg.chunk_size, direct=self.cfg.direct_io)

    def job(self, state: Any, *, allow_pickle: bool = False, mode: str = "sync") -> SaveJob:
        """Capture ``state`` for writing. ``mode`` is ``sync`` or a snapshot mode.

        When this returns, later changes to the state cannot reach the
        checkpoint, except in the opt-in ``overlap`` mode, whose copy runs
        after it (see the module's docstring).
        """
        if mode == "auto":
            mode = self.cfg.snapshot
        with gc_paused():
            return self._job(state, allow_pickle, mode)

    def _job(self, state: Any, allow_pickle: bool, requested: str) -> SaveJob:
        enc = encode_state(state, allow_pickle=allow_pickle, prepare=_keep)
        facts = Facts(
            nbytes=enc.nbytes,
            cuda=any(is_cuda(e.tensor) for e in enc.tensors),
            staging=self.staging.capacity,
            available=available_memory(),
            can_fork=hasattr(os, "fork"),
            overlap_ok=self._overlap_ok,
        )
        mode = choose_mode(requested, facts)
        if facts.cuda and requested in ("fork", "overlap"):
            log.debug("state has CUDA tensors: staging them instead of using %s", requested)
        if mode == "overlap":
            return overlap_job(enc, self.staging, self.write_image, caught=self._overlap_caught)
        if mode == "copy":
            return copy_job(enc, self.staging, self.write_image)
        if mode == "sync":
            return sync_job(enc, self.staging, self.write_image)
        try:
            return fork_job(enc, threads=self.threads, chunk=self.cfg.chunk_size, direct=self.cfg.direct_io)
        except OSError as e:
            log.warning("cannot fork the background writer (%s); copying the state instead", e)
            return copy_job(enc, self.staging, self.write_image)

    def _overlap_caught(self) -> None:
        self._overlap_ok = False

    def reader(self, *, mmap: bool = False) -> ReadFn:
        """The parallel reader a load reads each data file with (``reader.py``)."""
        # Reads are kept READ_DEPTH deep, not by cores; but a mapped file's threads are
        # not waiting on reads: each checksums the mapping, on a core.
        threads = self.threads if mmap else self.cfg.threads or READ_DEPTH
        return functools.partial(read_tensor_file, threads=threads, chunk=self.cfg.chunk_size, use_mmap=mmap)

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
        reader can (see ``reader``), matched by where they sit in it. The load
        itself is ``store/load.py``'s.
        """
        return Loader(self.reader(mmap=mmap), mmap=mmap, map_location=map_location, trusted=trusted,
                      into=into)(ckpt, man)  # fmt: skip

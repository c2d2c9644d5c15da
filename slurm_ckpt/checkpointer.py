"""The training-side API: ``Checkpointer``."""

from __future__ import annotations

import errno
import functools
import logging
import os
import time
from pathlib import Path
from typing import Any

from ._env import default_run_dir, job_id
from .config import Config, load_config
from .control import Control
from .engine import Engine, SaveHandle, SaveJob, gc_paused
from .engine.handle import start_save, take_error
from .errors import ConfigError, StorageError
from .metrics import Metrics
from .placement import after_commit, choose, surface_drain_error
from .ranks import rank_info
from .sharded.job import ShardJob
from .sharded.loader import load_checkpoint
from .sharded.parts import holds_dtensor
from .store import RunDir, Skipped, find_latest
from .store.commit import WriteFn
from .store.load import Loader
from .store.retention import reaped
from .store.tiers import Tiers

__all__ = ["Checkpointer", "SaveHandle"]

log = logging.getLogger("slurm_ckpt")


class Checkpointer:
    """Saves and restores training state, crash-safely.

    The run dir is ``dir`` if given, else ``$SLURM_CKPT_DIR``, else
    ``<storage.root>/<user>/job_<id>`` from the config, else ``./checkpoints``.

    With node-local scratch (``scratch``, else ``$SLURM_CKPT_SCRATCH``, an
    existing writable dir) there are two tiers: a save commits to
    ``<scratch>/ckpt`` and a background thread copies it to the run dir (the
    durable tier); see ``store/tiers.py``. ``scratch=False`` keeps one tier.

    >>> ckpt = Checkpointer()
    >>> state = ckpt.load_latest()          # None on a fresh start
    >>> ckpt.save({"model": model.state_dict(), "step": 10}, step=10)
    """

    def __init__(
        self,
        dir: str | Path | None = None,
        *,
        keep: int | None = None,
        config: Config | None = None,
        allow_pickle: bool | None = None,
        lock_timeout: float | None = 0,
        distributed: bool | None = None,
        scratch: str | Path | bool | None = None,
    ) -> None:
        self.config = config or load_config()
        self.run_dir = RunDir(Path(dir) if dir else default_run_dir(self.config), lock_timeout=lock_timeout)
        _check_owned(self.run_dir.path, self.config)
        self.keep = keep if keep is not None else self.config.storage.keep
        self.allow_pickle = self.config.storage.allow_pickle if allow_pickle is None else allow_pickle
        self.control = Control()
        self.control.install()
        self._inflight: SaveHandle | None = None
        self.last_committed: Path | None = None
        self.loaded_step: int | None = None
        self.loaded_path: Path | None = None
        self.metrics = Metrics.from_config(self.config.metrics, job_id=job_id())
        # The fast writer/reader; it keeps staging buffers between saves.
        self.engine = Engine(self.config.engine)
        # Collective saves when a torch.distributed group is up (placement/);
        # ``distributed=False`` keeps every process on its own.
        self.placement = choose(self.run_dir, storage=self.config.storage, keep=self.keep,
                                distributed=distributed, scratch=scratch, lock_timeout=lock_timeout,
                                on_lag=self.metrics.set_stageout_lag, on_stall=self.metrics.set_durable_stalled,
                                replicas=self.config.scratch.replicas, on_replicas=self.metrics.set_replicas)  # fmt: skip
        self._closed = False

    def _check_open(self) -> None:
        # After close() the lock is released and, with several ranks, the
        # process group may be gone: a save would run uncoordinated, each rank
        # writing the whole step into the shared dir.
        if self._closed:
            raise ConfigError(f"this Checkpointer for {self.dir} is closed; create a new one to save or load again")

    @property
    def dir(self) -> Path:
        return self.run_dir.path

    @property
    def search_dirs(self) -> list[Path]:
        """Run dirs that discovery looks in, fastest tier first."""
        return self.placement.search_dirs

    @property
    def tiers(self) -> Tiers | None:
        """The scratch and durable tiers of a one-process writer, if it has scratch."""
        return self.placement.tiers

    def is_durable(self, step: int) -> bool:
        """True once checkpoint ``step`` is committed on the durable tier.

        With one tier that is as soon as it is committed. The wrapper uses this
        (and :meth:`drain`) to decide whether the epilog must stage out.
        """
        h = self._inflight
        if h is not None and h.step == step and not h.done():
            return False
        return self.placement.is_durable(step)

    def drain(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds for the newest checkpoint to be durable.

        Returns True if it is. Never raises for a failed copy: the checkpoint
        stays on scratch, which the epilog stages out; the error surfaces at
        the next save or ``wait()`` per ``storage.on_async_error``.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        h = self._inflight
        # Not h.wait(): the save's error is kept for whoever raises it first.
        if h is not None and not (h.join(timeout) and not h.failed()):
            return False
        return self.placement.drain(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def _surface_drain_error(self) -> None:
        """A failed copy to the durable tier: raise or log it per ``storage.on_async_error``;
        only logged once a checkpoint-and-stop was requested (``placement.surface_drain_error``)."""
        surface_drain_error(self.placement, self.config.storage, stopping=self.control.requested)

    def _committed(self, step: int, path: Path) -> None:
        """After a commit: queue the copy to the durable tier, retention, the report."""
        self.last_committed = path
        after_commit(self.placement, step, path)
        self.control.report_committed(step, str(path))

    @property
    def preempted(self) -> bool:
        """True once a checkpoint-and-stop was requested (the wrapper's signal).

        Polled every step, so it is also where a failed background save
        surfaces (per ``storage.on_async_error``) before the next save, unless
        its handle's ``wait()`` raised the error already.
        """
        h = self._inflight
        if h is not None and h.failed():
            self._drain_inflight()
        return self.control.requested

    @property
    def rank(self) -> int:
        """Global rank: torch.distributed's if initialised, else SLURM_PROCID, else 0."""
        return rank_info().rank

    @property
    def world_size(self) -> int:
        return rank_info().world_size

    def maybe_save(self, state: Any, step: int, *, every: int = 0) -> bool:
        """Call at every step boundary: saves every ``every`` steps, and at once on a request.

        ``state`` may be a callable returning the state, built only when saving.
        Returns True when a checkpoint-and-stop was requested and this step is
        committed: the caller should exit (status 0). With several ranks every
        rank must call it at every step; they agree on the request first.
        It also records the step for the wrapper's hang watchdog (:meth:`progress`).
        """
        self._check_open()
        self.control.progress(step)  # before the collective below, which a hung rank never joins
        stop = self.placement.agree(self.preempted)
        if stop or (every > 0 and step % every == 0):
            self.save(state() if callable(state) else state, step)
        return stop

    def progress(self, step: int) -> None:
        """Record that this rank reached ``step``, for ``slurm-ckpt run --hang-timeout``.

        :meth:`maybe_save` calls it; a trainer that calls only :meth:`save` calls
        it once per step. It stores an int; the wrapper hears of it from a
        heartbeat thread that runs only when the wrapper watches for hangs.
        """
        self.control.progress(step)

    def save(self, state: Any, step: int) -> Path:
        """Write ``state`` as checkpoint ``step``; return once it is durable and committed."""
        self._check_open()
        self._drain_inflight()
        self._surface_drain_error()
        return self._save_sync(state, step)

    def _save_sync(self, state: Any, step: int) -> Path:
        with gc_paused():
            job = self._job(state, "sync")
            try:
                path = self._commit(step, job.write, job.nbytes, **_meta(job))
            finally:
                job.close()
            self._committed(step, path)
        return path

    def _job(self, state: Any, mode: str) -> SaveJob | ShardJob:
        """What writes ``state``: the engine's job, or for a state holding DTensors
        (collectively, on the placement's ranks) each rank's shards (``sharded/job.py``)."""
        if holds_dtensor(state):
            from .sharded.job import make_job

            return make_job(state, group=self.placement.group, engine=self.engine, allow_pickle=self.allow_pickle,
                            background=mode != "sync")  # fmt: skip
        return self.engine.job(state, allow_pickle=self.allow_pickle, mode=mode)

    def save_async(self, state: Any, step: int) -> SaveHandle:
        """Capture ``state`` and write it in the background.

        By default the checkpoint holds the state as it was when this call
        returns, whatever the trainer does next (in-place ops, writes through
        ``.data`` or NumPy views, ``optimizer.step()``, other threads): ``auto``
        copies the tensors into a staging buffer kept between saves before
        returning or, when that copy would not fit in memory, forks a child
        that writes from a copy-on-write image. The opt-in ``engine.snapshot:
        overlap`` returns before copying the large tensors and needs the
        trainer's help (``docs/async.md``). A call while a save is in flight
        first waits for that one to commit: one in flight per run dir, and no
        request is dropped.
        """
        self._check_open()
        self._drain_inflight()
        with gc_paused():
            job = self._job(state, "auto")
        handle = SaveHandle(step, job.captured, job.mode)

        def work() -> Path:
            try:
                path = self._commit(step, job.write, job.nbytes, **_meta(job))
                self._committed(step, path)
            except BaseException as e:  # surfaced on wait() and the next save
                log.error("background save of step %d failed: %s", step, e)
                raise
            return path

        self._inflight = handle
        # job.close() before the handle is done: a commit that failed early may
        # leave a copy into the staging buffer running, and the next save,
        # free to start once this one is done, reuses that buffer.
        start_save(handle, work, cleanup=job.close)
        return handle

    def _commit(self, step: int, write: WriteFn, nbytes: int, **meta: Any) -> Path:
        """Commit one checkpoint where the placement puts it, timed for the metrics."""
        with self.metrics.time_save(step, nbytes):
            return self.placement.commit(step, write, nbytes=nbytes, job_id=job_id(), **meta)

    def _drain_inflight(self, *, policy: bool = True) -> None:
        """Wait for the background save. Its error, unless raised already (by the
        handle's ``wait()``, or here before), is raised, or only logged with
        ``storage.on_async_error: warn`` (``policy=False`` always raises).

        Raised once: a trainer that caught it from ``handle.wait()`` must not
        meet it again at the next save or at ``close()``.
        """
        h, self._inflight = self._inflight, None
        if h is None:
            return
        h.join()
        e = take_error(h)
        if e is None:
            return
        if not policy or self.config.storage.on_async_error != "warn" or not isinstance(e, Exception):
            raise e
        log.warning("background save of step %d failed: %s; training goes on without it "
                    "(storage.on_async_error: warn)", h.step, e)  # fmt: skip

    def wait(self) -> None:
        """Block until any background save is committed, and copied to the durable tier,
        and the checkpoints retention dropped are deleted.

        A failed save raises its error (unless ``handle.wait()`` raised it already);
        a failed copy follows ``storage.on_async_error``.
        """
        self._drain_inflight(policy=False)
        self.placement.drain()
        reaped()
        self._surface_drain_error()

    def fence(self) -> None:
        """Block until the save in flight has copied the tensors, so the trainer may
        change them. Only ``engine.snapshot: overlap`` needs it, before changing large
        tensors other than through ``optimizer.step()`` (which waits by itself).
        By default it returns at once."""
        h = self._inflight
        if h is not None:
            h.fence()

    def latest(self, *, skipped: list[Skipped] | None = None) -> Path | None:
        """Path of the newest checkpoint that passes a full verification, or None."""
        cand = find_latest(self.search_dirs, full=True, skipped=skipped)
        return cand.path if cand else None

    def load_latest(
        self,
        *,
        map_location: Any = None,
        trusted: bool = False,
        skipped: list[Skipped] | None = None,
        mmap: bool = False,
        into: Any = None,
    ) -> Any:
        """The state of the newest valid checkpoint, or None if there is none.

        Checksums are verified as the data is read; a checkpoint that fails is
        skipped with a warning naming the bad file, and the next older one is
        tried. ``loaded_step`` and ``loaded_path`` then say which one was used.
        Tensors come back as ``torch.load`` gives them: storages shared where
        they were, offsets, strides, parameters and devices as saved (without
        ``map_location``, a tensor saved on a GPU goes back to it).
        ``map_location`` takes what ``torch.load``'s does: a device for every
        tensor, or a dict from saved device to device (``{"cuda:0": "cuda:1"}``);
        not a function. ``mmap=True`` maps the data files instead of reading them
        (zero-copy).

        ``into``: a state shaped like the saved one, e.g. ``{"model":
        model.state_dict(), ...}``; its tensors are loaded into in place, and the
        returned state holds them. Large CPU tensors are read straight into their
        memory: no second copy of the state, no fresh memory. A tensor of another
        dtype is cast, as ``load_state_dict`` casts. A tensor of ``into``
        that the checkpoint lacks, whose shape differs, on the meta device, or
        a lazy module's not yet run, raises ``ValueError`` before anything is read; a checkpoint tensor that ``into``
        lacks is loaded into fresh memory. If a checkpoint fails its checksum,
        tensors already read hold part of it until an older checkpoint is loaded
        over them (and if no valid one is left, this returns None and they keep
        what was read).
        """
        self._check_open()
        chunked = functools.partial(load_checkpoint, group=self.placement.group, config=self.config)
        load = Loader(self.engine.reader(mmap=mmap), mmap=mmap, map_location=map_location, trusted=trusted,
                      into=into, chunked=chunked)  # fmt: skip
        with gc_paused():
            found = self.placement.load_latest(load, skipped)
        if found is None:
            return None
        self.metrics.loaded(load.seconds, load.nbytes)
        state, self.loaded_step, self.loaded_path = found
        return state

    def close(self) -> None:
        """Finish any background save and copy to the durable tier; release the locks.

        The Checkpointer cannot save or load after this; closing again does nothing.
        """
        if self._closed:
            return
        self._closed = True
        try:
            self._drain_inflight()
        finally:
            self.placement.close()
            reaped()
            # Done checkpointing: the series ends, so no alert fires for a finished job.
            self.metrics.close(remove=True)
        self._surface_drain_error()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _meta(job: SaveJob | ShardJob) -> dict[str, Any]:
    """Manifest fields a job adds: those that make a DTensor state's checkpoint chunked."""
    return {"extra": job.extra} if isinstance(job, ShardJob) else {}


def _check_owned(run_dir: Path, config: Config) -> None:
    """Refuse a run dir under ``storage.root`` that another user made or can write in: its
    checkpoints could be theirs (see ``store/owner.py``)."""
    if not config.storage.root:
        return
    from .store.owner import untrusted_below

    why = untrusted_below(Path(config.storage.root), run_dir, os.geteuid())
    if why:
        raise StorageError(errno.EPERM, f"will not use run dir {run_dir}", run_dir, hint=why)

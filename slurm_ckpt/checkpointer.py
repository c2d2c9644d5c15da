"""The training-side API: ``Checkpointer``."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

from ._env import default_run_dir, job_id
from .config import Config, load_config
from .control import Control
from .dist import ShardedRunDir, rank_info
from .engine import Engine, SaveHandle
from .errors import CheckpointCorrupt
from .metrics import Metrics
from .store import RunDir, Skipped, find_latest, iter_valid, note_skip
from .store.commit import WriteFn
from .store.retry import RetryPolicy, commit_resilient

__all__ = ["Checkpointer", "SaveHandle"]

log = logging.getLogger("slurm_ckpt")


class Checkpointer:
    """Saves and restores training state, crash-safely.

    The run dir is ``dir`` if given, else ``$SLURM_CKPT_DIR``, else
    ``<storage.root>/<user>/job_<id>`` from the config, else ``./checkpoints``.

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
    ) -> None:
        self.config = config or load_config()
        run_dir = RunDir(Path(dir) if dir else default_run_dir(self.config), lock_timeout=lock_timeout)
        # Collective saves when a torch.distributed group is up (see dist.py);
        # ``distributed=False`` keeps every process on its own.
        self.run_dir = ShardedRunDir(run_dir, enabled=distributed)
        self.run_dir.group()
        self.keep = keep if keep is not None else self.config.storage.keep
        self.allow_pickle = self.config.storage.allow_pickle if allow_pickle is None else allow_pickle
        self.control = Control()
        self.control.install()
        self._inflight: SaveHandle | None = None
        self.last_committed: Path | None = None
        self.loaded_step: int | None = None
        self.loaded_path: Path | None = None
        self.metrics = Metrics.from_config(self.config.metrics, job_id=job_id())
        self._retry: dict[Path, RetryPolicy] = {}
        # The fast writer/reader; it keeps staging buffers between saves.
        self.engine = Engine(self.config.engine)

    @property
    def dir(self) -> Path:
        return self.run_dir.path

    @property
    def search_dirs(self) -> list[Path]:
        """Run dirs that discovery looks in, fastest tier first."""
        return [self.dir]

    @property
    def preempted(self) -> bool:
        """True once a checkpoint-and-stop was requested (the wrapper's signal).

        Polled every step, so it is also where a failed background save
        surfaces (per ``storage.on_async_error``) before the next save.
        """
        h = self._inflight
        if h is not None and h.done() and h._error is not None:
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
        """
        stop = self.run_dir.agree(self.preempted)
        if stop or (every > 0 and step % every == 0):
            self.save(state() if callable(state) else state, step)
        return stop

    def save(self, state: Any, step: int) -> Path:
        """Write ``state`` as checkpoint ``step``; return once it is durable and committed."""
        self._drain_inflight()
        return self._save_sync(state, step)

    def _save_sync(self, state: Any, step: int) -> Path:
        job = self.engine.job(state, allow_pickle=self.allow_pickle)
        try:
            path = self._commit(step, job.write, job.nbytes)
        finally:
            job.close()
        self.last_committed = path
        self.run_dir.retain(self.keep, protect=[path])
        self.control.report_committed(step, str(path))
        return path

    def save_async(self, state: Any, step: int) -> SaveHandle:
        """Stage ``state`` and write it in the background; returns once staging is done.

        Later in-place changes to the state's tensors do not reach this checkpoint
        (with ``engine.snapshot: lazy``, only after ``fence()``). A call while a
        save is in flight first waits for that one to commit: one in flight per
        run dir, and no request is dropped.
        """
        self._drain_inflight()
        self.run_dir.group()  # a collective: create it here, on the calling thread
        job = self.engine.job(state, allow_pickle=self.allow_pickle, mode="auto")
        handle = SaveHandle(step, job.captured)

        def run() -> None:
            try:
                path = self._commit(step, job.write, job.nbytes)
                self.last_committed = path
                self.run_dir.retain(self.keep, protect=[path])
                self.control.report_committed(step, str(path))
                handle._finish(path, None)
            except BaseException as e:  # surfaced on wait() and the next save
                log.error("background save of step %d failed: %s", step, e)
                handle._finish(None, e)
            finally:
                job.close()

        self._inflight = handle
        threading.Thread(target=run, name=f"slurm-ckpt-save-{step}", daemon=False).start()
        return handle

    def _commit(self, step: int, write: WriteFn, nbytes: int) -> Path:
        """Commit one checkpoint: retried, pruned on a full disk, timed (store/retry.py)."""
        with self.metrics.time_save(step, nbytes):
            if self.run_dir.group() is not None:
                # A collective save: one rank retrying alone would desynchronise the others.
                return self.run_dir.commit(step, write, nbytes=nbytes, job_id=job_id())
            dirs = [self.run_dir]
            pols = [self._retry.setdefault(d.path, RetryPolicy.for_path(self.config.storage, d.path))
                    for d in dirs]  # fmt: skip
            return commit_resilient(dirs, step, write, keep=self.keep, policies=pols,
                                    nbytes=nbytes, job_id=job_id())  # fmt: skip

    def _drain_inflight(self, *, policy: bool = True) -> None:
        """Wait for the background save; its error is raised, or only logged with
        ``storage.on_async_error: warn`` (``policy=False`` always raises)."""
        h, self._inflight = self._inflight, None
        if h is None:
            return
        try:
            h.wait()
        except Exception as e:
            if not policy or self.config.storage.on_async_error != "warn":
                raise
            log.warning("background save of step %d failed: %s; training goes on without it "
                        "(storage.on_async_error: warn)", h.step, e)  # fmt: skip

    def wait(self) -> None:
        """Block until any background save is committed; raise its error if it failed."""
        self._drain_inflight(policy=False)

    def fence(self) -> None:
        """With ``engine.snapshot: lazy``: block until the save in flight has copied
        the tensors, so the trainer may change them (call before ``optimizer.step()``)."""
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
    ) -> Any:
        """The state of the newest valid checkpoint, or None if there is none.

        Checksums are verified as the data is read; a checkpoint that fails is
        skipped with a warning naming the bad file, and the next older one is
        tried. ``loaded_step`` and ``loaded_path`` then say which one was used.
        ``mmap=True`` maps the data files instead of reading them (zero-copy).
        """

        def load_state(p: Path, m: Any, *, map_location: Any, trusted: bool) -> Any:
            with self.metrics.time_load() as loaded:
                state = self.engine.load(p, m, map_location=map_location, trusted=trusted, mmap=mmap)
                loaded.append(int(m.nbytes or sum(r.size for r in m.files.values())))
            return state

        if self.run_dir.group() is not None:
            found = self.run_dir.load_latest(
                self.search_dirs, lambda p, m: load_state(p, m, map_location=map_location, trusted=trusted),
                skipped,
            )  # fmt: skip
            if found is None:
                return None
            state, self.loaded_step, self.loaded_path = found
            return state
        for cand in iter_valid(self.search_dirs, full=False, skipped=skipped):
            try:
                state = load_state(cand.path, cand.manifest, map_location=map_location, trusted=trusted)
            except CheckpointCorrupt as e:
                note_skip(cand.path, str(e), skipped)
                continue
            self.loaded_step, self.loaded_path = cand.step, cand.path
            return state
        return None

    def close(self) -> None:
        """Finish any background save and release the run dir lock."""
        try:
            self._drain_inflight()
        finally:
            self.run_dir.unlock()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

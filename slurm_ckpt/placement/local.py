"""``Local``: one process's checkpoints, in its run dir, with node-local scratch in front."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..config import StorageConfig
from ..errors import CheckpointCorrupt, StorageHung
from ..ranks import RankGroup
from ..store import RunDir, Skipped, iter_valid, note_skip
from ..store.bounded import Bound
from ..store.commit import WriteFn
from ..store.retry import RetryPolicy, Target, commit_resilient
from ..store.tiers import Tiers
from ..store.verify import is_committed
from .base import Load

__all__ = ["Local"]

log = logging.getLogger("slurm_ckpt")


class _BoundedDir:
    """The durable run dir as a commit target whose commit is given up after
    ``storage.hang_timeout`` (``store/bounded.py``)."""

    def __init__(self, run_dir: RunDir, bound: Bound) -> None:
        self.run_dir, self.bound = run_dir, bound

    @property
    def path(self) -> Path:
        return self.run_dir.path

    def commit(self, step: int, write: WriteFn, **meta: Any) -> Path:
        if not self.run_dir.locked:
            # Waiting for another writer's lock is not a hang: that wait has its own timeout.
            wait = self.run_dir.lock_timeout
            self.bound.call(self.run_dir.lock, "locking the run dir", extra=wait)
        return self.bound.call(lambda: self.run_dir.commit(step, write, **meta), f"saving checkpoint {step}")


class _Stalls:
    """One 0/1 gauge fed by two sources (a given-up commit, a stalled drain):
    stalled while either is."""

    def __init__(self, out: Callable[[bool], None]) -> None:
        self.out, self.count, self.lock = out, 0, threading.Lock()

    def __call__(self, on: bool) -> None:
        with self.lock:
            was = self.count > 0
            self.count += 1 if on else -1
            if (self.count > 0) != was:
                self.out(self.count > 0)


class Local:
    """One process's checkpoints: the run dir, with an optional scratch tier in front
    (``store/tiers.py``)."""

    group: RankGroup | None = None

    def __init__(self, run_dir: RunDir, tiers: Tiers | None, storage: StorageConfig, keep: int,
                 on_stall: Callable[[bool], None] | None = None) -> None:  # fmt: skip
        self.run_dir, self.tiers, self.keep = run_dir, tiers, keep
        # The durable tier's I/O runs on a worker the save stops waiting for after
        # hang_timeout: a call hung in the kernel cannot be interrupted.
        self.bound = Bound(run_dir.path, storage.hang_timeout, on_stall)
        durable = _BoundedDir(run_dir, self.bound)
        # With tiers: scratch first; when it fails for good, the durable tier.
        self._dirs: list[Target] = [durable] if tiers is None else [tiers.fast, durable]
        self._policies = [RetryPolicy.for_path(storage, d.path) for d in self._dirs]

    @classmethod
    def setup(cls, run_dir: RunDir, fast: Path | None, *, storage: StorageConfig, keep: int,
              lock_timeout: float | None = 0, on_lag: Callable[[float], None] | None = None,
              on_stall: Callable[[bool], None] | None = None) -> Local:  # fmt: skip
        """A Local placement, with tiers when ``fast`` (``<scratch>/ckpt``) can be used."""
        on_stall = _Stalls(on_stall) if on_stall is not None else None
        tiers = None
        if fast is not None:
            tiers = Tiers(RunDir(fast, lock_timeout=lock_timeout), run_dir, keep=keep,
                          policy=RetryPolicy.for_path(storage, run_dir.path), on_lag=on_lag,
                          drain=storage.drain, stall_after=storage.hang_timeout, on_stall=on_stall)  # fmt: skip
            try:
                tiers.activate()
            except OSError as e:
                log.warning("cannot use scratch %s (%s); saving to %s only", fast, e, run_dir.path)
                tiers = None
        return cls(run_dir, tiers, storage, keep, on_stall)

    @property
    def search_dirs(self) -> list[Path]:
        return self.tiers.search_dirs if self.tiers is not None else [self.run_dir.path]

    def commit(self, step: int, write: WriteFn, **meta: Any) -> Path:
        """Retried, pruned on a full disk, falling back tier by tier (store/retry.py)."""
        protect = self.tiers.protected if self.tiers is not None else set
        return commit_resilient(self._dirs, step, write, keep=self.keep, policies=self._policies,
                                protect=protect, **meta)  # fmt: skip

    def committed(self, step: int, path: Path) -> None:
        tiers = self.tiers
        if tiers is not None and path.parent == tiers.fast.path:
            tiers.submit(step, path)
            tiers.fast.retain(self.keep, protect=[path, *tiers.protected()])
        else:
            try:
                self.bound.call(lambda: self.run_dir.retain(self.keep, protect=[path]), "retention")
            except StorageHung as e:  # committed already: old checkpoints wait for the next save
                log.warning("checkpoint %d committed, but %s", step, e)

    def is_durable(self, step: int) -> bool:
        if self.tiers is not None:
            return self.tiers.is_durable(step)
        return is_committed(self.run_dir.path, step)

    def drain(self, timeout: float | None = None) -> bool:
        return self.tiers.drain(timeout) if self.tiers is not None else True

    def take_error(self) -> BaseException | None:
        return self.tiers.take_error() if self.tiers is not None else None

    def agree(self, flag: bool) -> bool:
        return flag

    def load_latest(self, load: Load, skipped: list[Skipped] | None) -> tuple[Any, int, Path] | None:
        for cand in iter_valid(self.search_dirs, full=False, skipped=skipped, parse=False):
            try:
                return load(cand.path, cand.manifest), cand.step, cand.path
            except CheckpointCorrupt as e:
                note_skip(cand.path, str(e), skipped)
        return None

    def close(self, timeout: float | None = None) -> bool:
        try:
            return self.tiers.close(timeout) if self.tiers is not None else True
        finally:
            # A copy still running (stalled, or past timeout) writes to the run dir:
            # the lock stays with it, and goes with the process.
            if self.tiers is None or not self.tiers.copying:
                try:  # releasing the lock is a call to the storage too
                    self.bound.call(self.run_dir.unlock, "releasing the run dir lock")
                except StorageHung as e:
                    log.warning("%s", e)
            self.bound.close()

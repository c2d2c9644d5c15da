"""``Local``: one process's checkpoints, in its run dir, with node-local scratch in front."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..config import StorageConfig
from ..errors import CheckpointCorrupt
from ..ranks import RankGroup
from ..store import RunDir, Skipped, iter_valid, note_skip
from ..store.commit import WriteFn
from ..store.retry import RetryPolicy, commit_resilient
from ..store.tiers import Tiers
from ..store.verify import is_committed
from .base import Load

__all__ = ["Local"]

log = logging.getLogger("slurm_ckpt")


class Local:
    """One process's checkpoints: the run dir, with an optional scratch tier in front
    (``store/tiers.py``)."""

    group: RankGroup | None = None

    def __init__(self, run_dir: RunDir, tiers: Tiers | None, storage: StorageConfig, keep: int) -> None:
        self.run_dir, self.tiers, self.keep = run_dir, tiers, keep
        # With tiers: scratch first; when it fails for good, the durable tier.
        self._dirs = [run_dir] if tiers is None else [tiers.fast, run_dir]
        self._policies = [RetryPolicy.for_path(storage, d.path) for d in self._dirs]

    @classmethod
    def setup(cls, run_dir: RunDir, fast: Path | None, *, storage: StorageConfig, keep: int,
              lock_timeout: float | None = 0, on_lag: Callable[[float], None] | None = None) -> Local:  # fmt: skip
        """A Local placement, with tiers when ``fast`` (``<scratch>/ckpt``) can be used."""
        tiers = None
        if fast is not None:
            tiers = Tiers(RunDir(fast, lock_timeout=lock_timeout), run_dir, keep=keep,
                          policy=RetryPolicy.for_path(storage, run_dir.path), on_lag=on_lag,
                          drain=storage.drain)  # fmt: skip
            try:
                tiers.activate()
            except OSError as e:
                log.warning("cannot use scratch %s (%s); saving to %s only", fast, e, run_dir.path)
                tiers = None
        return cls(run_dir, tiers, storage, keep)

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
            self.run_dir.retain(self.keep, protect=[path])

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
            self.run_dir.unlock()

"""Where a Checkpointer's saves go and where resume looks: one object per layout.

==============  ===========================================================
:class:`Local`  one process: the run dir, or node-local scratch first and a
                background copy to the run dir (``store/tiers.py``)
``Collective``  several ranks sharing one run dir (``dist.py``)
``CrossNode``   several ranks, each with its own node's scratch (``crossnode.py``)
==============  ===========================================================

The Checkpointer picks one at start-up and talks to it only through
:class:`Placement`, so the save and resume paths read the same for all three.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from .config import StorageConfig
from .dist import ShardedRunDir
from .errors import CheckpointCorrupt
from .store import RunDir, Skipped, iter_valid, note_skip
from .store.commit import WriteFn
from .store.retry import RetryPolicy, commit_resilient
from .store.tiers import Tiers
from .store.verify import is_committed

__all__ = ["Collective", "Load", "Local", "Placement"]

log = logging.getLogger("slurm_ckpt")

Load = Callable[[Path, Any], Any]
"""``load(checkpoint dir, manifest)``: read one checkpoint, verifying its checksums."""


class Placement(Protocol):
    @property
    def search_dirs(self) -> list[Path]: ...

    def commit(self, step: int, write: WriteFn, **meta: Any) -> Path: ...

    def committed(self, step: int, path: Path) -> None:
        """After a commit: retention, and queueing the copy to the durable tier."""

    def is_durable(self, step: int) -> bool: ...

    def drain(self, timeout: float | None = None) -> bool: ...

    def take_error(self) -> BaseException | None: ...

    def load_latest(self, load: Load, skipped: list[Skipped] | None) -> tuple[Any, int, Path] | None:
        """(state, step, path) of the newest checkpoint that loads, or None."""

    def close(self, timeout: float | None = None) -> bool: ...


class Local:
    """One process's checkpoints: the run dir, with an optional scratch tier in front."""

    def __init__(self, run_dir: RunDir, tiers: Tiers | None, storage: StorageConfig, keep: int) -> None:
        self.run_dir, self.tiers, self.keep = run_dir, tiers, keep
        # With tiers: scratch first; when it fails for good, the durable tier.
        self._dirs = [run_dir] if tiers is None else [tiers.fast, run_dir]
        self._policies = [RetryPolicy.for_path(storage, d.path) for d in self._dirs]

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

    def load_latest(self, load: Load, skipped: list[Skipped] | None) -> tuple[Any, int, Path] | None:
        for cand in iter_valid(self.search_dirs, full=False, skipped=skipped):
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


class Collective:
    """Several ranks, one shared run dir: every save and resume is collective (dist.py).

    No retries: one rank retrying alone would desynchronise the others.
    """

    def __init__(self, run_dir: ShardedRunDir, keep: int) -> None:
        self.run_dir, self.keep = run_dir, keep

    @property
    def search_dirs(self) -> list[Path]:
        return [self.run_dir.path]

    def commit(self, step: int, write: WriteFn, **meta: Any) -> Path:
        return self.run_dir.commit(step, write, **meta)

    def committed(self, step: int, path: Path) -> None:
        self.run_dir.retain(self.keep, protect=[path])

    def is_durable(self, step: int) -> bool:
        return is_committed(self.run_dir.path, step)

    def drain(self, timeout: float | None = None) -> bool:
        return True

    def take_error(self) -> BaseException | None:
        return None

    def load_latest(self, load: Load, skipped: list[Skipped] | None) -> tuple[Any, int, Path] | None:
        return self.run_dir.load_latest(self.search_dirs, load, skipped)

    def close(self, timeout: float | None = None) -> bool:
        self.run_dir.unlock()
        return True

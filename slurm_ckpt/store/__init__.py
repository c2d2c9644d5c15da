"""The on-disk store: format, commit protocol, discovery, retention, locking.

``RunDir`` is the one object the rest of the package talks to.
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path
from typing import Any

from ..errors import storage_error
from .commit import WriteFn, commit
from .lock import RunDirLock
from .manifest import Manifest
from .retention import apply_retention, remove_stale_tmp
from .transfer import copy_checkpoint
from .verify import Candidate, Skipped, find_latest, iter_valid, note_skip, verify_checkpoint
from .writer import load_state

__all__ = [
    "Candidate",
    "Manifest",
    "RunDir",
    "Skipped",
    "WriteFn",
    "copy_checkpoint",
    "find_latest",
    "iter_valid",
    "load_state",
    "note_skip",
    "verify_checkpoint",
]


class RunDir:
    """A directory of ``step-N`` checkpoints with one writer at a time."""

    def __init__(self, path: str | Path, *, lock_timeout: float | None = 0) -> None:
        self.path = Path(path).absolute()
        self._lock = RunDirLock(self.path, lock_timeout)

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    def ensure(self) -> None:
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise storage_error(e, "cannot create run dir", self.path) from e

    def lock(self) -> None:
        """Take the writer lock (once) and clear temp dirs left by dead writers."""
        if not self._lock.held:
            self.ensure()
            self._lock.acquire()
            remove_stale_tmp(self.path)

    def unlock(self) -> None:
        self._lock.release()

    def commit(self, step: int, write: WriteFn, **meta: Any) -> Path:
        self.lock()
        return commit(self.path, step, write, **meta)

    def retain(self, keep: int, *, protect: Collection[Path] = ()) -> list[Path]:
        """Apply retention; ``protect`` (e.g. the checkpoint just committed) is never deleted.

        Old checkpoints vanish at once; their files are deleted in the background
        (``retention.reaped()`` waits for that).
        """
        return apply_retention(self.path, keep, protect=protect, later=True)

    def latest(self, *, full: bool = True, skipped: list[Skipped] | None = None) -> Candidate | None:
        return find_latest([self.path], full=full, skipped=skipped)

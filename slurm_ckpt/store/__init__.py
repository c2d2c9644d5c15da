"""The on-disk store: format, commit protocol, discovery, retention, locking.

``RunDir`` is the one object the rest of the package talks to.
"""

from __future__ import annotations

import importlib
from collections.abc import Collection
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import storage_error

if TYPE_CHECKING:
    from .commit import WriteFn
    from .load import load_state
    from .manifest import Manifest
    from .transfer import copy_checkpoint
    from .verify import Candidate, Skipped, find_latest, iter_valid, note_skip, verify_checkpoint

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


# Each name is imported on first use: the node hooks import one small module
# of the store (the step names), and a package that loaded the whole store
# first would cost every prolog the writer, the reader and the codecs.
_HOME = {
    "Candidate": "verify",
    "Manifest": "manifest",
    "Skipped": "verify",
    "WriteFn": "commit",
    "copy_checkpoint": "transfer",
    "find_latest": "verify",
    "iter_valid": "verify",
    "load_state": "load",
    "note_skip": "verify",
    "verify_checkpoint": "verify",
}


def __getattr__(name: str) -> Any:
    if name in _HOME:
        value = getattr(importlib.import_module(f".{_HOME[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


class RunDir:
    """A directory of ``step-N`` checkpoints with one writer at a time."""

    def __init__(self, path: str | Path, *, lock_timeout: float | None = 0) -> None:
        from .lock import RunDirLock

        self.path = Path(path).absolute()
        self._lock = RunDirLock(self.path, lock_timeout)

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    def ensure(self) -> None:
        try:
            # 0755 whatever the umask allows: a dir others can write in is refused by the
            # epilog's stage-out and by the next run (store/owner.py).
            missing = [p for p in (self.path, *self.path.parents) if not p.exists()]
            for path in reversed(missing):
                path.mkdir(mode=0o755, exist_ok=True)
        except OSError as e:
            raise storage_error(e, "cannot create run dir", self.path) from e

    @property
    def locked(self) -> bool:
        """True while this process holds the writer lock."""
        return self._lock.held

    @property
    def lock_timeout(self) -> float | None:
        """Seconds :meth:`lock` waits for another writer; None: without end."""
        return None if self._lock.timeout < 0 else self._lock.timeout

    def lock(self) -> None:
        """Take the writer lock (once) and clear temp dirs left by dead writers."""
        from .retention import remove_stale_tmp

        if not self._lock.held:
            self.ensure()
            self._lock.acquire()
            remove_stale_tmp(self.path)

    def unlock(self) -> None:
        self._lock.release()

    def commit(self, step: int, write: WriteFn, **meta: Any) -> Path:
        from .commit import commit

        self.lock()
        return commit(self.path, step, write, **meta)

    def retain(self, keep: int, *, protect: Collection[Path] = (), before: float | None = None) -> list[Path]:
        """Apply retention; ``protect`` (e.g. the checkpoint just committed) is never
        deleted, nor anything committed since ``before`` (see ``apply_retention``).

        Old checkpoints vanish at once; their files are deleted in the background
        (``retention.reaped()`` waits for that).
        """
        from .retention import apply_retention

        return apply_retention(self.path, keep, protect=protect, before=before, later=True)

    def latest(self, *, full: bool = True, skipped: list[Skipped] | None = None) -> Candidate | None:
        from .verify import find_latest

        return find_latest([self.path], full=full, skipped=skipped)

"""``SaveHandle``: one background save, its result and its fence."""

from __future__ import annotations

import threading
from pathlib import Path

__all__ = ["SaveHandle"]


class SaveHandle:
    """A save in flight. ``wait()`` returns the committed path or raises its error.

    A failed save's error is logged when it happens, raised by ``wait()``,
    and raised again by the next save (or only logged, with
    ``storage.on_async_error: warn``).
    """

    def __init__(self, step: int, captured: threading.Event | None = None, mode: str = "sync") -> None:
        self.step = step
        self.mode = mode
        """The snapshot mode the save used (what ``auto`` chose)."""
        self._done = threading.Event()
        self._captured = captured if captured is not None else threading.Event()
        self._path: Path | None = None
        self._error: BaseException | None = None

    def _finish(self, path: Path | None, error: BaseException | None) -> None:
        self._path, self._error = path, error
        self._captured.set()  # a save that failed early must not leave a fence hanging
        self._done.set()

    def done(self) -> bool:
        """True once the save is committed or has failed."""
        return self._done.is_set()

    def failed(self) -> bool:
        """True once the save has failed (``wait()`` raises its error)."""
        return self._done.is_set() and self._error is not None

    def fence(self, timeout: float | None = None) -> None:
        """Block until the save no longer reads the trainer's tensors.

        The opt-in ``lazy`` mode needs it before the next in-place update
        (``optimizer.step()``). In ``overlap`` mode ``optimizer.step()`` waits
        by itself; call it before changing large tensors any other way. In
        the other modes the data was captured before ``save_async`` returned,
        and it returns at once.
        """
        if not self._captured.wait(timeout):
            raise TimeoutError(f"save of step {self.step}: tensors not captured after {timeout}s")

    def wait(self, timeout: float | None = None) -> Path:
        """Block until committed; return the checkpoint path or raise the save's error."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"save of step {self.step} still running after {timeout}s")
        if self._error is not None:
            raise self._error
        assert self._path is not None
        return self._path

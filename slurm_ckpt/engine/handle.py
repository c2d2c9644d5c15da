"""``SaveHandle``: one background save, its result and its fence."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

__all__ = ["SaveHandle", "start_save", "take_error"]


class SaveHandle:
    """A save in flight. ``wait()`` returns the committed path or raises its error.

    A failed save's error is logged when it happens, and raised once, by
    whichever comes first: this handle's ``wait()``, or the Checkpointer's
    next save, ``preempted``, ``wait()`` or ``close()`` (those only log it
    with ``storage.on_async_error: warn``, except ``wait()``). Once raised,
    the Checkpointer does not raise it again; ``wait()`` has no path to
    return, so it raises the error every time it is called.
    """

    def __init__(self, step: int, captured: threading.Event | None = None, mode: str = "sync") -> None:
        self.step = step
        self.mode = mode
        """The snapshot mode the save used (what ``auto`` chose)."""
        self._done = threading.Event()
        self._captured = captured if captured is not None else threading.Event()
        self._path: Path | None = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._raised = False

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the save without raising its error; True once it is done."""
        return self._done.wait(timeout)

    def done(self) -> bool:
        """True once the save is committed or has failed."""
        return self._done.is_set()

    def failed(self) -> bool:
        """True once the save has failed (``wait()`` raises its error)."""
        return self._done.is_set() and self._error is not None

    def fence(self, timeout: float | None = None) -> None:
        """Block until the save no longer reads the trainer's tensors.

        Only the opt-in ``overlap`` needs it, before changing large tensors
        other than through ``optimizer.step()``, which waits by itself. In
        ``copy`` and ``fork`` (the default) the state was captured before
        ``save_async`` returned, and it returns at once.
        """
        if not self._captured.wait(timeout):
            raise TimeoutError(f"save of step {self.step}: tensors not captured after {timeout}s")

    def wait(self, timeout: float | None = None) -> Path:
        """Block until committed; return the checkpoint path or raise the save's error."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"save of step {self.step} still running after {timeout}s")
        if self._error is not None:
            with self._lock:
                self._raised = True
            raise self._error
        assert self._path is not None
        return self._path


def start_save(handle: SaveHandle, work: Callable[[], Path], cleanup: Callable[[], None]) -> None:
    """Run ``work`` (the commit) in a thread, then ``cleanup``, then mark ``handle`` done.

    ``cleanup`` runs before the handle is done: the next save is free to
    start once it is, and may reuse what ``work`` was still using.
    """

    def run() -> None:
        path, error = None, None
        try:
            path = work()
        except BaseException as e:  # surfaced on wait() and the next save
            error = e
        finally:
            cleanup()
            handle._path, handle._error = path, error
            handle._captured.set()  # a save that failed early must not leave a fence hanging
            handle._done.set()

    threading.Thread(target=run, name=f"slurm-ckpt-save-{handle.step}", daemon=False).start()


def take_error(handle: SaveHandle) -> BaseException | None:
    """The error of a finished save that nobody has raised yet; from now on it counts as raised."""
    with handle._lock:
        if not handle._done.is_set() or handle._error is None or handle._raised:
            return None
        handle._raised = True
        return handle._error

"""The background copy from node-local scratch to durable storage, newest first.

Both single-process tiers (``tiers.py``) and cross-node shards
(``placement/crossnode.py``) drain the same way, so the thread and its bookkeeping live
here once.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from .bounded import stall_watch

__all__ = ["Drainer"]

log = logging.getLogger("slurm_ckpt")

T = TypeVar("T")


class Drainer(Generic[T]):
    """Copies submitted items on one background thread, newest wins.

    An item submitted while another is being copied replaces any item still
    waiting: only the newest checkpoint is worth the bandwidth. ``copy(item)``
    runs without the lock; ``on_done(item, result)`` and ``on_change()`` run
    with it held (``cv``, re-entrant, so owners may take it around their own
    bookkeeping). A failed copy is kept for :meth:`take_error`; the item stays
    ``newest`` (so retention keeps it) until a later item is copied.

    A copy still running after ``stall_after`` seconds is *stalled* (the durable
    storage hangs): ``on_stall(True)`` is called, and :meth:`drain` stops
    waiting for it, since nothing can end a call hung in the kernel; the item
    stays on scratch for a later drain or the epilog. ``on_stall(False)`` when
    that copy ends.
    """

    def __init__(
        self,
        copy: Callable[[T], Any],
        *,
        name: str,
        describe: Callable[[T], str],
        enabled: bool = True,
        on_done: Callable[[T, Any], None] | None = None,
        on_change: Callable[[], None] | None = None,
        stall_after: float | None = None,
        on_stall: Callable[[bool], None] | None = None,
    ) -> None:
        self._copy, self._name, self._describe = copy, name, describe
        self._stall_after, self._on_stall = stall_after, on_stall
        self.stalled = False
        self.enabled = enabled
        """False (storage.drain): nothing is copied while the job runs; the epilog stages out."""
        self._on_done, self._on_change = on_done, on_change
        self.cv = threading.Condition()
        self.pending: T | None = None
        self.draining: T | None = None
        self.newest: T | None = None
        """The newest submitted item not copied yet."""
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def submit(self, item: T) -> None:
        with self.cv:
            self.pending = self.newest = item
            self._changed()
            if not self.enabled:
                self.pending = None  # kept as newest, so protected, for the epilog
                return
            if self._thread is None:
                # Not a daemon: the interpreter waits for a copy in progress at exit.
                self._thread = threading.Thread(target=self._run, name=self._name)
                self._thread.start()

    def in_flight(self) -> list[T]:
        """Items submitted and not yet copied (retention must keep them)."""
        with self.cv:
            return [i for i in (self.pending, self.draining, self.newest) if i is not None]

    @property
    def busy(self) -> bool:
        """True while the thread runs: a copy in progress, stalled or not, or one to follow."""
        with self.cv:
            return self._thread is not None

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until the thread is idle; True if the newest item was copied.

        False when ``timeout`` (seconds) passed first, the copy failed, or it is stalled.
        """
        with self.cv:
            idle = self.cv.wait_for(lambda: self._thread is None or self.stalled, timeout)
            return idle and self._thread is None and self.newest is None

    def take_error(self) -> BaseException | None:
        """The last copy error, once; None if there was none since the last call."""
        with self.cv:
            err, self._error = self._error, None
            return err

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change()

    def _watch(self, item: T) -> contextlib.AbstractContextManager[None]:
        if self._stall_after is None:
            return contextlib.nullcontext()

        def stall(on: bool) -> None:
            if on:
                log.error("%s: no answer from the storage in %.0fs (storage.hang_timeout); the "
                          "checkpoint stays on scratch until it answers", self._describe(item), self._stall_after)  # fmt: skip
            if self._on_stall is not None:  # first: a drain() that returns on the stall sees it reported
                self._on_stall(on)
            with self.cv:
                self.stalled = on
                self.cv.notify_all()

        return stall_watch(self._stall_after, stall)

    def _run(self) -> None:
        while True:
            with self.cv:
                item = self.draining = self.pending
                self.pending = None
                self.cv.notify_all()  # a copy starts, or the thread goes idle
                if item is None:
                    self._thread = None
                    return
            try:
                with self._watch(item):
                    result = self._copy(item)
            except Exception as e:  # surfaced by the Checkpointer per storage.on_async_error
                log.error("%s failed: %s; it stays on scratch for the next save or the epilog",
                          self._describe(item), e)  # fmt: skip
                with self.cv:
                    self._error = e
            else:
                with self.cv:
                    if self._on_done is not None:
                        self._on_done(item, result)
                    if self.newest == item:
                        self.newest = None
            finally:
                with self.cv:
                    self.draining = None
                    self._changed()
                    self.cv.notify_all()

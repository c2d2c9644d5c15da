"""Durable-tier I/O with a time bound: a hung system call holds a worker, never the trainer.

A write, an ``fsync`` or a ``statfs`` on a hung network filesystem (CephFS
through ``ceph-fuse`` with its servers stopped, GlusterFS before its ping
timeout) blocks in the kernel, in a state no signal ends. So the bound cannot
be a kill: the call runs on a worker thread (started before anything touches
the mount), and the caller stops waiting for it after ``storage.hang_timeout``
seconds. The worker is abandoned, not stopped; when the storage comes back it
finishes its call and then, at :func:`check_live`, gives up before the commit
can make the abandoned checkpoint visible (see ``commit.py``), so a save that
was reported failed commits nothing written after it was given up.

One worker may be stuck per directory: while it is, later calls fail at once
instead of piling up more stuck threads.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

from ..errors import StorageHung

__all__ = ["Bound", "check_live", "stall_watch"]

log = logging.getLogger("slurm_ckpt")

T = TypeVar("T")

_worker = threading.local()


def check_live() -> None:
    """Raise :class:`StorageHung` in a worker whose caller gave up on it.

    The commit calls it before the steps that make a checkpoint complete (the
    manifest, the rename): the data written after the caller went on may mix
    the state saved with the trainer's later changes.
    """
    bound: Bound | None = getattr(_worker, "bound", None)
    if bound is not None and bound.abandoned is threading.current_thread():
        raise StorageHung(bound.path, bound.timeout, "a save given up earlier")


class Bound:
    """Calls on one directory's storage, each given up after ``timeout`` seconds.

    ``on_stall(True)`` is called when a call is given up, ``on_stall(False)``
    when that call returns at last (the ``durable_stalled`` metric).
    """

    def __init__(self, path: str | os.PathLike[str], timeout: float,
                 on_stall: Callable[[bool], None] | None = None) -> None:  # fmt: skip
        self.path, self.timeout, self._on_stall = os.fspath(path), timeout, on_stall
        self.abandoned: threading.Thread | None = None
        """The worker given up on and still running, if any."""
        self._lock = threading.Lock()

    @property
    def stalled(self) -> bool:
        t = self.abandoned
        return t is not None and t.is_alive()

    def call(self, fn: Callable[[], T], what: str = "saving a checkpoint", *, extra: float | None = 0.0) -> T:
        """``fn()`` on a worker thread; its result or error, or :class:`StorageHung`
        once ``timeout`` seconds pass (or at once while an earlier call is still stuck).

        ``extra``: seconds the call may wait on purpose on top (for a lock
        another writer holds); None waits without bound.
        """
        if self.stalled:
            raise StorageHung(self.path, self.timeout, f"{what} (an earlier call there is still stuck)")
        done = threading.Event()
        out: list[T] = []
        err: list[BaseException] = []

        def run() -> None:
            _worker.bound = self
            try:
                out.append(fn())
            except BaseException as e:  # handed to the caller, or logged once it gave up
                err.append(e)
            finally:
                with self._lock:
                    done.set()
                    given_up = self.abandoned is threading.current_thread()
                    if given_up:
                        self.abandoned = None
                        self._stall(False)
                if given_up:
                    log.warning("%s in %s, given up earlier, returned: %s", what, self.path,
                                err[0] if err else "done")  # fmt: skip

        # A daemon: the interpreter must not wait at exit for a call stuck in the kernel.
        worker = threading.Thread(target=run, name="slurm-ckpt-durable-io", daemon=True)
        started = time.monotonic()
        worker.start()
        if not done.wait(None if extra is None else self.timeout + extra):
            with self._lock:
                if not done.is_set():  # else it returned just now: its result stands
                    self.abandoned = worker
                    self._stall(True)
            if self.abandoned is worker:
                log.error("%s in %s: no answer in %.1fs; giving up on it (it may still finish "
                          "when the storage is back, but commits nothing)", what, self.path,
                          time.monotonic() - started)  # fmt: skip
                raise StorageHung(self.path, self.timeout, what)
        if err:
            raise err[0]
        return out[0]

    def _stall(self, on: bool) -> None:
        if self._on_stall is not None:
            self._on_stall(on)


@contextlib.contextmanager
def stall_watch(timeout: float, on_stall: Callable[[bool], None]) -> Iterator[None]:
    """Call ``on_stall(True)`` if the block runs past ``timeout`` seconds, and
    ``on_stall(False)`` when it then ends. For I/O already off the trainer's
    thread (the tier drain), which only needs the stall to be seen."""
    lock = threading.Lock()
    state = {"stalled": False, "ended": False}

    def fire() -> None:
        with lock:
            if not state["ended"]:
                state["stalled"] = True
                on_stall(True)

    timer = threading.Timer(timeout, fire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        with lock:
            state["ended"] = True
            if state["stalled"]:
                on_stall(False)

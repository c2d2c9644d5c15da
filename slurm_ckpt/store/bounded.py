"""Durable-tier I/O with a time bound: a hung system call holds a worker, never the trainer.

A write, an ``fsync`` or a ``statfs`` on a hung network filesystem (CephFS
through ``ceph-fuse`` with its servers stopped, GlusterFS before its ping
timeout) blocks in the kernel, in a state no signal ends. So the bound cannot
be a kill: the call runs on a worker thread (started before anything touches
the mount), and the caller stops waiting for it once the storage has made no
:func:`progress` for ``storage.hang_timeout`` seconds. Slow storage that keeps
answering is not hung: each write, ``fsync`` and copied chunk restarts the
clock. The worker is abandoned, not stopped; when the storage comes back it
finishes its call and then, at :func:`check_live`, gives up before the commit
writes its manifest or renames (see ``commit.py``), so a save that was
reported failed commits nothing written after it was given up. A worker given
up during that rename (or the fsyncs around it) can still complete it: the
checkpoint then appears, whole, when the storage returns.

One worker may be stuck per directory: while it is, later calls fail at once
instead of piling up more stuck threads.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

from ..errors import StorageHung

__all__ = ["Bound", "check_live", "progress", "stall_watch", "ticker"]

log = logging.getLogger("slurm_ckpt")

T = TypeVar("T")

_worker = threading.local()


class _Clock:
    """When the storage last answered one bounded call."""

    def __init__(self) -> None:
        self.last = time.monotonic()

    def tick(self) -> None:
        self.last = time.monotonic()

    def idle(self) -> float:
        return time.monotonic() - self.last


def progress() -> None:
    """Note that the storage answered (a write, an fsync, a copied chunk): the
    bounded call or watched block this thread runs in is not hung."""
    clock: _Clock | None = getattr(_worker, "clock", None)
    if clock is not None:
        clock.tick()


def _nothing() -> None:
    pass


def ticker() -> Callable[[], None]:
    """:func:`progress` of this thread's call, for the I/O threads it starts."""
    clock: _Clock | None = getattr(_worker, "clock", None)
    return clock.tick if clock is not None else _nothing


def check_live() -> None:
    """Raise :class:`StorageHung` in a worker whose caller gave up on it.

    The commit calls it before the steps that make a checkpoint complete (the
    manifest, the rename): the data written after the caller went on may mix
    the state saved with the trainer's later changes.
    """
    bound: Bound | None = getattr(_worker, "bound", None)
    if bound is not None and bound.abandoned is threading.current_thread():
        raise StorageHung(bound.path, bound.timeout, "a save given up earlier")


class _IoThread:
    """The daemon thread that runs one Bound's calls in turn: one thread for a
    checkpointer's life rather than one started for every save. It is replaced
    only when a call on it is given up."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        # A daemon: the interpreter must not wait at exit for a call stuck in the kernel.
        self.thread = threading.Thread(target=self._loop, name="slurm-ckpt-durable-io", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while (job := self.jobs.get()) is not None:
            job()


class Bound:
    """Calls on one directory's storage, each given up after ``timeout`` seconds
    without :func:`progress`.

    ``on_stall(True)`` is called when a call is given up, ``on_stall(False)``
    when that call returns at last (the ``durable_stalled`` metric).
    """

    def __init__(self, path: str | os.PathLike[str], timeout: float,
                 on_stall: Callable[[bool], None] | None = None) -> None:  # fmt: skip
        self.path, self.timeout, self._on_stall = os.fspath(path), timeout, on_stall
        self.abandoned: threading.Thread | None = None
        """The worker given up on and still running, if any."""
        self._lock = threading.Lock()
        self._io: _IoThread | None = None

    @property
    def stalled(self) -> bool:
        t = self.abandoned
        return t is not None and t.is_alive()

    def call(self, fn: Callable[[], T], what: str = "saving a checkpoint", *, extra: float | None = 0.0) -> T:
        """``fn()`` on a worker thread; its result or error, or :class:`StorageHung`
        once ``timeout`` seconds pass without progress (or at once while an
        earlier call is still stuck).

        ``extra``: seconds the call may wait on purpose on top (for a lock
        another writer holds); None waits without bound.
        """
        if self.stalled:
            raise StorageHung(self.path, self.timeout, f"{what} (an earlier call there is still stuck)")
        done = threading.Event()
        out: list[T] = []
        err: list[BaseException] = []

        clock = _Clock()
        if self._io is None:
            self._io = _IoThread()
        io = self._io

        def run() -> None:
            _worker.bound, _worker.clock = self, clock
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
                    io.jobs.put(None)  # a fresh thread serves the calls made since
                    log.warning("%s in %s, given up earlier, returned: %s", what, self.path,
                                err[0] if err else "done")  # fmt: skip

        started = time.monotonic()
        io.jobs.put(run)
        if not _wait(done, clock, None if extra is None else self.timeout + extra):
            with self._lock:
                if not done.is_set():  # else it returned just now: its result stands
                    self.abandoned, self._io = io.thread, None
                    self._stall(True)
            if self.abandoned is io.thread:
                log.error("%s in %s: no answer in %.1fs (%.1fs since the call began); giving up on it "
                          "(it may still finish when the storage is back)", what, self.path, clock.idle(),
                          time.monotonic() - started)  # fmt: skip
                raise StorageHung(self.path, self.timeout, what)
        if err:
            raise err[0]
        return out[0]

    def close(self) -> None:
        """End the worker thread once it is idle (a stuck one ends when its call returns)."""
        if self._io is not None:
            self._io.jobs.put(None)
            self._io = None

    def _stall(self, on: bool) -> None:
        if self._on_stall is not None:
            self._on_stall(on)


def _wait(done: threading.Event, clock: _Clock, limit: float | None) -> bool:
    """Wait for ``done`` until ``clock`` has been idle for ``limit`` seconds; whether it was set."""
    if limit is None:
        return done.wait()
    while not done.wait(max(0.0, limit - clock.idle())):
        if clock.idle() >= limit:
            return done.is_set()
    return True


@contextlib.contextmanager
def stall_watch(timeout: float, on_stall: Callable[[bool], None]) -> Iterator[None]:
    """Call ``on_stall(True)`` once the block has made no :func:`progress` for
    ``timeout`` seconds, and ``on_stall(False)`` when it moves again or ends.
    For I/O already off the trainer's thread (the tier drain), which only needs
    the stall to be seen."""
    clock = _Clock()
    ended = threading.Event()

    def watch() -> None:
        stalled = False
        while True:
            idle = clock.idle()
            if stalled != (idle >= timeout):
                stalled = not stalled
                on_stall(stalled)
            # While stalled, look again soon: the storage may answer at any moment.
            wait = min(1.0, timeout / 4) if stalled else timeout - idle
            if ended.wait(max(0.0, wait)):
                break
        if stalled:
            on_stall(False)

    watcher = threading.Thread(target=watch, name="slurm-ckpt-stall-watch", daemon=True)
    outer = getattr(_worker, "clock", None)
    _worker.clock = clock
    watcher.start()
    try:
        yield
    finally:
        _worker.clock = outer
        ended.set()
        watcher.join()

"""Memory-to-memory copies of many pieces, split over threads: the staging copy's engine.

A snapshot copies the state's CPU tensors into the staging buffer while the
trainer waits; the writer's checksum threads and the disk read the buffer
afterwards, in the background. The copy is bound by memory bandwidth, so two
things decide how long the trainer waits:

* **The stores.** An ordinary store reads each destination cache line before
  writing it; a non-temporal store does not, so a copy larger than the cache
  moves two bytes over the memory bus per byte instead of three. glibc's
  ``memmove`` uses them only for one copy larger than most of the last-level
  cache, which a whole state in one piece is and its tensors one by one are
  not. ``_memcopy.c`` streams every piece of 4 KiB or more. The buffer is then
  not in the cache when the checksum threads read it, which costs the
  background write, not the stall. ``_memcopy.c`` is a shared library, not a
  Python module: it is built at install time where a C compiler is present
  and loaded here with ctypes; without it every piece goes through
  ``ctypes.memmove`` (:func:`nontemporal` says which).
* **The threads.** A few cores' copies fill the bandwidth, and both ways of
  calling C here release the GIL, so the bytes are shared among
  :func:`copy_threads` threads instead of each tensor being handed to torch's
  intra-op threads in turn, which wait for one another at the end of every
  tensor and lose most when other processes share the cores. The native copy
  hands the bytes out 2 MiB at a time to whichever thread asks first: on
  shared cores the threads of one copy do not run at the same speed, and with
  shares fixed in advance the trainer waits for the slowest.

The pieces must not overlap one another's destinations or a destination its
source.
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import importlib.machinery
import logging
import os
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path

__all__ = ["Piece", "copy_bytes", "copy_threads", "nontemporal"]

log = logging.getLogger("slurm_ckpt")

Piece = tuple[int, int, int]
"""(destination address, source address, bytes) of one copy."""

_SPLIT = 8 << 20  # below this, one thread copies it all: waking others costs more
# What a thread of the native copy claims at a time: small enough that the
# threads finish close together, large enough that claiming costs nothing.
_CHUNK = 2 << 20


def _load_native() -> ctypes.CDLL | None:
    here = Path(__file__).parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = here / f"_memcopy{suffix}"
        if not path.exists():
            continue
        try:
            lib = ctypes.CDLL(str(path))
            lib.sckpt_copy_shared.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_uint64]
            lib.sckpt_nontemporal.argtypes = []
        except (OSError, AttributeError) as e:  # unloadable, or built from another version
            log.warning("cannot use %s (%s); staging copies use memmove", path.name, e)
            return None
        lib.sckpt_copy_shared.restype = None
        lib.sckpt_nontemporal.restype = ctypes.c_int
        return lib
    return None


_native = _load_native()


def nontemporal() -> bool:
    """Whether staging copies use non-temporal stores (the native copy was built, on x86-64)."""
    return _native is not None and bool(_native.sckpt_nontemporal())


def copy_threads() -> int:
    """Threads a staging copy runs on: one per core this process may use, at most 8.

    A copy is bound by memory bandwidth, which a few cores' copies fill; the
    trainer waits for the copy, so its cores are free meanwhile.
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(8, cores))


def copy_bytes(pieces: Sequence[Piece], *, threads: int = 1, libc: bool = False) -> None:
    """Copy every piece, the bytes split over ``threads`` threads (this one included).

    The native copy hands out the bytes a chunk at a time to whichever thread
    asks first; ``memmove`` splits them evenly in advance. ``libc``: one
    ``memmove`` per piece, through the cache, whether or not the native copy
    is built (the bench's floor).
    """
    if sum(n for _, _, n in pieces) < _SPLIT:
        threads = 1
    if libc or _native is None:
        _memmove_split(pieces, threads)
        return
    flat = array.array("Q", [v for piece in pieces for v in piece])  # struct piece[] in C
    cursor = ctypes.c_uint64(0)
    args = (flat.buffer_info()[0], len(pieces), ctypes.byref(cursor), _CHUNK)
    futures: list[Future[None]] = []
    with contextlib.suppress(RuntimeError):  # a pool shut down (interpreter exit): copy alone
        for _ in range(threads - 1):
            futures.append(_thread_pool(threads - 1).submit(_native.sckpt_copy_shared, *args))
    try:
        _native.sckpt_copy_shared(*args)  # a ctypes foreign call: it releases the GIL
    finally:
        # Every chunk is claimed once this call returns, but a helper may still be
        # copying its last one: it reads ``flat`` and writes the caller's buffer,
        # so neither may go before it is done, even if this thread is interrupted.
        wait(futures)
    for f in futures:
        f.result()


def _memmove_split(pieces: Sequence[Piece], threads: int) -> None:
    """One ``memmove`` per piece, the bytes split evenly over ``threads`` threads."""
    if threads <= 1:
        _memmove_all(pieces)
        return
    share = -(-sum(n for _, _, n in pieces) // threads)
    share += -share % 4096  # cut at page boundaries of the buffer
    shares: list[list[Piece]] = [[]]
    room = share
    for dst, src, n in pieces:
        while n:
            take = min(n, room)
            shares[-1].append((dst, src, take))
            dst, src, n, room = dst + take, src + take, n - take, room - take
            if not room:
                shares.append([])
                room = share
    pool = _thread_pool(threads - 1)
    futures = [pool.submit(_memmove_all, part) for part in shares[1:] if part]
    _memmove_all(shares[0])
    for f in futures:
        f.result()


def _memmove_all(pieces: Sequence[Piece]) -> None:
    move = ctypes.memmove  # a ctypes foreign call: it releases the GIL
    for dst, src, n in pieces:
        move(dst, src, n)


_pool: ThreadPoolExecutor | None = None
_pool_workers = 0
_pool_lock = threading.Lock()


def _thread_pool(workers: int) -> ThreadPoolExecutor:
    global _pool, _pool_workers
    with _pool_lock:
        if _pool is None or _pool_workers < workers:
            if _pool is not None:
                _pool.shutdown(wait=False)
            _pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="slurm-ckpt-memcpy")
            _pool_workers = workers
        return _pool


def _forget_pool_in_child() -> None:
    # A forked child has the pool object but none of its threads, and maybe a
    # lock another thread held at the fork: it starts without either.
    global _pool, _pool_workers, _pool_lock
    _pool, _pool_workers, _pool_lock = None, 0, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool_in_child)

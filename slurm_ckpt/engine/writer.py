"""The parallel tensor-file writer: O_DIRECT, from the tensors' own memory where it lines up.

The file is cut into write calls (``layout.plan_writes``): stretches of large
tensors that line up with the file's pages are written straight from the
tensor's memory; the rest (header, small tensors, the ends of large ones) is
gathered into an aligned bounce buffer, so many small tensors become one
write. Worker threads take the writes in file order, so the ones in flight
sit next to each other and the disk sees a near-sequential stream at a queue
depth of ``threads``. Each write's crc32 is computed on exactly the bytes it
sends, and the crcs are combined in order at the end.

``O_DIRECT`` skips the page cache: no copy into it, and no dirty-page
throttling of other writers. ``pwrite``, ``memmove`` and ``crc32`` (zlib or ISA-L) all
release the GIL, so the threads run in parallel.

Fallbacks: a filesystem that refuses ``O_DIRECT`` at open, or at write time
with ``EINVAL`` (FUSE, some network filesystems), or that runs it slower than
buffered writes (ceph-fuse, ``fsinfo.DIRECT_IO_SLOW``), gets buffered writes from
the same memory (``pwritev`` gathers without a bounce buffer). The unaligned
tail of the file is always written buffered. ``fsync`` at the end makes both
kinds durable.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading
from collections.abc import Callable
from pathlib import Path

from ..errors import storage_error
from ..fsinfo import direct_io_pays
from ..store.bounded import ticker
from ..store.crc import crc32, crc32_of_chunks, crc_threads
from ..store.fsutil import fsync_file, preallocate
from ..store.tensorfile import FileRecord
from .buffers import ALIGN, address_of, memory_view, pool
from .layout import FileImage, Segment, Write, plan_writes

__all__ = ["write_image"]

_IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)


def write_image(
    path: Path,
    image: FileImage,
    *,
    threads: int = 4,
    chunk: int = 8 << 20,
    direct: bool = True,
    in_place: bool = True,
    cancel: Callable[[], bool] | None = None,
) -> FileRecord:
    """Create ``path`` holding ``image``, fsync it, and return its size and crc32.

    ``cancel`` is polled between chunks; when it returns True the write stops
    with ``ECANCELED`` (the forked writer uses it to stop when its parent dies).
    ``in_place=False`` sends every byte through bounce buffers: a forked writer
    must, because pinning a page it shares with its parent for O_DIRECT makes
    the kernel copy that page first: a page fault for every page, and a full
    second copy of the state in memory.
    """
    if chunk <= 0 or chunk % ALIGN:
        raise ValueError(f"chunk size {chunk} must be a positive multiple of {ALIGN}")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise storage_error(e, "cannot create data file", path) from e
    dfd = -1
    try:
        # The whole file's space first: a full disk or quota then fails the
        # save before it writes a byte, and on ext4 the O_DIRECT writes land
        # inside the file's length, which lets them run in parallel instead
        # of one at a time under the inode lock (allocating writes past the
        # end take it exclusively).
        preallocate(fd, image.size)
        if direct and image.size >= ALIGN and direct_io_pays(path.parent):
            dfd = _open_direct(path)
        job = _Job(plan_writes(image.pieces, chunk, direct=dfd >= 0 and in_place), chunk, fd, dfd, cancel)
        job.run(threads)
        fsync_file(fd, path)
    except OSError as e:
        raise storage_error(e, "cannot write data file", path) from e
    finally:
        if dfd >= 0:
            os.close(dfd)
        os.close(fd)
    return FileRecord(image.size, f"{crc32_of_chunks(job.results):08x}")


def _open_direct(path: Path) -> int:
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return -1
    try:
        return os.open(path, os.O_WRONLY | os.O_CLOEXEC | flag)
    except OSError as e:
        if e.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return -1  # tmpfs on old kernels, FUSE without direct_io: buffered it is
        raise


class _Job:
    """One file's writes, handed out in order to writer threads, checksummed beside them."""

    def __init__(
        self,
        writes: list[Write],
        chunk: int,
        fd: int,
        dfd: int,
        cancel: Callable[[], bool] | None,
    ) -> None:
        self.writes = writes
        self.chunk = chunk
        self.fd = fd
        self.dfd = dfd
        self.cancel = cancel
        # Built on the committing thread: its writer threads tell a bounded commit
        # (store/bounded.py) that the storage still answers.
        self.progress = ticker()
        self.direct_ok = dfd >= 0
        # One (crc, length) per segment, in file order.
        self.crcs: list[list[tuple[int, int]]] = [[(0, 0)] * len(w.segments) for w in writes]
        # Segments read from the trainer's memory in place: their memory does
        # not change, so other threads checksum them while the writes run (a
        # writer thread that stopped to checksum would leave the disk's queue
        # shallower; ``bench/profile_engine.py`` compares the two).
        self._crc_todo = [(k, i) for k, w in enumerate(writes) for i, seg in enumerate(w.segments)
                          if self._in_place(seg)]  # fmt: skip
        self._crc_next = 0
        self._next = 0
        self._lock = threading.Lock()
        self._error: BaseException | None = None

    @property
    def results(self) -> list[tuple[int, int]]:
        return [c for per_write in self.crcs for c in per_write]

    def _in_place(self, seg: Segment) -> bool:
        return seg.in_place or self.dfd < 0

    def run(self, threads: int) -> None:
        n = max(1, min(threads, len(self.writes)))
        c = min(len(self._crc_todo), crc_threads())
        workers = [threading.Thread(target=self._guard, args=(self._writer,), name=f"slurm-ckpt-write-{i}",
                                    daemon=True) for i in range(n)]  # fmt: skip
        workers += [threading.Thread(target=self._guard, args=(self._checksummer,), name=f"slurm-ckpt-crc-{i}",
                                     daemon=True) for i in range(c)]  # fmt: skip
        if len(workers) == 1:
            workers[0].run()
        else:
            for w in workers:
                w.start()
            for w in workers:
                w.join()
        if self._error is not None:
            raise self._error

    def _guard(self, body: Callable[[], None]) -> None:
        try:
            body()
        except BaseException as e:  # handed to run(), which raises it in the caller
            with self._lock:
                if self._error is None:
                    self._error = e

    def _take(self) -> int | None:
        with self._lock:
            if self._error is not None or self._next >= len(self.writes):
                return None
            k = self._next
            self._next += 1
            return k

    def _checksummer(self) -> None:
        while True:
            with self._lock:
                if self._error is not None or self._crc_next >= len(self._crc_todo):
                    return
                k, i = self._crc_todo[self._crc_next]
                self._crc_next += 1
            seg = self.writes[k].segments[i]
            crc = 0
            for a, m in seg.pieces:
                crc = crc32(memory_view(a, m), crc)
            self.crcs[k][i] = (crc, seg.size)

    def _writer(self) -> None:
        bounce = None
        try:
            while (k := self._take()) is not None:
                if self.cancel is not None and self.cancel():
                    raise OSError(errno.ECANCELED, "write cancelled")
                w = self.writes[k]
                if bounce is None and not all(self._in_place(seg) for seg in w.segments):
                    bounce = pool.acquire(self.chunk)
                self._write(k, w, bounce)
                self.progress()
        finally:
            if bounce is not None:
                pool.release(bounce)

    def _write(self, k: int, w: Write, bounce: mmap.mmap | None) -> None:
        iov: list[memoryview] = []
        base = address_of(bounce) if bounce is not None else 0
        pos = 0
        for i, seg in enumerate(w.segments):
            if self._in_place(seg):
                iov += [memory_view(a, m) for a, m in seg.pieces]
                continue
            start = pos
            for a, m in seg.pieces:
                ctypes.memmove(base + pos, a, m)
                pos += m
            view = memory_view(base + start, seg.size)
            self.crcs[k][i] = (crc32(view), seg.size)
            iov.append(view)
        body = w.size - w.size % ALIGN if self.direct_ok else 0
        if body:
            try:
                _pwritev_all(self.dfd, _cut(iov, body), w.offset)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                # The device wants a larger alignment than 4 KiB: write buffered.
                self.direct_ok = False
                body = 0
        if body < w.size:
            _pwritev_all(self.fd, _cut(iov, w.size, body), w.offset + body)


def _cut(views: list[memoryview], end: int, start: int = 0) -> list[memoryview]:
    """The bytes ``[start, end)`` of the concatenation of ``views``."""
    out = []
    pos = 0
    for v in views:
        lo, hi = max(start - pos, 0), min(end - pos, len(v))
        if lo < hi:
            out.append(v[lo:hi])
        pos += len(v)
    return out


def _pwritev_all(fd: int, views: list[memoryview], off: int) -> None:
    views = [v for v in views if len(v)]
    i = 0
    while i < len(views):
        n = os.pwritev(fd, views[i : i + _IOV_MAX], off)
        if n <= 0:
            raise OSError(errno.EIO, "pwritev wrote nothing")
        off += n
        while n and i < len(views):
            if n >= len(views[i]):
                n -= len(views[i])
                i += 1
            else:
                views[i] = views[i][n:]
                n = 0

"""The parallel tensor-file writer: O_DIRECT through aligned buffers, checksummed as it streams.

The file is cut into fixed-size chunks. Worker threads take chunks in file
order, so the writes in flight sit next to each other and the disk sees a
near-sequential stream at a queue depth of ``threads``. For each chunk a worker

1. gathers its pieces into an aligned bounce buffer (or uses the memory in
   place when it is one aligned piece): many small tensors become one write;
2. computes the chunk's crc32 on exactly the bytes it is about to write;
3. writes it with ``pwrite`` on an ``O_DIRECT`` descriptor, which skips the
   page cache: no copy into it, and no dirty-page throttling of other writers.

``pwrite``, ``memmove`` and ``zlib.crc32`` all release the GIL, so threads run
in parallel. The per-chunk crcs are combined in order at the end.

Fallbacks: a filesystem that refuses ``O_DIRECT`` at open (``EINVAL``: some
FUSE and network filesystems) or at write time gets buffered ``pwritev``
straight from the tensors' memory instead. The unaligned tail of the file is
always written buffered. ``fsync`` at the end makes both kinds durable.
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading
import zlib
from collections.abc import Callable
from pathlib import Path

from ..errors import storage_error
from ..store.fsutil import fsync_file
from ..store.tensorfile import FileRecord
from .buffers import ALIGN, address_of, memory_view, pool
from .crc import crc32_of_chunks
from .layout import FileImage, Piece, chunk_pieces

__all__ = ["write_image"]

_IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)


def write_image(
    path: Path,
    image: FileImage,
    *,
    threads: int = 4,
    chunk: int = 8 << 20,
    direct: bool = True,
    cancel: Callable[[], bool] | None = None,
) -> FileRecord:
    """Create ``path`` holding ``image``, fsync it, and return its size and crc32.

    ``cancel`` is polled between chunks; when it returns True the write stops
    with ``ECANCELED`` (the forked writer uses it to stop when its parent dies).
    """
    if chunk <= 0 or chunk % ALIGN:
        raise ValueError(f"chunk size {chunk} must be a positive multiple of {ALIGN}")
    chunks = chunk_pieces(image.pieces, chunk)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise storage_error(e, "cannot create data file", path) from e
    dfd = -1
    try:
        if direct and image.size >= ALIGN:
            dfd = _open_direct(path)
        job = _Job(chunks, chunk, fd, dfd, cancel)
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
    """One file's chunks, handed out in order to worker threads."""

    def __init__(
        self,
        chunks: list[list[Piece]],
        chunk: int,
        fd: int,
        dfd: int,
        cancel: Callable[[], bool] | None,
    ) -> None:
        self.chunks = chunks
        self.chunk = chunk
        self.fd = fd
        self.dfd = dfd
        self.cancel = cancel
        self.direct_ok = dfd >= 0
        self.results: list[tuple[int, int]] = [(0, 0)] * len(chunks)
        self._next = 0
        self._lock = threading.Lock()
        self._error: BaseException | None = None

    def run(self, threads: int) -> None:
        n = max(1, min(threads, len(self.chunks)))
        if n == 1:
            self._worker()
        else:
            workers = [threading.Thread(target=self._worker, name=f"slurm-ckpt-write-{i}", daemon=True)
                       for i in range(n)]  # fmt: skip
            for w in workers:
                w.start()
            for w in workers:
                w.join()
        if self._error is not None:
            raise self._error

    def _take(self) -> int | None:
        with self._lock:
            if self._error is not None or self._next >= len(self.chunks):
                return None
            k = self._next
            self._next += 1
            return k

    def _worker(self) -> None:
        bounce = pool.acquire(self.chunk) if self.dfd >= 0 else None
        try:
            while (k := self._take()) is not None:
                if self.cancel is not None and self.cancel():
                    raise OSError(errno.ECANCELED, "write cancelled")
                self.results[k] = self._write_chunk(self.chunks[k], k * self.chunk, bounce)
        except BaseException as e:  # handed to run(), which raises it in the caller
            with self._lock:
                if self._error is None:
                    self._error = e
        finally:
            if bounce is not None:
                pool.release(bounce)

    def _write_chunk(self, pieces: list[Piece], off: int, bounce: object) -> tuple[int, int]:
        n = sum(m for _, m in pieces)
        if not self.direct_ok or bounce is None:
            views = [memory_view(a, m) for a, m in pieces]
            crc = 0
            for v in views:
                crc = zlib.crc32(v, crc)
            _pwritev_all(self.fd, views, off)
            return crc, n
        if len(pieces) == 1 and pieces[0][0] % ALIGN == 0:
            src = memory_view(*pieces[0])  # aligned already (a staging image): no copy
        else:
            base = address_of(bounce)  # type: ignore[arg-type]
            pos = 0
            for a, m in pieces:
                ctypes.memmove(base + pos, a, m)
                pos += m
            src = memory_view(base, n)
        crc = zlib.crc32(src)
        body = n - n % ALIGN
        if body:
            try:
                _pwrite_all(self.dfd, src[:body], off)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                # The device wants a larger alignment than 4 KiB: write buffered.
                self.direct_ok = False
                _pwrite_all(self.fd, src[:body], off)
        if body < n:
            _pwrite_all(self.fd, src[body:], off + body)
        return crc, n


def _pwrite_all(fd: int, view: memoryview, off: int) -> None:
    while view:
        n = os.pwrite(fd, view, off)
        if n <= 0:
            raise OSError(errno.EIO, "pwrite wrote nothing")
        view = view[n:]
        off += n


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

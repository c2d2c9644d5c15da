"""The device's own limits, and a cold page cache: what the benchmarks measure against."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path

from slurm_ckpt.engine.buffers import ALIGN, aligned_buffer
from slurm_ckpt.store.fsutil import preallocate

__all__ = ["Raw", "drop_cache", "fsync_path"]


def drop_cache(paths: list[Path]) -> str:
    """Evict ``paths`` from the page cache; returns how it was done."""
    os.sync()
    if os.geteuid() == 0:
        try:
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
            return "drop_caches"
        except OSError:
            pass
    for p in paths:
        for f in [p] if p.is_file() else [q for q in p.rglob("*") if q.is_file()]:
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return "fadvise"


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Raw:
    """The device's own limit: sequential I/O of a page-aligned buffer, O_DIRECT
    unless ``direct=False`` (buffered, then fsync: faster where the filesystem's
    client runs O_DIRECT slowly, as ceph-fuse does)."""

    def __init__(self, nbytes: int, chunk: int, *, huge: bool = True) -> None:
        self.nbytes = -(-nbytes // ALIGN) * ALIGN
        self.chunk = chunk
        self.buf = aligned_buffer(self.nbytes, huge=huge)
        view = memoryview(self.buf)
        pattern = os.urandom(1 << 20)
        for off in range(0, self.nbytes, len(pattern)):
            n = min(len(pattern), self.nbytes - off)
            view[off : off + n] = pattern[:n]
        view.release()

    def write(self, path: Path, threads: int, *, direct: bool = True) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (getattr(os, "O_DIRECT", 0) if direct else 0)
        fd = os.open(path, flags, 0o644)
        try:
            preallocate(fd, self.nbytes)  # as the engine does: the limit is measured like for like
            self._parallel(threads, lambda v, off: os.pwrite(fd, v, off))
            os.fsync(fd)
        finally:
            os.close(fd)

    def read(
        self,
        path: Path,
        threads: int,
        into: memoryview | None = None,
        landed: Callable[[memoryview], None] = lambda v: None,
        *,
        direct: bool = True,
    ) -> None:
        """Read into our buffer, or into ``into`` (page-aligned, ``nbytes`` long);
        ``landed(piece)`` is called on each piece once it is read whole. A file
        shorter than ``nbytes`` (any other file, such as a checkpoint's) is read to its end."""
        fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECT", 0) if direct else 0))
        try:
            self._parallel(threads, lambda v, off: os.preadv(fd, [v], off), into, landed, os.fstat(fd).st_size)
        finally:
            os.close(fd)

    def _parallel(
        self,
        threads: int,
        io: Callable[[memoryview, int], int],
        into: memoryview | None = None,
        landed: Callable[[memoryview], None] = lambda v: None,
        end: int | None = None,
    ) -> None:
        offsets = iter(range(0, self.nbytes, self.chunk))
        end = self.nbytes if end is None else end
        lock = threading.Lock()
        view = memoryview(self.buf) if into is None else into
        failed: list[BaseException] = []

        def worker() -> None:
            try:
                while not failed:
                    with lock:
                        off = next(offsets, None)
                    if off is None:
                        return
                    piece = v = view[off : off + self.chunk]
                    while v:
                        n = io(v, off)
                        if n == 0 and off >= end:
                            break
                        if n <= 0:
                            raise OSError(f"raw I/O stopped at byte {off}")
                        v, off = v[n:], off + n
                    landed(piece)
            except BaseException as e:  # raised below: a failed read must not time as a fast one
                failed.append(e)

        pool = [threading.Thread(target=worker) for _ in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        if into is None:
            view.release()
        if failed:
            raise failed[0]

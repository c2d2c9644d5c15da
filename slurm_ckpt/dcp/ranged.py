"""Reads of parts of stored chunks, each block verified against its crc32 before use.

A load at a new world size needs, of each stored chunk, a hypercube: a row
band of a tensor sharded on dim 0, a column band of one sharded on dim 1, all
of a replicated one. In row-major order a hypercube is a set of byte runs
(:func:`runs`); a dim-0 band is a single run. Only the blocks the runs touch
are read (see ``index.block_size``: a run costs at most one block more at
each end than its own bytes), and each block's crc32 is checked against the
manifest before its bytes reach the caller's tensor: a flipped bit anywhere in
what a rank reads is a :class:`CheckpointCorrupt` naming the file, never a
silently wrong weight.

A single run into a contiguous CPU tensor of the same dtype is read straight
into the tensor's memory for its whole blocks (the usual case: the same world
size, or a dim-0 reshard), and through a small buffer for the partial blocks at
its ends. Then the crcs of the whole blocks are checked in place: if one fails,
that tensor holds part of the file (as with the engine's in-place reads), and
the caller loads an older checkpoint over it. Everything else is read into a
buffer, verified, and copied out.

The reads run on a thread pool (they, the copies and the crc32 release the
GIL). They bypass the page cache where the filesystem allows: ``O_DIRECT``
reads of the aligned span into one of the engine's bounce buffers, copied to
their place (``engine/direct.py``), in stretches of up to ``STRETCH`` bytes;
where ``O_DIRECT`` is refused, buffered ``preadv``.

An item stored without block crcs (a tensor of a checkpoint that
``Checkpointer.save`` wrote of plain tensors, ``plain.py``) is read after its
whole file has been checked once against the manifest's crc32.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ..engine.buffers import ALIGN
from ..engine.direct import open_direct, read_through_bounce  # the engine's own aligned reads
from ..errors import CheckpointCorrupt, storage_error
from ..store.crc import crc32
from ..store.fsutil import open_regular
from ..store.tensorfile import FileRecord
from .index import Stored

__all__ = ["RangeReader", "runs"]

STRETCH = 8 << 20
"""The most bytes one read asks for (consecutive whole blocks are read together)."""

Run = tuple[int, int]
"""Bytes ``[begin, end)`` relative to the start of a chunk."""


def runs(sizes: Sequence[int], offsets: Sequence[int], lengths: Sequence[int], itemsize: int) -> list[Run]:
    """The byte runs, in order, of the hypercube ``offsets``/``lengths`` of a row-major chunk of ``sizes``.

    Trailing dims taken whole merge into one run; so a band of whole rows is one run.
    """
    n = len(sizes)
    if any(o < 0 or ln < 0 or o + ln > s for s, o, ln in zip(sizes, offsets, lengths, strict=True)):
        raise ValueError(f"hypercube {list(offsets)}+{list(lengths)} exceeds chunk {list(sizes)}")
    if math.prod(lengths) == 0:
        return []
    strides = [itemsize] * n
    for d in range(n - 2, -1, -1):
        strides[d] = strides[d + 1] * sizes[d + 1]
    # k: the first dim from which the cube spans everything to the right (one run per index left of k).
    k = n
    while k > 0 and (k == n or (offsets[k] == 0 and lengths[k] == sizes[k])):
        k -= 1
    run_len = lengths[k] * strides[k] if n else itemsize
    out: list[Run] = []

    def walk(d: int, base: int) -> None:
        if d == k:
            start = base + (offsets[k] * strides[k] if n else 0)
            out.append((start, start + run_len))
            return
        for i in range(offsets[d], offsets[d] + lengths[d]):
            walk(d + 1, base + i * strides[d])

    walk(0, 0)
    return out


class RangeReader:
    """Block-verified reads from the files of one committed checkpoint.

    ``bytes_read`` counts the bytes read from the files; ``bytes_needed`` the
    bytes of the runs asked for (the least any reader could read).
    """

    def __init__(self, ckpt: Path, files: dict[str, FileRecord], *, threads: int = 4) -> None:
        self.ckpt = ckpt
        self.files = files
        self.threads = threads
        self.bytes_read = 0
        self.bytes_needed = 0
        self._fds: dict[str, int] = {}
        self._direct: dict[str, int] = {}  # an O_DIRECT fd per file, -1 where refused
        self._lock = threading.Lock()
        self._whole: dict[str, threading.Lock] = {}
        self._checked: set[str] = set()

    def close(self) -> None:
        with self._lock:
            fds, self._fds = [*self._fds.values(), *self._direct.values()], {}
            self._direct = {}
        for fd in fds:
            if fd >= 0:
                os.close(fd)

    def __enter__(self) -> RangeReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run_all(self, jobs: list[Callable[[], None]]) -> None:
        """Run read jobs on the thread pool; the first error is raised."""
        if len(jobs) <= 1 or self.threads <= 1:
            for job in jobs:
                job()
            return
        with ThreadPoolExecutor(max_workers=min(self.threads, len(jobs)), thread_name_prefix="slurm-ckpt-dcp-read") as ex:
            for fut in [ex.submit(job) for job in jobs]:
                fut.result()

    def read_bytes(self, where: Stored) -> bytes:
        """All of one stored item, verified."""
        import torch

        from ..engine.buffers import memory_view

        buf = torch.empty(where.length, dtype=torch.uint8)
        self.read_into(where, [(0, where.length)] if where.length else [], buf)
        return bytes(memory_view(int(buf.data_ptr()), where.length))

    def read_into(self, where: Stored, want: list[Run], dest: Any, *, sizes: Sequence[int] | None = None,
                  offsets: Sequence[int] | None = None) -> int:  # fmt: skip
        """Fill ``dest`` with the runs ``want`` of the stored item ``where``; return the bytes read.

        ``dest`` is a tensor holding exactly those bytes: as one flat byte run
        when ``want`` is a single run, else the hypercube ``offsets`` of a chunk
        of ``sizes`` (both needed then).
        """
        if not want:
            return 0
        if not where.crcs:
            self._check_file(where.file)
        with self._lock:
            self.bytes_needed += sum(e - b for b, e in want)
        if len(want) == 1 and _flat_ok(dest, want[0][1] - want[0][0]):
            return self._run_into(where, want[0], dest)
        return self._gather_into(where, want, dest, sizes, offsets)

    # ------------------------------------------------------------------ internals

    def _fd(self, name: str) -> int:
        with self._lock:
            fd = self._fds.get(name)
            if fd is not None:
                return fd
        path = self.ckpt / name
        try:
            fd = open_regular(path)
        except OSError as e:
            raise storage_error(e, "cannot open checkpoint file", path) from e
        size = os.fstat(fd).st_size
        expected = self.files[name].size
        if size != expected:
            os.close(fd)
            raise CheckpointCorrupt(f"{path}: size is {size}, manifest expects {expected}", path)
        with self._lock:
            if name in self._fds:  # another thread opened it meanwhile
                os.close(fd)
                return self._fds[name]
            self._fds[name] = fd
            return fd

    def _direct_fd(self, name: str) -> int:
        """An ``O_DIRECT`` fd of file ``name`` (opened after ``_fd`` checked its size), or -1."""
        self._fd(name)
        with self._lock:
            fd = self._direct.get(name)
        if fd is not None:
            return fd
        path = self.ckpt / name
        try:
            fd = open_direct(path)
        except OSError as e:
            raise storage_error(e, "cannot open checkpoint file", path) from e
        with self._lock:
            if name in self._direct:
                if fd >= 0:
                    os.close(fd)
                return self._direct[name]
            self._direct[name] = fd
            return fd

    def _blocks(self, where: Stored, b: int, e: int) -> tuple[int, int]:
        """The block indices ``[first, last)`` that bytes ``[b, e)`` of the item touch."""
        return b // where.block, -(-e // where.block)

    def _block_span(self, where: Stored, i: int) -> tuple[int, int]:
        return i * where.block, min((i + 1) * where.block, where.length)

    def _pread(self, where: Stored, view: memoryview, off: int) -> int:
        """Read ``len(view)`` bytes at item offset ``off`` into ``view``; return how many."""
        fd = self._fd(where.file)
        path = self.ckpt / where.file
        got = 0
        try:
            dfd = self._direct_fd(where.file) if len(view) >= ALIGN else -1
            if dfd >= 0:
                addr = address_of_view(view)
                for o in range(0, len(view), STRETCH):
                    n = min(STRETCH, len(view) - o)
                    read_through_bounce(dfd, path, addr + o, where.at + off + o, n, STRETCH)
                    got += n
                return got
            while got < len(view):
                n = os.preadv(fd, [view[got:]], where.at + off + got)
                if n == 0:
                    raise CheckpointCorrupt(f"{path}: unexpected end of file at byte {where.at + off + got}", path)
                got += n
        except OSError as e:
            raise storage_error(e, "cannot read checkpoint file", path) from e
        finally:
            with self._lock:
                self.bytes_read += got
        return got

    def _check_file(self, name: str) -> None:
        """Check a whole file against the manifest's crc32, once (for items without block crcs)."""
        with self._lock:
            if name in self._checked:
                return
            lock = self._whole.setdefault(name, threading.Lock())
        with lock:
            if name in self._checked:
                return
            fd, size, path = self._fd(name), self.files[name].size, self.ckpt / name
            buf = bytearray(min(size, 8 << 20) or 1)
            view, crc, off = memoryview(buf), 0, 0
            try:
                while off < size:
                    n = os.preadv(fd, [view[: min(len(buf), size - off)]], off)
                    if n == 0:
                        raise CheckpointCorrupt(f"{path}: unexpected end of file at byte {off}", path)
                    crc = crc32(view[:n], crc)
                    off += n
            except OSError as e:
                raise storage_error(e, "cannot read checkpoint file", path) from e
            finally:
                with self._lock:
                    self.bytes_read += off
            if f"{crc:08x}" != self.files[name].checksum:
                raise CheckpointCorrupt(f"{path}: checksum mismatch: expected crc32 {self.files[name].checksum}, "
                                        f"got {crc:08x}", path)  # fmt: skip
            with self._lock:
                self._checked.add(name)

    def _check(self, where: Stored, i: int, view: memoryview) -> None:
        if not where.crcs:  # checked whole, before the first read (_check_file)
            return
        got = f"{crc32(view):08x}"
        if got != where.crcs[i]:
            path = self.ckpt / where.file
            lo, hi = self._block_span(where, i)
            raise CheckpointCorrupt(
                f"{path}: checksum mismatch in bytes {where.at + lo}-{where.at + hi}: "
                f"expected crc32 {where.crcs[i]}, got {got}",
                path,
            )

    def _run_into(self, where: Stored, run: Run, dest: Any) -> int:
        """One run into contiguous CPU memory: whole blocks in place, the ends through a buffer."""
        from ..engine.buffers import memory_view

        b, e = run
        addr = int(dest.data_ptr())
        first, last = self._blocks(where, b, e)
        bounce: bytearray | None = None
        read = 0
        i = first
        while i < last:
            lo, hi = self._block_span(where, i)
            if b <= lo and hi <= e:  # whole blocks are wanted: straight into the tensor, a stretch at a time
                j = i + 1
                while j < last:
                    end = self._block_span(where, j)[1]
                    if end > e or end - lo > STRETCH:
                        break
                    j += 1
                hi = self._block_span(where, j - 1)[1]
                read += self._pread(where, memory_view(addr + lo - b, hi - lo), lo)
                for k in range(i, j):
                    klo, khi = self._block_span(where, k)
                    self._check(where, k, memory_view(addr + klo - b, khi - klo))
                i = j
                continue
            if bounce is None:
                bounce = bytearray(where.block)
            view = memoryview(bounce)[: hi - lo]
            read += self._pread(where, view, lo)
            self._check(where, i, view)
            s, t = max(b, lo), min(e, hi)
            memory_view(addr + s - b, t - s)[:] = view[s - lo : t - lo]
            i += 1
        return read

    def _gather_into(self, where: Stored, want: list[Run], dest: Any, sizes: Sequence[int] | None,
                     offsets: Sequence[int] | None) -> int:  # fmt: skip
        """Several runs (or a destination that cannot take bytes): read the blocks they
        touch into one buffer, verify them, then copy the runs out as a strided view."""
        import torch

        from ..engine.buffers import memory_view

        touched: list[int] = []
        for b, e in want:
            first, last = self._blocks(where, b, e)
            for i in range(max(first, touched[-1] + 1 if touched else first), last):
                touched.append(i)
        base = touched[0] * where.block
        buf = torch.empty(self._block_span(where, touched[-1])[1] - base, dtype=torch.uint8)
        whole = memory_view(int(buf.data_ptr()), buf.numel())
        # Consecutive blocks are read with one call each stretch.
        read = 0
        i = 0
        while i < len(touched):
            j = i
            while j + 1 < len(touched) and touched[j + 1] == touched[j] + 1:
                j += 1
            lo, hi = touched[i] * where.block, self._block_span(where, touched[j])[1]
            read += self._pread(where, whole[lo - base : hi - base], lo)
            for k in range(touched[i], touched[j] + 1):
                klo, khi = self._block_span(where, k)
                self._check(where, k, whole[klo - base : khi - base])
            i = j + 1
        dtype = dest.dtype  # the stored dtype: the caller converts afterwards if it must
        itemsize = dtype.itemsize
        if len(want) == 1:
            b, e = want[0]
            src = buf[b - base : e - base].view(dtype)
            dest.view(-1).copy_(src) if dest.is_contiguous() else dest.copy_(src.view(dest.shape))
            return read
        assert sizes is not None and offsets is not None, "several runs need the chunk's sizes and the cube's offsets"
        strides = [1] * len(sizes)
        for d in range(len(sizes) - 2, -1, -1):
            strides[d] = strides[d + 1] * sizes[d + 1]
        first = sum(o * s for o, s in zip(offsets, strides, strict=True)) * itemsize
        if (first - base) % itemsize or base % itemsize:
            raise CheckpointCorrupt(f"{self.ckpt / where.file}: chunk bytes not aligned to its dtype", self.ckpt / where.file)
        flat = buf.view(dtype)
        src = flat.as_strided(tuple(dest.shape), tuple(strides), (first - base) // itemsize)
        dest.copy_(src)
        return read


def address_of_view(view: memoryview) -> int:
    """The address of a writable memoryview's first byte."""
    import ctypes

    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def _flat_ok(dest: Any, nbytes: int) -> bool:
    """Whether ``dest`` can take a run's bytes as they are: contiguous CPU memory of that length."""
    return (
        dest.device.type == "cpu"
        and dest.is_contiguous()
        and dest.numel() * dest.element_size() == nbytes
        and not dest.is_conj()
        and not dest.is_neg()
    )

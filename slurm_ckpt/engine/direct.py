"""Aligned ``O_DIRECT`` reads into memory that is ours or the caller's.

O_DIRECT needs the file offset, the length and the memory address aligned
(``buffers.ALIGN``). A read into our own fresh buffer is aligned by making the
buffer so; one into a caller's tensor (``into=``) is aligned only where the
tensor's memory has the same phase within a page as its bytes in the file, and
the rest goes through a bounce buffer, so nothing is ever written outside it.
The engine's reader (``reader.py``) and DCP's ranged reads (``dcp/ranged.py``)
both read this way.
"""

from __future__ import annotations

import ctypes
import errno
import os
from pathlib import Path
from typing import NamedTuple

from ..errors import CheckpointCorrupt
from ..fsinfo import direct_io_pays
from .buffers import ALIGN, HUGE, address_of, memory_view, pool

__all__ = ["open_direct", "read_through_bounce"]


class _Item(NamedTuple):
    """One read: ``[off, off + n)`` of the file into ``addr``, of which the bytes
    ``[wb, wb + wn)`` are the file's own (checksummed, each file byte exactly once)."""

    off: int
    n: int
    addr: int
    wb: int
    wn: int
    exact: bool = False
    """Place exactly ``[wb, wb + wn)`` at ``addr``: memory that is not ours, where an
    aligned read would spill past the tensor or cannot line up. It is read aligned
    into a bounce buffer and copied; not through the page cache, whose readahead
    would fetch again what the O_DIRECT reads fetch."""


def _items_into(addr: int, rb: int, re: int, chunk: int) -> list[_Item]:
    """Reads of the file bytes ``[rb, re)`` into the caller's memory at ``addr``.

    Where the memory's offset within a page matches the file's (as when the
    tensor was saved from an allocation like it), its whole 2 MiB pages (else
    its whole 4 KiB pages) are read straight into it, and only the bytes at the
    two ends go through a bounce buffer; otherwise all of it does. Nothing is
    ever written outside ``[addr, addr + re - rb)``.
    """
    lo, hi = -(-rb // ALIGN) * ALIGN, re // ALIGN * ALIGN
    if (addr - rb) % ALIGN or hi <= lo:
        lo = hi = rb  # nothing lines up: all of it through a bounce buffer
    else:
        # Only the 2 MiB-aligned stretch of an allocation can be huge pages (torch's
        # are not aligned to 2 MiB). A read into 4 KiB pages costs the disk a segment
        # per page: the rest costs about as much through a bounce buffer, and at times
        # far less (``python -m bench.read_contention`` compares them).
        h0, h1 = -(-(addr + lo - rb) // HUGE) * HUGE, (addr + hi - rb) // HUGE * HUGE
        if h1 > h0:
            lo, hi = h0 - addr + rb, h1 - addr + rb
    items: list[_Item] = []

    def span(a: int, b: int, exact: bool) -> None:
        for o in range(a, b, chunk):
            m = min(chunk, b - o)
            items.append(_Item(o, m, addr + o - rb, o, m, exact))

    span(rb, lo, True)
    span(lo, hi, False)
    span(hi, re, True)
    return items


def read_through_bounce(dfd: int, path: Path, addr: int, wb: int, wn: int, chunk: int) -> None:
    """Read the file bytes ``[wb, wb + wn)`` (at most ``chunk``) to ``addr`` with aligned reads."""
    a0, a1 = wb - wb % ALIGN, -(-(wb + wn) // ALIGN) * ALIGN
    buf = pool.acquire(chunk + 2 * ALIGN)
    try:
        base = address_of(buf)
        _read_exactly(dfd, path, memory_view(base, a1 - a0), a0, wb + wn - a0)
        ctypes.memmove(addr, base + wb - a0, wn)
    finally:
        pool.release(buf)


def open_direct(path: Path) -> int:
    """``path`` opened read-only with ``O_DIRECT``, or -1 where the filesystem refuses it
    or runs it slower than buffered reads (``fsinfo.direct_io_pays``)."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag or not direct_io_pays(path.parent):
        return -1
    try:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | flag)
    except OSError as e:
        if e.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return -1
        raise


def _read_exactly(fd: int, path: Path, view: memoryview, off: int, need: int) -> None:
    """Fill ``view`` from ``off``; at least ``need`` bytes must exist (EOF may cut the rest)."""
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], off + got)
        if n == 0:
            break
        got += n
    if got < need:
        raise CheckpointCorrupt(f"{path}: unexpected end of file at byte {off + got}", path)

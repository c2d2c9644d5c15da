"""The byte layout of one tensor file, and how to write it in aligned pieces.

A file is described, not copied: the header bytes followed by each tensor's
bytes, each an ``(address, length)`` of memory that stays alive while the file
is written.

O_DIRECT needs the memory address and the file offset of every write aligned
(4 KiB covers every common device). Tensor memory is rarely page-aligned, but
large tensors from glibc's allocator all sit at the same offset within their
pages (64 bytes past a boundary for every tensor of 1 MiB or more: the
header of glibc's mmap chunk). So the file is laid out to match: the header is padded so the data
starts at that same offset within a page, and the large tensors whose length
is a whole number of pages come first. Each of them then lines up with the
file page for page, and everything but the few bytes at its two ends goes to
disk straight from the tensor's memory; only those ends, the header and the
small tensors are gathered through a bounce buffer (:func:`plan_writes`).

The other tensors follow: first those whose size is a multiple of 64 bytes,
then the rest by element size, largest first, as safetensors itself orders
them. The phase is a multiple of 64 (else 0), so every tensor's offset is a
multiple of its element size, and each of the first kind starts at a multiple
of 64 bytes: a reader can give it back aligned as torch's allocator aligns
tensors (``buffers.TORCH_ALIGN``) without copying it. Nearly every tensor of a
model has such a size (a row of 16 floats does); the reader moves or copies
the others to aligned memory.
"""

from __future__ import annotations

import ctypes
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..store.codec import TensorEntry
from ..store.tensorfile import build_header
from .buffers import ALIGN, TORCH_ALIGN

__all__ = ["FileImage", "Segment", "Write", "order_entries", "plan_file", "plan_writes"]

Piece = tuple[int, int]
"""(memory address, length in bytes)."""

_BIG = 1 << 20


@dataclass
class FileImage:
    """What to write into one file: its pieces of memory, in file order."""

    size: int
    pieces: list[Piece]
    keep: list[Any] = field(default_factory=list)
    """Objects that own the memory the pieces point into."""


@dataclass(frozen=True)
class Segment:
    """Consecutive file bytes from ``pieces``: in place (one aligned piece of
    memory, written as it is) or gathered (copied into a bounce buffer first)."""

    in_place: bool
    pieces: tuple[Piece, ...]
    size: int


@dataclass(frozen=True)
class Write:
    """One write call: ``size`` bytes at file offset ``offset``, made of ``segments``."""

    offset: int
    size: int
    segments: tuple[Segment, ...]


def order_entries(entries: Sequence[TensorEntry]) -> list[TensorEntry]:
    """Sizes that are multiples of 64 bytes first, then the others by element size,
    largest first (stable): every offset is dtype-aligned, and each of the first
    is 64-byte aligned from an aligned start."""
    return sorted(entries, key=lambda e: (e.nbytes % TORCH_ALIGN != 0, -int(e.tensor.element_size())))


def _phase(entries: Sequence[TensorEntry]) -> int:
    """The in-page offset most of the large tensors' bytes sit at (0 if not a multiple of 64).

    Memory from numpy's allocator sits at 16: matching it would let a save write
    from it in place, but put no tensor of the file at a 64-byte boundary, and a
    load would then move or copy every one of them to align it.
    """
    weight: Counter[int] = Counter()
    for e in entries:
        if e.nbytes >= _BIG:
            weight[int(e.tensor.data_ptr()) % ALIGN] += e.nbytes
    if not weight:
        return 0
    phase = weight.most_common(1)[0][0]
    return phase if phase % TORCH_ALIGN == 0 else 0


def plan_file(entries: Sequence[TensorEntry], metadata: dict[str, str] | None = None) -> FileImage:
    """Order ``entries`` (CPU contiguous tensors) and lay out their safetensors file.

    ``entries`` is reordered in place to the file's order.
    """
    phase = _phase(entries)
    in_step = [e for e in entries if e.nbytes >= _BIG and e.nbytes % ALIGN == 0
               and int(e.tensor.data_ptr()) % ALIGN == phase]  # fmt: skip
    chosen = {id(e) for e in in_step}
    ordered = order_entries(in_step) + order_entries([e for e in entries if id(e) not in chosen])
    if isinstance(entries, list):
        entries[:] = ordered
    header = bytearray(build_header(ordered, metadata, phase=phase))
    pieces: list[Piece] = [(ctypes.addressof(ctypes.c_char.from_buffer(header)), len(header))]
    size = len(header)
    for e in ordered:
        n = e.nbytes
        if n:
            pieces.append((int(e.tensor.data_ptr()), n))
            size += n
    return FileImage(size=size, pieces=pieces, keep=[header, [e.tensor for e in ordered]])


def plan_writes(pieces: Sequence[Piece], chunk: int, *, direct: bool = True) -> list[Write]:
    """The write calls for a file made of ``pieces``, in file order, each at most ``chunk`` bytes.

    With ``direct``, every stretch of a piece whose address and file offset
    are both page-aligned is an in-place segment; the bytes around them are
    gathered in whole pages (only the file's last page may be partial). One
    write call takes both kinds (``pwritev``), so the few gathered pages at the
    seams between tensors do not cost a round trip to the device each.
    Without ``direct``, everything is gathered (``pwritev`` needs no alignment;
    ``write_image(in_place=False)`` asks for that on an O_DIRECT file too).
    """
    segs: list[Segment] = []
    run: list[Piece] = []
    run_size = 0

    def gather(addr: int, n: int) -> None:
        nonlocal run_size
        if n:
            run.append((addr, n))
            run_size += n

    def close_run() -> None:
        nonlocal run, run_size
        if run_size:
            segs.append(Segment(False, tuple(run), run_size))
        run, run_size = [], 0

    off = 0
    for addr, n in pieces:
        lo = -(-off // ALIGN) * ALIGN  # first page boundary in the piece
        hi = (off + n) // ALIGN * ALIGN
        if direct and (addr - off) % ALIGN == 0 and hi - lo >= ALIGN:
            gather(addr, lo - off)  # ends exactly at ``lo``: the run stays page-aligned
            close_run()
            segs.append(Segment(True, ((addr + lo - off, hi - lo),), hi - lo))
            gather(addr + hi - off, off + n - hi)
        else:
            gather(addr, n)
        off += n
    close_run()
    return _pack(segs, chunk)


def _split(seg: Segment, n: int) -> tuple[Segment, Segment]:
    """The first ``n`` bytes of ``seg``, and the rest."""
    head: list[Piece] = []
    tail: list[Piece] = []
    left = n
    for a, m in seg.pieces:
        if left >= m:
            head.append((a, m))
            left -= m
        elif left > 0:
            head.append((a, left))
            tail.append((a + left, m - left))
            left = 0
        else:
            tail.append((a, m))
    return Segment(seg.in_place, tuple(head), n), Segment(seg.in_place, tuple(tail), seg.size - n)


def _pack(segs: list[Segment], chunk: int) -> list[Write]:
    """Group segments into writes of at most ``chunk`` bytes, cutting at page multiples."""
    out: list[Write] = []
    cur: list[Segment] = []
    start = fill = 0
    for seg in segs:
        while seg.size:
            take = min(seg.size, chunk - fill)
            if take < seg.size:
                part, seg = _split(seg, take)
            else:
                part, seg = seg, Segment(seg.in_place, (), 0)
            cur.append(part)
            fill += take
            if fill == chunk:
                out.append(Write(start, fill, tuple(cur)))
                start, fill, cur = start + fill, 0, []
    if cur:
        out.append(Write(start, fill, tuple(cur)))
    return out

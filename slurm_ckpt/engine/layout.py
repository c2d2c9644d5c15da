"""The byte layout of one tensor file, as pieces of memory in file order.

A file is described, not copied: the header bytes followed by each tensor's
bytes, each piece an ``(address, length)`` of memory that stays alive while the
file is written. Writers and readers walk the file in fixed-size chunks, so
:func:`chunk_pieces` cuts the piece list at chunk boundaries once.

Tensors are ordered by element size, largest first, as safetensors itself
does: then every tensor's offset is a multiple of its element size, so a
reader can view the bytes as the tensor's dtype without copying.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..store.codec import TensorEntry
from ..store.tensorfile import build_header

__all__ = ["FileImage", "chunk_pieces", "order_entries", "plan_file"]

Piece = tuple[int, int]
"""(memory address, length in bytes)."""


@dataclass
class FileImage:
    """What to write into one file: its pieces of memory, in file order."""

    size: int
    pieces: list[Piece]
    keep: list[Any] = field(default_factory=list)
    """Objects that own the memory the pieces point into."""


def order_entries(entries: Sequence[TensorEntry]) -> list[TensorEntry]:
    """Largest element size first (stable), so every offset is dtype-aligned."""
    return sorted(entries, key=lambda e: -int(e.tensor.element_size()))


def _address(buf: bytearray) -> int:
    import ctypes

    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def plan_file(entries: Sequence[TensorEntry], metadata: dict[str, str] | None = None) -> FileImage:
    """The image of a safetensors file holding ``entries`` (CPU contiguous tensors), in order."""
    header = bytearray(build_header(entries, metadata))
    pieces: list[Piece] = [(_address(header), len(header))]
    size = len(header)
    for e in entries:
        n = e.nbytes
        if n:
            pieces.append((int(e.tensor.data_ptr()), n))
            size += n
    return FileImage(size=size, pieces=pieces, keep=[header, [e.tensor for e in entries]])


def chunk_pieces(pieces: Sequence[Piece], chunk: int) -> list[list[Piece]]:
    """Cut a stream of ``pieces`` into ``chunk``-byte chunks; the last may be shorter."""
    out: list[list[Piece]] = []
    cur: list[Piece] = []
    room = chunk
    for addr, n in pieces:
        while n:
            take = min(n, room)
            cur.append((addr, take))
            addr += take
            n -= take
            room -= take
            if room == 0:
                out.append(cur)
                cur, room = [], chunk
    if cur:
        out.append(cur)
    return out

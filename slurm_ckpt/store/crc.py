"""crc32, the checksum of every file in a checkpoint, and combining per-chunk crcs.

Why crc32 (zlib's) and not crc32c or xxhash: every Python has ``zlib``, so every
install can verify every checkpoint with no extra package. ``crc32`` here is
that same function, computed by ISA-L when the optional ``isal`` package is
installed (``pip install slurm-ckpt[fast]``): identical values, several times
faster, and like zlib it releases the GIL, so worker threads checksum in
parallel. At zlib's speed the checksum's CPU time is felt on a machine with
few cores, where it competes with the I/O threads. crc32c and xxh3 are no
faster than ISA-L's crc32, and would make checkpoints unverifiable wherever
their package is missing (``python -m bench.checksums`` measures all of them
on a given machine).

Chunks are checksummed independently by the worker that moves them and then
combined in file order with :func:`crc32_combine` (zlib's algorithm: multiply
by x^(8*len) modulo the CRC polynomial; ISA-L's, in C, where installed), so no
second pass over the data is needed.
"""

from __future__ import annotations

import functools
import os
import zlib
from collections.abc import Callable

__all__ = ["CHECKSUM", "FAST", "crc32", "crc32_combine", "crc32_of_chunks", "crc_threads"]

CHECKSUM = "crc32"


def crc_threads() -> int:
    """Threads to checksum beside the I/O threads: half the cores, 1 to 4.

    One core's crc32 keeps up with a fast disk, so a few keep up with several;
    the other half of the cores stay free to keep the I/O flowing, which
    matters most on a machine with few cores, where a second crc thread
    takes time from the writers.
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 2
    return max(1, min(4, cores // 2))


_POLY = 0xEDB88320  # reflected CRC-32 polynomial, as zlib uses


def _multmodp(a: int, b: int) -> int:
    """a * b modulo the CRC polynomial (bit-reflected, as in zlib's crc32.c)."""
    m = 1 << 31
    p = 0
    while True:
        if a & m:
            p ^= b
            if (a & (m - 1)) == 0:
                break
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return p


def _x2n_table() -> list[int]:
    table = [1 << 30]  # x^1
    for _ in range(31):
        table.append(_multmodp(table[-1], table[-1]))
    return table


_X2N = _x2n_table()


@functools.lru_cache(maxsize=64)
def _xpow8n(length: int) -> int:
    """x^(8 * length) modulo the polynomial; cached because chunk sizes repeat."""
    p = 1 << 31  # x^0
    k = 3
    n = length
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return p


def _combine(crc1: int, crc2: int, len2: int) -> int:
    """zlib's ``crc32_combine``, in Python (the fallback where ISA-L is missing);
    for ``len2 == 0`` it gives ``crc1 ^ crc2``, as zlib and ISA-L do."""
    if len2 < 0:
        raise ValueError(f"crc32_combine: negative length {len2}")
    return _multmodp(_xpow8n(len2), crc1) ^ crc2


crc32: Callable[..., int] = zlib.crc32
"""``crc32(data, value=0)``, as ``zlib.crc32``."""
crc32_combine: Callable[[int, int, int], int] = _combine
"""``crc32_combine(crc1, crc2, len2)``: the crc32 of ``A + B`` from ``crc32(A)``,
``crc32(B)`` and ``len(B)``."""
FAST = False
try:
    from isal import isal_zlib

    crc32, FAST = isal_zlib.crc32, True
    # In C: a read combines a crc per chunk once its last byte lands, while the
    # trainer waits, and chunks of many lengths miss ``_xpow8n``'s cache.
    crc32_combine = getattr(isal_zlib, "crc32_combine", _combine)
except ImportError:
    pass


def crc32_of_chunks(parts: list[tuple[int, int]]) -> int:
    """Combine ``[(crc, length), ...]`` of consecutive pieces into one crc32."""
    crc = 0
    for c, n in parts:
        crc = crc32_combine(crc, c, n)
    return crc

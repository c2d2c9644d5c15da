"""Checksum speed on this machine: why the manifest uses zlib's crc32.

    python -m bench.checksums [--mib 256]

Every candidate hashes the same buffer, interleaved, 5 times; medians in GB/s
and as a ratio to zlib.crc32. Optional packages (xxhash, crc32c) are measured
only when installed; the manifest format needs a checksum every install can
verify, which is what zlib gives.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import time
import zlib
from collections.abc import Callable


def candidates() -> dict[str, Callable[[memoryview], object]]:
    out: dict[str, Callable[[memoryview], object]] = {
        "zlib.crc32": zlib.crc32,
        "zlib.adler32": zlib.adler32,
        "hashlib.blake2b": lambda b: hashlib.blake2b(b).digest(),
        "hashlib.sha1": lambda b: hashlib.sha1(b).digest(),
    }
    try:
        import xxhash

        out["xxhash.xxh3_64 (extra)"] = lambda b: xxhash.xxh3_64(b).digest()
    except ImportError:
        pass
    try:
        from isal import isal_zlib

        out["isal crc32 (extra: slurm-ckpt[fast], the same crc32)"] = isal_zlib.crc32
    except ImportError:
        pass
    try:
        import crc32c

        out["crc32c (extra)"] = crc32c.crc32c
    except ImportError:
        pass
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    buf = memoryview(os.urandom(args.mib << 20))
    times: dict[str, list[float]] = {}
    for _ in range(args.reps):
        for name, fn in candidates().items():
            t0 = time.perf_counter()
            fn(buf)
            times.setdefault(name, []).append(time.perf_counter() - t0)
    base = statistics.median(times["zlib.crc32"])
    print(f"{'checksum':<26} {'GB/s':>7} {'x crc32':>8}")
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"{name:<26} {len(buf) / m / 1e9:7.2f} {base / m:8.2f}")


if __name__ == "__main__":
    main()

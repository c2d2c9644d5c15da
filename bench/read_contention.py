"""What a verified read costs beside the disk's own reads: CPU time, or memory traffic.

    python -m bench.read_contention --size 1G --dir /path/on/the/disk [--reps 15]

A verified read reads every byte twice: the disk (or, in a virtual machine,
the host) writes it into memory, and the checksum reads it back. This times
the raw read (O_DIRECT, 4 threads, 8 MiB pieces, into faulted huge-page
memory; the limit) alone and with work beside it, interleaved in one run
(each repetition in a shuffled order, seeded, cold cache before each line;
medians), as a ratio to the read alone:

raw    of the checkpoint's own data file, the same way: the same bytes on the
       disk's blocks that the engine reads (the second ratio printed is to this)
       in 1 MiB pieces (a request no larger than a virtio disk takes from 4 KiB
       pages: at most 254 segments), and into 4 KiB pages: which of the two
       costs when a read lands on 4 KiB pages, the requests or the pages
       beside a thread checksumming 256 KiB over and over (CPU time only:
       the data stays in the core's cache)
       beside a thread checksumming 256 MiB over and over (the same CPU time,
       and a stream of memory reads)
       with one thread checksumming each piece as it lands (the least any
       verified read does: the floor for a reader that checksums)
engine ``read_tensor_file(into=)`` the state's own tensors (the reader as it
       is: each tensor's whole 2 MiB pages read in place, and the up to 2 MiB
       at each end, on 4 KiB pages, through a bounce buffer, which copies
       them; ``READ_DEPTH`` reads in flight)
       the same with 4 reads in flight (two per core on a 2-core machine)
       the same with the ends' whole 4 KiB pages read in place too (no copy,
       but the pages cost what the line into 4 KiB pages shows)
       ``Checkpointer.load_latest(into=)``, both ways

If the read beside the 256 KiB loop loses nothing and the read beside the
256 MiB loop does, what slows the disk is
memory traffic, not CPU: copies beside the read cost more than their CPU time.
Torch puts the state's tensors on huge pages only when asked
(``THP_MEM_ALLOC_ENABLE=1``, which ``slurm-ckpt run`` sets); this script sets it
too unless it is already set, so the comparison is of the usual case.
"""

from __future__ import annotations

import os

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # before torch is imported

import argparse
import contextlib
import queue
import shutil
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from bench.disk import Raw, drop_cache
from bench.run import shuffled
from bench.state import synthetic_state
from slurm_ckpt import Checkpointer
from slurm_ckpt.config import parse_size
from slurm_ckpt.engine import reader
from slurm_ckpt.engine.buffers import ALIGN
from slurm_ckpt.store.codec import encode_state
from slurm_ckpt.store.crc import FAST, crc32
from slurm_ckpt.store.verify import verify_checkpoint


@contextlib.contextmanager
def beside(work: Callable[[], object]) -> Iterator[None]:
    """``work`` run over and over on a thread of its own for the duration."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            work()

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()


def checksummed_raw(raw: Raw, path: Path) -> None:
    """``raw``'s read, with one thread taking each piece's crc32 as it lands."""
    landed: queue.SimpleQueue[memoryview | None] = queue.SimpleQueue()

    def summer() -> None:
        while (piece := landed.get()) is not None:
            crc32(piece)

    t = threading.Thread(target=summer, daemon=True)
    t.start()
    try:
        raw.read(path, 4, landed=landed.put)
    finally:
        landed.put(None)
        t.join()


def ends_in_place(addr: int, rb: int, re: int, chunk: int) -> list[Any]:
    """The reader's reads into a tensor, with every whole 4 KiB page read in place:
    only the partial pages at its two ends go through the bounce buffer."""
    lo, hi = -(-rb // ALIGN) * ALIGN, re // ALIGN * ALIGN
    if (addr - rb) % ALIGN or hi <= lo:
        return real_items_into(addr, rb, re, chunk)
    items = []
    for a, b, exact in ((rb, lo, True), (lo, hi, False), (hi, re, True)):
        for o in range(a, b, chunk):
            m = min(chunk, b - o)
            items.append(reader._Item(o, m, addr + o - rb, o, m, exact))
    return items


real_items_into = reader._items_into


def with_ends_in_place(fn: Callable[[], object]) -> Callable[[], None]:
    def run() -> None:
        reader._items_into = ends_in_place
        try:
            fn()
        finally:
            reader._items_into = real_items_into

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="1G")
    ap.add_argument("--dir", required=True)
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    if args.reps < 1:
        ap.error("--reps must be at least 1")
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    state = synthetic_state(parse_size(args.size))
    ck = Checkpointer(root / "ckpt", keep=1000, distributed=False)
    out = root / "raw.bin"
    try:
        try:
            times, nbytes = _measure(state, ck, out, args.reps)
        finally:
            ck.close()
    finally:
        shutil.rmtree(root / "ckpt", ignore_errors=True)
        out.unlink(missing_ok=True)
    base, same = (statistics.median(v) for v in list(times.values())[:2])
    print(f"cold reads of {nbytes / 2**30:.2f} GiB, {args.reps} reps, medians "
          f"(THP_MEM_ALLOC_ENABLE={os.environ['THP_MEM_ALLOC_ENABLE']}, crc32 by {'ISA-L' if FAST else 'zlib'})")  # fmt: skip
    for name, v in times.items():
        m = statistics.median(v)
        print(f"  {name:<50} {m:7.3f} s  x{base / m:5.2f} of raw, x{same / m:5.2f} of its file  "
              f"(min {min(v):.3f}, max {max(v):.3f})")


def _measure(state: Any, ck: Checkpointer, out: Path, reps: int) -> tuple[dict[str, list[float]], int]:
    """Each line's seconds, by line, in the order printed; and the bytes read."""
    path = ck.save(state, 1)
    data = path / "tensors-00000.safetensors"
    rec = verify_checkpoint(path).files[data.name]
    mine = {e.key: e.tensor for e in encode_state(state).tensors}
    raw = Raw(data.stat().st_size, 8 << 20)
    raw.write(out, 4)
    small_pieces, small_pages = Raw(raw.nbytes, 1 << 20), Raw(raw.nbytes, 8 << 20, huge=False)
    cached = memoryview(os.urandom(256 << 10))
    streamed = memoryview(os.urandom(256 << 20))

    def in_place() -> None:
        reader.read_tensor_file(data, rec, into=mine)

    def loaded() -> None:
        ck.load_latest(into=state)

    cases: list[tuple[str, Callable[[], float]]] = [
        ("raw O_DIRECT x4 (limit)", lambda: timed(lambda: raw.read(out, 4))),
        ("raw, the checkpoint's data file", lambda: timed(lambda: raw.read(data, 4))),
        ("raw, 1 MiB pieces", lambda: timed(lambda: small_pieces.read(out, 4))),
        ("raw, into 4 KiB pages", lambda: timed(lambda: small_pages.read(out, 4))),
        ("raw, beside a crc32 loop over 256 KiB", lambda: _beside(lambda: crc32(cached), raw, out)),
        ("raw, beside a crc32 loop over 256 MiB", lambda: _beside(lambda: crc32(streamed), raw, out)),
        ("raw, each piece checksummed as it lands", lambda: timed(lambda: checksummed_raw(raw, out))),
        ("engine into= the state's tensors", lambda: timed(in_place)),
        ("engine, 4 reads in flight", lambda: timed(lambda: reader.read_tensor_file(data, rec, into=mine, threads=4))),
        ("engine, the ends' whole 4 KiB pages in place", lambda: timed(with_ends_in_place(in_place))),
        ("load_latest(into=) the state", lambda: timed(loaded)),
        ("load_latest, the ends' whole 4 KiB pages in place", lambda: timed(with_ends_in_place(loaded))),
    ]
    times: dict[str, list[float]] = {name: [] for name, _ in cases}
    for r in range(reps):
        for name, fn in shuffled(cases, r):
            drop_cache([out, path])
            times[name].append(fn())
    return times, raw.nbytes


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _beside(work: Callable[[], object], raw: Raw, path: Path) -> float:
    """The raw read's seconds with ``work`` looping beside it; not the wait for the
    loop's last round to end, which for a long one would be counted as the read's."""
    with beside(work):
        return timed(lambda: raw.read(path, 4))


if __name__ == "__main__":
    main()

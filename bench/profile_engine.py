"""Where the engine's time goes, next to the device limit: the profile behind the bench.

    python bench/profile_engine.py --size 1G --dir /path/on/the/disk [--reps 5]

Each line removes one cost from the real engine path, measured interleaved in
one run (medians; each repetition runs the lines in a shuffled order, seeded,
as ``slurm-ckpt bench`` does), so the gaps between lines are the costs:

write  raw O_DIRECT from one page-aligned buffer on huge pages (the limit)
       the same from a buffer on 4 KiB pages (what huge pages are worth)
       engine, from the huge-page buffer (adds: checksum threads, planning)
       engine, from copies of the tensors in 2 MiB-aligned huge-page buffers
       (adds: many tensors, but none of torch's 4 KiB-page ends)
       engine, from the tensors, no checksum (adds: tensors' own memory)
       engine, from the tensors (the real sync path, without the commit)
       the same without reserving the file's space first (what that is worth)
       Checkpointer.save (adds: state.json, manifest, fsyncs, rename)
read   raw O_DIRECT into memory already faulted in (the limit)
       raw O_DIRECT into fresh memory (adds: page faults)
       engine read (adds: checksums, one storage per large tensor)
       the same with zlib's crc32 (what the optional isal package is worth)
       engine read into the state's own tensors (``into=``: no fresh memory,
       but torch's allocations keep up to 2 MiB at each end on 4 KiB pages)
       engine read into tensors it read before (no fresh memory, huge pages)
       engine read into the state's tensors, no checksum (what verifying costs)
       Checkpointer.load_latest(into=) the state (adds: finding and checking
       the checkpoint, state.json, matching ``into`` to it, the decode)
stall  memcpy of the state into a reused buffer, against the sync save
       (the floor of the copy snapshot's stall ratio on this machine)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from slurm_ckpt import Checkpointer
from slurm_ckpt.bench.disk import Raw, drop_cache
from slurm_ckpt.bench.run import shuffled
from slurm_ckpt.bench.state import map_tensors, synthetic_state
from slurm_ckpt.config import parse_size
from slurm_ckpt.engine import reader as engine_reader
from slurm_ckpt.engine import writer as engine_writer
from slurm_ckpt.engine.buffers import ALIGN, aligned_buffer, memory_view
from slurm_ckpt.engine.layout import plan_file
from slurm_ckpt.engine.reader import read_tensor_file
from slurm_ckpt.engine.staging import Staging
from slurm_ckpt.engine.writer import write_image
from slurm_ckpt.store import crc as crc_module
from slurm_ckpt.store.codec import encode_state
from slurm_ckpt.store.crc import FAST, crc32
from slurm_ckpt.store.verify import verify_checkpoint


@contextlib.contextmanager
def crc32_of(module: Any, fn: Callable[..., int]) -> Iterator[None]:
    """``module`` computes its checksums with ``fn`` for the duration."""
    real = module.crc32
    module.crc32 = fn
    try:
        yield
    finally:
        module.crc32 = real


def _zlib_read(path: Path, rec: Any) -> Any:
    """The read as it runs without isal: zlib's crc32, and the Python combine."""
    real = crc_module.crc32_combine, engine_reader.crc32_combine
    crc_module.crc32_combine = engine_reader.crc32_combine = crc_module._combine
    try:
        with crc32_of(engine_reader, zlib.crc32):
            return read_tensor_file(path, rec)
    finally:
        crc_module.crc32_combine, engine_reader.crc32_combine = real


def timed(fn: Callable[[], Any], before: Callable[[], Any] = lambda: None) -> float:
    before()
    t0 = time.perf_counter()
    out = fn()
    secs = time.perf_counter() - t0
    del out
    return secs


def table(title: str, nbytes: int, rows: dict[str, list[float]], base: str) -> None:
    print(f"\n{title}")
    ref = statistics.median(rows[base])
    for name, ts in rows.items():
        m = statistics.median(ts)
        print(f"  {name:<50} {m:7.3f} s {nbytes / m / 1e9:6.2f} GB/s  x{ref / m:5.2f} of {base}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="1G")
    ap.add_argument("--dir", required=True)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    state = synthetic_state(parse_size(args.size))
    enc = encode_state(state)
    image = plan_file(enc.tensors)
    staged, _ = Staging().stage(encode_state(state).tensors)
    on_huge, _held = _on_huge_pages(state)  # the buffers must outlive the writes
    huge_image = plan_file(encode_state(on_huge).tensors)
    raw = Raw(image.size, 8 << 20)
    raw_small = Raw(image.size, 8 << 20, huge=False)
    out = root / "profile.bin"
    ck = Checkpointer(root / "ckpt", keep=1000, distributed=False)

    def fresh() -> None:
        with contextlib.suppress(FileNotFoundError):
            out.unlink()
        shutil.rmtree(root / "ckpt" / "step-000000001", ignore_errors=True)
        os.sync()

    writes: dict[str, list[float]] = {}
    for r in range(args.reps):
        cases: list[tuple[str, Callable[[], Any]]] = [
            ("raw O_DIRECT x4 (limit)", lambda: raw.write(out, 4)),
            ("raw O_DIRECT x4, from 4 KiB pages", lambda: raw_small.write(out, 4)),
            ("engine, from one aligned buffer", lambda: write_image(out, staged)),
            ("engine, from tensors on aligned huge pages", lambda: write_image(out, huge_image)),
            ("engine, from the tensors, no checksum", lambda: _nocrc(out, image)),
            ("engine, from the tensors", lambda: write_image(out, image)),
            ("engine, from the tensors, not preallocated", lambda: _unreserved(out, image)),
            ("Checkpointer.save", lambda: ck.save(state, 1)),
        ]
        for name, _ in cases:
            writes.setdefault(name, [])  # the table keeps this order
        for name, fn in shuffled(cases, r):
            writes[name].append(timed(fn, fresh))
    table("WRITE", image.size, writes, "raw O_DIRECT x4 (limit)")

    path = ck.save(state, 1)
    rec = verify_checkpoint(path).files["tensors-00000.safetensors"]
    raw.write(out, 4)
    warm = Raw(image.size, 8 << 20)  # its buffer is faulted in already
    data = path / "tensors-00000.safetensors"
    mine = {e.key: e.tensor for e in enc.tensors}
    ours = read_tensor_file(data, rec)
    reads: dict[str, list[float]] = {}
    for r in range(args.reps):
        cases = [
            ("raw O_DIRECT x4 into faulted memory (limit)", lambda: warm.read(out, 4)),
            ("raw O_DIRECT x4 into fresh memory", lambda: _fresh_read(warm, out)),
            ("engine read", lambda: read_tensor_file(data, rec)),
            ("engine read, zlib's crc32 (without isal)", lambda: _zlib_read(data, rec)),
            ("engine read into the state's tensors", lambda: read_tensor_file(data, rec, into=mine)),
            ("engine read into tensors it read before", lambda: read_tensor_file(data, rec, into=ours)),
            ("engine read into the state's tensors, no checksum",
             lambda: read_tensor_file(data, rec, into=mine, verify=False)),
            ("Checkpointer.load_latest(into=the state)", lambda: ck.load_latest(into=state)),
        ]
        for name, _ in cases:
            reads.setdefault(name, [])
        for name, fn in shuffled(cases, r):
            reads[name].append(timed(fn, lambda: drop_cache([out, path])))
    table("READ (cold cache)", image.size, reads, "raw O_DIRECT x4 into faulted memory (limit)")

    staging = Staging()
    staging.stage(encode_state(state).tensors)  # first stage allocates
    stall: dict[str, list[float]] = {}
    for _ in range(args.reps):
        stall.setdefault("Checkpointer.save", []).append(timed(lambda: ck.save(state, 1), fresh))
        stall.setdefault("memcpy into the reused staging buffer", []).append(
            timed(lambda: staging.stage(encode_state(state).tensors)))  # fmt: skip
    table("ASYNC STALL FLOOR (copy snapshot)", image.size, stall, "Checkpointer.save")
    ck.close()
    shutil.rmtree(root / "ckpt", ignore_errors=True)
    with contextlib.suppress(FileNotFoundError):
        out.unlink()
    print(f"\ncrc32 ({'ISA-L' if FAST else 'zlib'}) of 64 MiB on one core: {_crc_rate():.2f} GB/s")


def _nocrc(out: Path, image: Any) -> None:
    with crc32_of(engine_writer, lambda data, value=0: 0):
        write_image(out, image)


def _on_huge_pages(state: Any) -> tuple[Any, list[Any]]:
    """A copy of ``state`` whose large tensors each sit on their own 2 MiB-aligned
    huge-page buffer, and those buffers (keep them alive)."""
    import torch

    held: list[Any] = []

    def copy(t: Any) -> Any:
        if t.numel() * t.element_size() < (1 << 20):
            return t.clone()
        buf = aligned_buffer(t.numel() * t.element_size())
        held.append(buf)
        return torch.frombuffer(buf, dtype=t.dtype, count=t.numel()).view(t.shape).copy_(t)

    return map_tensors(state, copy), held


def _unreserved(out: Path, image: Any) -> None:
    real = engine_writer.preallocate
    engine_writer.preallocate = lambda fd, size: False
    try:
        write_image(out, image)
    finally:
        engine_writer.preallocate = real


def _fresh_read(raw: Raw, path: Path) -> None:
    """``raw``'s read, into memory allocated just before (every page faulted by the read)."""
    import torch

    buf = torch.empty(raw.nbytes + ALIGN, dtype=torch.uint8)
    raw.read(path, 4, into=memory_view(buf.data_ptr() + (-buf.data_ptr() % ALIGN), raw.nbytes))


def _crc_rate() -> float:
    data = memoryview(os.urandom(64 << 20))
    t0 = time.perf_counter()
    crc32(data)
    return len(data) / (time.perf_counter() - t0) / 1e9


if __name__ == "__main__":
    main()

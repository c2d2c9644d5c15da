"""Where the engine's time goes, next to the device limit: the profile behind the bench.

    python -m bench.profile_engine --size 1G --dir /path/on/the/disk [--reps 5]

Each line removes one cost from the real engine path, measured interleaved in
one run (medians; each repetition runs the lines in a shuffled order, seeded,
as ``slurm-ckpt bench`` does), so the gaps between lines are the costs. Each
line also gives the CPU time the process took (every thread, user and system):

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
       the same, no checksum (what verifying costs where nothing else does)
       engine read into the state's tensors, no checksum (what verifying costs)
       Checkpointer.load_latest(into=) the state (adds: finding and checking
       the checkpoint, state.json, matching ``into`` to it, the decode)
       the same with the Python crc32_combine (what isal's combine is worth)
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

from bench.disk import Raw, drop_cache
from bench.run import shuffled
from bench.state import map_tensors, synthetic_state
from slurm_ckpt import Checkpointer
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
def swapped(*changes: tuple[Any, str, Any]) -> Iterator[None]:
    """Each ``(module, name, value)``: ``module.name`` is ``value`` for the duration."""
    real = [(module, name, getattr(module, name)) for module, name, _ in changes]
    for module, name, value in changes:
        setattr(module, name, value)
    try:
        yield
    finally:
        for module, name, value in real:
            setattr(module, name, value)


# The reader as it runs without isal: zlib's crc32, and the Python combine
# (the reader imports ``crc32_combine`` by name; ``crc32_of_chunks`` looks it up in ``crc``).
PYTHON_COMBINE = ((crc_module, "crc32_combine", crc_module._combine),
                  (engine_reader, "crc32_combine", crc_module._combine))  # fmt: skip
WITHOUT_ISAL = ((engine_reader, "crc32", zlib.crc32), *PYTHON_COMBINE)


def _swapped(fn: Callable[[], Any], *changes: tuple[Any, str, Any]) -> Callable[[], Any]:
    """``fn``, run with ``changes`` in place."""

    def run() -> Any:
        with swapped(*changes):
            return fn()

    return run


def timed(fn: Callable[[], Any], before: Callable[[], Any] = lambda: None) -> tuple[float, float]:
    """Wall seconds of ``fn``, and the CPU seconds (user and system, every thread) it took."""
    before()
    c0, t0 = time.process_time(), time.perf_counter()
    out = fn()
    secs, cpu = time.perf_counter() - t0, time.process_time() - c0
    del out
    return secs, cpu


def table(title: str, nbytes: int, rows: dict[str, list[tuple[float, float]]], base: str) -> None:
    """Medians: wall time, rate, ratio to ``base``, and this process's CPU time. On a
    machine with few cores, CPU spent beside the I/O can slow the I/O itself."""
    print(f"\n{title}")
    ref = statistics.median(t for t, _ in rows[base])
    for name, samples in rows.items():
        m = statistics.median(t for t, _ in samples)
        cpu = statistics.median(c for _, c in samples)
        print(f"  {name:<50} {m:7.3f} s {nbytes / m / 1e9:6.2f} GB/s  x{ref / m:5.2f} of {base}  cpu {cpu:6.3f} s")


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

    writes: dict[str, list[tuple[float, float]]] = {}
    for r in range(args.reps):
        cases: list[tuple[str, Callable[[], Any]]] = [
            ("raw O_DIRECT x4 (limit)", lambda: raw.write(out, 4)),
            ("raw O_DIRECT x4, from 4 KiB pages", lambda: raw_small.write(out, 4)),
            ("engine, from one aligned buffer", lambda: write_image(out, staged)),
            ("engine, from tensors on aligned huge pages", lambda: write_image(out, huge_image)),
            ("engine, from the tensors, no checksum",
             _swapped(lambda: write_image(out, image), (engine_writer, "crc32", lambda data, value=0: 0))),
            ("engine, from the tensors", lambda: write_image(out, image)),
            ("engine, from the tensors, not preallocated",
             _swapped(lambda: write_image(out, image), (engine_writer, "preallocate", lambda fd, size: False))),
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
    reads: dict[str, list[tuple[float, float]]] = {}
    for r in range(args.reps):
        cases = [
            ("raw O_DIRECT x4 into faulted memory (limit)", lambda: warm.read(out, 4)),
            ("raw O_DIRECT x4 into fresh memory", lambda: _fresh_read(warm, out)),
            ("engine read", lambda: read_tensor_file(data, rec)),
            ("engine read, zlib's crc32 (without isal)", _swapped(lambda: read_tensor_file(data, rec), *WITHOUT_ISAL)),
            ("engine read into the state's tensors", lambda: read_tensor_file(data, rec, into=mine)),
            ("engine read into tensors it read before", lambda: read_tensor_file(data, rec, into=ours)),
            ("the same, no checksum", lambda: read_tensor_file(data, rec, into=ours, verify=False)),
            ("engine read into the state's tensors, no checksum",
             lambda: read_tensor_file(data, rec, into=mine, verify=False)),
            ("Checkpointer.load_latest(into=the state)", lambda: ck.load_latest(into=state)),
            ("the same, Python crc32_combine (without isal)",
             _swapped(lambda: ck.load_latest(into=state), *PYTHON_COMBINE)),
        ]
        for name, _ in cases:
            reads.setdefault(name, [])
        for name, fn in shuffled(cases, r):
            reads[name].append(timed(fn, lambda: drop_cache([out, path])))
    table("READ (cold cache)", image.size, reads, "raw O_DIRECT x4 into faulted memory (limit)")

    staging = Staging()
    staging.stage(encode_state(state).tensors)  # first stage allocates
    stall: dict[str, list[tuple[float, float]]] = {}
    for _ in range(args.reps):
        stall.setdefault("Checkpointer.save", []).append(timed(lambda: ck.save(state, 1), fresh))
        stall.setdefault("memcpy into the reused staging buffer", []).append(
            timed(lambda: staging.stage(encode_state(state).tensors)))  # fmt: skip
    table("ASYNC STALL FLOOR (copy snapshot)", image.size, stall, "Checkpointer.save")
    combine_line = _combine_cost(lambda: ck.load_latest(into=state))
    ck.close()
    shutil.rmtree(root / "ckpt", ignore_errors=True)
    with contextlib.suppress(FileNotFoundError):
        out.unlink()
    print(f"\ncrc32 ({'ISA-L' if FAST else 'zlib'}) of 64 MiB on one core: {_crc_rate():.2f} GB/s")
    print(combine_line)


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


def _fresh_read(raw: Raw, path: Path) -> None:
    """``raw``'s read, into memory allocated just before (every page faulted by the read)."""
    import torch

    buf = torch.empty(raw.nbytes + ALIGN, dtype=torch.uint8)
    raw.read(path, 4, into=memory_view(buf.data_ptr() + (-buf.data_ptr() % ALIGN), raw.nbytes))


def _combine_cost(load: Callable[[], Any]) -> str:
    """What combining one ``into=`` load's chunk crcs costs, ISA-L's combine against
    the Python one (its cache of lengths emptied first, as in a process's first load)."""
    parts: list[list[tuple[int, int]]] = []
    real = crc_module.crc32_of_chunks

    def keep(p: list[tuple[int, int]]) -> int:
        parts.append(list(p))
        return real(p)

    with swapped((engine_reader, "crc32_of_chunks", keep)):
        load()
    costs = {}
    for name, combine in (("in use", crc_module.crc32_combine), ("Python", crc_module._combine)):
        crc_module._xpow8n.cache_clear()
        with swapped((crc_module, "crc32_combine", combine)):
            t0 = time.perf_counter()
            for p in parts:
                real(p)
            costs[name] = time.perf_counter() - t0
    n = sum(len(p) for p in parts)
    return (f"combining the {n} chunk crcs of one into= load: {costs['in use'] * 1e3:.2f} ms with the combine "
            f"in use, {costs['Python'] * 1e3:.2f} ms with the Python one")


def _crc_rate() -> float:
    data = memoryview(os.urandom(64 << 20))
    t0 = time.perf_counter()
    crc32(data)
    return len(data) / (time.perf_counter() - t0) / 1e9


if __name__ == "__main__":
    main()

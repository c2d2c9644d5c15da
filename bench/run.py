"""Running ``slurm-ckpt bench``: every method, interleaved, in one process."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import mmap
import os
import random
import shutil
import statistics
import time
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from slurm_ckpt.checkpointer import Checkpointer
from slurm_ckpt.config import SNAPSHOTS, EngineConfig, load_config
from slurm_ckpt.engine.buffers import address_of, aligned_buffer
from slurm_ckpt.engine.memcopy import Piece, copy_bytes, copy_threads, nontemporal
from slurm_ckpt.engine.staging import Staging

from .disk import Raw, drop_cache
from .peers import dcp_load, dcp_save, st_load, st_save, torch_save
from .scripts import remove_steps, training_step
from .state import flatten, map_tensors, small_state, state_nbytes, synthetic_state

__all__ = ["FLOOR", "Result", "machine", "packed_pieces", "run_bench", "shuffled"]

Progress = Callable[[str], None]
Tick = Callable[..., None]
FLOOR = "memcpy floor"
"""The name the floor rows start with (``report`` sets the stalls against the faster one)."""


@dataclasses.dataclass
class Result:
    """One method's timings: ``times`` are seconds per repetition."""

    name: str
    kind: str  # "write", "read", "async", "memcpy", "update", "small-write", "small-read"
    nbytes: int
    times: list[float] = dataclasses.field(default_factory=list)
    extra: dict[str, list[float]] = dataclasses.field(default_factory=dict)

    @property
    def median(self) -> float:
        return statistics.median(self.times) if self.times else float("nan")

    def extra_median(self, key: str) -> float:
        vals = self.extra.get(key) or []
        return statistics.median(vals) if vals else float("nan")


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def shuffled(methods: list[Any], rep: int) -> list[Any]:
    """``methods`` in the order repetition ``rep`` runs them: shuffled, seeded by ``rep``."""
    return random.Random(rep).sample(methods, len(methods))


def machine(root: Path) -> dict[str, Any]:
    """What the results table names as the machine: CPU, memory, kernel, the filesystem measured."""
    import platform

    from slurm_ckpt.fsinfo import mount_of

    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.machine())  # fmt: skip
    mem = next((int(ln.split()[1]) * 1024 for ln in Path("/proc/meminfo").read_text().splitlines()
                if ln.startswith("MemTotal:")), 0)  # fmt: skip
    m = mount_of(root)
    return {"cpu": cpu, "cores": len(os.sched_getaffinity(0)), "memory_gib": round(mem / 2**30),
            "kernel": platform.release(), "fs": f"{m.fstype} on {m.source}" if m else "?"}  # fmt: skip


def run_bench(
    size: int,
    root: Path,
    *,
    reps: int = 3,
    small: bool = True,
    progress: Progress = lambda s: None,
    engine: EngineConfig | None = None,
) -> dict[str, Any]:
    """Run every method ``reps`` times, interleaved, in ``root``; return the results."""
    import torch

    root.mkdir(parents=True, exist_ok=True)
    cfg = load_config()
    if engine is not None:
        cfg = dataclasses.replace(cfg, engine=engine)
    cores = len(os.sched_getaffinity(0))
    state = synthetic_state(size)
    nbytes = state_nbytes(state)
    flat = flatten(state)
    dcp_state = {"model": state["model"], "optim": {str(k): v for k, v in state["optim"]["state"].items()}}
    raw = Raw(nbytes, 8 << 20)
    results: dict[str, Result] = {}
    info: dict[str, Any] = {"size": size, "nbytes": nbytes, "tensors": len(flat), "reps": reps,
                            "dir": str(root), "cores": cores, "torch": torch.__version__,
                            "torch_huge_pages": os.environ.get("THP_MEM_ALLOC_ENABLE") == "1",
                            "machine": machine(root)}  # fmt: skip

    def res(name: str, kind: str, n: int = nbytes) -> Result:
        return results.setdefault(f"{kind}:{name}", Result(name, kind, n))

    def ckpt(sub: str, snapshot: str = "auto") -> Checkpointer:
        c = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, snapshot=snapshot))
        return Checkpointer(root / sub, keep=1000, config=c, distributed=False)

    ours = ckpt("ours")
    writers: list[tuple[str, Callable[[], Any], Path]] = [
        ("raw O_DIRECT", lambda: raw.write(root / "raw.bin", 1), root / "raw.bin"),
        (f"raw O_DIRECT x{cores * 2}", lambda: raw.write(root / "raw.bin", cores * 2), root / "raw.bin"),
        ("raw buffered+fsync", lambda: raw.write(root / "raw.bin", 1, direct=False), root / "raw.bin"),
        ("torch.save+fsync", lambda: torch_save(state, root / "torch.pt"), root / "torch.pt"),
        (f"DCP (threads={cores})", lambda: dcp_save(dcp_state, root / "dcp", cores), root / "dcp"),
        ("safetensors+fsync", lambda: st_save(flat, root / "st.safetensors"), root / "st.safetensors"),
        ("ours sync", lambda: ours.save(state, 1), root / "ours" / "step-000000001"),
    ]
    asyncs = {mode: ckpt(f"async-{mode}", mode) for mode in SNAPSHOTS}
    floors = _memcpy_floors(raw, flat)
    readers: list[tuple[str, Callable[[], Any], list[Path]]] = [
        ("raw O_DIRECT", lambda: raw.read(root / "raw.bin", 1), [root / "raw.bin"]),
        (f"raw O_DIRECT x{cores * 2}", lambda: raw.read(root / "raw.bin", cores * 2), [root / "raw.bin"]),
        ("raw buffered", lambda: raw.read(root / "raw.bin", 1, direct=False), [root / "raw.bin"]),
        ("torch.load", lambda: torch.load(root / "torch.pt", weights_only=True), [root / "torch.pt"]),
        (f"DCP (threads={cores})", lambda: dcp_load(dcp_state, root / "dcp"), [root / "dcp"]),
        ("safetensors load_file", lambda: st_load(root / "st.safetensors"), [root / "st.safetensors"]),
        ("ours", lambda: ours.load_latest(), [root / "ours"]),
        ("ours mmap", lambda: ours.load_latest(mmap=True), [root / "ours"]),
        # A resume into the model and optimizer the trainer already built.
        ("DCP, into existing tensors", lambda: dcp_load(dcp_state, root / "dcp", into=True), [root / "dcp"]),
        ("ours, into existing tensors", lambda: ours.load_latest(into=state), [root / "ours"]),
    ]
    total = reps * (len(writers) + len(asyncs) * 3 + len(floors) + len(readers) + (4 if small else 0))
    step = [0]

    def tick(kind: str, name: str, r: int, secs: float, n: int = 0) -> None:
        step[0] += 1
        rate = f"  {n / secs / 1e9:6.2f} GB/s" if n else ""
        progress(f"[{step[0]:>3}/{total}] {kind:<6} {name:<28} rep {r + 1}/{reps}  {secs:7.3f} s{rate}")

    # The report lists the methods in these orders, not in the order they ran in.
    for name, _, _ in writers:
        res(name, "write")
    for mode in asyncs:
        res(f"ours async {mode}", "async")
    for name, _ in floors:
        res(name, "memcpy")
    for name, _, _ in readers:
        res(name, "read")
    snapshots: list[tuple[str, Callable[[int], None]]] = []
    snapshots += [(mode, functools.partial(_async_run, asyncs, state, mode, res, tick, info)) for mode in asyncs]
    snapshots += [(name, functools.partial(_memcpy_run, fn, res(name, "memcpy"), name, tick)) for name, fn in floors]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for ck in asyncs.values():
            # Untimed: a first save allocates its staging buffer (seconds a GiB
            # where fresh memory is slow), once a job; the stall is the others'.
            ck.save_async(state, 0).wait()
        _clear(asyncs)
        for r in range(reps):
            for name, fn, out in shuffled(writers, r):
                _remove(out)  # every method writes a new file, none overwrites
                training_step(state)
                os.sync()
                secs, _ = _timed(fn)
                res(name, "write").times.append(secs)
                tick("write", name, r, secs, nbytes)
            for _, run in shuffled(snapshots, r):
                # After a fork every page of the process owes an unshare fault:
                # training_step pays them, outside the timing, as it does for every method.
                training_step(state)
                run(r)
            _clear(asyncs)
        _penalties(asyncs, state, reps, res, tick)
        # The memcpy lines' buffers, a state's size each, are unmapped before
        # the loads, which allocate their results.
        floors.clear()
        snapshots.clear()
        for r in range(reps):
            for name, fn, paths in shuffled(readers, r):
                info["cache"] = drop_cache(paths)
                secs, out = _timed(fn)
                del out
                res(name, "read").times.append(secs)
                tick("read", name, r, secs, nbytes)
        if small:
            _small(root, cfg, reps, res, tick)
    for ck in (ours, *asyncs.values()):
        ck.close()
    for name in ("raw.bin", "torch.pt", "dcp", "st.safetensors", "ours", "small"):
        _remove(root / name)
    for mode in asyncs:
        _remove(root / f"async-{mode}")
    return {"info": info, "results": [dataclasses.asdict(r) | {"median": r.median} for r in results.values()]}


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _async_run(asyncs: dict[str, Checkpointer], state: Any, mode: str, res: Callable[..., Result], tick: Tick,
               info: dict[str, Any], r: int) -> None:  # fmt: skip
    """One timed ``save_async`` in ``mode``."""
    ck = asyncs[mode]
    result = res(f"ours async {mode}", "async")
    t0 = time.perf_counter()
    h = ck.save_async(state, r + 1)
    stall = time.perf_counter() - t0
    h.fence()
    fenced = time.perf_counter() - t0
    h.wait()
    durable = time.perf_counter() - t0
    result.times.append(stall)
    result.extra.setdefault("stall_with_fence", []).append(fenced)
    result.extra.setdefault("durable", []).append(durable)
    staging: Staging = ck.engine.staging
    result.extra.setdefault("staging_bytes", []).append(float(staging.capacity))
    tick("async", f"{mode} stall", r, stall)
    tick("async", f"{mode} durable", r, durable, result.nbytes)
    if mode == "auto":
        info["auto_chose"] = h.mode


def _clear(asyncs: dict[str, Checkpointer]) -> None:
    """Delete the background saves' checkpoints, once all of a round has been timed.

    Not right before each timed save: freeing a checkpoint's blocks goes on in
    the kernel after the unlink returns (on a filesystem mounted with
    ``discard``, the device is told of each freed extent), and it would take
    cores from the next timed copy but not from a memcpy floor timed elsewhere.
    """
    for ck in asyncs.values():
        remove_steps(ck.dir)
    os.sync()


def _memcpy_floors(raw: Raw, flat: dict[str, Any]) -> list[tuple[str, Callable[[], None]]]:
    """The floor of an exact snapshot of CPU tensors: the state's bytes copied into a
    reused staging buffer in one piece, with nothing else to do. On one thread (one
    ``memcpy``), and on the threads the ``copy`` snapshot copies with.

    The source is the raw rows' buffer: as many bytes as the state, in one
    page-aligned piece on huge pages, which no trainer's tensors beat. The
    floors are libc's ``memmove``, whatever the staging copy uses.

    Two last lines copy the state's own tensors to their places, one piece
    each, on the same threads: with libc's ``memmove`` (through the cache),
    and with the staging copy's stores (what the copy snapshot does, less its
    bookkeeping). Between them and the floor is what the tensors' sizes and
    places in memory, and the kind of store, cost.

    Each line copies into a buffer of its own, allocated as a staging buffer
    is and faulted in, which only that line writes: once a repetition, as each
    mode writes its staging buffer. On a VM the first write to a buffer in a
    repetition can be slower than a second one right after it (in one run on
    the development VM, ``docs/performance.md``: 1 GiB into a staging buffer
    took 66-85 ms in four repetitions of seven, where the ``save_async``
    right after it took 52-55 ms); a destination that several lines shared
    would be written cold by the first of them and warm by the rest.
    """
    threads = copy_threads()

    def copy(dst: mmap.mmap, n: int) -> None:
        copy_bytes([(address_of(dst), address_of(raw.buf), raw.nbytes)], threads=n, libc=True)

    def tensors(dst: mmap.mmap, libc: bool) -> None:
        copy_bytes(packed_pieces(flat.values(), address_of(dst)), threads=threads, libc=libc)

    def into_own(fn: Callable[[mmap.mmap, Any], None], arg: Any) -> Callable[[], None]:
        return functools.partial(fn, aligned_buffer(raw.nbytes, wipe_on_fork=True), arg)

    floors: list[tuple[str, Callable[[], None]]] = [(f"{FLOOR}, 1 thread", into_own(copy, 1))]
    if threads > 1:
        floors.append((f"{FLOOR}, {threads} threads", into_own(copy, threads)))
    on = f"{threads} thread{'s' * (threads > 1)}"
    floors.append((f"memcpy of each tensor, {on}", into_own(tensors, True)))
    if nontemporal():
        floors.append((f"streaming copy of each tensor, {on}", into_own(tensors, False)))
    return floors


def packed_pieces(tensors: Iterable[Any], base: int) -> list[Piece]:
    """One piece per contiguous CPU tensor, to consecutive addresses from ``base``:
    the state's tensors copied once each, as a file image lays them out."""
    pieces, off = [], base
    for t in tensors:
        n = t.numel() * t.element_size()
        pieces.append((off, int(t.data_ptr()), n))
        off += n
    return pieces


def _memcpy_run(fn: Callable[[], None], result: Result, name: str, tick: Tick, r: int) -> None:
    secs, _ = _timed(fn)
    result.times.append(secs)
    tick("async", name, r, secs, result.nbytes)


def _penalties(asyncs: dict[str, Checkpointer], state: Any, reps: int, res: Callable[..., Result], tick: Tick) -> None:
    """Extra time of an in-place update of the whole state right after save_async
    returns, compared with the same update with nothing in flight: what copy-on-write
    (fork) costs the trainer later, and what waiting for a background copy costs.

    fork's runs update a copy of the state made here, after the stall was measured:
    writing a page its child still shares splits the huge page that holds it,
    which would slow every later method that reads the state. The copy exists
    only now, so the stall was measured in a process holding one state, as a
    trainer does (fork copies the page tables of everything the process holds).
    """
    own = {mode: map_tensors(state, lambda t: t.clone()) if mode == "fork" else state for mode in asyncs}

    def update(state: Any) -> float:
        t0 = time.perf_counter()
        for t in flatten(state).values():
            t.mul_(1.0)  # writes every page, leaves the values as they are
        return time.perf_counter() - t0

    for r in range(reps):
        base = update(own["auto"])
        res("in-place update, nothing in flight", "update").times.append(base)
        for mode, ck in asyncs.items():
            h = ck.save_async(own[mode], 1000 + r)
            h.fence()
            secs = update(own[mode])
            h.wait()
            res(f"in-place update, {mode} in flight", "update").times.append(secs)
            tick("update", f"{mode} in flight", r, secs)
        _clear(asyncs)


def _small(root: Path, cfg: Any, reps: int, res: Callable[..., Result], tick: Tick) -> None:
    import torch

    state = small_state()
    n = state_nbytes(state)
    ck = Checkpointer(root / "small", keep=1000, config=cfg, distributed=False)
    for r in range(reps):
        secs, _ = _timed(lambda: torch_save(state, root / "small.pt"))
        res("torch.save+fsync (10k tensors)", "small-write", n).times.append(secs)
        tick("write", "torch.save 10k", r, secs, n)
        remove_steps(ck.dir)
        secs, _ = _timed(functools.partial(ck.save, state, r + 1))
        res("ours sync (10k tensors)", "small-write", n).times.append(secs)
        tick("write", "ours 10k", r, secs, n)
        drop_cache([root / "small.pt"])
        secs, _ = _timed(lambda: torch.load(root / "small.pt", weights_only=True))
        res("torch.load (10k tensors)", "small-read", n).times.append(secs)
        tick("read", "torch.load 10k", r, secs, n)
        drop_cache([ck.dir])
        secs, _ = _timed(ck.load_latest)
        res("ours (10k tensors)", "small-read", n).times.append(secs)
        tick("read", "ours 10k", r, secs, n)
    ck.close()
    _remove(root / "small.pt")

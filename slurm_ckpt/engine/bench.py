"""``slurm-ckpt bench``: our engine against torch.save, DCP, safetensors and the raw disk.

Everything runs in one process, on one directory, interleaved: repetition 1
of every method, then repetition 2, and so on, so a disk that speeds up or
slows down during the run (shared machines do) affects every method alike.
Within a repetition the methods run in an order shuffled anew each time
(seeded, so a run can be repeated), so that no method always follows the same
one, whatever that one leaves behind: a disk still busy with its buffered
writes, or memory it has just freed, which on a VM whose balloon reports free
memory to the host is fast to fault in again only for a short while.
Each figure is the median of the repetitions, and is only ever shown as a
ratio to another figure measured in the same run.

The state is shaped like a transformer plus its Adam state: per layer a few
large matrices and several small vectors, the optimizer's ``exp_avg`` and
``exp_avg_sq`` for each, and an int-keyed optimizer state dict as torch makes
it. Before each load the page cache is dropped (``/proc/sys/vm/drop_caches``
as root, else ``POSIX_FADV_DONTNEED`` on the files), so loads read the disk.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import random
import shutil
import statistics
import threading
import time
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from ..config import SNAPSHOTS, EngineConfig, load_config
from ..store.fsutil import preallocate
from .buffers import ALIGN, aligned_buffer, populate
from .staging import Staging

__all__ = ["Result", "run_bench", "small_state", "synthetic_state"]

Progress = Callable[[str], None]


@dataclasses.dataclass
class Result:
    """One method's timings: ``times`` are seconds per repetition."""

    name: str
    kind: str  # "write", "read", "async", "small-write", "small-read"
    nbytes: int
    times: list[float] = dataclasses.field(default_factory=list)
    extra: dict[str, list[float]] = dataclasses.field(default_factory=dict)

    @property
    def median(self) -> float:
        return statistics.median(self.times) if self.times else float("nan")

    def extra_median(self, key: str) -> float:
        vals = self.extra.get(key) or []
        return statistics.median(vals) if vals else float("nan")


def synthetic_state(nbytes: int) -> dict[str, Any]:
    """A model + Adam state of about ``nbytes`` (fp32; parameters are a third)."""
    import torch

    params_bytes = max(nbytes // 3, 64 * 1024)
    d = 64
    while 12 * (2 * d) ** 2 * 4 * 4 <= params_bytes and d < 4096:
        d *= 2  # at least ~4 layers of the chosen width
    layers = max(1, round(params_bytes / (12 * d * d * 4)))
    shapes: dict[str, tuple[int, ...]] = {}
    for i in range(layers):
        p = f"layers.{i}."
        shapes.update({p + "attn.qkv.weight": (3 * d, d), p + "attn.qkv.bias": (3 * d,),
                       p + "attn.out.weight": (d, d), p + "attn.out.bias": (d,),
                       p + "mlp.fc1.weight": (4 * d, d), p + "mlp.fc1.bias": (4 * d,),
                       p + "mlp.fc2.weight": (d, 4 * d), p + "mlp.fc2.bias": (d,),
                       p + "ln1.weight": (d,), p + "ln1.bias": (d,),
                       p + "ln2.weight": (d,), p + "ln2.bias": (d,)})  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    model = {k: torch.randn(s, generator=gen) for k, s in shapes.items()}
    opt_state = {i: {"step": torch.tensor(100.0), "exp_avg": torch.randn(s, generator=gen),
                     "exp_avg_sq": torch.rand(s, generator=gen)}
                 for i, s in enumerate(shapes.values())}  # fmt: skip
    groups = [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0,
               "params": list(range(len(shapes)))}]  # fmt: skip
    return {"model": model, "optim": {"state": opt_state, "param_groups": groups}, "step": 100}


def script_state(sub: str, reps: int, make: Callable[[int], Any] | None = None) -> tuple[Any, Path, Any]:
    """For a script in ``bench/``: its arguments (``--size``, ``--dir``, ``--reps``), a
    fresh ``sub`` dir under ``--dir``, and a state of ``--size`` (``make(nbytes)``,
    else the synthetic one)."""
    import argparse

    from ..config import parse_size

    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="1G")
    ap.add_argument("--dir", type=Path, required=True)
    ap.add_argument("--reps", type=int, default=reps)
    args = ap.parse_args()
    root = args.dir / sub
    shutil.rmtree(root, ignore_errors=True)
    return args, root, (make or synthetic_state)(parse_size(args.size))


def script_finish(times: dict[str, list[float]], base: str, of: str, checkpointers: Iterable[Any], root: Path) -> None:
    """For a script in ``bench/``: print each median in ms and as a ratio to ``base``'s, then clean up."""
    ref = statistics.median(times[base])
    for name, v in times.items():
        m = statistics.median(v)
        print(f"  {name:<36} {m * 1e3:8.1f} ms  x {m / ref:.3f} {of}")
    for c in checkpointers:
        c.close()
    shutil.rmtree(root, ignore_errors=True)


def small_state(count: int = 10_000, numel: int = 256) -> dict[str, Any]:
    """``count`` small tensors: the case where per-tensor overheads dominate."""
    import torch

    gen = torch.Generator().manual_seed(1)
    return {"model": {f"p{i}": torch.randn(numel, generator=gen) for i in range(count)}, "step": 1}


def flatten(state: Any, prefix: str = "") -> dict[str, Any]:
    """Tensors of ``state`` under dotted keys (what safetensors and DCP take)."""
    import torch

    out: dict[str, Any] = {}
    if isinstance(state, dict):
        for k, v in state.items():
            out.update(flatten(v, f"{prefix}{k}."))
    elif isinstance(state, torch.Tensor):
        out[prefix[:-1]] = state
    return out


def state_nbytes(state: Any) -> int:
    return sum(t.numel() * t.element_size() for t in flatten(state).values())


def drop_cache(paths: list[Path]) -> str:
    """Evict ``paths`` from the page cache; returns how it was done."""
    os.sync()
    if os.geteuid() == 0:
        try:
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
            return "drop_caches"
        except OSError:
            pass
    for p in paths:
        for f in [p] if p.is_file() else [q for q in p.rglob("*") if q.is_file()]:
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return "fadvise"


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _Raw:
    """The device's own limit: O_DIRECT sequential I/O of a page-aligned buffer."""

    def __init__(self, nbytes: int, chunk: int, *, huge: bool = True) -> None:
        self.nbytes = -(-nbytes // ALIGN) * ALIGN
        self.chunk = chunk
        self.buf = aligned_buffer(self.nbytes, huge=huge)
        view = memoryview(self.buf)
        pattern = os.urandom(1 << 20)
        for off in range(0, self.nbytes, len(pattern)):
            n = min(len(pattern), self.nbytes - off)
            view[off : off + n] = pattern[:n]
        view.release()

    def write(self, path: Path, threads: int) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0), 0o644)
        try:
            preallocate(fd, self.nbytes)  # as the engine does: the limit is measured like for like
            self._parallel(threads, lambda v, off: os.pwrite(fd, v, off))
            os.fsync(fd)
        finally:
            os.close(fd)

    def read(self, path: Path, threads: int, into: memoryview | None = None) -> None:
        """Read into our buffer, or into ``into`` (page-aligned, ``nbytes`` long)."""
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
        try:
            self._parallel(threads, lambda v, off: os.preadv(fd, [v], off), into)
        finally:
            os.close(fd)

    def _parallel(self, threads: int, io: Callable[[memoryview, int], int], into: memoryview | None = None) -> None:
        offsets = iter(range(0, self.nbytes, self.chunk))
        lock = threading.Lock()
        view = memoryview(self.buf) if into is None else into

        def worker() -> None:
            while True:
                with lock:
                    off = next(offsets, None)
                if off is None:
                    return
                v = view[off : off + self.chunk]
                while v:
                    n = io(v, off)
                    if n <= 0:
                        raise OSError(f"raw I/O stopped at byte {off}")
                    v, off = v[n:], off + n

        pool = [threading.Thread(target=worker) for _ in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        if into is None:
            view.release()


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


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

    from .. import Checkpointer

    root.mkdir(parents=True, exist_ok=True)
    cfg = load_config()
    if engine is not None:
        cfg = dataclasses.replace(cfg, engine=engine)
    cores = len(os.sched_getaffinity(0))
    state = synthetic_state(size)
    nbytes = state_nbytes(state)
    flat = flatten(state)
    dcp_state = {"model": state["model"], "optim": {str(k): v for k, v in state["optim"]["state"].items()}}
    raw = _Raw(nbytes, 8 << 20)
    results: dict[str, Result] = {}
    info: dict[str, Any] = {"size": size, "nbytes": nbytes, "tensors": len(flat), "reps": reps,
                            "dir": str(root), "cores": cores, "torch": torch.__version__,
                            "torch_huge_pages": os.environ.get("THP_MEM_ALLOC_ENABLE") == "1"}  # fmt: skip

    def res(name: str, kind: str, n: int = nbytes) -> Result:
        return results.setdefault(f"{kind}:{name}", Result(name, kind, n))

    def ckpt(sub: str, snapshot: str = "auto") -> Checkpointer:
        c = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, snapshot=snapshot))
        return Checkpointer(root / sub, keep=1000, config=c, distributed=False)

    ours = ckpt("ours")
    writers: list[tuple[str, Callable[[], Any], Path]] = [
        ("raw O_DIRECT", lambda: raw.write(root / "raw.bin", 1), root / "raw.bin"),
        (f"raw O_DIRECT x{cores * 2}", lambda: raw.write(root / "raw.bin", cores * 2), root / "raw.bin"),
        ("torch.save+fsync", lambda: _torch_save(state, root / "torch.pt"), root / "torch.pt"),
        (f"DCP (threads={cores})", lambda: _dcp_save(dcp_state, root / "dcp", cores), root / "dcp"),
        ("safetensors+fsync", lambda: _st_save(flat, root / "st.safetensors"), root / "st.safetensors"),
        ("ours sync", lambda: ours.save(state, 1), root / "ours" / "step-000000001"),
    ]
    asyncs = {mode: ckpt(f"async-{mode}", mode) for mode in SNAPSHOTS}
    readers: list[tuple[str, Callable[[], Any], list[Path]]] = [
        ("raw O_DIRECT", lambda: raw.read(root / "raw.bin", 1), [root / "raw.bin"]),
        (f"raw O_DIRECT x{cores * 2}", lambda: raw.read(root / "raw.bin", cores * 2), [root / "raw.bin"]),
        ("torch.load", lambda: torch.load(root / "torch.pt", weights_only=True), [root / "torch.pt"]),
        (f"DCP (threads={cores})", lambda: _dcp_load(dcp_state, root / "dcp"), [root / "dcp"]),
        ("safetensors load_file", lambda: _st_load(root / "st.safetensors"), [root / "st.safetensors"]),
        ("ours", lambda: ours.load_latest(), [root / "ours"]),
        ("ours mmap", lambda: ours.load_latest(mmap=True), [root / "ours"]),
        # A resume into the model and optimizer the trainer already built.
        ("DCP, into existing tensors", lambda: _dcp_load(dcp_state, root / "dcp", into=True), [root / "dcp"]),
        ("ours, into existing tensors", lambda: ours.load_latest(into=state), [root / "ours"]),
    ]
    total = reps * (len(writers) + len(asyncs) * 3 + len(readers) + (4 if small else 0))
    step = [0]

    def tick(kind: str, name: str, r: int, secs: float, n: int = 0) -> None:
        step[0] += 1
        rate = f"  {n / secs / 1e9:6.2f} GB/s" if n else ""
        progress(f"[{step[0]:>3}/{total}] {kind:<6} {name:<28} rep {r + 1}/{reps}  {secs:7.3f} s{rate}")

    for name, _, _ in writers:  # the report lists them in this order, not the order they ran in
        res(name, "write")
    for name, _, _ in readers:
        res(name, "read")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for r in range(reps):
            for name, fn, out in _shuffled(writers, r):
                _remove(out)  # every method writes a new file, none overwrites
                _training_step(state)
                os.sync()
                secs, _ = _timed(fn)
                res(name, "write").times.append(secs)
                tick("write", name, r, secs, nbytes)
            for mode, ck in asyncs.items():
                # After a fork every page of the process owes an unshare fault:
                # _training_step pays them, outside the timing, as it does for every method.
                _training_step(state)
                chose = _async_run(ck, state, mode, res(f"ours async {mode}", "async"), r, tick)
                if mode == "auto":
                    info["auto_chose"] = chose
        _penalties(asyncs, state, reps, res, tick)
        for r in range(reps):
            for name, fn, paths in _shuffled(readers, r):
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


def _shuffled(methods: list[Any], rep: int) -> list[Any]:
    return random.Random(rep).sample(methods, len(methods))


def _torch_save(state: Any, path: Path) -> None:
    import torch

    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def _st_save(flat: dict[str, Any], path: Path) -> None:
    from safetensors.torch import save_file

    save_file(flat, str(path))
    _fsync_path(path)


def _st_load(path: Path) -> Any:
    from safetensors.torch import load_file

    return load_file(str(path))


def _dcp_save(state: dict[str, Any], path: Path, threads: int) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path), thread_count=threads), no_dist=True)


def _dcp_load(like: dict[str, Any], path: Path, *, into: bool = False) -> Any:
    import torch
    import torch.distributed.checkpoint as dcp

    # DCP loads into tensors the caller allocates: into ``like``'s own, or into
    # new ones, whose allocation is then part of the load.
    target = {k: {n: t if into else torch.empty_like(t) for n, t in flatten(v).items()} for k, v in like.items()}
    dcp.load(target, storage_reader=dcp.FileSystemReader(str(path)), no_dist=True)
    return target


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _async_run(ck: Any, state: Any, mode: str, result: Result, r: int, tick: Callable[..., None]) -> str:
    """One timed ``save_async``; returns the snapshot mode it used."""
    _remove_steps(ck.dir)
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
    return h.mode


def _training_step(state: Any) -> None:
    """Write every page of the state in place, as an optimizer step does between saves.

    After a fork (the fork snapshot here; DataLoader workers in a trainer) every
    page of the parent stays marked shared until it is written again, and an
    O_DIRECT write straight from such a page first takes a fault to unshare
    it: 0.47 s for 1 GiB became 0.61 s on the development VM. A trainer writes
    its whole state every step, so the bench does too, outside the timing,
    before each method: without it the methods after a fork pay for it.
    """
    for t in flatten(state).values():
        if hasattr(t, "data_ptr") and t.numel():
            lo = t.data_ptr() - t.data_ptr() % ALIGN
            populate(lo, t.data_ptr() + t.numel() * t.element_size() - lo)


def _remove_steps(run_dir: Path) -> None:
    for p in run_dir.glob("step-*"):
        shutil.rmtree(p, ignore_errors=True)


def map_tensors(state: Any, fn: Callable[[Any], Any]) -> Any:
    """``state`` with each tensor ``t`` replaced by ``fn(t)``; other values kept."""
    import torch

    if isinstance(state, dict):
        return {k: map_tensors(v, fn) for k, v in state.items()}
    if isinstance(state, list):
        return [map_tensors(v, fn) for v in state]
    return fn(state) if isinstance(state, torch.Tensor) else state


def _penalties(asyncs: dict[str, Any], state: Any, reps: int,
               res: Callable[..., Result], tick: Callable[..., None]) -> None:  # fmt: skip
    """Extra time of an in-place update of the whole state right after save_async
    returns, compared with the same update with nothing in flight: what copy-on-write
    (fork) costs the trainer later, and what a lazy fence costs.

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
            _remove_steps(ck.dir)
            h = ck.save_async(own[mode], 1000 + r)
            h.fence()
            secs = update(own[mode])
            h.wait()
            res(f"in-place update, {mode} in flight", "update").times.append(secs)
            tick("update", f"{mode} in flight", r, secs)


def _small(root: Path, cfg: Any, reps: int, res: Callable[..., Result], tick: Callable[..., None]) -> None:
    import torch

    from .. import Checkpointer

    state = small_state()
    n = state_nbytes(state)
    ck = Checkpointer(root / "small", keep=1000, config=cfg, distributed=False)
    for r in range(reps):
        secs, _ = _timed(lambda: _torch_save(state, root / "small.pt"))
        res("torch.save+fsync (10k tensors)", "small-write", n).times.append(secs)
        tick("write", "torch.save 10k", r, secs, n)
        _remove_steps(ck.dir)
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

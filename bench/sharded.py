"""``slurm-ckpt bench --sharded``: an FSDP2 state through ``Checkpointer`` against ``dcp.save``/``dcp.load``.

Ranks are processes on this machine joined by gloo over loopback, each on the
CPU. The state is ``get_state_dict(model, optimizer)`` of a stack of square
``fully_shard`` linear layers and AdamW's two moments for each, ``size`` bytes
in all (rounded up to whole layers of 64 MiB).

1. ``ranks`` ranks (2) save it, in an order shuffled anew each repetition
   (seeded): ``Checkpointer.save`` (one shard per rank, the engine's
   ``O_DIRECT`` writer, a committed checkpoint), ``dcp.save`` with DCP's
   ``FileSystemWriter`` as it comes (one thread) and with as many threads as
   our engine uses; then they load the last checkpoint of each cold:
   ``Checkpointer.load_latest(into=...)`` and ``dcp.load`` with
   ``FileSystemReader``, into the same DTensors.
2. The same checkpoints are loaded cold at other world sizes (``reshard``:
   3 and 1), each rank into its new shards.

Cold: the checkpoint's files are evicted from the page cache first
(``disk.drop_cache``); DCP's writes fill the cache and ours bypass it, so
without that DCP's loads would read memory. A time is the slowest rank's,
between barriers. Reported: each line's median and its ratio to ours in the
same run (above 1: ours is faster). Each method's load, into zeroed
tensors, is checked bit for bit against the other's, and at the world size
that saved against the state as saved.
"""

from __future__ import annotations

import functools
import json
import os
import random
import shutil
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["format_sharded", "run_sharded_bench"]

WIDTH = 4096
"""Each layer is WIDTH x WIDTH fp32: 64 MiB, and as much again for each AdamW moment."""

Progress = Callable[[str], None]


def run_sharded_bench(size: int, root: Path, *, reps: int = 3, ranks: int = 2, reshard: tuple[int, ...] = (3, 1),
                      width: int = WIDTH, progress: Progress = lambda s: None) -> dict[str, Any]:  # fmt: skip
    """Run the sharded case in a temp dir under ``root`` (removed after); return the timings.

    ``width``: of each square layer (smaller for a quick run of the machinery).
    """
    import torch.multiprocessing as mp

    root.mkdir(parents=True, exist_ok=True)
    base = Path(tempfile.mkdtemp(prefix="sharded-bench-", dir=root)).absolute()
    layers = max(1, -(-size // (3 * width * width * 4)))  # at least ``size``
    doc: dict[str, Any] = {"info": {"layers": layers, "width": width, "nbytes": 3 * layers * width * width * 4, "reps": reps,
                                    "ranks": ranks, "dir": str(root), "cores": len(os.sched_getaffinity(0))},
                           "lines": {}, "ok": True}  # fmt: skip
    try:
        for world, phase in [(ranks, "save"), *((w, "reshard") for w in reshard)]:
            progress(f"sharded bench: {phase} at {world} rank(s)")
            out = base / f"result-{phase}-{world}.json"
            args = (world, _free_port(), str(base), layers, width, reps, phase, str(out))
            mp.spawn(_rank, args=args, nprocs=world)
            got = json.loads(out.read_text())
            doc["lines"].update(got["lines"])
            doc["ok"] = doc["ok"] and got["ok"]
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return doc


def format_sharded(doc: dict[str, Any]) -> str:
    """The report: one line per method, its median, throughput and ratio to ours."""
    info = doc["info"]
    out = [f"sharded: FSDP2 state {info['nbytes'] / 2**30:.2f} GiB ({info['layers']} layers of {info['width']}x{info['width']} fp32 "
           f"and AdamW's moments), saved by {info['ranks']} ranks; {info['reps']} repetitions interleaved, medians; "
           f"dir {info['dir']}; {info['cores']} cores; loads cold (files evicted from the page cache)"]  # fmt: skip
    med = {k: statistics.median(v) for k, v in doc["lines"].items() if v}
    for k, v in med.items():
        group = k.split(":", 1)[0]
        ours = next((x for name, x in med.items() if name.startswith(group + ":") and "slurm-ckpt" in name), v)
        out.append(f"  {k:<58} {v:8.3f} s {info['nbytes'] / v / 1e9:6.2f} GB/s  x{v / ours:5.2f} ours")
    out.append(f"  every load bit-exact (ours against dcp.load's, and at {info['ranks']} ranks against the saved "
               "state): " + ("yes" if doc["ok"] else "NO"))  # fmt: skip
    return "\n".join(out)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _model(world: int, layers: int, width: int) -> tuple[Any, Any]:
    """The FSDP2 model and AdamW with its moments created (one step)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width, bias=False) for _ in range(layers)))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def _rank(rank: int, world: int, port: int, base: str, layers: int, width: int, reps: int, phase: str,
          out: str) -> None:  # fmt: skip
    import warnings

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from slurm_ckpt import Checkpointer
    from slurm_ckpt.engine import default_threads
    from slurm_ckpt.store.retention import reaped

    from .disk import drop_cache

    warnings.filterwarnings("ignore", category=UserWarning)
    os.environ.pop("SLURM_CKPT_SCRATCH", None)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    root = Path(base)
    model, opt = _model(world, layers, width)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    saved = {k: v.to_local().clone() for k, v in _tensors(state)}  # never changed: every save holds it
    threads = default_threads()
    lines: dict[str, list[float]] = {}
    rng = random.Random(1234)

    def timed(name: str, fn: Callable[[], Any]) -> None:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        mine = time.perf_counter() - t0
        slowest: list[float] = [0.0] * world
        dist.all_gather_object(slowest, mine)
        lines.setdefault(name, []).append(max(slowest))

    def evict(path: Path) -> None:
        if rank == 0:
            drop_cache([path])
        dist.barrier()

    ck = Checkpointer(root / "ours", scratch=False, keep=1, lock_timeout=None)
    fs = root / "dcp"
    tag = f"{world} rank{'s' if world > 1 else ''}"
    load_ours, load_dcp = f"load {tag}: slurm-ckpt load_latest", f"load {tag}: dcp.load FileSystemReader"
    if phase == "reshard":
        load_ours, load_dcp = f"reshard {tag}: slurm-ckpt load_latest", f"reshard {tag}: dcp.load FileSystemReader"
    for rep in range(reps):
        if phase == "save":
            saves: list[tuple[str, Callable[[], Any]]] = [
                ("save: slurm-ckpt Checkpointer.save", functools.partial(ck.save, state, step=rep)),
                ("save: dcp.save FileSystemWriter",
                 functools.partial(dcp.save, state, storage_writer=dcp.FileSystemWriter(fs / f"step-{rep}"))),
                (f"save: dcp.save FileSystemWriter, {threads} threads",
                 functools.partial(dcp.save, state, storage_writer=dcp.FileSystemWriter(
                     root / "dcp-threads" / f"step-{rep}", thread_count=threads))),
            ]  # fmt: skip
            rng.shuffle(saves)
            for name, fn in saves:
                timed(name, fn)
                reaped()  # retention deletes the older checkpoint on a thread: not during the next line
            if rank == 0:
                for d in (fs, root / "dcp-threads"):
                    for old in d.glob("step-*"):
                        if old.name != f"step-{rep}":
                            shutil.rmtree(old)
            dist.barrier()
        last = fs / f"step-{max(int(p.name.split('-')[1]) for p in fs.glob('step-*'))}"
        loads: list[tuple[str, Callable[[], Any]]] = [
            (load_ours, functools.partial(ck.load_latest, into=state)),
            (load_dcp, functools.partial(dcp.load, state, storage_reader=dcp.FileSystemReader(last))),
        ]
        rng.shuffle(loads)
        for name, fn in loads:
            evict(root / "ours" if "slurm-ckpt" in name else last)
            timed(name, fn)
    # Each method's load into zeroed tensors, bit for bit against the other's; at the
    # world size that saved, against the state as saved too (at another, this rank's
    # model trained its one step with other sums, so it is no reference).
    got = []
    for load in (functools.partial(ck.load_latest, into=state),
                 functools.partial(dcp.load, state, storage_reader=dcp.FileSystemReader(last))):  # fmt: skip
        for _, v in _tensors(state):
            v.to_local().zero_()
        load()
        got.append({k: v.to_local().clone() for k, v in _tensors(state)})
    refs = [got[1], saved] if phase == "save" else [got[1]]
    ok = all(torch.equal(got[0][k], ref[k]) for ref in refs for k in saved)
    oks: list[bool] = [False] * world
    dist.all_gather_object(oks, ok)
    ck.close()
    if rank == 0:
        Path(out).write_text(json.dumps({"lines": lines, "ok": all(oks)}))
    dist.barrier()
    dist.destroy_process_group()


def _tensors(state: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """The DTensors of a nested state, by dotted path."""
    out: list[tuple[str, Any]] = []
    items = state.items() if isinstance(state, dict) else enumerate(state) if isinstance(state, list) else ()
    for k, v in items:
        if hasattr(v, "to_local"):
            out.append((f"{prefix}{k}", v))
        else:
            out += _tensors(v, f"{prefix}{k}.")
    return out

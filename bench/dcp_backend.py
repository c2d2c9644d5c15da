"""slurm_ckpt.dcp against DCP's own FileSystemWriter/FileSystemReader: 2 ranks, one run, ratios.

    python -m bench.dcp_backend --dir /path/on/the/disk [--size 1G] [--reps 5]

Two processes (gloo over loopback) hold a state of DTensors sharded on dim 0
over both, ``--size`` in all (tensors of 64 MiB, as large layers and their
optimizer moments are). Each repetition runs, in an order shuffled anew
(seeded), ``dcp.save`` and ``dcp.load`` with each backend; a load is timed
cold, after the checkpoint's files were dropped from the page cache
(``posix_fadvise(DONTNEED)``; our writes bypass the cache, DCP's fill it).
A time is the slowest rank's, between barriers. Printed: the median of each
line and its ratio to ours (above 1: ours is faster).

``FileSystemWriter`` is DCP's default (``thread_count=1``, ``sync_files=True``)
and, as a second line, with as many threads as our engine uses. Our loads
verify every block's crc32; DCP's verify nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

TENSOR = 64 << 20


def _drop_cache(path: Path) -> None:
    for f in path.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _rank(rank: int, world: int, port: int, root: str, size: int, reps: int, out: str) -> None:
    import warnings

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from slurm_ckpt.dcp import StorageReader, StorageWriter
    from slurm_ckpt.engine import default_threads
    from slurm_ckpt.store.retention import reaped

    warnings.filterwarnings("ignore", category=UserWarning)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    rows = TENSOR // 4 // 1024
    state = {f"layer{i}": distribute_tensor(torch.randn(rows, 1024), mesh, [Shard(0)]) for i in range(max(1, size // TENSOR))}
    target = {k: distribute_tensor(torch.zeros(rows, 1024), mesh, [Shard(0)]) for k in state}
    base = Path(root)
    threads = default_threads()

    def ours_save(i: int) -> Path:
        dcp.save(state, storage_writer=StorageWriter(base / "ours", step=i, keep=1))
        return base / "ours"

    def fs_save(i: int, n: int) -> Path:
        path = base / f"fs{n}" / f"step-{i}"
        dcp.save(state, storage_writer=dcp.FileSystemWriter(path, thread_count=n))
        return path

    def ours_load(path: Path) -> None:
        dcp.load(target, storage_reader=StorageReader(path))

    def fs_load(path: Path) -> None:
        dcp.load(target, storage_reader=dcp.FileSystemReader(path))

    lines: dict[str, list[float]] = {"save: slurm_ckpt.dcp": [], "save: FileSystemWriter": [], f"save: FileSystemWriter, {threads} threads": [],
             "load cold: slurm_ckpt.dcp": [], "load cold: FileSystemReader": []}  # fmt: skip
    order = list(range(4))
    rng = random.Random(1234)
    last: dict[str, Path] = {}

    def timed(name: str, fn: Any) -> Any:
        dist.barrier()
        t0 = time.perf_counter()
        got = fn()
        mine = time.perf_counter() - t0
        slowest = [0.0] * world
        dist.all_gather_object(slowest, mine)
        lines[name].append(max(slowest))
        return got

    for rep in range(reps):
        rng.shuffle(order)
        for k in order:
            if k == 0:
                last["ours"] = timed("save: slurm_ckpt.dcp", lambda r=rep: ours_save(r))
                reaped()  # retention deletes the older one on a thread: not during the next line
            elif k == 1:
                last["fs"] = timed("save: FileSystemWriter", lambda r=rep: fs_save(r, 1))
            elif k == 2:
                timed(f"save: FileSystemWriter, {threads} threads", lambda r=rep: fs_save(r, threads))
            else:
                for which in rng.sample(["ours", "fs"], 2):
                    if rank == 0 and which in last:
                        _drop_cache(last[which])
                    if which not in last:
                        continue
                    if which == "ours":
                        timed("load cold: slurm_ckpt.dcp", lambda: ours_load(last["ours"]))
                    else:
                        timed("load cold: FileSystemReader", lambda: fs_load(last["fs"]))
        if rank == 0:
            for n in (1, threads):  # keep one DCP checkpoint per writer, as keep=1 does for ours
                for old in sorted((base / f"fs{n}").glob("step-*")):
                    if old.name != f"step-{rep}":
                        shutil.rmtree(old)
        dist.barrier()
    ok = all(torch.equal(target[k].to_local(), state[k].to_local()) for k in state)
    if rank == 0:
        Path(out).write_text(json.dumps({"lines": lines, "ok": ok, "bytes": sum(t.numel() * 4 for t in state.values())}))
    dist.barrier()
    dist.destroy_process_group()


def report(result: dict[str, Any]) -> str:
    lines = result["lines"]
    med = {k: statistics.median(v) for k, v in lines.items() if v}
    out = []
    for k, v in med.items():
        ours = med["save: slurm_ckpt.dcp"] if k.startswith("save") else med["load cold: slurm_ckpt.dcp"]
        gbs = result["bytes"] / v / 1e9
        out.append(f"{k:<40} median {v:7.3f} s  {gbs:5.2f} GB/s  x{v / ours:5.2f} ours")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    import torch.multiprocessing as mp

    from slurm_ckpt.config import parse_size

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=None, help="a directory on the disk to measure (default: a temp dir)")
    ap.add_argument("--size", default="1G", help="state size over both ranks (default 1G)")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="dcp-bench-", dir=args.dir)).absolute()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = root / "result.json"
    try:
        mp.spawn(_rank, args=(2, port, str(root), parse_size(args.size), args.reps, str(out)), nprocs=2)
        result = json.loads(out.read_text())
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"# {time.strftime('%Y-%m-%d')}, 2 ranks, {result['bytes'] / 2**30:.2f} GiB, {args.reps} repetitions, "
          f"{os.uname().nodename}, {len(os.sched_getaffinity(0))} cores")  # fmt: skip
    print(report(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

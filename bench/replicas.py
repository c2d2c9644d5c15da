"""What peer replicas cost a training loop: the stall added per save, and the bytes sent.

    python -m bench.replicas [--dir D] [--size 256M] [--ranks 3] [--reps 5] [--json OUT]

``ranks`` processes on this machine play one node each (``SLURMD_NODENAME``
node0.., a scratch dir each under ``D``), joined by gloo over loopback. Each
rank holds ``size / ranks`` bytes of fp32 tensors (its shard) and runs a
synchronous loop: a matmul and an all-reduce per step, like data-parallel
training. Each repetition times, interleaved and in a shuffled order (seeded):

* ``plain``: ``STEPS`` steps;
* for each replica count (0, then 1 up to ``ranks - 1``): ``save`` at a step
  boundary (every rank its shard on its scratch, the ``CrossNode``
  placement), then steps while the replicas are sent in the background: at
  least ``STEPS``, and on until every rank's replicas are committed.

A save's stall is that time less as many plain steps': what the loop waits
for, the save itself and what the background copy takes from the steps (the
same cores, the loopback, the disk). The in-job drain to the durable tier is off in every line, so only
replication differs between them. Reported: medians over the repetitions of
the slowest rank, the stall and what it adds to ``replicas=0``'s, and the bytes each
save sent to peers (all ranks), with the time the replication took.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["format_replicas", "run_replicas_bench"]

STEPS = 20
WIDTH = 512


def run_replicas_bench(size: int, root: Path, *, ranks: int = 3, reps: int = 5) -> dict[str, Any]:
    """Run the benchmark in a temp dir under ``root`` (removed after); return the figures."""
    import torch.multiprocessing as mp

    root.mkdir(parents=True, exist_ok=True)
    base = Path(tempfile.mkdtemp(prefix="replicas-bench-", dir=root)).absolute()
    try:
        out = base / "result.json"
        mp.spawn(_rank, args=(ranks, _free_port(), str(base), size, reps, str(out)), nprocs=ranks)
        doc: dict[str, Any] = json.loads(out.read_text())
    finally:
        shutil.rmtree(base, ignore_errors=True)
    doc["info"] |= {"dir": str(root), "cores": len(os.sched_getaffinity(0))}
    return doc


def format_replicas(doc: dict[str, Any]) -> str:
    info = doc["info"]
    out = [f"replicas: {info['ranks']} ranks as {info['ranks']} nodes (gloo over loopback), {info['nbytes'] / 2**20:.0f} MiB "
           f"per rank's shard; {info['steps']} steps or more after each save, until its replicas are committed; {info['reps']} repetitions interleaved, medians of "
           f"the slowest rank; dir {info['dir']}; {info['cores']} cores; in-job drain off",
           f"  {'plain steps':<14} {statistics.median(doc['plain']):8.3f} s"]  # fmt: skip
    base = None
    for n, line in sorted(doc["lines"].items(), key=lambda kv: int(kv[0])):
        stall = statistics.median(line["stall"])
        save = statistics.median(line["save"])
        base = stall if base is None else base
        sent = statistics.median(line["sent"])
        took = statistics.median(line["replicate"])
        count = statistics.median(line["steps"])
        out.append(f"  replicas={n:<2} save {save:6.3f} s  stall {stall:6.3f} s ({stall - base:+7.3f} s on replicas=0's)  "
                   f"sent {sent / 2**20:8.1f} MiB per save (all ranks)  replication {took:6.3f} s over {count:.0f} steps")  # fmt: skip
    out.append(f"  every replica committed on its peer (checksums matched): {'yes' if doc['ok'] else 'NO'}")
    return "\n".join(out)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank(rank: int, world: int, port: int, base: str, size: int, reps: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from slurm_ckpt import Checkpointer
    from slurm_ckpt.config import Config, ScratchConfig, StorageConfig

    os.environ["SLURMD_NODENAME"] = f"node{rank}"
    for k in ("SLURM_CKPT_SCRATCH", "SLURM_CKPT_SCRATCH_REPLICAS", "SLURM_CKPT_STORAGE_DRAIN"):
        os.environ.pop(k, None)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    per = max(1, size // world // 4)
    g = torch.Generator().manual_seed(rank)
    shard = [torch.randn(min(per, 1 << 24), generator=g) for _ in range(-(-per // (1 << 24)))]
    state = {"shard": shard, "rank": rank}
    nbytes = sum(t.numel() * 4 for t in shard)
    a = torch.randn(WIDTH, WIDTH, generator=g)
    grad = torch.zeros(1 << 16)

    def steps(done: Any = lambda: True) -> int:
        """At least STEPS steps, then on until ``done()`` on every rank; returns how many."""
        x, n = a, 0
        while True:
            x = torch.tanh(x @ a) * 0.5
            dist.all_reduce(grad)
            n += 1
            flag = torch.tensor([0 if n >= STEPS and done() else 1])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if not int(flag.item()):
                return n

    counts = list(range(world))  # replicas 0 .. world-1
    ckpts = {}
    for n in counts:
        cfg = Config(storage=StorageConfig(drain=False), scratch=ScratchConfig(replicas=n))
        scratch = Path(base) / f"scratch-{n}" / f"node{rank}"
        scratch.mkdir(parents=True, exist_ok=True)
        ckpts[n] = Checkpointer(Path(base) / f"run-{n}", scratch=scratch, config=cfg, keep=2)
    plain: list[float] = []
    lines: dict[int, dict[str, list[float]]] = {n: {"stall": [], "save": [], "sent": [], "replicate": [], "steps": []} for n in counts}
    order: list[int | None] = [None, *counts]
    rnd = random.Random(1)
    steps()  # warm up
    ok = True
    for rep in range(reps):
        rnd.shuffle(order)
        for which in order:
            dist.barrier()
            t0 = time.perf_counter()
            if which is not None:
                ck = ckpts[which]
                rep_ = getattr(ck.placement, "replicator", None)
                sent0 = rep_.stats.bytes_sent if rep_ is not None else 0
                secs0 = rep_.stats.seconds if rep_ is not None else 0.0
                ck.save(state, step=rep + 1)
                t_save = time.perf_counter() - t0
            if which is None:
                steps()
                plain.append(_slowest(time.perf_counter() - t0))
                continue
            n = which
            # The steps go on until every rank's replicas are committed: the whole copy overlaps them.
            count = steps(lambda ck=ck: ck.placement.replicated(0))
            took = time.perf_counter() - t0
            ok = ck.placement.replicated(600) and ok  # type: ignore[attr-defined]
            sent = (rep_.stats.bytes_sent - sent0) if rep_ is not None else 0
            secs = (rep_.stats.seconds - secs0) if rep_ is not None else 0.0
            lines[n]["save"].append(_slowest(t_save))
            lines[n]["stall"].append(_slowest(took))
            lines[n]["steps"].append(float(count))
            lines[n]["sent"].append(_total(sent))
            lines[n]["replicate"].append(_slowest(secs))
    for ck in ckpts.values():
        ck.close()
    oks: list[Any] = [None] * world
    dist.all_gather_object(oks, ok)
    if rank == 0:
        per_step = statistics.median(plain) / STEPS
        for line in lines.values():
            line["stall"] = [t - k * per_step for t, k in zip(line["stall"], line["steps"], strict=True)]
        doc = {"info": {"ranks": world, "nbytes": nbytes, "steps": STEPS, "reps": reps},
               "plain": plain, "lines": {str(n): v for n, v in lines.items()}, "ok": all(oks)}  # fmt: skip
        Path(out).write_text(json.dumps(doc))
    dist.barrier()
    dist.destroy_process_group()


def _slowest(x: float) -> float:
    import torch.distributed as dist

    got: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(got, x)
    return float(max(got))


def _total(x: float) -> float:
    import torch.distributed as dist

    got: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(got, x)
    return float(sum(got))


def main() -> None:
    from slurm_ckpt.config import parse_size

    ap = argparse.ArgumentParser(prog="python -m bench.replicas", description=__doc__.split("\n")[0])
    ap.add_argument("--dir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")), help="where the scratch dirs go")
    ap.add_argument("--size", default="256M", help="bytes of each rank's shard")
    ap.add_argument("--ranks", type=int, default=3)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = ap.parse_args()
    doc = run_replicas_bench(parse_size(args.size) * args.ranks, args.dir, ranks=args.ranks, reps=args.reps)
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1))
    print(format_replicas(doc))


if __name__ == "__main__":
    main()

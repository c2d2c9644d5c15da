"""The resharding matrix: save at 1-4 ranks, load at 1-4 ranks, FSDP2 over gloo on CPU.

    python -m bench.reshard_matrix --dir /path/on/the/disk [--width 1152] [--json out.json]

Four processes join one gloo group; ranks 0..n-1 of each size n form a group
of their own, so a save at 3 ranks and a load at 2 are real FSDP2 models on
real 3- and 2-rank meshes. The model: three ``width x width`` linear layers,
the first sharded on dim 1 and the others on dim 0 (``fully_shard``), AdamW
after two steps (so the optimizer's moments are sharded too), a replicated
DTensor, and a per-rank RNG state. Each save goes through
``slurm_ckpt.sharded.save``; each load builds a fresh model at the new world
size, loads with ``into=`` from ``get_state_dict`` and applies it with
``set_state_dict``.

Each cell says ``ok`` when every tensor of the model and of the optimizer,
made whole (``full_tensor()``), equals the saved one bit for bit on every
rank, then each rank's bytes read over the least it could read (the bytes of
its own parts: ``Loaded.bytes_needed``). Reads are whole blocks of 1 MiB, so
a rank needing part of a chunk reads at most one block more at each end of
each run; a chunk of a dim-1-sharded tensor is read in full when any of its
columns are wanted. ``width`` must be a multiple of 12 (dim-1 sharding by 1-4
ranks must be even in FSDP2).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SIZES = (1, 2, 3, 4)


def _model(width: int, mesh: Any) -> tuple[Any, Any]:
    import torch
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
                                torch.nn.ReLU(), torch.nn.Linear(width, width // 3))  # fmt: skip
    fully_shard(model[0], mesh=mesh, shard_placement_fn=lambda p: Shard(1) if p.ndim == 2 else None)
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _full(state: Any, prefix: str = "") -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    out: dict[str, Any] = {}
    for k, v in state.items():
        if isinstance(v, DTensor):
            out[prefix + str(k)] = v.full_tensor()
        elif isinstance(v, dict):
            out.update(_full(v, f"{prefix}{k}."))
        elif hasattr(v, "shape"):
            out[prefix + str(k)] = v.detach().clone()
    return out


def _rank(rank: int, world: int, port: int, root: str, width: int, out: str) -> None:
    import warnings

    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    from slurm_ckpt import sharded

    warnings.filterwarnings("ignore", category=UserWarning)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    groups = {n: dist.new_group(list(range(n)), backend="gloo") for n in SIZES}
    base = Path(root)
    for s in SIZES:
        if rank < s:
            mesh = DeviceMesh.from_group(groups[s], "cpu")
            model, opt = _model(width, mesh)
            for step in (1, 2):
                g = torch.Generator().manual_seed(100 * step + rank)
                model(torch.randn(8, width, generator=g)).square().mean().backward()
                opt.step()
                opt.zero_grad()
            msd, osd = get_state_dict(model, opt)
            rep = distribute_tensor(torch.arange(3 * width, dtype=torch.float32).reshape(3, width), mesh, [Replicate()])
            state = {"model": msd, "optim": osd, "rep": rep, "rng": torch.get_rng_state(), "step": 2}
            sharded.save(state, base / f"save-{s}", 2, process_group=groups[s])
            ref = _full({"model": msd, "optim": osd["state"], "rep": rep})
            if rank == 0:
                torch.save(ref, base / f"ref-{s}.pt")
        dist.barrier()
    rows = []
    for s in SIZES:
        ref = torch.load(base / f"ref-{s}.pt")
        for m in SIZES:
            if rank < m:
                mesh = DeviceMesh.from_group(groups[m], "cpu")
                model, opt = _model(width, mesh)
                msd, osd = get_state_dict(model, opt)
                rep = distribute_tensor(torch.zeros(3, width), mesh, [Replicate()])
                t0 = time.perf_counter()
                got = sharded.load(base / f"save-{s}", into={"model": msd, "optim": osd, "rep": rep},
                                   process_group=groups[m])  # fmt: skip
                took = time.perf_counter() - t0
                assert got is not None
                set_state_dict(model, opt, model_state_dict=got.state["model"], optim_state_dict=got.state["optim"])
                msd, osd = get_state_dict(model, opt)
                now = _full({"model": msd, "optim": osd["state"], "rep": got.state["rep"]})
                bad = sorted(set(now) ^ set(ref)) + [k for k in ref if k in now and not torch.equal(now[k], ref[k])]
                dim0 = [v for k, v in got.reads.items() if ".0.weight" not in k]  # all but the dim-1 layer
                rows.append({"save": s, "load": m, "rank": rank, "bad": bad, "read": got.bytes_read,
                             "needed": got.bytes_needed, "read0": sum(r for r, _ in dim0),
                             "needed0": sum(n for _, n in dim0), "seconds": took})  # fmt: skip
            dist.barrier()
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        Path(out).write_text(json.dumps([r for per in gathered for r in per]))
    dist.barrier()
    dist.destroy_process_group()


def _data_bytes(run: Path) -> int:
    from slurm_ckpt.store import find_latest

    cand = find_latest([run], full=False)
    assert cand is not None
    return sum(r.size for n, r in cand.manifest.files.items() if n.startswith("dcp-"))


def _matrix(rows: list[dict[str, Any]], read: str, needed: str) -> list[str]:
    cells: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for r in rows:
        cells.setdefault((r["save"], r["load"]), []).append(r)
    lines = ["save \\ load".ljust(12) + "".join(f"{m:<26}" for m in SIZES)]
    for s in SIZES:
        line = f"{s:<12}"
        for m in SIZES:
            rs = sorted(cells.get((s, m), []), key=lambda r: r["rank"])
            ok = len(rs) == m and not any(r["bad"] for r in rs)
            ratios = " ".join(f"{r[read] / r[needed]:.2f}" for r in rs)
            line += f"{('ok ' if ok else 'FAIL ') + ratios:<26}"
        lines.append(line)
    return lines


def table(rows: list[dict[str, Any]], root: Path | None = None) -> str:
    """The matrix as text: a cell per (save, load) size, each rank's bytes read over needed."""
    lines = ["all tensors:", *_matrix(rows, "read", "needed"), ""]
    lines += ["the tensors sharded on dim 0 or replicated (all but the dim-1 layer and its moments):"]
    lines += [*_matrix(rows, "read0", "needed0"), ""]
    lines.append("cell: bit-exact on every rank ('ok'), then each rank's bytes read / bytes it needed")
    for m in SIZES:
        rs = [r for r in rows if r["load"] == m and r["save"] == 1]
        need = ", ".join(f"{r['needed'] / 2**20:.1f}" for r in sorted(rs, key=lambda r: r["rank"]))
        lines.append(f"load at {m}: MiB needed per rank (from the 1-rank save): {need}")
    if root is not None:
        sizes = ", ".join(f"{s}: {_data_bytes(root / f'save-{s}') / 2**20:.1f}" for s in SIZES)
        lines.append(f"data files per save size, MiB: {sizes}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import torch.multiprocessing as mp

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=None, help="where to write the checkpoints (default: a temp dir)")
    ap.add_argument("--width", type=int, default=1152, help="layer width, a multiple of 12 (default 1152)")
    ap.add_argument("--json", default=None, help="also write the rows as JSON here")
    args = ap.parse_args(argv)
    if args.width % 12:
        ap.error("--width must be a multiple of 12")
    root = Path(args.dir or tempfile.mkdtemp(prefix="reshard-matrix-")).absolute()
    root.mkdir(parents=True, exist_ok=True)
    out = root / "rows.json"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_rank, args=(max(SIZES), port, str(root), args.width, str(out)), nprocs=max(SIZES))
    rows = json.loads(out.read_text())
    if args.json:
        Path(args.json).write_text(json.dumps(rows))
    print(f"# {time.strftime('%Y-%m-%d')}, width {args.width}, {root}")
    print(table(rows, root))
    return 0 if all(not r["bad"] for r in rows) and len(rows) == sum(SIZES) * len(SIZES) else 1


if __name__ == "__main__":
    sys.exit(main())

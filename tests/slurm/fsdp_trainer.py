"""An FSDP2 trainer whose weights do not depend on the world size, for resumes onto another node count.

The model is sharded with ``fully_shard`` (one layer on dim 1, the others on
dim 0; the last layer has fewer rows than some world sizes have ranks, so a
rank may hold an empty shard) and trained with AdamW over its DTensor
parameters; the checkpoint is ``get_state_dict(model, opt)`` through
``Checkpointer``, resumed with ``load_latest(into=...)`` and ``set_state_dict``.

What makes a run at 1, 2 or 3 ranks end with the same bits:

* the global batch of step ``s`` is a function of ``s`` alone: 12 samples,
  cut into 6 micro-batches; rank ``r`` takes micro-batches ``r, r+W, ...``;
* each micro-batch's gradient is computed against the full parameters
  (``full_tensor()``, an exact copy) on one thread, so it has the same bits
  on whichever rank computes it; the ranks exchange them (``all_gather``,
  exact) and every rank sums the 6 in micro-batch order, then takes its shard;
* AdamW's update is element by element.

FSDP2's own backward sums the ranks' gradients in a reduce-scatter whose order
depends on the world size (and on gloo's or NCCL's algorithm), so its weights
differ in the last bits between world sizes; ``--fsdp-backward`` trains that
way, to measure by how much (``docs/sharded.md``).

    python fsdp_trainer.py --steps 120 --out DIR [--every 20] [--step-time 0.05] [--no-ckpt]
                           [--hang-at STEP --hang-rank R]

World and rank come from ``SLURM_NTASKS``/``SLURM_PROCID`` (or ``WORLD_SIZE``/
``RANK``), the group's address from ``MASTER_ADDR``/``MASTER_PORT``. Lines:

    fsdp: start rank=0 world=2 from=0 restart=0 host=node1
    fsdp: step 40
    fsdp: committed step=57 path=...
    fsdp: stopping at step=57 for requeue
    fsdp: done steps=120 world=3 digest=ab12...    (rank 0; also DIR/done.txt, and the
                                                   full tensors in DIR/final.pt)
"""

from __future__ import annotations

import argparse
import hashlib
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

MICRO, PER_MICRO = 6, 2


def say(msg: str) -> None:
    print(f"fsdp: {msg}", flush=True)


def build(world: int) -> tuple[Any, Any, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    def layers() -> torch.nn.Sequential:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(24, 48), torch.nn.Tanh(), torch.nn.Linear(48, 36),
                                   torch.nn.Tanh(), torch.nn.Linear(36, 2))  # fmt: skip

    mesh = init_device_mesh("cpu", (world,))
    model = layers()
    fully_shard(model[0], mesh=mesh, shard_placement_fn=lambda p: Shard(1) if p.ndim == 2 else None)
    fully_shard(model[2], mesh=mesh)
    fully_shard(model[4], mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
    return model, opt, layers()  # the last: a plain replica to compute gradients with


def batch(step: int, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    idx = torch.randint(0, len(x), (MICRO * PER_MICRO,), generator=g)
    return x[idx], y[idx]


def exact_step(model: Any, opt: Any, replica: Any, bx: torch.Tensor, by: torch.Tensor, rank: int, world: int) -> None:
    """One step whose result has the same bits at any world size (see the module docstring)."""
    from torch.distributed.tensor import distribute_tensor
    from torch.func import functional_call, grad

    names = [n for n, _ in model.named_parameters()]
    params = {n: p.full_tensor().detach() for n, p in model.named_parameters()}

    def loss(ps: dict[str, torch.Tensor], xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(functional_call(replica, ps, (xb,)), yb)

    mine = []
    for j in range(rank, MICRO, world):
        sl = slice(j * PER_MICRO, (j + 1) * PER_MICRO)
        g = grad(loss)(params, bx[sl], by[sl])
        mine.append(torch.cat([g[n].reshape(-1) for n in names]))
    rows = torch.stack(mine)
    gathered = [torch.empty_like(rows) for _ in range(world)]
    dist.all_gather(gathered, rows)
    total = torch.zeros_like(rows[0])
    for j in range(MICRO):  # in micro-batch order, whoever computed it
        total = total + gathered[j % world][j // world]
    total = total / MICRO
    at = 0
    for p in model.parameters():
        full = total[at : at + p.numel()].view(p.shape)
        at += p.numel()
        p.grad = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)
    opt.step()
    opt.zero_grad(set_to_none=True)


def fsdp_step(model: Any, opt: Any, bx: torch.Tensor, by: torch.Tensor, rank: int, world: int) -> None:
    """FSDP2's own forward and backward: the gradients are summed by a reduce-scatter."""
    per = MICRO * PER_MICRO // world
    sl = slice(rank * per, (rank + 1) * per)
    torch.nn.functional.mse_loss(model(bx[sl]), by[sl]).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def full_state(model: Any, opt: Any) -> dict[str, torch.Tensor]:
    """The full parameters and optimizer moments by name (a collective)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    flat = [(f"model.{k}", v) for k, v in msd.items()]
    flat += [(f"optim.{k}.{s}", v) for k, d in osd["state"].items() for s, v in d.items()]
    return {name: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach() for name, t in sorted(flat)}


def digest(state: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name, t in state.items():
        h.update(name.encode())
        h.update(t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--every", type=int, default=0, help="periodic checkpoint interval (0: only on request)")
    ap.add_argument("--step-time", type=float, default=0.0, help="simulated compute per step")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--no-ckpt", action="store_true", help="reference run: never save or load")
    ap.add_argument("--fsdp-backward", action="store_true", help="FSDP2's own backward (not world-size exact)")
    ap.add_argument("--hang-at", type=int, default=0,
                    help="first run only: rank --hang-rank never joins step STEP's collectives")  # fmt: skip
    ap.add_argument("--hang-rank", type=int, default=1)
    args = ap.parse_args()

    torch.set_num_threads(1)  # one thread: a micro-batch's gradient has the same bits on every rank
    world = int(os.environ.get("SLURM_NTASKS") or os.environ.get("WORLD_SIZE") or 1)
    rank = int(os.environ.get("SLURM_PROCID") or os.environ.get("RANK") or 0)
    addr, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), os.environ.get("MASTER_PORT", "29500")
    dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world)
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from slurm_ckpt import Checkpointer

    model, opt, replica = build(world)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(600, 24, generator=g)
    y = torch.tanh(x @ torch.randn(24, 2, generator=g))

    # get_state_dict() on an optimizer without state creates it with a step() at lr 0,
    # which counts as AdamW's first step: every run, resumed or not, calls it here.
    msd, osd = get_state_dict(model, opt)
    ckpt = None if args.no_ckpt else Checkpointer()
    start = 0
    if ckpt is not None:
        state = ckpt.load_latest(into={"model": msd, "optim": osd})
        if state is not None:
            set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
            start = int(state["step"])
    say(f"start rank={rank} world={world} from={start} restart={os.environ.get('SLURM_RESTART_COUNT', '0')} "
        f"host={socket.gethostname()}")  # fmt: skip
    restart = os.environ.get("SLURM_RESTART_COUNT", "0")
    for step in range(start + 1, args.steps + 1):
        if step == args.hang_at and rank == args.hang_rank and restart in ("", "0"):
            say(f"hanging at step={step} rank={rank} t={time.time():.3f}")
            while True:  # the other ranks wait for it in the step's first collective
                time.sleep(3600)
        bx, by = batch(step, x, y)
        if args.fsdp_backward:
            fsdp_step(model, opt, bx, by, rank, world)
        else:
            exact_step(model, opt, replica, bx, by, rank, world)
        time.sleep(args.step_time)
        if step % 10 == 0:
            say(f"step {step}")
        if ckpt is None:
            continue
        before = ckpt.last_committed

        def current(step: int = step) -> dict[str, Any]:
            msd, osd = get_state_dict(model, opt)
            return {"model": msd, "optim": osd, "step": step}

        stop = ckpt.maybe_save(current, step, every=args.every)
        if ckpt.last_committed != before:
            say(f"committed step={step} path={ckpt.last_committed}")
        if stop:
            say(f"stopping at step={step} for requeue")
            return finish(ckpt)
    weights = full_state(model, opt)
    final = digest(weights)
    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "done.txt").write_text(f"{args.steps} {world} {final}\n")
        torch.save(weights, args.out / "final.pt")
        say(f"done steps={args.steps} world={world} digest={final}")
    return finish(ckpt)


def finish(ckpt: Any) -> int:
    """Close the run dir, then the group; skip the interpreter's teardown (see tests/slurm/trainer.py).

    The barrier first: rank 0 may still be in its last ``full_tensor()`` (it
    also writes the outputs) when the others are done, and a rank that exits
    then can take bytes rank 0 still needs with it ("Connection reset by
    peer" in rank 0's ``full_tensor``, seen once in CI).
    """
    if ckpt is not None:
        ckpt.close()
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())

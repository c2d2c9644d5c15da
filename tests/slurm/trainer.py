"""A small, deterministic trainer for the end-to-end Slurm tests.

Every batch is a function of the step number (and rank), never of how many
steps ran before in this process, so a run that is interrupted, requeued and
resumed must end with exactly the weights of an uninterrupted run: the tests
compare a SHA-256 of the raw parameter bytes.

    python trainer.py --steps 300 --out DIR [--workers 2] [--step-time 0.02]
                      [--first-step-time 0.25] [--crash-at STEP --crash-code 3]
                      [--hang-at STEP --hang-rank R] [--freeze-at STEP --freeze-rank R]

With ``SLURM_NTASKS`` (or ``WORLD_SIZE``) > 1 it joins a gloo process group
(``MASTER_ADDR``/``MASTER_PORT``), averages gradients across ranks and saves a
shard per rank. Lines it prints, which the tests parse:

    trainer: start rank=0 world=1 from=0 pid=123 restart=0
    trainer: step 40
    trainer: committed step=57 t=1732900000.123 path=...
    trainer: stopping at step=57 for requeue
    trainer: hanging at step=50 rank=1 t=1732900000.123
    trainer: freezing at step=50 rank=1 wrapper=456 t=1732900000.123
    trainer: thawed at step=50 rank=1 t=1732900000.123
    trainer: done rank=0 steps=300 digest=ab12...
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from slurm_ckpt import Checkpointer

N_SAMPLES, N_IN = 512, 8


def say(msg: str) -> None:
    print(f"trainer: {msg}", flush=True)


class StepBatches(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Item ``i`` is the batch of step ``first + i``: a seeded draw, independent of history."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, first: int, last: int, seed: int) -> None:
        self.x, self.y, self.first, self.last, self.seed = x, y, first, last, seed

    def __len__(self) -> int:
        return max(0, self.last - self.first + 1)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.first + i)
        idx = torch.randint(0, len(self.x), (32,), generator=g)
        return self.x[idx], self.y[idx]


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def dist_setup() -> tuple[int, int]:
    world = int(os.environ.get("SLURM_NTASKS") or os.environ.get("WORLD_SIZE") or 1)
    rank = int(os.environ.get("SLURM_PROCID") or os.environ.get("RANK") or 0)
    if world > 1:
        import torch.distributed as dist

        addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
        port = os.environ.get("MASTER_PORT", "29500")
        dist.init_process_group(
            "gloo", init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world
        )
    return rank, world


def finish(ckpt: Checkpointer | None, world: int) -> None:
    """Close the run dir, then the process group: a gloo group left to interpreter exit can abort."""
    if ckpt is not None:
        ckpt.close()
    if world > 1:
        import torch.distributed as dist

        dist.destroy_process_group()
        # Adam's import of torch._dynamo keeps the default group alive past
        # destroy_process_group() (torch 2.13); its gloo workers would then
        # outlive the interpreter and, 2 runs in 60, abort its teardown (exit
        # 134). Everything is on disk: skip the teardown (examples/train.py).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def freeze(step: int, rank: int) -> None:
    """Stop this rank's node side: its ``slurm-ckpt run`` wrapper (our parent), then us.

    Both stay stopped (state T) until Slurm ends the job, as on a node that froze
    while its slurmd still answers: no heartbeat, no watchdog report. A wrapper
    that is not our parent is refused rather than some other process stopped.
    """
    wrapper = os.getppid()
    argv = Path(f"/proc/{wrapper}/cmdline").read_bytes().split(b"\0")
    if not any(a.endswith(b"slurm-ckpt") for a in argv) or b"run" not in argv:
        raise SystemExit(f"--freeze-at: parent {wrapper} is not a slurm-ckpt run wrapper: {argv!r}")
    say(f"freezing at step={step} rank={rank} wrapper={wrapper} t={time.time():.3f}")
    os.kill(wrapper, signal.SIGSTOP)
    os.kill(os.getpid(), signal.SIGSTOP)
    say(f"thawed at step={step} rank={rank} t={time.time():.3f}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--every", type=int, default=50, help="periodic checkpoint interval")
    ap.add_argument("--step-time", type=float, default=0.02, help="simulated compute per step")
    ap.add_argument("--first-step-time", type=float, default=None,
                    help="--step-time for the first run only (SLURM_RESTART_COUNT unset or 0)")  # fmt: skip
    ap.add_argument("--workers", type=int, default=0, help="DataLoader num_workers")
    ap.add_argument("--crash-at", type=int, default=0)
    ap.add_argument("--crash-code", type=int, default=3)
    ap.add_argument("--hang-at", type=int, default=0,
                    help="first run only: rank --hang-rank never joins step STEP's all_reduce")  # fmt: skip
    ap.add_argument("--hang-rank", type=int, default=1)
    ap.add_argument("--freeze-at", type=int, default=0,
                    help="first run only: rank --freeze-rank SIGSTOPs its wrapper and itself at step STEP")  # fmt: skip
    ap.add_argument("--freeze-rank", type=int, default=1)
    ap.add_argument("--out", type=Path, required=True, help="where done-rank<R>.txt goes")
    ap.add_argument("--no-ckpt", action="store_true", help="reference run: never save or load")
    args = ap.parse_args()

    rank, world = dist_setup()
    torch.manual_seed(1000 + rank)
    model = torch.nn.Sequential(torch.nn.Linear(N_IN, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(N_SAMPLES, N_IN, generator=g)
    y = (x @ torch.randn(N_IN, 1, generator=g)).squeeze(1)

    ckpt = None if args.no_ckpt else Checkpointer()
    start = 0
    state: Any = ckpt.load_latest() if ckpt else None
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        start = int(state["step"])
    restart = os.environ.get("SLURM_RESTART_COUNT", "0")
    step_time = args.step_time
    if args.first_step_time is not None and restart in ("", "0"):
        step_time = args.first_step_time  # timing only: the weights do not depend on it
    say(f"start rank={rank} world={world} from={start} pid={os.getpid()} restart={restart}")

    data = StepBatches(x, y, start + 1, args.steps, seed=rank)
    loader = DataLoader(data, batch_size=None, shuffle=False, num_workers=args.workers,
                        persistent_workers=False)  # fmt: skip
    step = start
    for step, (bx, by) in enumerate(loader, start=start + 1):
        if step == args.hang_at and rank == args.hang_rank and restart in ("", "0"):
            say(f"hanging at step={step} rank={rank} t={time.time():.3f}")
            while True:  # the other ranks wait for it in the all_reduce below
                time.sleep(3600)
        if step == args.freeze_at and rank == args.freeze_rank and restart in ("", "0"):
            freeze(step, rank)
        loss = torch.nn.functional.mse_loss(model(bx).squeeze(1), by)
        opt.zero_grad()
        loss.backward()
        if world > 1:
            import torch.distributed as dist

            for p in model.parameters():
                assert p.grad is not None
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        time.sleep(step_time)
        if step % 20 == 0:
            say(f"step {step}")
        if step == args.crash_at:
            say(f"crashing at step={step} with exit code {args.crash_code}")
            sys.stdout.flush()
            os._exit(args.crash_code)
        if ckpt is None:
            continue
        before = ckpt.last_committed
        # Collective with several ranks: they agree on the request, then all save.
        state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}
        stop = ckpt.maybe_save(state, step, every=args.every)
        if ckpt.last_committed != before:
            say(f"committed step={step} t={time.time():.3f} path={ckpt.last_committed}")
        if stop:
            say(f"stopping at step={step} for requeue")
            finish(ckpt, world)
            return 0
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"done-rank{rank}.txt").write_text(f"{step} {digest(model)}\n")
    say(f"done rank={rank} steps={step} digest={digest(model)}")
    finish(ckpt, world)
    return 0


if __name__ == "__main__":
    sys.exit(main())

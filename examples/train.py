"""A small, deterministic PyTorch training run that checkpoints and resumes.

    SLURM_CKPT_DIR=runs/demo python examples/train.py --steps 200
"""

from __future__ import annotations

import argparse
import hashlib
import random

import torch

from slurm_ckpt import Checkpointer


def make_data(n: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(n, 16, generator=g)
    y = (x @ torch.randn(16, 1, generator=g)).squeeze(1) + 0.1 * torch.randn(n, generator=g)
    return x, y


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for t in model.state_dict().values():
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--every", type=int, default=25, help="periodic checkpoint interval")
    ap.add_argument("--stop-at", type=int, default=0, help="simulate a crash after this step")
    args = ap.parse_args()

    torch.manual_seed(0)
    random.seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = make_data()

    ckpt = Checkpointer()
    start = 0
    state = ckpt.load_latest()
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        torch.set_rng_state(state["rng"])
        start = state["step"]
        print(f"resumed from step {start} ({ckpt.loaded_path})")

    for step in range(start + 1, args.steps + 1):
        idx = torch.randint(0, len(x), (32,))
        loss = torch.nn.functional.mse_loss(model(x[idx]).squeeze(1), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        state = {"model": model.state_dict(), "optim": opt.state_dict(),
                 "rng": torch.get_rng_state(), "step": step}  # fmt: skip
        if step % args.every == 0 or ckpt.preempted or step == args.steps:
            ckpt.save(state, step=step)
        if ckpt.preempted:
            print(f"checkpointed step {step} on request; stopping")
            return
        if step == args.stop_at:
            print(f"simulated crash after step {step} (loss {loss.item():.4f})")
            return
    print(f"finished {args.steps} steps, loss {loss.item():.4f}, weights {digest(model)}")


if __name__ == "__main__":
    main()

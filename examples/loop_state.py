"""A plain torch loop that saves its whole state, so a resumed run continues the same stream.

    # stopped by the wrapper, restarted in place, resumed; the digest matches --no-ckpt's
    slurm-ckpt run --local --preempt-after 15 -- python examples/loop_state.py --steps 400
    python examples/loop_state.py --steps 400 --no-ckpt --out ref

Everything a step depends on is in the checkpoint: the model, Adam, a StepLR
scheduler, a GradScaler, the random number generators (dropout, and noise drawn
from torch, NumPy and Python ``random``) and the data position (the epoch and
the batches consumed in it, for a plain ``DataLoader`` over a
``ResumableSampler``; or torchdata's ``StatefulDataLoader``'s own state with
``--loader stateful``). ``--stop-at K`` saves after step K and exits, as a
preemption would; the next run resumes. Each step's loss goes to
``<out>/metrics.jsonl`` and the final weights' digest to ``<out>/done.txt``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

from slurm_ckpt import Checkpointer, ResumableSampler, rng_state, set_rng_state

BATCH = 8


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--every", type=int, default=50, help="periodic checkpoint interval")
    ap.add_argument("--out", type=Path, default=Path("loop-out"))
    ap.add_argument("--loader", choices=["plain", "stateful"], default="plain")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--stop-at", type=int, default=0, help="save after this step and exit 0")
    ap.add_argument("--no-ckpt", action="store_true", help="an uninterrupted reference run")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(100, 8, generator=g)
    y = x @ torch.randn(8, generator=g)
    dataset = TensorDataset(x, y)  # 13 batches an epoch, the last one short
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(32, 1))  # fmt: skip
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=30, gamma=0.5)
    # enabled on CPU too: its scale, growth tracker and skipped steps are state like any other.
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=20)

    sampler = ResumableSampler(len(dataset), seed=7)
    loader_gen = torch.Generator()
    loader: Any
    if args.loader == "stateful":
        from torchdata.stateful_dataloader import StatefulDataLoader

        loader = StatefulDataLoader(dataset, batch_size=BATCH, shuffle=True, num_workers=args.workers)
    else:
        # Its own generator: the workers' base seed then comes from it, not from
        # torch's global generator, whose stream the steps continue.
        loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler, num_workers=args.workers,
                            generator=loader_gen)  # fmt: skip

    ckpt = None if args.no_ckpt else Checkpointer()
    state = ckpt.load_latest() if ckpt is not None else None
    step, epoch, done = 0, 0, 0
    rng: dict[str, Any] | None = None
    if state is not None:
        assert ckpt is not None
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        sched.load_state_dict(state["sched"])
        scaler.load_state_dict(state["scaler"])
        step, epoch, done = state["step"], state["epoch"], state["batches"]
        if args.loader == "stateful":
            loader.load_state_dict(state["loader"])
        rng = state["rng"]
        print(f"loop: resumed from step {step} (epoch {epoch}, batch {done})", flush=True)

    def batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        nonlocal epoch, done, rng
        while True:
            if args.loader == "plain":
                sampler.set_epoch(epoch, start=done * BATCH)
                loader_gen.manual_seed(1000 + epoch)
            it = iter(loader)
            # After iter(): building the iterator may draw from torch's generator
            # (a StatefulDataLoader's shuffle seed); the saved run had drawn it
            # before the point it saved at.
            if rng is not None:
                set_rng_state(rng)
                rng = None
            for batch in it:
                done += 1
                yield batch
            epoch, done = epoch + 1, 0

    metrics = open(args.out / "metrics.jsonl", "a")  # noqa: SIM115
    for bx, by in batches():
        if step >= args.steps:
            break
        step += 1
        noise = torch.randn_like(by) * 0.01 + float(np.random.rand()) * 1e-3 + random.random() * 1e-3
        loss = torch.nn.functional.mse_loss(model(bx).squeeze(1), by + noise)
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
        metrics.write(json.dumps({"step": step, "loss": loss.item().hex()}) + "\n")
        metrics.flush()

        def snapshot(s: int = step) -> dict[str, Any]:
            out = {"model": model.state_dict(), "optim": opt.state_dict(), "sched": sched.state_dict(),
                   "scaler": scaler.state_dict(), "step": s, "epoch": epoch, "batches": done,
                   "rng": rng_state()}  # fmt: skip
            if args.loader == "stateful":
                out["loader"] = loader.state_dict()
            return out

        if ckpt is not None:
            if step == args.stop_at:
                ckpt.save(snapshot(), step)
                print(f"loop: stopping at step={step}", flush=True)
                ckpt.close()
                return 0
            if ckpt.maybe_save(snapshot, step, every=args.every):
                print(f"loop: stopping at step={step} on request", flush=True)
                ckpt.close()
                return 0
    if ckpt is not None:
        ckpt.close()
    (args.out / "done.txt").write_text(digest(model) + "\n")
    print(f"loop: done steps={step} digest={digest(model)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

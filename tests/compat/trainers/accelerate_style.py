"""An Accelerate-style loop and checkpoint, as ``accelerator.save_state``/``load_state`` make them.

``save_state`` writes the model's state dict, the optimizer's, the LR
scheduler's, the sampler's (a seedable sampler: its seed and epoch), and the
random states as one dict: ``random_state`` (``random.getstate()``),
``numpy_random_seed`` (``np.random.get_state()``), ``torch_manual_seed``
(``torch.get_rng_state()``) and ``torch_cuda_manual_seed``
(``torch.cuda.get_rng_state_all()``); ``load_state`` gives each back with
``load_state_dict``, ``random.setstate``, ``np.random.set_state``,
``torch.set_rng_state`` and ``torch.cuda.set_rng_state_all``, and the loop
skips the batches of the epoch already seen (``skip_first_batches``). Here all
of it is one slurm-ckpt checkpoint, with the step counter Accelerate keeps.

The loop uses every one of those generators: Python's ``random`` and NumPy's
for data augmentation, torch's for dropout, the sampler's for the order. A
linear warmup-then-decay schedule (``get_linear_schedule_with_warmup``'s) and
AdamW; synthetic regression data made in code.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Sampler, TensorDataset

from slurm_ckpt import Checkpointer
from tests.compat.trainers.common import args, finish, pause_for_request, say


class SeedableRandomSampler(Sampler[int]):
    """Accelerate's: each epoch's order comes from ``initial_seed + epoch`` alone."""

    def __init__(self, n: int, initial_seed: int) -> None:
        self.n, self.initial_seed, self.epoch = n, initial_seed, 0

    def __iter__(self) -> Iterator[int]:
        g = torch.Generator().manual_seed(self.initial_seed + self.epoch)
        yield from torch.randperm(self.n, generator=g).tolist()

    def __len__(self) -> int:
        return self.n

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "initial_seed": self.initial_seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.initial_seed = state["epoch"], state["initial_seed"]


def linear_schedule_with_warmup(optimizer: torch.optim.Optimizer, warmup: int, total: int) -> torch.optim.lr_scheduler.LambdaLR:
    def lr_lambda(step: int) -> float:
        if step < warmup:
            return step / max(1, warmup)
        return max(0.0, (total - step) / max(1, total - warmup))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)


def random_states() -> dict[str, object]:
    return {"random_state": random.getstate(), "numpy_random_seed": np.random.get_state(),
            "torch_manual_seed": torch.get_rng_state(), "torch_cuda_manual_seed": torch.cuda.get_rng_state_all()}  # fmt: skip


def main() -> None:
    a = args(steps=36)
    random.seed(42)
    np.random.seed(42)
    torch.manual_seed(42)  # accelerate.utils.set_seed
    g = torch.Generator().manual_seed(0)
    x = torch.randn(96, 8, generator=g)
    dataset = TensorDataset(x, x @ torch.randn(8, 1, generator=g) + 0.1 * torch.randn(96, 1, generator=g))
    sampler = SeedableRandomSampler(len(dataset), initial_seed=7)
    # Each iter() of a DataLoader draws a seed for its workers, from the global
    # generator unless it has its own: one per epoch from the sampler's seed, so
    # that a resumed epoch's iter() does not draw from the restored global one.
    loader_gen = torch.Generator()
    loader = DataLoader(dataset, batch_size=8, sampler=sampler, generator=loader_gen)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-2)
    scheduler = linear_schedule_with_warmup(optimizer, warmup=6, total=a.steps)

    ckpt = Checkpointer()
    step, skip = 0, 0
    state = ckpt.load_latest()
    if state is not None:  # load_state
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        sampler.load_state_dict(state["sampler"])
        states = state["random_states"]
        random.setstate(states["random_state"])
        np.random.set_state(states["numpy_random_seed"])
        torch.set_rng_state(states["torch_manual_seed"])
        torch.cuda.set_rng_state_all(states["torch_cuda_manual_seed"])
        step, skip = state["step"], state["batches_seen"]
        say(f"resumed from step {step} (epoch {sampler.epoch}, batch {skip})")
    started_at = step
    losses: dict[int, float] = {}
    while step < a.steps:
        model.train()
        loader_gen.manual_seed(sampler.initial_seed + sampler.epoch)
        for seen, (xb, yb) in enumerate(loader, start=1):
            if seen <= skip:
                continue  # skip_first_batches
            noise = torch.from_numpy(np.random.normal(0, 0.05, xb.shape).astype(np.float32))
            scale = random.uniform(0.9, 1.1)  # augmentation from both host generators
            loss = F.mse_loss(model(xb * scale + noise), yb * scale)
            loss.backward()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            step += 1
            losses[step] = loss.item()
            pause_for_request(ckpt, step, a.pause_at, started_at)
            if ckpt.preempted:  # save_state
                ckpt.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                           "scheduler": scheduler.state_dict(), "sampler": sampler.state_dict(),
                           "random_states": random_states(), "step": step, "batches_seen": seen}, step=step)  # fmt: skip
                say(f"checkpointed step {step} on request; stopping")
                ckpt.close()
                return
            if step == a.steps:
                break
        skip = 0
        if step < a.steps:
            sampler.set_epoch(sampler.epoch + 1)
    ckpt.close()
    finish(a.out, model=model, optimizer=optimizer, losses=losses, started_at=started_at,
           generators=("torch", "numpy", "python"), extra={"lr": scheduler.get_last_lr()})  # fmt: skip


if __name__ == "__main__":
    main()

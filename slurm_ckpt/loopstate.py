"""The rest of a training loop's state: random number generators and the data position.

A checkpoint of the model and the optimizer alone does not make a resumed run
continue the one that stopped: dropout masks, augmentations and shuffles come
from the random number generators, and the data stream restarts at the top of
the epoch unless its position is saved. This module holds what a plain torch
loop needs for that; the LR scheduler and the GradScaler already have
``state_dict()``/``load_state_dict()``, whose values the Checkpointer stores as
they are::

    from slurm_ckpt import Checkpointer, ResumableSampler, rng_state, set_rng_state

    sampler = ResumableSampler(len(dataset), seed=0)
    loader = DataLoader(dataset, batch_size=32, sampler=sampler, num_workers=2)
    state = ckpt.load_latest()
    epoch, done = 0, 0                     # the epoch, and the batches consumed in it
    if state is not None:
        model.load_state_dict(state["model"]); opt.load_state_dict(state["optim"])
        sched.load_state_dict(state["sched"]); scaler.load_state_dict(state["scaler"])
        epoch, done = state["epoch"], state["batches"]
        set_rng_state(state["rng"])
    ...
    sampler.set_epoch(epoch, start=done * 32)
    ...
    ckpt.save({"model": ..., "optim": ..., "sched": sched.state_dict(),
               "scaler": scaler.state_dict(), "epoch": epoch, "batches": done,
               "rng": rng_state()}, step=step)

The trainer counts the batches it consumed: a DataLoader with workers asks its
sampler for indices ahead of the batches the loop has seen, so a sampler cannot
know the position by itself. torchdata's ``StatefulDataLoader`` tracks it for
any sampler; its ``state_dict()`` is a plain value the Checkpointer stores too.

Workers. A DataLoader worker's torch and ``random`` seeds come from the base
seed the loader draws from the main process's torch generator at each
``iter(loader)``; restoring that generator before the epoch's ``iter()``
makes them repeat. NumPy's global generator is *not* reseeded in workers: seed
it in ``worker_init_fn`` from ``torch.initial_seed()``.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Sampler

__all__ = ["ResumableSampler", "rng_state", "set_rng_state"]


def rng_state() -> dict[str, Any]:
    """The process's generator states: Python ``random``, NumPy's global, torch CPU and CUDA.

    CUDA's are included only once CUDA is initialised (reading them would
    start it otherwise); NumPy's only when NumPy is installed. The result is a
    plain value for :meth:`Checkpointer.save`; :func:`set_rng_state` restores it.
    Generators a program makes itself (``torch.Generator``,
    ``numpy.random.default_rng``) are not global: save their ``get_state()`` /
    ``bit_generator.state`` beside this.
    """
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np
    except ImportError:
        pass
    else:
        state["numpy"] = np.random.get_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned (as loaded from a checkpoint).

    A CUDA state saved on more devices than this process sees restores the
    first ones; saved with none, CUDA keeps its own.
    """
    unknown = set(state) - {"python", "torch", "numpy", "cuda"}
    if unknown:
        raise ValueError(
            f"set_rng_state got unknown keys {sorted(unknown)}: pass the dict rng_state() returned"
        )
    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(tuple(state["numpy"]))
    if state.get("cuda") and torch.cuda.is_available():
        cuda = list(state["cuda"])[: torch.cuda.device_count()]
        for device, s in enumerate(cuda):
            torch.cuda.set_rng_state(s, device)


class ResumableSampler(Sampler[int]):
    """Indices ``0..n-1`` in an order that depends only on ``(seed, epoch)``, from a start offset.

    Like ``DistributedSampler``: call :meth:`set_epoch` before each epoch; the
    order is a permutation drawn from a generator seeded with ``seed + epoch``
    (or ``range(n)`` with ``shuffle=False``). ``start`` skips the first indices
    of that order: on resume, the batches already consumed times the batch
    size. With ``num_replicas > 1`` each rank takes every ``num_replicas``-th
    index of the order from ``rank`` on, after padding it to a multiple of
    ``num_replicas`` (as ``DistributedSampler`` does), so ranks stay in step.
    The sampler draws from no global generator.
    """

    def __init__(self, n: int, *, shuffle: bool = True, seed: int = 0,
                 num_replicas: int = 1, rank: int = 0) -> None:  # fmt: skip
        if n < 0:
            raise ValueError(f"ResumableSampler needs a dataset size >= 0, got {n}")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is not in 0..{num_replicas - 1} (num_replicas)")
        self.n, self.shuffle, self.seed = n, shuffle, seed
        self.num_replicas, self.rank = num_replicas, rank
        self.epoch = 0
        self.start = 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Iterate epoch ``epoch`` next, skipping its first ``start`` indices (this rank's)."""
        if start < 0:
            raise ValueError(f"start must be >= 0, got {start}")
        self.epoch, self.start = epoch, start

    def _order(self) -> list[int]:
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.n, generator=g).tolist()
        else:
            order = list(range(self.n))
        if self.num_replicas > 1 and order:
            pad = -len(order) % self.num_replicas
            order += (order * (pad // len(order) + 1))[:pad]
            order = order[self.rank :: self.num_replicas]
        return order

    def __iter__(self) -> Iterator[int]:
        return iter(self._order()[self.start :])

    def __len__(self) -> int:
        per_rank = -(-self.n // self.num_replicas) if self.num_replicas > 1 else self.n
        return max(0, per_rank - self.start)

"""What one save costs a real training loop, for each snapshot mode.

    THP_MEM_ALLOC_ENABLE=1 python -m bench.overlap_step --dir /path/on/the/disk [--size 1G]

An MLP trained with Adam, whose state (parameters and both moments) is about
``--size``. Each repetition times, interleaved: three plain training steps
(forward, backward, ``optimizer.step()``); and for each mode, a save at a step
boundary followed by the next three steps, by which time the background write
is done (it is waited for, outside the timing). The save's cost to the
trainer is that time less the plain steps', printed as a ratio to the sync
save's cost: the stall, what the steps wait for, and what the background
write takes from them (the same cores and memory).

``auto`` is the default (it chooses ``copy`` here: the staging buffer fits).
The opt-in ``overlap`` returns at once and copies behind forward and backward;
``optimizer.step()`` waits for whatever is left. This loop keeps to what it
requires (it changes the state only in ``optimizer.step()``), so its
checkpoints are exact here; ``docs/async.md`` says what it lets through
otherwise.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from bench.scripts import remove_steps, script_finish, script_state
from slurm_ckpt import Checkpointer
from slurm_ckpt.config import load_config

WIDTH, BATCH, STEPS = 2048, 32, 3


class Trainer:
    def __init__(self, nbytes: int) -> None:
        torch.manual_seed(0)
        layers = max(1, nbytes // 3 // (4 * WIDTH * WIDTH))  # parameters are a third with Adam
        self.model = torch.nn.Sequential(*[m for _ in range(layers) for m in (torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU())])
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-5)
        self.x = torch.randn(BATCH, WIDTH)
        self.n = 0
        self.step()  # Adam creates its moments at the first step

    def step(self) -> None:
        self.opt.zero_grad(set_to_none=False)
        self.model(self.x).square().mean().backward()
        self.opt.step()
        self.n += 1

    def state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.opt.state_dict(), "step": self.n}


def _save(c: Checkpointer, sync: bool, tr: Trainer) -> Any:
    """The save a mode's line times: sync returns once durable, the others once captured."""
    if sync:
        c.save(tr.state(), tr.n)
        return None
    return c.save_async(tr.state(), tr.n)


def main() -> None:
    args, root, tr = script_state("overlap-step", reps=15, make=Trainer)
    cfg = load_config()
    modes = ("sync", "auto", "copy", "fork", "overlap")
    ck = {mode: Checkpointer(root / mode, keep=1000, distributed=False,
                             config=dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, snapshot=mode)))
          for mode in modes if mode != "sync"}  # fmt: skip
    ck["sync"] = ck["copy"]
    times: dict[str, list[float]] = {}

    def timed(name: str, save: Callable[[], Any]) -> None:
        remove_steps(ck[name].dir)
        os.sync()
        tr.step()
        t0 = time.perf_counter()
        handle = save()
        for _ in range(STEPS):
            tr.step()
        times.setdefault(name, []).append(time.perf_counter() - t0)
        if handle is not None:
            handle.wait()

    for _ in range(args.reps):
        t0 = time.perf_counter()
        for _ in range(STEPS):
            tr.step()
        times.setdefault("plain steps", []).append(time.perf_counter() - t0)
        for mode in modes:
            c = ck[mode]
            timed(mode, functools.partial(_save, c, mode == "sync", tr))
    plain = statistics.median(times.pop("plain steps"))
    cost = {f"{mode}: save + {STEPS} steps, less plain ones": [t - plain for t in v] for mode, v in times.items()}
    nbytes = sum(t.numel() * t.element_size() for t in tr.model.parameters()) * 3
    print(f"state {nbytes / 2**30:.2f} GiB ({len(tr.model) // 2} layers of {WIDTH}x{WIDTH}, Adam), batch {BATCH}, "
          f"plain step {plain / STEPS * 1e3:.0f} ms, THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE', '')}, "
          f"{args.reps} reps, medians")  # fmt: skip
    script_finish(cost, f"sync: save + {STEPS} steps, less plain ones", "of the sync save's cost",
                  set(ck.values()), root)  # fmt: skip


if __name__ == "__main__":
    main()

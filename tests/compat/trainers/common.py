"""What the trainers share: arguments, the pause that lets a test interrupt at a
chosen step, and the result file a resumed run is compared on.

The trainers themselves are written the way their public originals are (see
each module's docstring); only these three things are ours:

* ``--pause-at K``: after step ``K`` of a run that started before it, the
  trainer says ``paused at step K`` on stdout and waits for the wrapper's
  checkpoint request, which the test sends when it reads that line. So the
  interruption lands mid-epoch at a known step, with no sleeps in the test.
* ``--out FILE``: at the end, the digests of the final weights and optimizer
  state, the next numbers of every random generator the trainer uses, and the
  loss of every step this process ran.
* ``Checkpointer()`` takes its run dir from ``slurm-ckpt run``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["args", "digest", "finish", "pause_for_request", "say"]


def args(**defaults: Any) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=defaults.get("steps", 40), help="optimizer steps in all")
    ap.add_argument("--pause-at", type=int, default=0, help="wait for the checkpoint request after this step")
    ap.add_argument("--out", type=Path, required=True)
    return ap.parse_args()


def say(msg: str) -> None:
    print(f"train: {msg}", flush=True)


def pause_for_request(ckpt: Any, step: int, pause_at: int, started_at: int) -> None:
    """At ``pause_at`` (once, in the run that got there), wait for the wrapper's request."""
    if step != pause_at or started_at >= pause_at:
        return
    say(f"paused at step {step}")
    deadline = time.monotonic() + 120  # a hang guard: the test asks within seconds
    while not ckpt.preempted:
        if time.monotonic() > deadline:
            raise SystemExit("no checkpoint request came")
        time.sleep(0.01)


def digest(tensors: Any) -> str:
    """sha256 of every tensor's bytes (and name), in order."""
    h = hashlib.sha256()
    items = tensors.items() if isinstance(tensors, dict) else enumerate(tensors)
    for name, t in items:
        if isinstance(t, dict):
            h.update(f"{name}:{digest(t)}".encode())
        elif isinstance(t, torch.Tensor):
            h.update(str(name).encode())
            h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        else:
            h.update(f"{name}={t!r}".encode())
    return h.hexdigest()[:16]


_NEXT = {
    "torch": lambda: torch.rand(3).tolist(),
    "numpy": lambda: np.random.rand(2).tolist(),
    "python": lambda: [random.random() for _ in range(2)],
}


def finish(out: Path, *, model: torch.nn.Module, optimizer: Any, losses: dict[int, float], started_at: int,
           generators: tuple[str, ...] = ("torch",), extra: dict[str, Any] | None = None) -> None:  # fmt: skip
    """Write the result a resumed run must share with an uninterrupted one: the
    next numbers of the global ``generators`` the trainer uses and restores."""
    result = {
        "weights": digest(model.state_dict()),
        "optimizer": digest(optimizer.state_dict()["state"]) if optimizer is not None else None,
        **{f"next {name}": _NEXT[name]() for name in generators},
        "started at": started_at,
        "losses": {str(k): v for k, v in losses.items()},
        **(extra or {}),
    }
    out.write_text(json.dumps(result, indent=1))
    say(f"finished; weights {result['weights']}")

"""What the scripts in ``bench/`` share: their arguments, their report, and the steps between saves."""

from __future__ import annotations

import shutil
import statistics
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from slurm_ckpt.engine.buffers import ALIGN, populate

from .state import flatten, synthetic_state

__all__ = ["remove_steps", "script_finish", "script_state", "training_step"]


def script_state(sub: str, reps: int, make: Callable[[int], Any] | None = None) -> tuple[Any, Path, Any]:
    """For a script in ``bench/``: its arguments (``--size``, ``--dir``, ``--reps``), a
    fresh ``sub`` dir under ``--dir``, and a state of ``--size`` (``make(nbytes)``,
    else the synthetic one)."""
    import argparse

    from slurm_ckpt.config import parse_size

    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="1G")
    ap.add_argument("--dir", type=Path, required=True)
    ap.add_argument("--reps", type=int, default=reps)
    args = ap.parse_args()
    root = args.dir / sub
    shutil.rmtree(root, ignore_errors=True)
    return args, root, (make or synthetic_state)(parse_size(args.size))


def script_finish(times: dict[str, list[float]], base: str, of: str, checkpointers: Iterable[Any], root: Path) -> None:
    """For a script in ``bench/``: print each median in ms and as a ratio to ``base``'s, then clean up."""
    ref = statistics.median(times[base])
    for name, v in times.items():
        m = statistics.median(v)
        print(f"  {name:<36} {m * 1e3:8.1f} ms  x {m / ref:.3f} {of}")
    for c in checkpointers:
        c.close()
    shutil.rmtree(root, ignore_errors=True)


def remove_steps(run_dir: Path) -> None:
    for p in run_dir.glob("step-*"):
        shutil.rmtree(p, ignore_errors=True)


def training_step(state: Any) -> None:
    """Write every page of the state in place, as an optimizer step does between saves.

    After a fork (the fork snapshot here; DataLoader workers in a trainer) every
    page of the parent stays marked shared until it is written again, and an
    O_DIRECT write straight from such a page first takes a fault to unshare
    it. A trainer writes its whole state every step, so the bench does too,
    outside the timing, before each method: without it the methods after a
    fork pay for it.
    """
    for t in flatten(state).values():
        if hasattr(t, "data_ptr") and t.numel():
            lo = t.data_ptr() - t.data_ptr() % ALIGN
            populate(lo, t.data_ptr() + t.numel() * t.element_size() - lo)

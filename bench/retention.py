"""What deleting the oldest checkpoint costs a sync save, inline or in the background.

    THP_MEM_ALLOC_ENABLE=1 python bench/retention.py --dir /path/on/the/disk [--size 1G]

Three run dirs saved interleaved, each save of a whole state (medians):

none      keep=1000, the old step removed outside the timing (the bench's setting)
inline    keep=1000, then retention deleting the old step before the save returns
          (what ``save()`` did before deletes moved to the background)
deferred  keep=1: ``save()`` as it is, the delete on the reaper thread; the time
          until the reaper is done is shown apart, as the trainer would not wait

On a filesystem that discards freed blocks (ext4 ``-o discard``), the delete's
cost is in the journal commit that frees them, which any fsync forces: a delete
running beside a save slows it as much as one inside it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time
from pathlib import Path

from slurm_ckpt import Checkpointer
from slurm_ckpt.config import parse_size
from slurm_ckpt.engine.bench import _training_step, synthetic_state
from slurm_ckpt.store.layout import step_dir
from slurm_ckpt.store.retention import apply_retention, reaped


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="1G")
    ap.add_argument("--dir", type=Path, required=True)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    root = args.dir / "retention"
    shutil.rmtree(root, ignore_errors=True)
    state = synthetic_state(parse_size(args.size))
    ck = {"none": Checkpointer(root / "none", keep=1000, distributed=False),
          "inline": Checkpointer(root / "inline", keep=1000, distributed=False),
          "deferred": Checkpointer(root / "deferred", keep=1, distributed=False)}  # fmt: skip
    for c in ck.values():
        c.save(state, 0)
    times: dict[str, list[float]] = {}
    for step in range(1, args.reps + 1):
        for name, c in ck.items():
            if name == "none":
                shutil.rmtree(step_dir(c.dir, step - 1), ignore_errors=True)
            _training_step(state)
            os.sync()
            t0 = time.perf_counter()
            c.save(state, step)
            if name == "inline":
                apply_retention(c.dir, 1)
            times.setdefault(name, []).append(time.perf_counter() - t0)
            if name == "deferred":
                reaped()
                times.setdefault("deferred, until the reaper is done", []).append(time.perf_counter() - t0)
    base = statistics.median(times["none"])
    print(f"state {args.size}, {args.reps} reps interleaved, medians, dir {args.dir}")
    for name, v in times.items():
        m = statistics.median(v)
        print(f"  {name:<36} {m * 1e3:8.1f} ms  x {m / base:.2f} of a save that deletes nothing")
    for c in ck.values():
        c.close()
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

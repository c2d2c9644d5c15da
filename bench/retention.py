"""What deleting the oldest checkpoint costs a sync save, inline or in the background.

    THP_MEM_ALLOC_ENABLE=1 python -m bench.retention --dir /path/on/the/disk [--size 1G]

Four run dirs saved interleaved, each save of a whole state (medians):

none      keep=1000, the old step removed outside the timing (the bench's setting)
inline    keep=1000, then retention deleting the old step before the save returns
beside    keep=1000, the old step deleted on another thread while the save runs
deferred  keep=1: ``save()`` as it is, the delete on the reaper thread once the
          save has committed; the time until the reaper is done is shown apart,
          as the trainer would not wait

On a filesystem that discards freed blocks (ext4 ``-o discard``), the delete's
cost is in the journal commit that frees them, which any fsync forces: a delete
running beside a save slows it as much as one inside it.
"""

from __future__ import annotations

import os
import shutil
import threading
import time

from bench.scripts import script_finish, script_state, training_step
from slurm_ckpt import Checkpointer
from slurm_ckpt.store.layout import step_dir
from slurm_ckpt.store.retention import apply_retention, discard_checkpoint, reaped


def main() -> None:
    args, root, state = script_state("retention", reps=5)
    ck = {"none": Checkpointer(root / "none", keep=1000, distributed=False),
          "inline": Checkpointer(root / "inline", keep=1000, distributed=False),
          "beside": Checkpointer(root / "beside", keep=1000, distributed=False),
          "deferred": Checkpointer(root / "deferred", keep=1, distributed=False)}  # fmt: skip
    for c in ck.values():
        c.save(state, 0)
    times: dict[str, list[float]] = {}
    for step in range(1, args.reps + 1):
        for name, c in ck.items():
            if name == "none":
                shutil.rmtree(step_dir(c.dir, step - 1), ignore_errors=True)
            training_step(state)
            os.sync()
            delete = threading.Thread(target=discard_checkpoint, args=(step_dir(c.dir, step - 1),))
            t0 = time.perf_counter()
            if name == "beside":
                delete.start()
            c.save(state, step)
            if name == "inline":
                apply_retention(c.dir, 1)
            times.setdefault(name, []).append(time.perf_counter() - t0)
            if name == "beside":
                delete.join()
            if name == "deferred":
                reaped()
                times.setdefault("deferred, until the reaper is done", []).append(time.perf_counter() - t0)
    print(f"state {args.size}, {args.reps} reps interleaved, medians, dir {args.dir}")
    script_finish(times, "none", "of a save that deletes nothing", ck.values(), root)


if __name__ == "__main__":
    main()

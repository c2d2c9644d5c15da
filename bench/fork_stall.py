"""The fork snapshot's stall in a process that holds only a trainer's state.

    THP_MEM_ALLOC_ENABLE=1 python -m bench.fork_stall --dir /path/on/the/disk [--size 1G]

``slurm-ckpt bench`` measures every snapshot mode in one process that also
holds staging and raw buffers (huge pages, whose page tables cost fork() little).
This script holds only the state and one staging buffer, and splits
``save_async`` in fork mode into its parts: the bare fork(), encoding and
planning the state, and the rest. Between saves it
writes the whole state in place, as a training step would (after a fork every
page owes an unshare fault, which the next O_DIRECT save would otherwise pay).
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Any

from bench.scripts import remove_steps, script_finish, script_state, training_step
from slurm_ckpt import Checkpointer
from slurm_ckpt.config import load_config
from slurm_ckpt.engine.layout import plan_file
from slurm_ckpt.store.codec import encode_state


def main() -> None:
    args, root, state = script_state("fork-stall", reps=7)
    cfg = load_config()
    ck = {mode: Checkpointer(root / mode, keep=1000, distributed=False,
                             config=dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, snapshot=mode)))
          for mode in ("fork", "copy")}  # fmt: skip
    times: dict[str, list[float]] = {}

    def timed(name: str, fn: object) -> None:
        for c in ck.values():
            remove_steps(c.dir)  # outside the timing, as in slurm-ckpt bench
        os.sync()
        training_step(state)
        t0 = time.perf_counter()
        fn()  # type: ignore[operator]
        times.setdefault(name, []).append(time.perf_counter() - t0)

    def bare_fork() -> None:
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)

    for r in range(args.reps):
        timed("bare fork() and reap", bare_fork)
        timed("encode and plan the state", lambda: plan_file(encode_state(state).tensors))
        handles: dict[str, Any] = {}
        for mode, c in ck.items():
            timed(f"save_async, {mode} (the stall)",
                  lambda c=c, mode=mode, r=r, h=handles: h.__setitem__(mode, c.save_async(state, r + 1)))  # fmt: skip
            handles[mode].wait()
        timed("save (sync, durable)", lambda r=r: ck["copy"].save(state, 1000 + r))
    rss = int(Path("/proc/self/status").read_text().split("VmRSS:")[1].split()[0]) >> 10
    print(f"state {args.size}, process RSS {rss} MiB, THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE', '')}, "
          f"{args.reps} reps, medians")  # fmt: skip
    script_finish(times, "save (sync, durable)", "of the sync save", ck.values(), root)


if __name__ == "__main__":
    main()

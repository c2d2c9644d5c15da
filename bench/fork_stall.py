"""The fork snapshot's stall in a process that holds only a trainer's state.

    THP_MEM_ALLOC_ENABLE=1 python bench/fork_stall.py --dir /path/on/the/disk [--size 1G]

``slurm-ckpt bench`` measures every snapshot mode in one process that also
holds a clone of the state, staging and raw buffers: several GiB more than a
trainer, and fork() copies the page tables of all of it. This script holds
only the state, and splits ``save_async`` in fork mode into its parts: the
bare fork(), encoding and planning the state, and the rest. Between saves it
writes the whole state in place, as a training step would (after a fork every
page owes an unshare fault, which the next O_DIRECT save would otherwise pay).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

from slurm_ckpt import Checkpointer
from slurm_ckpt.config import load_config, parse_size
from slurm_ckpt.engine.bench import _remove_steps, _training_step, synthetic_state
from slurm_ckpt.engine.layout import plan_file
from slurm_ckpt.store.codec import encode_state


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="1G")
    ap.add_argument("--dir", type=Path, required=True)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    root = args.dir / "fork-stall"
    shutil.rmtree(root, ignore_errors=True)
    state = synthetic_state(parse_size(args.size))
    cfg = load_config()
    ck = {mode: Checkpointer(root / mode, keep=1000, distributed=False,
                             config=dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, snapshot=mode)))
          for mode in ("fork", "copy")}  # fmt: skip
    times: dict[str, list[float]] = {}

    def timed(name: str, fn: object) -> None:
        for c in ck.values():
            _remove_steps(c.dir)  # outside the timing, as in slurm-ckpt bench
        os.sync()
        _training_step(state)
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
    sync = statistics.median(times["save (sync, durable)"])
    rss = int(Path("/proc/self/status").read_text().split("VmRSS:")[1].split()[0]) >> 10
    print(f"state {args.size}, process RSS {rss} MiB, THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE', '')}, "
          f"{args.reps} reps, medians")  # fmt: skip
    for name, v in times.items():
        print(f"  {name:<32} {statistics.median(v) * 1e3:8.1f} ms  x {statistics.median(v) / sync:.3f} of the sync save")
    for c in ck.values():
        c.close()
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

"""The default save_async's stall while a forked child lives, as a DataLoader worker does.

    THP_MEM_ALLOC_ENABLE=1 python -m bench.worker_fork --dir /path/on/the/disk [--size 1G] [--reps 5]

A DataLoader worker is forked at the start of an epoch and lives through it.
fork() shares every private page of the trainer with it copy-on-write, and
the next write to such a page, while the child lives, copies it in a fault.
The engine maps its staging buffer so that a child gets zeros there instead
(``MADV_WIPEONFORK``). Interleaved, each a median:

* ``no child``: the stall with nobody forked;
* ``child alive``: a child forked before the save, alive until it returns;
* ``child alive, buffer shared``: the same, from a second Checkpointer whose
  staging buffer had ``MADV_KEEPONFORK`` applied, which undoes the engine's
  choice: the buffer is shared with the child, as any memory is by default.

Each Checkpointer saves once before the timing, which allocates its buffer.
"""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Callable

from bench.scripts import remove_steps, script_finish, script_state, training_step
from slurm_ckpt import Checkpointer

_MADV_KEEPONFORK = 19


def main() -> None:
    args, root, state = script_state("worker-fork", reps=5)
    ck = {name: Checkpointer(root / name, keep=1000, distributed=False) for name in ("wiped", "shared")}
    for c in ck.values():
        c.save_async(state, 0).wait()
    shared = ck["shared"].engine.staging
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if libc.madvise(int(shared._buf.data_ptr()), shared.capacity, _MADV_KEEPONFORK):
        raise SystemExit(f"madvise(MADV_KEEPONFORK): {os.strerror(ctypes.get_errno())}")
    steps = iter(range(1, 10**6))

    def timed_save(c: Checkpointer) -> float:
        t0 = time.perf_counter()
        handle = c.save_async(state, next(steps))
        stall = time.perf_counter() - t0
        handle.wait()
        return stall

    def save(c: Checkpointer, child: bool) -> Callable[[], float]:
        def run() -> float:
            if not child:
                return timed_save(c)
            wait, release = os.pipe()
            pid = os.fork()
            if pid == 0:  # the worker: alive until the save has returned
                os.read(wait, 1)
                os._exit(0)
            try:
                return timed_save(c)
            finally:
                os.write(release, b"x")
                os.waitpid(pid, 0)
                os.close(release)
                os.close(wait)

        return run

    cases = {"no child": save(ck["wiped"], False), "child alive": save(ck["wiped"], True),
             "child alive, buffer shared": save(ck["shared"], True)}  # fmt: skip
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.reps):
        for name, run in cases.items():
            training_step(state)  # unshares the state's pages after the last fork
            times[name].append(run())
            for c in ck.values():
                remove_steps(c.dir)
    print(f"{args.size} state, {args.reps} repetitions interleaved, medians")
    script_finish(times, "no child", "the stall with no child", ck.values(), root)


if __name__ == "__main__":
    main()

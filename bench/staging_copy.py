"""Where the copy snapshot's stall goes: the state's tensors copied into a staging buffer.

    THP_MEM_ALLOC_ENABLE=1 python -m bench.staging_copy [--size 1G] [--reps 7] [--dir /var/tmp]

Each line is a median over interleaved repetitions, as a ratio to the first
(the floor: the same number of bytes in one piece with libc's ``memmove``,
split over the copy's threads). The state is the bench's synthetic one
(``slurm-ckpt bench``).

* ``each tensor, memmove``: one libc ``memmove`` per tensor to consecutive
  offsets, as the copy snapshot lays out a file image;
* ``each tensor, streaming``: the same pieces with the staging copy's
  non-temporal stores (``slurm_ckpt/engine/memcopy.py``), when it is built;
* ``one piece, streaming``: the floor's piece with those stores;
* ``capture``: the copy snapshot itself (``Staging.capture``), with the
  encoding of the state;
* ``save_async``: the default background save's stall, from a Checkpointer
  in ``--dir``, the only one in the process (as in a trainer). Each save is
  waited for outside the timing; every checkpoint is kept until the end,
  since deleting one makes the kernel free its blocks while the next line is
  timed. The Checkpointer's first save, which allocates its staging buffer
  and so stalls longer, is printed last, on its own.

glibc's ``memmove`` switches to non-temporal stores only above
``x86_non_temporal_threshold`` (three quarters of the shared cache it
detects), so the floor's large pieces get them and a state's tensors, one
by one, do not: the two ``memmove`` lines show what that costs, and the
streaming lines what the staging copy gets back.
"""

from __future__ import annotations

import argparse
import itertools
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable

from bench.run import packed_pieces
from bench.state import flatten, synthetic_state
from slurm_ckpt import Checkpointer
from slurm_ckpt.config import parse_size
from slurm_ckpt.engine.buffers import address_of, aligned_buffer
from slurm_ckpt.engine.memcopy import copy_bytes, copy_threads, nontemporal
from slurm_ckpt.engine.staging import Staging
from slurm_ckpt.store.codec import encode_state


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="1G")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--dir", default="/var/tmp", help="Where the save_async line writes (a temp dir in it).")
    args = ap.parse_args()
    state = synthetic_state(parse_size(args.size))
    tensors = list(flatten(state).values())
    total, threads = sum(t.numel() * t.element_size() for t in tensors), copy_threads()
    src = aligned_buffer(total)
    staging = Staging()

    # Each line writes a buffer of its own, once a repetition, as each save
    # writes its staging buffer (see ``bench.run._memcpy_floors``).
    def one_piece(libc: bool) -> Callable[[], None]:
        dst = aligned_buffer(total, wipe_on_fork=True)
        return lambda: copy_bytes([(address_of(dst), address_of(src), total)], threads=threads, libc=libc)

    def each(libc: bool) -> Callable[[], None]:
        dst = aligned_buffer(total, wipe_on_fork=True)
        return lambda: copy_bytes(packed_pieces(tensors, address_of(dst)), threads=threads, libc=libc)

    def capture() -> None:
        staging.capture(encode_state(state).tensors)

    run_dir = tempfile.mkdtemp(prefix="staging-copy-", dir=args.dir)
    ck = Checkpointer(run_dir, keep=1000, distributed=False)
    handles, steps = [], itertools.count(1)

    def save_async() -> None:
        handles.append(ck.save_async(state, next(steps)))

    cases = {
        f"floor: one piece, {threads} threads": one_piece(True),
        "each tensor, memmove": each(True),
    }
    if nontemporal():
        cases |= {"each tensor, streaming": each(False), "one piece, streaming": one_piece(False)}
    cases |= {
        "capture (the copy snapshot)": capture,
        "save_async (the default's stall)": save_async,
    }
    first = 0.0
    for name, fn in cases.items():  # fault in and warm up
        t0 = time.perf_counter()
        fn()
        if name.startswith("save_async"):
            first = time.perf_counter() - t0  # the stall of a job's first save: it allocates the buffer
        if handles:
            handles.pop().wait()
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.reps):
        for name, fn in cases.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
            if handles:
                handles.pop().wait()
    ck.close()
    shutil.rmtree(run_dir)
    base = statistics.median(next(iter(times.values())))
    print(f"{total / 2**30:.2f} GiB in {len(tensors)} tensors, {args.reps} repetitions interleaved, medians")
    for name, ts in times.items():
        print(f"  {name:<32} {statistics.median(ts) * 1e3:8.1f} ms  x{statistics.median(ts) / base:.2f}")
    print(f"  {'first save_async (allocates)':<32} {first * 1e3:8.1f} ms  x{first / base:.2f}  (once, untimed above)")


if __name__ == "__main__":
    main()

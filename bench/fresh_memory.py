"""What fresh memory costs on this machine: faulting in 1 GiB just freed, or freed a while ago.

    python -m bench.fresh_memory [--size 1G] [--idle 5] [--reps 5]

A virtual machine whose balloon device has free page reporting (virtio-balloon
``VIRTIO_BALLOON_F_FREE_PAGE_REPORTING``; ``/sys/module/page_reporting`` exists)
hands memory the guest has freed back to the host after a moment, and the
host faults it in again on the guest's next use. So a load into fresh memory,
and any first touch of a buffer, costs several times more when the memory was
freed some seconds before than when it was freed just now. Loads that allocate
their result (torch.load, safetensors, DCP with new tensors, ours without
``into=``) pay it at random in ``slurm-ckpt bench``; ``load_latest(into=...)``
does not, as it reads into memory the trainer already uses.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from slurm_ckpt.config import parse_size
from slurm_ckpt.engine.buffers import address_of, huge_buffer, populate


def fault_in(nbytes: int) -> float:
    buf = huge_buffer(nbytes)
    t0 = time.perf_counter()
    populate(address_of(buf), nbytes)
    secs = time.perf_counter() - t0
    buf.close()
    return secs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="1G")
    ap.add_argument("--idle", type=float, default=5.0)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    nbytes = parse_size(args.size)
    fault_in(nbytes)  # the first touch of never-used memory is its own case
    times: dict[str, list[float]] = {}
    for _ in range(args.reps):
        times.setdefault("freed just before", []).append(fault_in(nbytes))
        time.sleep(args.idle)
        times.setdefault(f"freed {args.idle:g} s before", []).append(fault_in(nbytes))
    reporting = Path("/sys/module/page_reporting/parameters/reported_kib").exists()
    print(f"fault in {args.size} of huge pages, {args.reps} reps, medians; free page reporting: "
          f"{'on' if reporting else 'not found'}")  # fmt: skip
    base = statistics.median(times["freed just before"])
    for name, v in times.items():
        m = statistics.median(v)
        print(f"  {name:<20} {m * 1e3:8.1f} ms  {nbytes / m / 1e9:6.1f} GB/s  x {m / base:.1f}")


if __name__ == "__main__":
    main()

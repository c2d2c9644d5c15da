"""The prolog and epilog shims against a bare interpreter, measured interleaved in one run.

    sudo .venv/bin/python -m bench.hooks [--reps 30] [--seed 1] [--enforce none,loop]

The hooks run before and after every job, so what they cost is start-up: a
bash shim, ``timeout``, the interpreter, the imports, a little work. The
yardstick is the same interpreter importing only click, yaml and filelock
(the runtime dependencies every hook needs), measured in the same loop: each
repetition runs the prolog shim, the epilog shim and the yardstick in an
order shuffled anew (seeded), so load on the machine falls on all three
alike. The shims run as slurmd runs them (root, no PATH, only the job's
variables), installed with ``scripts/install-hooks.sh`` into a temp dir, for
a job with no checkpoint to stage out, once per ``scratch.enforce`` mode:
``none`` is the hooks' own cost; ``loop`` adds the per-job filesystem's
``mkfs`` and ``mount`` (prolog) and its unmount (epilog), disk I/O whose
cost depends on the disk. Printed: medians of wall time and of CPU time
(user+sys of the process tree), and each hook's ratio to the yardstick. The
target is a ratio of at most 2.0.

Needs root: the prolog creates and hands over a scratch dir.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BASELINE = "import click, yaml, filelock"
TARGET = 2.0


def install(tmp: Path, enforce: str) -> Path:
    """The hooks installed as the README says, with a config for ``tmp``; returns their dir."""
    hooks = tmp / f"hooks-{enforce}"
    config = tmp / f"config-{enforce}.yaml"
    config.write_text(f"scratch:\n  base: {tmp}/scratch-{enforce}\n  default_size: 64M\n  min_size: 1M\n"
                      f"  enforce: {enforce}\nstorage:\n  root: {tmp}/shared\n")  # fmt: skip
    subprocess.run(["bash", str(REPO / "scripts" / "install-hooks.sh"), "--dest", str(hooks),
                    "--bin", str(Path(sys.executable).with_name("slurm-ckpt")), "--config", str(config),
                    "--log", str(hooks / "hooks.log")], check=True, capture_output=True, timeout=120)  # fmt: skip
    return hooks


def timed(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(wall, CPU) seconds of one run; CPU is user+sys of the process tree (wait4 rusage)."""
    start = time.monotonic()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd="/")
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.monotonic() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{argv[0]} exited {os.waitstatus_to_exitcode(status)}")
    return wall, usage.ru_utime + usage.ru_stime


def measure(hooks: dict[str, Path], reps: int, seed: int) -> dict[str, tuple[list[float], list[float]]]:
    rng = random.Random(seed)
    runs: dict[str, tuple[list[float], list[float]]] = {"yardstick": ([], [])}
    argv = {"yardstick": [sys.executable, "-c", BASELINE]}
    for mode, d in hooks.items():
        for hook in ("prolog", "epilog"):
            runs[f"{hook} {mode}"] = ([], [])
            argv[f"{hook} {mode}"] = [str(d / f"slurm-ckpt-{hook}")]
    for i in range(reps):
        env = {"SLURM_JOB_ID": str(900_000 + i), "SLURM_JOB_UID": "0", "SLURM_JOB_GID": "0",
               "SLURM_JOB_USER": "root"}  # fmt: skip
        # Each mode's prolog before its epilog of the same job; modes and the yardstick anywhere.
        pairs = [[f"prolog {m}", f"epilog {m}"] for m in hooks]
        rng.shuffle(pairs)
        order = [name for pair in pairs for name in pair]
        order.insert(rng.randrange(len(order) + 1), "yardstick")
        for name in order:
            wall, cpu = timed(argv[name], env)
            runs[name][0].append(wall)
            runs[name][1].append(cpu)
    return runs


def report(runs: dict[str, tuple[list[float], list[float]]], reps: int) -> str:
    base_w = statistics.median(runs["yardstick"][0])
    base_c = statistics.median(runs["yardstick"][1])
    when = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    lines = [f"hooks bench, {when}, {platform.node()}, {os.cpu_count()} cpus, python {platform.python_version()}, "
             f"median of {reps} interleaved runs",
             f"yardstick: {sys.executable} -c '{BASELINE}'",
             f"{'':<12} {'wall ms':>8} {'cpu ms':>8} {'wall x':>7} {'cpu x':>7}"]  # fmt: skip
    for name, (wall, cpu) in runs.items():
        w, c = statistics.median(wall), statistics.median(cpu)
        lines.append(f"{name:<12} {w * 1000:8.1f} {c * 1000:8.1f} {w / base_w:7.2f} {c / base_c:7.2f}")
    for mode in sorted({name.split()[1] for name in runs if name != "yardstick"}):
        worst = max(statistics.median(runs[f"{h} {mode}"][0]) / base_w for h in ("prolog", "epilog"))
        lines.append(f"target ({mode}): each hook's wall median at most {TARGET:.1f}x the yardstick's; "
                     f"worst {worst:.2f}x: {'met' if worst <= TARGET else 'NOT met'}")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--enforce", default="none,loop", help="scratch.enforce modes to measure, comma-separated")
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        raise SystemExit("bench/hooks.py needs root (the prolog makes and chowns scratch dirs)")
    tmp = Path(tempfile.mkdtemp(prefix="sckt-hooks-bench-"))
    try:
        tmp.chmod(0o755)
        hooks = {mode: install(tmp, mode) for mode in args.enforce.split(",")}
        measure(hooks, 2, args.seed)  # warm the page cache: the first runs read everything from disk
        print(report(measure(hooks, args.reps, args.seed), args.reps))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The epilog's wall time against its deadline when a job leaves a hostile scratch.

    sudo .venv/bin/python -m bench.scratch_removal [--files 1000000] [--chain 5000] [--timeout 240]

Each case runs the real prolog and epilog (in this process, as the shims would
run them) for a job of the user ``nobody`` on a fresh tmpfs, with
``scratch.epilog_timeout`` set to ``--timeout`` and ``scratch.enforce: none``
(the tree is removed file by file; a loop filesystem would be unmounted whole):

- ``files``: ``--files`` empty files in 1,000 directories. Run twice, with
  the deadline and with a deadline of half the time the first run took, to
  show the deadline cuts the removal wherever it falls (the rest waits in the
  graveyard, with its reservation).
- ``chain``: one directory chain ``--chain`` levels deep.
- ``second job``: a shell of the user, its working directory inside the dying
  job's dir, makes 70-level chains as fast as it can during the epilog.

Printed per case: entries made, entries the epilog removed, its wall time,
the deadline, the wall time as a fraction of the deadline and of the shim's
watchdog (``SLURM_CKPT_EPILOG_WATCHDOG``, 10 s above the deadline by default),
and the removal rate, from which the time for 25 million entries follows.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from slurm_ckpt.config import Config, ScratchConfig, job_dir_name
from slurm_ckpt.node import run_epilog, run_prolog
from slurm_ckpt.node.graveyard import GRAVE_DIR, reap
from slurm_ckpt.node.scratch import STATE_DIR

ATTACK = """
import os, sys
os.chdir(sys.argv[1])
i = 0
while True:  # chains 70 levels deep, as fast as one core makes them
    i += 1
    try:
        os.makedirs(f"c{i}/" + "d/" * 70)
    except OSError:
        pass
"""
WATCHDOG_MARGIN = 10.0
"""The shims' default watchdog (250 s) less the default epilog_timeout (240 s)."""


def config(base: Path, timeout: float) -> Config:
    sc = ScratchConfig(base=str(base), default_size=64 * 2**20, min_size=2**20,  # type: ignore[arg-type]
                       epilog_timeout=timeout, reap_budget=0.001, enforce="none")  # fmt: skip
    return dataclasses.replace(Config(), scratch=sc).validate()


def env(job: str) -> dict[str, str]:
    pw = pwd.getpwnam("nobody")
    return {"SLURM_JOB_ID": job, "SLURM_JOB_UID": str(pw.pw_uid), "SLURM_JOB_GID": str(pw.pw_gid),
            "SLURM_JOB_USER": "nobody"}  # fmt: skip


def fill_files(job: Path, n: int) -> int:
    per = 1000
    for d in range(-(-n // per)):
        sub = job / f"d{d:05d}"
        sub.mkdir()
        fd = os.open(sub, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for i in range(min(per, n - d * per)):
                os.close(os.open(f"f{i:04d}", os.O_CREAT | os.O_WRONLY, 0o600, dir_fd=fd))
        finally:
            os.close(fd)
    return n + -(-n // per)


def fill_chain(job: Path, depth: int) -> int:
    cur = os.open(job, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(depth):
        os.mkdir("d", dir_fd=cur)
        nxt = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=cur)
        os.close(cur)
        cur = nxt
    os.close(cur)
    return depth


def left_behind(base: Path) -> int:
    """Entries waiting in the graveyard (inside the buried job dirs)."""
    n = 0
    for _, dirs, files in os.walk(base / STATE_DIR / GRAVE_DIR):
        n += len(dirs) + len(files)
    return max(0, n - len(os.listdir(base / STATE_DIR / GRAVE_DIR)))


def case(name: str, base: Path, job_id: str, timeout: float, fill: object, attack: bool = False) -> dict[str, object]:
    cfg = config(base, timeout)
    run_prolog(env(job_id), cfg)
    job = base / job_dir_name(job_id)
    made = fill(job) if callable(fill) else 0
    subprocess.run(["chown", "-R", "nobody:", str(job)], check=True)
    attacker = None
    if attack:
        os.mkdir(job / "w")
        os.chown(job / "w", pwd.getpwnam("nobody").pw_uid, -1)
        pw = pwd.getpwnam("nobody")
        attacker = subprocess.Popen(
            ["/usr/bin/python3", "-c", ATTACK, str(job / "w")], user=pw.pw_uid, group=pw.pw_gid,
            extra_groups=[], start_new_session=True, cwd="/", stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL)  # fmt: skip
        while len(os.listdir(job / "w")) < 3:
            if attacker.poll() is not None:
                raise SystemExit("the second job's shell could not start in the job dir")
            time.sleep(0.01)
    t0 = time.monotonic()
    res = run_epilog(env(job_id), cfg)
    wall = time.monotonic() - t0
    if attacker is not None:
        os.killpg(attacker.pid, signal.SIGKILL)
        attacker.wait()
    left = left_behind(base)
    if attack:
        made = 0
    reap(str(base), cfg.scratch.keep_failed, 3600, wait=True)  # empty the graveyard for the next case
    return {"case": name, "made": made, "left": left, "wall": wall, "deadline": timeout,
            "status": res.status if res else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=1_000_000)
    ap.add_argument("--chain", type=int, default=5000)
    ap.add_argument("--timeout", type=float, default=240.0, help="scratch.epilog_timeout")
    ap.add_argument("--attack-timeout", type=float, default=20.0,
                    help="scratch.epilog_timeout for the second-job case (it runs to the deadline)")
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        raise SystemExit("bench/scratch_removal.py needs root (tmpfs, a job of the user nobody)")
    tmp = Path(tempfile.mkdtemp(prefix="sckt-removal-bench-"))
    tmp.chmod(0o755)  # the job's user must reach its scratch
    base = tmp / "scratch"
    base.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8g,nr_inodes=0,mode=0755", "bench", str(base)], check=True)
    rows = []
    try:
        first = case("files", base, "1", args.timeout, lambda j: fill_files(j, args.files))
        rows.append(first)
        half = max(1.0, float(first["wall"]) / 2)  # type: ignore[arg-type]
        rows.append(case("files, half", base, "2", half, lambda j: fill_files(j, args.files)))
        rows.append(case("chain", base, "3", args.timeout, lambda j: fill_chain(j, args.chain)))
        rows.append(case("second job", base, "4", args.attack_timeout, None, attack=True))
    finally:
        subprocess.run(["umount", "-l", str(base)], check=False)
        shutil.rmtree(tmp, ignore_errors=True)
    when = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    print(f"scratch removal bench, {when}, {platform.node()}, {os.cpu_count()} cpus, tmpfs, "
          f"python {platform.python_version()}; watchdog = deadline + {WATCHDOG_MARGIN:.0f} s")
    print(f"{'case':<12} {'entries':>9} {'left':>9} {'wall s':>8} {'deadline':>8} {'wall/dl':>7} "
          f"{'wall/wd':>7} {'rate/s':>9}  status")  # fmt: skip
    for r in rows:
        wall, dl = float(r["wall"]), float(r["deadline"])  # type: ignore[arg-type]
        made, left = int(r["made"]), int(r["left"])  # type: ignore[call-overload]
        rate = (made - left) / wall if made else 0
        print(f"{r['case']:<12} {made:>9} {left:>9} {wall:8.2f} {dl:8.1f} {wall / dl:7.2f} "
              f"{wall / (dl + WATCHDOG_MARGIN):7.2f} {rate:9.0f}  {r['status']}")  # fmt: skip
    rate = (int(rows[0]["made"]) - int(rows[0]["left"])) / float(rows[0]["wall"])  # type: ignore[call-overload,arg-type]
    need = 25_000_000 / rate
    print(f"25 million entries at the 'files' rate: {need:.0f} s of removal; the epilog stops at its "
          f"deadline ({args.timeout:.0f} s), {min(need, args.timeout) / (args.timeout + WATCHDOG_MARGIN):.2f} "
          "of the watchdog, and leaves the rest to the graveyard")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

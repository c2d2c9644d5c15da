"""kill -9 of a real writer at random moments never leaves a bad checkpoint behind.

A driver process (this file run as a script) imports torch once and, for each
trial, forks a child that runs the real ``Checkpointer`` save loop on one run
dir, resuming where the last trial left off. The driver SIGKILLs the child
after a random delay, then checks what ``slurm-ckpt resume`` would pick (a full
verification) against what was saved at that step. Kills land before the first
commit, mid-write, between fsyncs and renames, in a same-step replacement
(RENAME_EXCHANGE) and in retention's deletes. The writer keeps a single
checkpoint (keep=1), so retention deleting anything before the new checkpoint
is committed would show up as a lost commit. Every checkpoint left in every
tier must verify and hold what was saved at its step.

Modes: ``sync`` saves, ``async`` (kills during the background write), and
``tiers`` (saves to scratch while a thread copies to the run dir; kills land
in the copy too).

SIGKILL tests atomicity of what reaches the filesystem; a power cut (lost page
cache) is beyond what a test can do here, which is why the commit protocol
fsyncs anyway.
"""

from __future__ import annotations

import ctypes
import json
import os
import random
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

SYNC_TRIALS = 100
ASYNC_TRIALS = 60
TIERS_TRIALS = 40
MAX_DELAY = 0.05
"""Initial bound of the kill delay after the child is ready, in seconds. It adapts
(see ``drive``) to a few saves' worth, since a save takes 5 ms on an idle
machine and ten times that on a loaded CI runner."""
EARLY = 0.15
"""Share of trials killed without waiting for the child to be ready: before any commit."""

N = 1 << 18


def make_state(step: int, base: Any) -> dict[str, Any]:
    """The state saved at ``step``: every value is a function of the step."""
    import torch

    return {
        "model": {
            "w": torch.from_numpy(base + step),
            "b": torch.full((7,), step, dtype=torch.bfloat16),
            "i": torch.arange(5, dtype=torch.int64) * step,
        },
        "step": step,
        "rng": [step, step * 3, b"%d" % step],
    }


def same_state(got: Any, step: int, base: Any) -> bool:
    want = make_state(step, base)
    gm, wm = got["model"], want["model"]
    return (
        got["step"] == step
        and got["rng"] == want["rng"]
        and all(
            gm[k].dtype == wm[k].dtype
            and gm[k].shape == wm[k].shape
            and gm[k].view(-1).numpy().tobytes() == wm[k].view(-1).numpy().tobytes()
            for k in ("w", "i")
        )
        and gm["b"].view(-1).view(dtype=wm["b"].dtype).float().tolist() == wm["b"].float().tolist()
    )


def _child(run: Path, start: int, mode: str, channel: Path, base: Any, ready: int) -> None:
    from slurm_ckpt import Checkpointer

    os.environ["SLURM_CKPT_CONTROL"] = str(channel)
    ck = Checkpointer(run, keep=1, lock_timeout=30)
    os.write(ready, b"r")
    step = start
    while True:
        if mode in ("sync", "tiers"):
            ck.save(make_state(step, base), step=step)
        else:
            ck.save_async(make_state(step, base), step=step)  # waits for the previous one
        step += 1


def _die_with_parent() -> None:
    """A child must not outlive a driver killed by the test's timeout."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() == 1:  # the driver died before prctl took effect
        os._exit(1)


def _committed(channel: Path) -> list[int]:
    try:
        lines = channel.read_text().split("\n")[:-1]  # a kill can cut the last line
    except FileNotFoundError:
        return []
    return [int(line.split()[1]) for line in lines if line.startswith("committed ")]


def _tmp_dirs(run: Path) -> set[str]:
    return {n for n in os.listdir(run) if n.startswith(".tmp-")} if run.exists() else set()


def drive(run: Path, trials: int, mode: str, seed: int) -> dict[str, Any]:
    import numpy as np
    import torch

    from slurm_ckpt import Checkpointer
    from slurm_ckpt.store import Skipped, iter_valid, load_state

    torch.set_num_threads(1)  # no OpenMP pool in a process that forks
    base = np.arange(N, dtype=np.float32)
    rng = random.Random(seed)
    channel = run.parent / f"committed-{mode}.log"
    stats: dict[str, Any] = {
        "mode": mode,
        "trials": 0,
        "killed_before_first_commit": 0,
        "resumes": 0,
        "failed_verify": 0,
        "content_mismatch": 0,
        "lost_commits": 0,
        "resaves": 0,
        "stale_tmp_survived_a_save": 0,
        "max_step": -1,
        "problems": [],
    }
    dirs = [run]
    if mode == "tiers":  # scratch first; a background thread copies to the run dir
        scratch = run.parent / f"scratch-{mode}"
        scratch.mkdir(exist_ok=True)
        os.environ["SLURM_CKPT_SCRATCH"] = str(scratch)
        dirs = [scratch / "ckpt", run]
    next_start, prev_tmp, max_delay = 0, set[str](), MAX_DELAY
    for trial in range(trials):
        channel.unlink(missing_ok=True)
        resave = next_start > 0 and rng.random() < 0.3
        start = next_start - 1 if resave else next_start
        stats["resaves"] += resave
        ready_r, ready_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                _die_with_parent()
                os.close(ready_r)
                _child(run, start, mode, channel, base, ready_w)
            finally:
                os._exit(1)
        os.close(ready_w)
        early = rng.random() < EARLY
        if early:
            delay = rng.uniform(0, 0.01)
        else:
            # Wait for the child to be ready (timing varies with machine load), so
            # that the random part below covers the saves themselves.
            if not select.select([ready_r], [], [], 60)[0]:
                os.kill(pid, signal.SIGKILL)
                raise RuntimeError(f"trial {trial}: child {pid} not ready after 60 s")
            delay = rng.uniform(0, max_delay)
        # The random kill moment; this is the fault, not a synchronisation.
        time.sleep(delay)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(ready_r)
        stats["trials"] += 1
        committed = _committed(channel)
        skipped: list[Skipped] = []
        # Every checkpoint in every tier must verify, not just the one resume picks.
        valid = list(iter_valid(dirs, full=True, skipped=skipped))
        cand = valid[0] if valid else None
        if skipped:
            stats["failed_verify"] += len(skipped)
            stats["problems"].append(
                f"trial {trial}: skipped {[(str(s.path), s.reason) for s in skipped]}"
            )
        if committed and (cand is None or cand.step < committed[-1]):
            stats["lost_commits"] += 1
            stats["problems"].append(
                f"trial {trial}: committed {committed[-1]} but resume gave {cand}"
            )
        if not committed:
            stats["killed_before_first_commit"] += 1
        if not early:  # aim at 0 to ~6 commits per trial, whatever the machine's speed
            max_delay *= 1.2 if not committed else 0.9 if len(committed) > 6 else 1.0
        for c in valid:
            if not same_state(load_state(c.path, c.manifest), c.step, base):
                stats["content_mismatch"] += 1
                stats["problems"].append(f"trial {trial}: {c.path} content differs")
        if cand is not None:
            stats["resumes"] += 1
            next_start = cand.step + 1
            stats["max_step"] = max(stats["max_step"], cand.step)
        now_tmp = _tmp_dirs(dirs[0])  # the tier the child commits to before it reports
        if committed and prev_tmp & now_tmp:
            stats["stale_tmp_survived_a_save"] += 1
            stats["problems"].append(f"trial {trial}: {sorted(prev_tmp & now_tmp)} survived")
        prev_tmp = now_tmp
    with Checkpointer(run, keep=1) as ck:  # one clean save at the end clears every leftover
        ck.save(make_state(next_start, base), step=next_start)
    stats["tmp_left_after_final_save"] = sorted(n for d in dirs for n in _tmp_dirs(d))
    stats["kill_delay_bound_ms"] = round(max_delay * 1000, 1)
    return stats


def _run_driver(tmp_path: Path, mode: str, trials: int) -> dict[str, Any]:
    run = tmp_path / f"run-{mode}"
    out = tmp_path / f"stats-{mode}.json"
    seed = int(os.environ.get("CRASH_SEED", random.randrange(1 << 30)))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    res = subprocess.run(
        [sys.executable, __file__, str(run), str(trials), mode, str(seed), str(out)],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    stats = json.loads(out.read_text())
    stats["seed"] = seed
    return stats


def _report(stats: dict[str, Any]) -> str:
    keys = [
        "trials",
        "killed_before_first_commit",
        "resumes",
        "resaves",
        "max_step",
        "failed_verify",
        "content_mismatch",
        "lost_commits",
        "stale_tmp_survived_a_save",
        "tmp_left_after_final_save",
        "kill_delay_bound_ms",
        "seed",
    ]
    return "\n".join(f"{k:28} {stats[k]}" for k in keys)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mode", "trials"), [("sync", SYNC_TRIALS), ("async", ASYNC_TRIALS), ("tiers", TIERS_TRIALS)]
)
def test_kill9_never_yields_a_bad_checkpoint(
    tmp_path: Path, mode: str, trials: int, figures: Callable[[str, str], Path]
) -> None:
    stats = _run_driver(tmp_path, mode, trials)
    figures(
        f"kill9-{mode}",
        f"reproduce: CRASH_SEED={stats['seed']} pytest {__file__}\n" + _report(stats),
    )
    assert stats["trials"] == trials
    assert stats["problems"] == []
    assert stats["failed_verify"] == 0 and stats["content_mismatch"] == 0
    assert stats["lost_commits"] == 0 and stats["stale_tmp_survived_a_save"] == 0
    assert stats["tmp_left_after_final_save"] == []
    # The kills must have spread: some before any commit, most after some progress.
    assert 0 < stats["killed_before_first_commit"] < trials
    assert stats["resumes"] > trials // 2 and stats["max_step"] > trials // 2


if __name__ == "__main__":
    _run, _trials, _mode, _seed, _out = sys.argv[1:]
    Path(_out).write_text(json.dumps(drive(Path(_run), int(_trials), _mode, int(_seed))))

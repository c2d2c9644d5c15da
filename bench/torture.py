#!/usr/bin/env python3
"""Torture: train with periodic async saves under random I/O faults, then kill -9.

    sudo .venv/bin/python -m bench.torture --attempts 500 --seed 1

A trainer process saves asynchronously every ``--every`` steps into a run dir
on the fault-injecting FUSE filesystem (tests/faultfs) while this driver swaps
random fault sets in and out (EIO, ENOSPC, EDQUOT, ESTALE, EROFS, failed fsync
and close, short writes, stalls). After ``--attempts`` save attempts it kills
the trainer with SIGKILL at a random moment, clears the faults and resumes the
way a requeued job would. Each of ``--rounds`` rounds resumes from the last.

Reported: save attempts, commits and failures (by errno); resume picks that
fail verification or hold the wrong data (must be 0); committed checkpoints
that do not verify (must be 0); steps lost to the kill, against the ideal (the
steps since the last save attempt, what an instant fault-free save would lose).
Exit status 1 if anything that must be 0 is not.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

FAULT_SETS: list[list[dict[str, Any]]] = [
    [],
    [{"op": "write", "path": "*/tensors-*", "errno": "EIO", "prob": 0.3}],
    [{"op": "write", "errno": "ENOSPC", "prob": 0.2}],
    [{"op": "write", "errno": "EDQUOT", "prob": 0.2}],
    [{"op": ["create", "open"], "errno": "ESTALE", "prob": 0.2}],
    [{"op": ["mkdir", "create"], "errno": "EROFS", "prob": 0.5}],
    [{"op": "fsync", "errno": "EIO", "prob": 0.2}],
    [{"op": "fsyncdir", "errno": "EIO", "prob": 0.2}],
    [{"op": "flush", "errno": "EIO", "prob": 0.2}],
    [{"op": "rename", "errno": "EIO", "prob": 0.2}],
    [{"op": "write", "short": True, "prob": 0.5}],
    [{"op": "fsync", "delay": 0.03, "prob": 0.5}],
    [{"op": "write", "errno": "EIO", "prob": 0.1}, {"op": "fsync", "errno": "EIO", "prob": 0.1},
     {"op": "mkdir", "errno": "ENOSPC", "prob": 0.1}, {"op": "write", "short": True, "prob": 0.3}],
]  # fmt: skip


def model_state(step: int, kib: int) -> dict[str, Any]:
    """The training state after ``step`` steps: every value derived from the step."""
    import torch

    g = torch.Generator().manual_seed(step)
    w = torch.randn(kib * 256, generator=g)
    return {"step": step, "model": {"w": w}, "optim": {"m": w * 0.5, "lr": 0.1 / (1 + step)},
            "sampler": {"epoch": step // 100, "index": step % 100}}  # fmt: skip


def state_ok(state: Any, step: int, kib: int) -> bool:
    import torch

    want = model_state(step, kib)
    return (state["step"] == step and state["sampler"] == want["sampler"]
            and torch.equal(state["model"]["w"], want["model"]["w"])
            and torch.equal(state["optim"]["m"], want["optim"]["m"]))  # fmt: skip


# -- the trainer (child) -------------------------------------------------------
def trainer(run_dir: Path, log_path: Path, every: int, kib: int) -> None:
    import logging

    from slurm_ckpt import Checkpointer
    from slurm_ckpt.config import Config, StorageConfig

    # Thousands of warnings ("retry 1/2", "pruned ...") would drown the report;
    # the failures that reach the trainer are counted from its log instead.
    logging.getLogger("slurm_ckpt").setLevel(logging.CRITICAL)
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def log(*words: object) -> None:
        os.write(fd, (" ".join(map(str, words)) + "\n").encode())  # one write: whole lines

    cfg = Config(storage=StorageConfig(keep=3, retries=2, retry_backoff=0.005, on_async_error="raise"))
    ckpt = Checkpointer(run_dir, config=cfg)
    state = ckpt.load_latest()
    step = ckpt.loaded_step or 0
    log("R", step, "ok" if state is None or state_ok(state, step, kib) else "BAD")
    prev = None
    while True:
        step += 1
        log("S", step)
        if step % every:
            continue
        log("A", step)
        try:
            h = ckpt.save_async(model_state(step, kib), step)
        except Exception as e:  # the failure of the previous save, per on_async_error=raise
            log("F", prev.step if prev else "?", _errname(e), str(e).replace("\n", " ")[:300])
            prev = None
            h = ckpt.save_async(model_state(step, kib), step)
        if prev is not None:
            log("C", prev.step)  # save_async drained it without an error: committed
        prev = h


def _errname(e: BaseException) -> str:
    import errno

    code = getattr(e, "errno", None)
    return errno.errorcode.get(code, type(e).__name__) if isinstance(code, int) else type(e).__name__


# -- the driver ----------------------------------------------------------------
def read_log(path: Path) -> list[list[str]]:
    try:
        return [ln.split(" ", 3) for ln in path.read_text().splitlines() if ln]
    except FileNotFoundError:
        return []


def run_round(args: argparse.Namespace, fs: Any, run: Path, log: Path, rng: random.Random,
              scratch: Path | None) -> dict[str, Any]:  # fmt: skip
    from slurm_ckpt import Checkpointer
    from slurm_ckpt.config import Config
    from slurm_ckpt.store import find_latest, verify_checkpoint
    from slurm_ckpt.store.layout import fast_dir, list_steps

    fs.clear()
    log.unlink(missing_ok=True)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("SLURM_CKPT_SCRATCH", None)
    if scratch is not None:
        # Two tiers: saves commit to local scratch, and the drain to the faulty run dir suffers.
        env["SLURM_CKPT_SCRATCH"] = str(scratch)
    child = subprocess.Popen([sys.executable, __file__, "--child", "--dir", str(run), "--log", str(log),
                              "--every", str(args.every), "--kib", str(args.kib)], env=env)  # fmt: skip
    kill_at = args.attempts + rng.randint(0, max(1, args.attempts // 20))
    injected = 0

    def switch(rules: list[dict[str, Any]]) -> None:
        nonlocal injected
        injected += sum(r["fired"] for r in fs.stats()["rules"])
        fs.set(*rules, seed=rng.randrange(2**31))

    try:
        deadline = time.monotonic() + args.timeout
        started = False
        while True:
            lines = read_log(log)
            if not started and any(ln[0] == "R" for ln in lines):
                started = True  # resume done with faults off; now the storage turns hostile
                switch(rng.choice(FAULT_SETS[1:]))
                switched = time.monotonic()
            attempts = sum(ln[0] == "A" for ln in lines)
            if attempts >= kill_at:
                # A random moment: a save is very likely in flight, somewhere in its protocol.
                time.sleep(rng.uniform(0, args.kill_jitter))
                break
            if child.poll() is not None:
                raise RuntimeError(f"trainer exited early with {child.returncode}; log: {lines[-5:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {attempts} attempts in {args.timeout}s")
            if started and time.monotonic() - switched > args.switch:
                switch(rng.choice(FAULT_SETS))
                switched = time.monotonic()
            time.sleep(0.02)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
        switch([])
    lines = read_log(log)
    # What the requeued job does: take the newest checkpoint that verifies, and load it.
    dirs = [run] if scratch is None else [fast_dir(scratch), run]
    pick = find_latest(dirs, full=True)
    bad_pick = 0
    resumed = 0
    if pick is not None:
        resumed = pick.step
        with Checkpointer(run, config=Config(), scratch=scratch or False) as ck:
            state = ck.load_latest()
            if state is None or ck.loaded_step != pick.step or not state_ok(state, pick.step, args.kib):
                bad_pick = 1
    bad_committed = 0
    for _, p in [sp for d in dirs for sp in list_steps(d)]:
        try:
            verify_checkpoint(p, full=True)
        except Exception:
            bad_committed += 1
    durable = find_latest([run], full=True)
    reached = max((int(ln[1]) for ln in lines if ln[0] == "S"), default=0)
    last_attempt = max((int(ln[1]) for ln in lines if ln[0] == "A"), default=0)
    failed = [ln for ln in lines if ln[0] == "F"]
    return {
        "faults_injected": injected,
        "attempted": sum(ln[0] == "A" for ln in lines),
        "committed": sum(ln[0] == "C" for ln in lines),
        "failed": len(failed),
        "failed_by_errno": dict(collections.Counter(ln[2] for ln in failed)),
        "messages": {ln[2]: ln[3] for ln in failed if len(ln) > 3},
        "child_resume_bad": sum(ln[0] == "R" and ln[2] == "BAD" for ln in lines),
        "resume_picks_bad": bad_pick,
        "committed_not_verifying": bad_committed,
        "resumed_step": resumed,
        "resumed_from": "none" if pick is None else ("durable" if pick.path.parent == run else "scratch"),
        "newest_durable_step": durable.step if durable else 0,
        "reached_step": reached,
        "steps_lost": reached - resumed,
        "steps_lost_ideal": reached - last_attempt,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--attempts", type=int, default=500, help="save attempts per round before the kill")
    ap.add_argument("--rounds", type=int, default=1, help="kill -9 / resume cycles")
    ap.add_argument("--every", type=int, default=2, help="steps between saves")
    ap.add_argument("--kib", type=int, default=64, help="KiB of model weights in the state")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--switch", type=float, default=0.5, help="seconds between fault-set changes")
    ap.add_argument("--kill-jitter", type=float, default=0.05, help="random delay before the kill")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--mounted", nargs=3, metavar=("ROOT", "MNT", "SOCK"),
                    help="use an already mounted tests.faultfs instead of mounting one")  # fmt: skip
    ap.add_argument("--tiers", action="store_true",
                    help="save to local scratch first and drain to the faulty run dir")  # fmt: skip
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--dir", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--log", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        trainer(args.dir, args.log, args.every, args.kib)
        return 0
    from tests.faultfs import FaultFS, mount_faultfs

    seed = args.seed if args.seed is not None else random.randrange(2**31)
    rng = random.Random(seed)
    with contextlib.ExitStack() as stack:
        if args.mounted:
            root, mnt, sock = map(Path, args.mounted)
            fs = FaultFS(root, mnt, sock)
        else:
            base = Path(tempfile.mkdtemp(prefix="torture-"))
            stack.callback(shutil.rmtree, base, ignore_errors=True)
            fs = stack.enter_context(mount_faultfs(base / "root", base / "mnt", base / "ctl.sock"))
        work = fs.mnt / f"torture-{os.getpid()}"
        work.mkdir()
        stack.callback(shutil.rmtree, work, ignore_errors=True)
        # The trainer's log stays off the faulty filesystem: it is the ground truth.
        logdir = Path(tempfile.mkdtemp(prefix="torture-log-"))
        stack.callback(shutil.rmtree, logdir, ignore_errors=True)
        scratch = logdir / "scratch" if args.tiers else None
        if scratch is not None:
            scratch.mkdir()
        rounds = [run_round(args, fs, work / "run", logdir / "trainer.log", rng, scratch)
                  for _ in range(args.rounds)]  # fmt: skip
    total: dict[str, Any] = {"seed": seed, "rounds": rounds}
    for key in ("faults_injected", "attempted", "committed", "failed", "child_resume_bad", "resume_picks_bad",
                "committed_not_verifying", "steps_lost", "steps_lost_ideal"):  # fmt: skip
        total[key] = sum(r[key] for r in rounds)
    total["failed_by_errno"] = dict(sum((collections.Counter(r["failed_by_errno"]) for r in rounds),
                                        collections.Counter()))  # fmt: skip
    total["messages"] = {k: v for r in rounds for k, v in r["messages"].items()}
    if args.json:
        print(json.dumps(total, indent=2))
    else:
        print(f"torture (seed {seed}, {args.rounds} round(s) of >= {args.attempts} save attempts, kill -9 each)")
        print(f"  faults injected {total['faults_injected']}; save attempts {total['attempted']}, "
              f"committed {total['committed']}, failed {total['failed']} (the rest were in flight at a kill)")
        print("  failures by errno: " + ", ".join(f"{k} {v}" for k, v in sorted(total["failed_by_errno"].items())))
        print(f"  resume picks failing verification or holding wrong data: {total['resume_picks_bad']} "
              f"(trainer's own resume: {total['child_resume_bad']})")
        print(f"  committed checkpoints that do not verify: {total['committed_not_verifying']}")
        print(f"  steps lost to the kills: {total['steps_lost']} (ideal {total['steps_lost_ideal']}: "
              f"the steps since each round's last save attempt); per round: "
              + ", ".join(f"{r['steps_lost']} vs {r['steps_lost_ideal']}" for r in rounds))
        if args.tiers:
            print("  resumed from: " + ", ".join(f"step {r['resumed_step']} on {r['resumed_from']} "
                                                 f"(newest durable: {r['newest_durable_step']})" for r in rounds))
        for k, v in sorted(total["messages"].items()):
            print(f"  e.g. {k}: {v}")
    bad = total["resume_picks_bad"] + total["child_resume_bad"] + total["committed_not_verifying"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

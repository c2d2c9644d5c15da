"""Lightning, HF Trainer and Accelerate: signalled, resumed, the same run to the bit.

Each framework's example (``examples/*_train.py``) runs as its own process, as
under a requeue: the test waits until the run's metric file reaches a step,
sends the real checkpoint signal (SIGUSR1) to the trainer, and expects it to
commit a checkpoint, stop cleanly (exit 0) and, started again, resume from it
and finish; its per-step losses, its step history and its final weights must
equal those of a run that never stopped. The full path, stopped twice through
``srun slurm-ckpt run`` and Slurm's requeue, is in ``tests/slurm/test_frameworks_e2e.py``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.slurm.harness import poll

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
STEPS = 32

# name -> (example, the module it needs)
FRAMEWORKS = {
    "lightning": ("lightning_train.py", "lightning.pytorch"),
    "hf_trainer": ("hf_trainer_train.py", "transformers"),
    "accelerate": ("accelerate_train.py", "accelerate"),
}


def _env(run_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    env.update(SLURM_CKPT_DIR=str(run_dir), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONUNBUFFERED="1")  # fmt: skip
    return env


def _steps(out: Path) -> list[int]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


def _run(argv: list[str], env: dict[str, str], cwd: Path) -> str:
    # Small output (HF logs a line a step): a pipe read to the end by run() is fine.
    proc = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=400, check=False)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc.stdout


def _signalled_run(argv: list[str], env: dict[str, str], cwd: Path, out: Path, past: int) -> int:
    """Run until the metric file passes step ``past``, send SIGUSR1, return the step it stopped at."""
    log = cwd / f"run-past-{past}.log"
    # Output to a file, not a pipe nobody reads while polling: a full pipe would block the trainer.
    with open(log, "w") as f:
        proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=f, stderr=subprocess.STDOUT)
    try:
        poll(f"the trainer past step {past}",
             lambda: True if (_steps(out) and _steps(out)[-1] >= past) or proc.poll() is not None else None,
             300, interval=0.05, on_timeout=lambda: log.read_text()[-3000:])  # fmt: skip
        if proc.poll() is None:
            proc.send_signal(signal.SIGUSR1)
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    output = log.read_text()
    assert proc.returncode == 0, f"exit {proc.returncode}\n{output[-5000:]}"
    stop = re.search(r"stopping at step=(\d+)", output)
    assert stop, f"the trainer did not stop on SIGUSR1:\n{output[-5000:]}"
    return int(stop.group(1))


@pytest.mark.slow
@pytest.mark.parametrize("framework", list(FRAMEWORKS))
def test_signalled_and_resumed_ends_bit_identical(tmp_path: Path, framework: str) -> None:
    example, module = FRAMEWORKS[framework]
    pytest.importorskip(module)
    script = [sys.executable, str(EXAMPLES / example), "--steps", str(STEPS), "--every", "15"]
    env = _env(tmp_path / "run")
    ref, res = tmp_path / "ref", tmp_path / "res"
    _run([*script, "--no-ckpt", "--out", str(ref)], env, tmp_path)

    slow = [*script, "--out", str(res), "--step-time", "0.2"]
    stopped = _signalled_run(slow, env, tmp_path, res, past=18)  # past a save (15), mid-epoch
    last = _run([*script, "--out", str(res)], env, tmp_path)

    assert 18 <= stopped < STEPS
    assert re.search(rf"start from={stopped}\b", last), last[-2000:]
    # The history goes on from each stop: every step once, in order, none redone.
    assert _steps(res) == list(range(1, STEPS + 1))
    assert (res / "metrics.jsonl").read_text() == (ref / "metrics.jsonl").read_text()
    assert (res / "done.txt").read_text() == (ref / "done.txt").read_text()


def _ranks(argv: list[str], env: dict[str, str], cwd: Path, world: int, tag: str) -> list[subprocess.Popen[str]]:
    """``world`` processes of one Accelerate job, started as srun starts tasks: each with its
    rank in the environment, each signalled on its own."""
    from tests.integration.dist_ranks import free_port

    port = str(free_port())
    procs = []
    for r in range(world):
        rank_env = {**env, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(world),
                    "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
                    "OMP_NUM_THREADS": "1"}  # fmt: skip
        with open(cwd / f"{tag}-rank{r}.log", "w") as f:
            procs.append(subprocess.Popen(argv, env=rank_env, cwd=cwd, stdout=f, stderr=subprocess.STDOUT, text=True))
    return procs


def _finish(procs: list[subprocess.Popen[str]], cwd: Path, tag: str) -> list[str]:
    try:
        for p in procs:
            p.wait(timeout=120)  # a run takes seconds; ranks that disagree wait forever
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    logs = [(cwd / f"{tag}-rank{r}.log").read_text() for r in range(len(procs))]
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} exit {p.returncode}\n{logs[r][-5000:]}"
    return logs


@pytest.mark.slow
def test_accelerate_ranks_signalled_one_at_a_time_stop_together_and_resume_bit_identical(tmp_path: Path) -> None:
    """Two processes, as two srun tasks; the signal reaches rank 1 only (Slurm signals each
    task at its own moment). Both must stop at the same step (a rank saving while the other
    trains on waits for it forever), and the pair started again resumes to the same bits."""
    pytest.importorskip("accelerate")
    script = [sys.executable, str(EXAMPLES / "accelerate_train.py"), "--steps", "24", "--every", "10"]
    env = {**_env(tmp_path / "run"), "TMPDIR": str(tmp_path / "tmp")}  # where load_state stages
    (tmp_path / "tmp").mkdir()
    ref, res = tmp_path / "ref", tmp_path / "res"
    _finish(_ranks([*script, "--no-ckpt", "--out", str(ref)], env, tmp_path, 2, "ref"), tmp_path, "ref")

    procs = _ranks([*script, "--out", str(res), "--step-time", "0.1"], env, tmp_path, 2, "stop")
    poll("the trainer past step 12", lambda: True if (_steps(res) and _steps(res)[-1] >= 12) or
         any(p.poll() is not None for p in procs) else None, 300, interval=0.05)  # fmt: skip
    procs[1].send_signal(signal.SIGUSR1)
    stops = [re.search(r"stopping at step=(\d+)", log) for log in _finish(procs, tmp_path, "stop")]
    assert all(stops), stops
    stopped = {int(m.group(1)) for m in stops if m}
    assert len(stopped) == 1 and 12 <= min(stopped) < 24, stopped
    step = stopped.pop()
    assert (tmp_path / "run" / f"step-{step:09d}").is_dir()

    logs = _finish(_ranks([*script, "--out", str(res)], env, tmp_path, 2, "resume"), tmp_path, "resume")
    assert all(re.search(rf"start from={step}\b", log) for log in logs), logs[0][-2000:]
    assert _steps(res) == list(range(1, 25))
    assert (res / "metrics.jsonl").read_text() == (ref / "metrics.jsonl").read_text()
    assert (res / "done.txt").read_text() == (ref / "done.txt").read_text()
    # Only what slurm-ckpt put there: torch._dynamo, which transformers imports, makes its
    # cache dir in TMPDIR too (unless an import in this process already set
    # TORCHINDUCTOR_CACHE_DIR, which the ranks then inherit).
    assert not list((tmp_path / "tmp").glob("slurm-ckpt-*")), "the resume's copy is removed, and its dir"

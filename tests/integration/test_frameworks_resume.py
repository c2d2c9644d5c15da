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

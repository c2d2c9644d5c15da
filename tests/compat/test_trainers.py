"""Six trainers written the way their public originals are resume bit-exact under ``slurm-ckpt run``.

Each trainer (``trainers/``) runs twice under ``slurm-ckpt run --local``, at
the same time: once straight through, and once interrupted mid-epoch. The
interrupted one pauses after a chosen step and says so; the test then sends the
wrapper USR1, as Slurm would; the wrapper asks the trainer for a checkpoint,
the trainer saves and exits, and the wrapper restarts it in place ("requeue"),
which resumes from the checkpoint and trains to the end. Both runs must end
with the same weights, the same optimizer state, the same next numbers from
every random generator the trainer uses, and the same loss at every step after
the resume.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from slurm_ckpt.wrapper.events import parse_event

ROOT = Path(__file__).resolve().parents[2]

TRAINERS = {
    # name: (steps, the step after which the interrupted run pauses: mid-epoch in each)
    "mnist_style": (40, 21),  # 16 batches an epoch: epoch 2, batch 5
    "word_lm": (30, 17),  # 13 slices an epoch: epoch 2, slice 4
    "nanogpt_style": (30, 13),  # between evaluations, after a saving one
    "accelerate_style": (36, 17),  # 12 batches an epoch: epoch 2, batch 5
    "time_sequence": (8, 4),  # L-BFGS: every step after the resume takes dot products of loaded tensors
    "deit_style": (36, 17),  # 12 batches an epoch: epoch 1 of 0-2, batch 5
}


class Wrapped:
    """``slurm-ckpt run --local -- python -m tests.compat.trainers.<name> ...``, read as it runs."""

    def __init__(self, tmp: Path, name: str, steps: int, pause_at: int = 0) -> None:
        self.out = tmp / "result.json"
        argv = [sys.executable, "-c", "from slurm_ckpt.cli import main; main()", "run", "--local", "--",
                sys.executable, "-m", f"tests.compat.trainers.{name}", "--steps", str(steps),
                "--out", str(self.out), "--pause-at", str(pause_at)]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "THP_MEM_ALLOC_ENABLE"))}
        env.update(SLURM_CKPT_DIR=str(tmp / "ckpt"), PYTHONPATH=str(ROOT))
        self.proc = subprocess.Popen(argv, env=env, cwd=ROOT, text=True, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE)  # fmt: skip
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        self._readers = [threading.Thread(target=self._read, args=(s, b), daemon=True)
                         for s, b in ((self.proc.stdout, self.stdout), (self.proc.stderr, self.stderr))]  # fmt: skip
        for t in self._readers:
            t.start()

    @staticmethod
    def _read(stream: Any, into: list[str]) -> None:
        for line in stream:
            into.append(line)

    def wait_line(self, text: str, timeout: float = 300) -> None:
        end = time.monotonic() + timeout  # a hang guard; the line comes within seconds
        while not any(text in line for line in list(self.stdout)):
            if self.proc.poll() is not None or time.monotonic() > end:
                raise AssertionError(f"no {text!r} from the trainer:\n{''.join(self.stdout)}{''.join(self.stderr)}")
            time.sleep(0.02)

    def finish(self, timeout: float = 600) -> tuple[dict[str, Any], list[dict[str, str]]]:
        try:
            code = self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            for t in self._readers:
                t.join(10)
        log = "".join(self.stdout) + "".join(self.stderr)
        assert code == 0, log
        events = [e for e in map(parse_event, "".join(self.stderr).splitlines()) if e is not None]
        return json.loads(self.out.read_text()), events


@pytest.mark.slow
@pytest.mark.parametrize("name", list(TRAINERS))
def test_trainer_resumes_bit_exact_after_an_interruption(tmp_path: Path, name: str,
                                                        figures: Any) -> None:  # fmt: skip
    steps, pause_at = TRAINERS[name]
    (tmp_path / "straight").mkdir()
    (tmp_path / "interrupted").mkdir()
    straight = Wrapped(tmp_path / "straight", name, steps)
    interrupted = Wrapped(tmp_path / "interrupted", name, steps, pause_at)
    interrupted.wait_line(f"paused at step {pause_at}")
    os.kill(interrupted.proc.pid, signal.SIGUSR1)  # what Slurm sends ahead of the time limit
    want, _ = straight.finish()
    got, events = interrupted.finish()

    committed = [e["step"] for e in events if e["event"] == "committed" and e["run"] == "1"]
    assert committed[-1:] == [str(pause_at)], events  # the checkpoint asked for, the newest
    assert [e["run"] for e in events if e["event"] == "restart"] == ["2"]
    assert f"resumed from step {pause_at}" in "".join(interrupted.stdout)
    assert got["started at"] == pause_at and want["started at"] == 0
    after = {k: v for k, v in want["losses"].items() if int(k) > pause_at}
    assert got["losses"] == after, "the resumed run trained on something else"
    assert {k: v for k, v in got.items() if k not in ("losses", "started at")} == \
        {k: v for k, v in want.items() if k not in ("losses", "started at")}  # fmt: skip
    nexts = [k for k in want if k.startswith("next ")]
    figures(f"trainer-{name}", f"{name}: {steps} steps, interrupted after step {pause_at}, resumed from "
            f"{got['started at']}; final weights {got['weights']} = {want['weights']}; same "
            f"{', '.join(nexts)} numbers; {len(after)} losses after the resume equal")  # fmt: skip

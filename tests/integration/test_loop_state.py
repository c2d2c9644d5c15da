"""The whole loop's state: generators and data position survive a save, a new process and a load.

Every resume here happens in a new process, as after a requeue: state that only
lived in the old process (a generator, a sampler's position) is lost unless the
checkpoint carried it. A process that crashes (a loaded tensor handed to
``torch.set_rng_state`` must behave like ``torch.load``'s) fails the test with
its exit code instead of taking pytest down.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from slurm_ckpt import ResumableSampler

REPO = Path(__file__).resolve().parents[2]
LOOP = REPO / "examples" / "loop_state.py"


def _python(code_or_argv: str | list[str], run_dir: Path, cwd: Path) -> str:
    argv = [sys.executable, "-c", textwrap.dedent(code_or_argv)] if isinstance(code_or_argv, str) \
        else [sys.executable, *code_or_argv]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    env["SLURM_CKPT_DIR"] = str(run_dir)
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return proc.stdout


_DRAW = """
    import random, numpy as np, torch
    def draws():
        return [torch.rand(3).tolist(), np.random.rand(3).tolist(), [random.random() for _ in range(3)],
                torch.randn(2, generator=None).tolist()]
"""


def test_rng_state_restores_every_generator_in_a_new_process(tmp_path: Path) -> None:
    """torch, NumPy and Python random continue where the saving process left them."""
    saver = _DRAW + """
    import json
    from slurm_ckpt import Checkpointer, rng_state
    torch.manual_seed(3); np.random.seed(4); random.seed(5)
    draws()                                   # move every stream away from its seed
    with Checkpointer(scratch=False) as ckpt:
        ckpt.save({"rng": rng_state()}, step=1)
    print(json.dumps(draws()))
    """
    loader = _DRAW + """
    import json
    from slurm_ckpt import Checkpointer, set_rng_state
    torch.manual_seed(99); np.random.seed(99); random.seed(99)
    with Checkpointer(scratch=False) as ckpt:
        set_rng_state(ckpt.load_latest()["rng"])
    print(json.dumps(draws()))
    """
    expected = json.loads(_python(saver, tmp_path / "run", tmp_path))
    got = json.loads(_python(loader, tmp_path / "run", tmp_path))
    assert got == expected


def test_set_rng_state_refuses_unknown_keys() -> None:
    from slurm_ckpt import set_rng_state

    with pytest.raises(ValueError, match="unknown keys"):
        set_rng_state({"torch_cpu": None})


def test_resumable_sampler_order_depends_on_seed_and_epoch_and_starts_at_an_offset() -> None:
    s = ResumableSampler(50, seed=1)
    first = list(s)
    assert sorted(first) == list(range(50)) and first != list(range(50))
    assert list(ResumableSampler(50, seed=1)) == first  # no global generator involved
    s.set_epoch(1)
    second = list(s)
    assert second != first and sorted(second) == list(range(50))
    s.set_epoch(1, start=17)
    assert list(s) == second[17:] and len(s) == 33
    s.set_epoch(0)
    assert list(s) == first
    assert list(ResumableSampler(5, shuffle=False)) == [0, 1, 2, 3, 4]


def test_resumable_sampler_splits_an_epoch_across_ranks_like_distributed_sampler() -> None:
    ranks = [ResumableSampler(10, seed=2, num_replicas=3, rank=r) for r in range(3)]
    parts = [list(r) for r in ranks]
    assert all(len(p) == 4 == len(r) for p, r in zip(parts, ranks, strict=True))  # padded to 12
    assert set().union(*parts) == set(range(10))
    for r in ranks:
        r.set_epoch(0, start=2)
    assert [list(r) for r in ranks] == [p[2:] for p in parts]
    with pytest.raises(ValueError, match="rank 3"):
        ResumableSampler(10, num_replicas=3, rank=3)


@pytest.mark.slow
@pytest.mark.parametrize("loader", ["plain", "stateful"])
def test_loop_stopped_twice_mid_epoch_ends_bit_identical(tmp_path: Path, loader: str) -> None:
    """examples/loop_state.py: model, Adam, StepLR, GradScaler, RNGs, data position, 2 workers.

    Stopped after steps 17 and 29 (mid-epoch, 13 batches an epoch) and resumed
    each time in a new process: the same losses at every step and the same
    final weights as one run that never stopped.
    """
    if loader == "stateful":
        pytest.importorskip("torchdata.stateful_dataloader")
    common = [str(LOOP), "--steps", "40", "--every", "0", "--loader", loader]
    _python([*common, "--no-ckpt", "--out", "ref"], tmp_path / "unused", tmp_path)
    for stop in ("17", "29", "0"):
        out = _python([*common, "--out", "res", "--stop-at", stop], tmp_path / "run", tmp_path)
    assert "resumed from step 29 (epoch 2, batch 3)" in out
    ref, res = tmp_path / "ref", tmp_path / "res"
    steps = [json.loads(line)["step"] for line in (res / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 41))  # the history goes on; nothing is redone or skipped
    assert (res / "metrics.jsonl").read_text() == (ref / "metrics.jsonl").read_text()
    assert (res / "done.txt").read_text() == (ref / "done.txt").read_text()

"""The opt-in ``overlap`` snapshot and its guard; what ``auto`` chooses.

Every test holds the background copy on an event, so what the trainer does
while the copy is pending is fixed, not left to thread timing.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import slurm_ckpt.engine as engine_module
import slurm_ckpt.engine.snapshot.overlap as overlap_module
from slurm_ckpt import Checkpointer, SnapshotChanged
from slurm_ckpt.config import Config, EngineConfig, StorageConfig
from slurm_ckpt.engine import Engine
from slurm_ckpt.store.commit import commit
from slurm_ckpt.store.verify import verify_checkpoint

torch = pytest.importorskip("torch")

BLOCKED = 0.5
"""How long a thread that must be blocked is given to (wrongly) finish."""


def config(snapshot: str = "overlap") -> Config:
    return Config(storage=StorageConfig(retries=0, keep=10), engine=EngineConfig(snapshot=snapshot))


@pytest.fixture
def held(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """The background copy waits until the returned event is set."""
    go = threading.Event()
    real = overlap_module.copy_pairs

    def copy_pairs(pairs: Any) -> None:
        if threading.current_thread().name == "slurm-ckpt-copy":
            assert go.wait(60), "the test never released the copy"
        real(pairs)

    monkeypatch.setattr(overlap_module, "copy_pairs", copy_pairs)
    yield go
    go.set()


def blocked(fn: Callable[[], Any]) -> threading.Thread:
    """Run ``fn`` on a thread; return it after checking it is still blocked."""
    t = threading.Thread(target=fn)
    t.start()
    t.join(BLOCKED)
    assert t.is_alive(), f"{fn} returned while the copy was still pending"
    return t


def test_auto_copies_before_returning_and_forks_when_no_staging_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    # Only the modes that capture the state before save_async returns.
    state = {"w": torch.zeros(1 << 20)}
    jobs = [Engine().job(state, mode="auto")]
    monkeypatch.setattr(engine_module, "available_memory", lambda: 0)
    jobs.append(Engine().job(state, mode="auto"))
    for job in jobs:
        job.close()
    assert [job.mode for job in jobs] == ["copy", "fork"]
    assert Engine().cfg.snapshot == "auto"


def test_the_optimizer_waits_for_the_copy_and_the_checkpoint_holds_the_state_of_save_async(
    tmp_path: Path, held: threading.Event
) -> None:
    torch.manual_seed(0)
    # A 2 MiB weight, copied in the background; a bias and batch-norm buffers, copied at once.
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.BatchNorm1d(1024)).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(16, 512)).square().mean().backward()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    with Checkpointer(tmp_path, config=config(), distributed=False) as ck:
        h = ck.save_async({"model": model.state_dict()}, step=1)
        assert h.mode == "overlap"
        # The next forward pass changes the running statistics in place, and
        # without a version bump: only copying them before returning keeps them out.
        model(torch.randn(16, 512))
        assert not torch.equal(model[1].running_mean, want["1.running_mean"])
        stepper = blocked(opt.step)
        assert torch.equal(model[0].weight, want["0.weight"])
        held.set()
        stepper.join(60)
        h.wait(60)
    assert not torch.equal(model[0].weight, want["0.weight"])  # the step did run, after the copy
    with Checkpointer(tmp_path, config=config(), distributed=False) as ck:
        got = ck.load_latest()["model"]
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_a_change_outside_the_optimizer_fails_the_save_and_later_saves_copy(
    tmp_path: Path, held: threading.Event, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="slurm_ckpt")
    w = torch.arange(1 << 20, dtype=torch.float32)  # 4 MiB: copied in the background
    with Checkpointer(tmp_path, config=config(), distributed=False) as ck:
        ck.save({"w": w}, step=1)
        h = ck.save_async({"w": w}, step=2)
        w.add_(1)  # before the copy, and not through an optimizer
        held.set()
        with pytest.raises(SnapshotChanged, match="'w'"):
            h.wait(60)
        assert "changed in place while a save was copying it" in caplog.text
        assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-000000001"]
        want = w.clone()
        h = ck.save_async({"w": w}, step=3)
        assert h.mode == "copy"
        w.add_(1)
        h.wait(60)
        assert torch.equal(ck.load_latest()["w"], want)
        assert ck.loaded_step == 3


def test_tensors_without_a_version_counter_are_copied_before_save_async_returns(
    tmp_path: Path, held: threading.Event
) -> None:
    with torch.inference_mode():
        w = torch.zeros(1 << 20)  # large, but an inference tensor: no version to check
    job = Engine().job({"w": w}, mode="overlap")
    with torch.inference_mode():
        w.add_(1)
    held.set()
    try:
        path = commit(tmp_path, 1, job.write)
    finally:
        job.close()
    assert torch.equal(Engine().load(path, verify_checkpoint(path))["w"], torch.zeros(1 << 20))


def test_closing_a_job_waits_for_its_copy(held: threading.Event) -> None:
    # The staging buffer goes to the next save when the job closes: a copy
    # still running would write into that save's data.
    job = Engine().job({"w": torch.zeros(1 << 20)}, mode="overlap")
    closer = blocked(job.close)
    held.set()
    closer.join(60)
    assert job.captured.is_set()


def test_a_save_that_fails_early_is_done_only_after_its_copy(
    tmp_path: Path, held: threading.Event, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The next save reuses the staging buffer once this one is done: a copy
    # still running then would write into that save's data.
    ck = Checkpointer(tmp_path, config=config(), distributed=False)

    def fail(*_: Any, **__: Any) -> Any:
        raise OSError(5, "the storage failed before any write")

    monkeypatch.setattr(ck, "_commit", fail)
    h = ck.save_async({"w": torch.zeros(1 << 20)}, step=1)
    waiter = blocked(h._done.wait)
    held.set()
    waiter.join(60)
    with pytest.raises(OSError, match="before any write"):
        h.wait(60)
    ck.close()  # raised once, by wait()

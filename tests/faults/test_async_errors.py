"""A background save that fails never ends training silently: storage.on_async_error
decides, at the next save or the next step, whether it raises or warns; either way
the failure is logged and counted in the metrics."""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from slurm_ckpt import Checkpointer, SaveHandle, StorageError
from slurm_ckpt.store.layout import list_steps
from tests.faultfs import FaultFS
from tests.faults.helpers import check_state, state

EROFS = {"op": ["create", "mkdir"], "errno": "EROFS"}


def wait_done(h: object, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not h.done():  # type: ignore[attr-defined]
        assert time.monotonic() < deadline, "background save never finished"
        time.sleep(0.01)


def metric(ckpt: Checkpointer, name: str, **labels: str) -> float:
    assert ckpt.metrics.textfile is not None
    for fam in text_string_to_metric_families(ckpt.metrics.textfile.read_text()):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return 0.0


def test_raise_policy_surfaces_at_next_step_and_next_save(
    faultfs: FaultFS, fault_dir: Path, make_ckpt: Callable[..., Checkpointer],
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    ckpt = make_ckpt(fault_dir, on_async_error="raise")
    ckpt.save(state(1), step=1)
    with faultfs.faults(EROFS):
        h = ckpt.save_async(state(2), step=2)
        wait_done(h)
    # The next step boundary: the trainer's `if ckpt.preempted` raises the failure.
    with pytest.raises(StorageError) as ei:
        _ = ckpt.preempted
    assert ei.value.errno == errno.EROFS and "read-only" in ei.value.hint
    assert any("background save of step 2 failed" in r.getMessage() and r.levelno == logging.ERROR
               for r in caplog.records)  # fmt: skip
    assert metric(ckpt, "slurm_ckpt_save_failures_total", errno="EROFS") == 1
    # Raised once; the trainer that catches it goes on, and the next save works.
    assert ckpt.preempted is False
    with faultfs.faults(EROFS):
        h = ckpt.save_async(state(3), step=3)
        wait_done(h)
    with pytest.raises(StorageError):  # ...and at the next save, if no step check came first
        ckpt.save_async(state(4), step=4)
    ckpt.save(state(4), step=4)
    assert sorted(s for s, _ in list_steps(fault_dir)) == [1, 4]
    check_state(ckpt.load_latest(), 4)
    assert metric(ckpt, "slurm_ckpt_save_failures_total", errno="EROFS") == 2
    assert metric(ckpt, "slurm_ckpt_last_committed_step") == 4


def test_warn_policy_logs_and_training_goes_on(
    faultfs: FaultFS, fault_dir: Path, make_ckpt: Callable[..., Checkpointer],
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    ckpt = make_ckpt(fault_dir, on_async_error="warn")
    with faultfs.faults(EROFS):
        h = ckpt.save_async(state(1), step=1)
        wait_done(h)
    caplog.set_level(logging.WARNING, "slurm_ckpt")
    assert ckpt.preempted is False  # no exception: warned instead
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("background save of step 1 failed" in m and "on_async_error: warn" in m for m in warned)
    with faultfs.faults(EROFS):
        h = ckpt.save_async(state(2), step=2)
        wait_done(h)
    h3 = ckpt.save_async(state(3), step=3)  # the failed step 2 is warned about here, not raised
    h3.wait(timeout=30)
    check_state(ckpt.load_latest(), 3)
    assert metric(ckpt, "slurm_ckpt_save_failures_total", errno="EROFS") == 2
    # An explicit wait() always raises: the caller asked for that save's outcome.
    with faultfs.faults(EROFS):
        ckpt.save_async(state(4), step=4)
        with pytest.raises(StorageError):
            ckpt.wait()


def failed_save(faultfs: FaultFS, ckpt: Checkpointer, step: int) -> SaveHandle:
    """A save_async that fails for real (a read-only filesystem), and has finished."""
    with faultfs.faults(EROFS):
        h = ckpt.save_async(state(step), step=step)
        wait_done(h)
    return h


def logged(caplog: pytest.LogCaptureFixture, step: int, level: int) -> int:
    return sum(f"background save of step {step} failed" in r.getMessage() and r.levelno == level
               for r in caplog.records)  # fmt: skip


def test_an_error_that_handle_wait_raised_is_not_raised_again(
    faultfs: FaultFS, fault_dir: Path, make_ckpt: Callable[..., Checkpointer], caplog: pytest.LogCaptureFixture
) -> None:
    ckpt = make_ckpt(fault_dir, on_async_error="raise")
    h = failed_save(faultfs, ckpt, 1)
    with pytest.raises(StorageError):
        h.wait()
    with pytest.raises(StorageError):  # the handle has no path to give: asked again, it says why
        h.wait()
    assert ckpt.preempted is False  # the next step boundary does not raise it again,
    ckpt.wait()  # nor an explicit wait for every save,
    ckpt.save_async(state(2), step=2).wait(30)  # nor the next save
    h = failed_save(faultfs, ckpt, 3)
    with pytest.raises(StorageError):
        h.wait()
    ckpt.close()  # nor close()
    assert logged(caplog, 1, logging.ERROR) == 1 and logged(caplog, 3, logging.ERROR) == 1
    assert sorted(s for s, _ in list_steps(fault_dir)) == [2]


@pytest.mark.parametrize("first", ["next save", "preempted", "close", "ckpt.wait"])
def test_an_error_nobody_waited_for_is_raised_by_whichever_comes_first_and_only_there(
    faultfs: FaultFS, fault_dir: Path, make_ckpt: Callable[..., Checkpointer], first: str
) -> None:
    ckpt = make_ckpt(fault_dir, on_async_error="raise")
    failed_save(faultfs, ckpt, 1)
    assert ckpt.drain(30) is False  # says the save failed, and leaves its error to be raised
    surfaces: dict[str, Callable[[], object]] = {
        "next save": lambda: ckpt.save(state(2), step=2),
        "preempted": lambda: ckpt.preempted,
        "close": ckpt.close,
        "ckpt.wait": ckpt.wait,
    }
    with pytest.raises(StorageError):
        surfaces[first]()
    rest = [name for name in surfaces if name != first]
    if first == "close":
        rest.remove("next save")  # a closed Checkpointer refuses to save
    for name in rest:  # every one after the first is quiet
        surfaces[name]()


def test_warn_policy_logs_an_unwaited_error_once_and_never_raises_it(
    faultfs: FaultFS, fault_dir: Path, make_ckpt: Callable[..., Checkpointer], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "slurm_ckpt")
    ckpt = make_ckpt(fault_dir, on_async_error="warn")
    failed_save(faultfs, ckpt, 1)
    assert ckpt.preempted is False
    ckpt.close()
    assert logged(caplog, 1, logging.ERROR) == 1  # when it happened
    assert logged(caplog, 1, logging.WARNING) == 1  # where it would have been raised

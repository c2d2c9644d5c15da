"""Transient errors are retried with backoff, a bounded number of times; stalls are waited out."""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from slurm_ckpt import Checkpointer, StorageError
from slurm_ckpt.config import StorageConfig
from slurm_ckpt.fsinfo import mount_for
from slurm_ckpt.store.layout import list_steps
from slurm_ckpt.store.retry import RetryPolicy, retry_call
from tests.faultfs import FaultFS
from tests.faults.helpers import check_state, state


def test_eio_is_transient_only_on_network_and_fuse(fault_dir: Path, tmp_path: Path) -> None:
    cfg = StorageConfig()
    fuse = mount_for(fault_dir)
    assert fuse is not None and fuse.fstype == "fuse.faultfs" and fuse.is_network
    assert errno.EIO in RetryPolicy.for_path(cfg, fault_dir).errnos
    local = mount_for(tmp_path)
    assert local is not None and not local.is_network, local
    assert errno.EIO not in RetryPolicy.for_path(cfg, tmp_path).errnos
    assert RetryPolicy.for_path(cfg, tmp_path).errnos == {errno.ESTALE, errno.EAGAIN, errno.EINTR}


def test_retry_call_backs_off_and_gives_up() -> None:
    pol = RetryPolicy(retries=3, backoff=1.0, errnos=frozenset({errno.EAGAIN}))
    slept: list[float] = []
    calls = 0

    def flaky() -> str:
        nonlocal calls
        calls += 1
        raise OSError(errno.EAGAIN, "try again", "/x")

    with pytest.raises(StorageError) as ei:
        retry_call(flaky, pol, "saving", sleep=slept.append)
    assert calls == 4 and ei.value.errno == errno.EAGAIN and ei.value.filename == "/x"
    # Doubling with +-25% jitter: 1, 2, 4.
    for s, b in zip(slept, [1, 2, 4], strict=True):
        assert 0.75 * b <= s <= 1.25 * b, slept
    with pytest.raises(StorageError):  # not transient: no retry at all
        retry_call(lambda: (_ for _ in ()).throw(OSError(errno.EACCES, "no")), pol, "x", sleep=slept.append)
    assert len(slept) == 3


def test_estale_then_success_commits(
    faultfs: FaultFS, fault_dir: Path, make_ckpt: Callable[..., Checkpointer],
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    ckpt = make_ckpt(fault_dir, retries=3)
    caplog.set_level(logging.WARNING, "slurm_ckpt")
    with faultfs.faults({"op": "create", "path": "*/tensors-*", "errno": "ESTALE", "count": 2}):
        path = ckpt.save(state(5), step=5)
        assert faultfs.fired() == 2
    check_state(ckpt.load_latest(), 5)
    assert ckpt.loaded_path == path
    msgs = [r.getMessage() for r in caplog.records if "retry" in r.getMessage()]
    assert any("transient ESTALE" in m and "retry 1/3" in m for m in msgs), msgs
    assert [n for n in (faultfs.root / fault_dir.name).iterdir() if n.name.startswith(".tmp-")] == []


def test_eio_on_fuse_retried_then_given_up(
    faultfs: FaultFS, fault_dir: Path, make_ckpt: Callable[..., Checkpointer]
) -> None:
    ckpt = make_ckpt(fault_dir, retries=2)
    ckpt.save(state(1), step=1)
    with faultfs.faults({"op": "write", "path": "*/tensors-*", "errno": "EIO"}):
        with pytest.raises(StorageError) as ei:
            ckpt.save(state(2), step=2)
        assert faultfs.fired() == 3  # the first try and two retries, each a full fresh commit
    assert ei.value.errno == errno.EIO
    assert [s for s, _ in list_steps(fault_dir)] == [1]
    check_state(ckpt.load_latest(), 1)


def test_stall_is_waited_out_and_async_save_does_not_block_training(
    faultfs: FaultFS, fault_dir: Path, make_ckpt: Callable[..., Checkpointer]
) -> None:
    ckpt = make_ckpt(fault_dir)
    with faultfs.faults({"op": "fsync", "path": "*/tensors-*", "delay": 1.0}):
        t0 = time.monotonic()
        h = ckpt.save_async(state(7), step=7)
        # The stall is in the background writer: the trainer got control back before it ended.
        assert not h.done()
        path = h.wait(timeout=60)
        assert time.monotonic() - t0 >= 1.0
        assert faultfs.fired() == 1
    check_state(ckpt.load_latest(), 7)
    assert ckpt.loaded_path == path


def test_async_save_retries_with_a_fresh_write(
    faultfs: FaultFS, fault_dir: Path, make_ckpt: Callable[..., Checkpointer]
) -> None:
    """A retry runs the whole commit again: the staged state must be writable twice."""
    ckpt = make_ckpt(fault_dir, retries=2)
    with faultfs.faults({"op": "write", "path": "*/tensors-*", "errno": "EIO", "count": 1}):
        path = ckpt.save_async(state(8, kib=1024), step=8).wait(timeout=60)
        assert faultfs.fired() == 1
    check_state(ckpt.load_latest(), 8, kib=1024)
    assert ckpt.loaded_path == path

"""Full disks and quotas: prune per retention and retry once, never touching the newest
valid checkpoint; when that is not enough, fall back to the other tier."""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable
from pathlib import Path

import pytest

from slurm_ckpt import Checkpointer, NoSpace
from slurm_ckpt.store import RunDir, verify_checkpoint
from slurm_ckpt.store.layout import list_steps
from slurm_ckpt.store.retry import RetryPolicy, commit_resilient
from slurm_ckpt.store.writer import write_state
from tests.faultfs import FaultFS
from tests.faults.helpers import check_state, state

KIB = 256  # one checkpoint is ~270 KiB on tmpfs


def steps(d: Path) -> list[int]:
    return sorted(s for s, _ in list_steps(d))


def test_full_tmpfs_prunes_oldest_and_commits(
    make_tmpfs: Callable[..., Path], make_ckpt: Callable[..., Checkpointer],
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    d = make_tmpfs("1000k")  # room for three checkpoints, not four
    ckpt = make_ckpt(d / "run", keep=3)
    for s in (1, 2, 3):
        ckpt.save(state(s, KIB), step=s)
    caplog.set_level(logging.WARNING, "slurm_ckpt")
    for s in (4, 5, 6):
        ckpt.save(state(s, KIB), step=s)
        assert steps(d / "run") == [s - 2, s - 1, s]
    pruned = [r.getMessage() for r in caplog.records if "pruned" in r.getMessage()]
    assert len(pruned) == 3 and "No space left on device" in pruned[0], pruned
    check_state(ckpt.load_latest(), 6, KIB)
    assert [n for n in (d / "run").iterdir() if n.name.startswith(".tmp-")] == []


def test_full_disk_that_pruning_cannot_fix_keeps_the_newest(
    make_loopfs: Callable[..., Path], make_ckpt: Callable[..., Checkpointer]
) -> None:
    d = make_loopfs(8)  # a real ext4 on a loop device
    ckpt = make_ckpt(d / "run", keep=2)
    ckpt.save(state(1, KIB), step=1)
    ckpt.save(state(2, KIB), step=2)
    with pytest.raises(NoSpace) as ei:
        ckpt.save(state(3, 16 * 1024), step=3)  # 16 MiB into an 8 MiB filesystem
    e = ei.value
    assert e.errno == errno.ENOSPC and str(d / "run") in (e.filename or "") and "free space" in e.hint
    # Pruning per retention may drop step 1 (keep - 1 = 1 kept) but never step 2, the newest valid.
    assert steps(d / "run") == [2]
    verify_checkpoint(d / "run" / "step-000000002", full=True)
    check_state(ckpt.load_latest(), 2, KIB)
    assert [n for n in (d / "run").iterdir() if n.name.startswith(".tmp-")] == []


def test_edquot_prunes_and_retries_once(
    faultfs: FaultFS, fault_dir: Path, make_ckpt: Callable[..., Checkpointer]
) -> None:
    # This kernel has no quota support (no CONFIG_QUOTA): the fault fs returns the EDQUOT.
    ckpt = make_ckpt(fault_dir, keep=2)
    ckpt.save(state(1), step=1)
    ckpt.save(state(2), step=2)
    with faultfs.faults({"op": "write", "path": "*/tensors-*", "errno": "EDQUOT", "count": 1}):
        ckpt.save(state(3), step=3)
        assert faultfs.fired() == 1
    assert steps(fault_dir) == [2, 3]
    with faultfs.faults({"op": "write", "path": "*/tensors-*", "errno": "EDQUOT"}):
        with pytest.raises(NoSpace) as ei:
            ckpt.save(state(4), step=4)
        assert faultfs.fired() == 2  # the first attempt and the single retry after pruning
    assert ei.value.errno == errno.EDQUOT and "quota" in ei.value.hint
    assert steps(fault_dir) == [3]  # step 2 pruned for room; step 3, the newest valid, kept
    check_state(ckpt.load_latest(), 3)


def test_falls_back_to_the_other_tier(make_tmpfs: Callable[..., Path], tmp_path: Path) -> None:
    from slurm_ckpt.store.codec import encode_state

    full = make_tmpfs("200k")
    primary, other = RunDir(full / "run"), RunDir(tmp_path / "other")
    enc = encode_state(state(9, KIB))
    try:
        path = commit_resilient([primary, other], 9, lambda tmp: write_state(tmp, enc), keep=3,
                                policies=[RetryPolicy(retries=0)] * 2, nbytes=enc.nbytes)  # fmt: skip
    finally:
        primary.unlock()
        other.unlock()
    assert path == tmp_path / "other" / "step-000000009"
    verify_checkpoint(path, full=True)
    assert steps(full / "run") == [] and [n for n in (full / "run").iterdir() if n.name.startswith(".tmp")] == []


def test_pruning_spares_protected_checkpoints(make_tmpfs: Callable[..., Path], tmp_path: Path) -> None:
    """A checkpoint a drain is still copying is never pruned for room: the save goes
    to the other tier instead."""
    from slurm_ckpt.store.codec import encode_state

    d = make_tmpfs("1000k")
    fast, other = RunDir(d / "run"), RunDir(tmp_path / "other")
    try:
        for s in (1, 2, 3):
            enc = encode_state(state(s, KIB))
            commit_resilient([fast], s, lambda tmp, e=enc: write_state(tmp, e), keep=3, nbytes=enc.nbytes)
        enc = encode_state(state(4, KIB))
        copying = d / "run" / "step-000000001"
        path = commit_resilient([fast, other], 4, lambda tmp: write_state(tmp, enc), keep=3,
                                protect=lambda: [copying], nbytes=enc.nbytes)  # fmt: skip
    finally:
        fast.unlock()
        other.unlock()
    assert path == tmp_path / "other" / "step-000000004"
    assert steps(d / "run") == [1, 2, 3]

"""Each I/O fault a real filesystem throws, injected under a real save through FUSE.

For every fault: the save fails with a typed error carrying errno, path and a
hint; nothing is committed; no temp data is left behind; the previous
checkpoint still verifies and loads.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from slurm_ckpt import Checkpointer, NoSpace, StorageError
from slurm_ckpt.store import verify_checkpoint
from slurm_ckpt.store.layout import list_steps
from tests.faultfs import FaultFS
from tests.faults.helpers import check_state, state

# (rule, expected errno, words the hint must contain). retries=0 so the
# transient ones (EIO on FUSE, ESTALE) fail at once here; test_retry covers retrying.
FAULTS: list[tuple[str, dict[str, Any], int, str]] = [
    ("EIO on a tensor write", {"op": "write", "path": "*/tensors-*", "errno": "EIO"}, errno.EIO, "doctor"),
    ("ENOSPC on a write", {"op": "write", "errno": "ENOSPC"}, errno.ENOSPC, "free space"),
    ("EDQUOT on a write", {"op": "write", "errno": "EDQUOT"}, errno.EDQUOT, "quota"),
    ("EROFS on create", {"op": ["create", "mkdir"], "errno": "EROFS"}, errno.EROFS, "read-only"),
    ("ESTALE on create", {"op": "create", "errno": "ESTALE"}, errno.ESTALE, "stale"),
    ("EIO on fsync of data", {"op": "fsync", "path": "*/tensors-*", "errno": "EIO"}, errno.EIO, "doctor"),
    ("EIO on fsync of the manifest", {"op": "fsync", "path": "*/MANIFEST.json", "errno": "EIO"},
     errno.EIO, "doctor"),
    ("EIO on fsync of the temp dir", {"op": "fsyncdir", "path": "*/.tmp-step-*", "errno": "EIO"},
     errno.EIO, "doctor"),
    ("EIO on close (NFS reports write-back errors there)", {"op": "flush", "path": "*/state.json",
     "errno": "EIO"}, errno.EIO, "doctor"),
    ("ENOSPC on mkdir of the temp dir", {"op": "mkdir", "errno": "ENOSPC"}, errno.ENOSPC, "free space"),
    ("ETIMEDOUT on a write (soft NFS)", {"op": "write", "errno": "ETIMEDOUT"}, errno.ETIMEDOUT, "soft"),
    ("ENOTCONN on create (FUSE daemon gone)", {"op": "create", "errno": "ENOTCONN"}, errno.ENOTCONN,
     "remount"),
]  # fmt: skip


def tmp_dirs(fs: FaultFS, run: Path) -> list[str]:
    """In-flight dirs as the real directory under the mount has them (not the kernel's view)."""
    return [n for n in os.listdir(fs.root / run.name) if n.startswith(".tmp-")]


@pytest.mark.parametrize("what,rule,code,hint", FAULTS, ids=[f[0] for f in FAULTS])
def test_fault_fails_typed_and_leaves_no_trace(
    what: str, rule: dict[str, Any], code: int, hint: str,
    faultfs: FaultFS, fault_dir: Path, make_ckpt: Callable[..., Checkpointer],
) -> None:  # fmt: skip
    ckpt = make_ckpt(fault_dir, retries=0)
    good = ckpt.save(state(1), step=1)
    with faultfs.faults(rule):
        with pytest.raises(StorageError) as ei:
            ckpt.save(state(2), step=2)
        fired = faultfs.fired()
    e = ei.value
    print(f"{what}: {type(e).__name__}: {e}")
    assert e.errno == code, e
    assert isinstance(e, NoSpace) == (code in (errno.ENOSPC, errno.EDQUOT))
    assert e.filename and str(fault_dir) in e.filename, e.filename
    assert hint in e.hint, e.hint
    # The fault really happened, and nothing retried it (retries=0); for ESTALE the
    # kernel itself retries a lookup once with revalidation, hence up to 2.
    assert 1 <= fired <= (2 if code == errno.ESTALE else 1), fired
    # Never committed, and the temp data is gone from the real disk.
    assert [s for s, _ in list_steps(fault_dir)] == [1]
    assert tmp_dirs(faultfs, fault_dir) == []
    # The previous checkpoint is untouched and still the one a resume picks.
    verify_checkpoint(good, full=True)
    check_state(ckpt.load_latest(), 1)
    assert ckpt.loaded_step == 1
    # The storage recovers: the same step commits once the fault is gone.
    ckpt.save(state(2), step=2)
    check_state(ckpt.load_latest(), 2)


def test_short_writes_still_commit_correct_data(
    faultfs: FaultFS, fault_dir: Path, make_ckpt: Callable[..., Checkpointer]
) -> None:
    """A short write is legal (NFS, signals, FUSE); writers must loop, not truncate."""
    ckpt = make_ckpt(fault_dir, retries=0)
    with faultfs.faults({"op": "write", "short": True}):
        path = ckpt.save(state(3, kib=512), step=3)
        fired = faultfs.fired()
    assert fired >= 3  # state.json, tensors, manifest: every file was written short at least once
    verify_checkpoint(path, full=True)
    check_state(ckpt.load_latest(), 3, kib=512)


def test_parent_fsync_failure_after_rename(
    faultfs: FaultFS, fault_dir: Path, make_ckpt: Callable[..., Checkpointer]
) -> None:
    """The last step, fsync of the run dir after the rename, fails.

    The data and manifest were already durable, so the renamed checkpoint is
    complete; the save still reports the failure, because the rename itself may
    not survive a crash. Either way discovery only ever returns a valid one.
    """
    ckpt = make_ckpt(fault_dir, retries=0)
    ckpt.save(state(1), step=1)
    with faultfs.faults({"op": "fsyncdir", "path": f"/{fault_dir.name}", "errno": "EIO"}), \
            pytest.raises(StorageError) as ei:  # fmt: skip
        ckpt.save(state(2), step=2)
    assert ei.value.errno == errno.EIO and ei.value.filename == str(fault_dir)
    assert tmp_dirs(faultfs, fault_dir) == []
    for _, p in list_steps(fault_dir):
        verify_checkpoint(p, full=True)
    loaded = ckpt.load_latest()
    check_state(loaded, ckpt.loaded_step or 0)


def test_retention_failure_does_not_fail_a_committed_save(
    faultfs: FaultFS, fault_dir: Path, make_ckpt: Callable[..., Checkpointer],
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    ckpt = make_ckpt(fault_dir, keep=1, retries=0)
    ckpt.save(state(1), step=1)
    # Retention removes step 1 by renaming it aside first: that rename fails.
    with faultfs.faults({"op": "rename", "path": f"/{fault_dir.name}/step-*", "errno": "EIO"}):
        path = ckpt.save(state(2), step=2)
        assert faultfs.fired() == 1
    assert path == fault_dir / "step-000000002"
    assert any("checkpoint 2 committed, but retention failed" in r.getMessage() for r in caplog.records)
    assert sorted(s for s, _ in list_steps(fault_dir)) == [1, 2]
    check_state(ckpt.load_latest(), 2)
    ckpt.save(state(3), step=3)  # the next retention catches up
    assert [s for s, _ in list_steps(fault_dir)] == [3]


def test_an_io_error_partway_through_a_read_into_a_model_still_marks_it_changed(
    faultfs: FaultFS, fault_dir: Path, make_ckpt: Callable[..., Checkpointer],
) -> None:  # fmt: skip
    """Reads straight into a parameter write its memory before the error comes: a graph
    that saved it for backward must raise there, as after any change in place."""
    import torch

    torch.manual_seed(0)
    ckpt = make_ckpt(fault_dir, retries=0)
    ckpt.save({"model": torch.nn.Linear(2048, 1024, bias=False).state_dict()}, step=1)  # 8 MiB: read in place
    fresh = torch.nn.Linear(2048, 1024, bias=False)
    before, was = fresh.weight._version, fresh.weight.detach().clone()
    loss = fresh(torch.randn(2, 2048, requires_grad=True)).sum()  # saves the weight for backward
    # FUSE passes the reads on in pieces (48 for this file, here): the first 30 land.
    with faultfs.faults({"op": "read", "path": "*/tensors-*", "errno": "EIO", "after": 30}):
        with pytest.raises(StorageError) as ei:
            ckpt.load_latest(into={"model": dict(fresh.named_parameters())})
        assert faultfs.fired() >= 1 and ei.value.errno == errno.EIO
    assert not torch.equal(fresh.weight, was)  # partly read into
    assert fresh.weight._version > before
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()

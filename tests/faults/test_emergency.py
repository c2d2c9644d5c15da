"""Emergency save (the checkpoint signal arrived) while the durable tier fails:
commit to node-local scratch at once, never wait on the durable storage, and
leave the stage-out to the epilog."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

from slurm_ckpt import Checkpointer
from slurm_ckpt.config import Config, MetricsConfig, StorageConfig
from slurm_ckpt.node.job import Job
from slurm_ckpt.node.stageout import StageLimits, stage_out
from slurm_ckpt.store import verify_checkpoint
from slurm_ckpt.store.layout import list_steps
from tests.faultfs import FaultFS
from tests.faults.helpers import check_state, state

DURABLE_READ_ONLY = {"op": ["mkdir", "create", "rename", "write"], "errno": "EROFS"}


def steps(d: Path) -> list[int]:
    return sorted(s for s, _ in list_steps(d))


def test_emergency_save_goes_to_scratch_and_epilog_stages_it_out(
    faultfs: FaultFS, fault_dir: Path, make_tmpfs: Callable[..., Path], tmp_path: Path
) -> None:
    scratch = make_tmpfs("64M")  # the node-local scratch the prolog made
    cfg = Config(storage=StorageConfig(retries=1, retry_backoff=0.01),
                 metrics=MetricsConfig(textfile_dir=str(tmp_path / "prom")))  # fmt: skip
    ckpt = Checkpointer(fault_dir, config=cfg, scratch=scratch)
    try:
        assert ckpt.tiers is not None
        ckpt.save(state(1), step=1)
        ckpt.wait()
        assert steps(fault_dir) == [1]  # drained to the durable tier while it was healthy
        with faultfs.faults(DURABLE_READ_ONLY):
            os.kill(os.getpid(), signal.SIGUSR1)  # the wrapper forwards Slurm's --signal
            deadline = time.monotonic() + 10
            while not ckpt.preempted:
                assert time.monotonic() < deadline, "the signal never set the flag"
                time.sleep(0.01)
            path = ckpt.save(state(2), step=2)
            assert path == scratch / "ckpt" / "step-000000002"
            verify_checkpoint(path, full=True)
            # The copy to durable storage fails (read-only): not durable, and no exception,
            # because a checkpoint-and-stop is under way and scratch holds it.
            assert ckpt.drain(timeout=30) is False
            assert not ckpt.is_durable(2)
            assert faultfs.fired() >= 1
            ckpt.close()
    finally:
        ckpt.run_dir.unlock()
    assert steps(fault_dir) == [1]
    assert [n for n in os.listdir(faultfs.root / fault_dir.name) if n.startswith(".tmp-")] == []
    # The epilog, after the job: the durable storage is back and it stages the checkpoint out.
    job = Job.from_env({"SLURM_JOB_ID": "4242", "SLURM_JOB_UID": "0", "SLURM_JOB_GID": "0",
                        "SLURM_JOB_USER": "root"})  # fmt: skip
    limits = StageLimits((str(fault_dir),), frozenset({os.stat(scratch).st_dev}), 2**40)
    res = stage_out(scratch / "ckpt", None, job, timeout=60, limits=limits)
    assert res.status == "staged" and res.step == 2, res
    verify_checkpoint(fault_dir / "step-000000002", full=True)
    # The requeued job, on any node, resumes from the emergency checkpoint.
    with Checkpointer(fault_dir, config=cfg, scratch=False) as again:
        check_state(again.load_latest(), 2)
        assert again.loaded_step == 2


def test_full_scratch_falls_back_to_the_durable_tier(
    make_tmpfs: Callable[..., Path], tmp_path: Path
) -> None:
    scratch = make_tmpfs("300k")  # node-local scratch too small for one checkpoint
    cfg = Config(storage=StorageConfig(retries=0), metrics=MetricsConfig())
    with Checkpointer(tmp_path / "durable", config=cfg, scratch=scratch) as ckpt:
        assert ckpt.tiers is not None
        path = ckpt.save(state(3, kib=1024), step=3)
        assert path == tmp_path / "durable" / "step-000000003"
        assert ckpt.is_durable(3)
        check_state(ckpt.load_latest(), 3, kib=1024)
    assert steps(scratch / "ckpt") == []
    assert [n for n in os.listdir(scratch / "ckpt") if n.startswith(".tmp-")] == []

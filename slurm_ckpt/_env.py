"""The one place that reads the process environment for job context."""

from __future__ import annotations

import getpass
import os
from pathlib import Path

from .config import Config, job_dir_name

__all__ = ["default_run_dir", "job_id", "scratch_dir", "task_rank", "user_name"]


def job_id() -> str:
    """``JOBID`` or, for an array task, ``JOBID_TASKID`` (the id scontrol requeues)."""
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    task = os.environ.get("SLURM_ARRAY_TASK_ID")
    if array_job and task:
        return f"{array_job}_{task}"
    return os.environ.get("SLURM_JOB_ID", "")


def task_rank() -> tuple[int, int, bool]:
    """``SLURM_PROCID`` and ``SLURM_NTASKS`` (0 and 1 where unset or unreadable), and
    whether ``SLURM_PROCID`` is set at all (this process is a Slurm task)."""
    try:
        rank = int(os.environ.get("SLURM_PROCID", "0"))
        world = int(os.environ.get("SLURM_NTASKS", "1"))
    except ValueError:
        rank, world = 0, 1
    return rank, world, "SLURM_PROCID" in os.environ


def user_name() -> str:
    return os.environ.get("SLURM_JOB_USER") or getpass.getuser()


def default_run_dir(cfg: Config) -> Path:
    """$SLURM_CKPT_DIR, else <storage.root>/<user>/job_<id>, else ./checkpoints."""
    explicit = os.environ.get("SLURM_CKPT_DIR")
    if explicit:
        return Path(explicit)
    jid = job_id()
    if cfg.storage.root and jid:
        return Path(cfg.storage.root) / user_name() / job_dir_name(jid)
    return Path("checkpoints")


def scratch_dir() -> Path | None:
    """$SLURM_CKPT_SCRATCH: the job's node-local scratch (the prolog makes it), or None."""
    value = os.environ.get("SLURM_CKPT_SCRATCH")
    return Path(value) if value else None

"""What a Slurm task learns about its job from the environment.

Slurm exports these to every task; reading them costs nothing, unlike a call
to slurmctld. ``SLURM_RESTART_COUNT`` is only set once the job has been
requeued, so its absence means 0.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["SlurmEnv"]


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    try:
        return int(env.get(name, "") or default)
    except ValueError:
        return default


@dataclass(frozen=True)
class SlurmEnv:
    """The job context of this process, from ``SLURM_*`` variables."""

    job_id: str = ""
    """``SLURM_JOB_ID``: unique per array task too."""
    array_job_id: str = ""
    array_task_id: str = ""
    procid: int = 0
    """Global rank of this task in the step (``SLURM_PROCID``)."""
    ntasks: int = 1
    localid: int = 0
    restart_count: int = 0
    """How many times the job was requeued before this run."""
    node: str = ""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> SlurmEnv:
        env = os.environ if env is None else env
        return cls(
            job_id=env.get("SLURM_JOB_ID", "") or env.get("SLURM_JOBID", ""),
            array_job_id=env.get("SLURM_ARRAY_JOB_ID", ""),
            array_task_id=env.get("SLURM_ARRAY_TASK_ID", ""),
            procid=_int(env, "SLURM_PROCID", 0),
            ntasks=_int(env, "SLURM_NTASKS", 0) or _int(env, "SLURM_NPROCS", 1),
            localid=_int(env, "SLURM_LOCALID", 0),
            restart_count=_int(env, "SLURM_RESTART_COUNT", 0),
            node=env.get("SLURMD_NODENAME", ""),
        )

    @property
    def in_job(self) -> bool:
        return bool(self.job_id)

    @property
    def requeue_id(self) -> str:
        """The id ``scontrol requeue`` needs: ``ARRAYJOB_TASK`` for an array task."""
        if self.array_job_id and self.array_task_id:
            return f"{self.array_job_id}_{self.array_task_id}"
        return self.job_id

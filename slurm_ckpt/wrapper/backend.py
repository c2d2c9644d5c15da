"""Where the wrapper runs: inside a Slurm job, or locally (``--local``).

The supervisor asks a backend for the job's state and end time and, on rank 0,
to requeue. Locally there is no scheduler: no end time, no state, and the
"requeue" is a restart of the command in place, done by the caller.
"""

from __future__ import annotations

import logging
from typing import Protocol

from ..errors import SlurmError
from ..slurm import JobInfo, RequeueResult, SlurmEnv, requeue, show_job

__all__ = ["JobBackend", "LocalJob", "SlurmJob"]

log = logging.getLogger("slurm_ckpt")


class JobBackend(Protocol):
    local: bool

    def job_info(self) -> JobInfo | None:
        """The job as the scheduler sees it now, or None if unknown."""

    def requeue(self, budget: float) -> RequeueResult:
        """Requeue the job; raises SlurmError (or SlurmCommandMissing)."""


class SlurmJob:
    local = False

    def __init__(self, env: SlurmEnv, *, query_timeout: float = 10.0) -> None:
        self.env = env
        self.query_timeout = query_timeout

    def job_info(self) -> JobInfo | None:
        try:
            return show_job(self.env.job_id, timeout=self.query_timeout)
        except SlurmError as e:
            log.warning("cannot read job %s from Slurm: %s", self.env.job_id, e)
            return None

    def requeue(self, budget: float) -> RequeueResult:
        return requeue(self.env.requeue_id, numeric_id=self.env.job_id, budget=budget)


class LocalJob:
    local = True

    def job_info(self) -> JobInfo | None:
        return None

    def requeue(self, budget: float) -> RequeueResult:  # pragma: no cover - never called
        raise SlurmError("local mode restarts the command instead of requeueing")

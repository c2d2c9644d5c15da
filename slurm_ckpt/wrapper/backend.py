"""Where the wrapper runs: inside a Slurm job, or locally (``--local``).

The supervisor asks a backend for the job's state and end time and, on rank 0,
to requeue. Locally there is no scheduler: no end time, no state, and the
"requeue" is a restart of the command in place, done by the caller.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from ..errors import SlurmError
from ..slurm import (
    JobInfo,
    RequeueResult,
    SlurmEnv,
    hostnames,
    partition_nodes,
    requeue,
    show_job,
    update_pending,
)

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

    def nodes(self, env: dict[str, str]) -> tuple[str, ...]:
        """The job's nodes, from ``SLURM_JOB_NODELIST`` (raises SlurmError)."""
        return hostnames(env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or self.env.node)

    def placement(self, info: JobInfo | None) -> dict[str, Any]:
        """The job's placement as :class:`~.policy.HangFacts` fields: ExcNodeList,
        ReqNodeList, the partition's node count, NumNodes and NumTasks (0 where unknown)."""
        f = (info.fields if info is not None else None) or {}
        return {
            "excluded": hostnames(f.get("ExcNodeList", "")),
            "required": hostnames(f.get("ReqNodeList", "")),
            "partition_nodes": partition_nodes(f["Partition"]) if f.get("Partition") else 0,
            "num_nodes": _leading_int(f.get("NumNodes", "")),
            "num_tasks": _leading_int(f.get("NumTasks", "")),
        }

    def exclude(self, fields: dict[str, str]) -> None:
        """Set ``fields`` (ExcNodeList, ReqNodeList, NumNodes, NumTasks) on the job requeued a moment ago."""
        update_pending(self.env.requeue_id, fields)


def _leading_int(text: str) -> int:
    """``2`` from ``2`` or ``2-2`` (a pending job's node range); 0 if none."""
    digits = text.split("-")[0]
    return int(digits) if digits.isdigit() else 0


class LocalJob:
    local = True

    def job_info(self) -> JobInfo | None:
        return None

    def requeue(self, budget: float) -> RequeueResult:  # pragma: no cover - never called
        raise SlurmError("local mode restarts the command instead of requeueing")

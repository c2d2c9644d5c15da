"""Requeue a job: pyslurm when it imports, else ``scontrol requeue``.

Outcomes, each a :class:`RequeueResult`:

* ``ok``: slurmctld accepted the requeue.
* ``ok`` with ``already=True``: "Job is pending execution", i.e. Slurm had
  requeued it already (``PreemptMode=REQUEUE`` does that on preemption).
  That is success, not an error.
* ``SlurmCommandMissing``: neither pyslurm nor scontrol is on the node; the
  caller falls back to exiting with slurm.conf's ``RequeueExit`` code.
* :class:`SlurmError` for anything else, with scontrol's message and a hint.

Transient controller trouble (timeouts, "not responding") is retried until the
time budget runs out; a refusal ("presently disabled": the job was submitted
with ``--no-requeue``) is not.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from ..errors import SlurmError
from .command import SlurmCommandMissing, run_slurm

__all__ = ["RequeueResult", "requeue", "update_pending"]

log = logging.getLogger("slurm_ckpt")

_PENDING = "pending execution"
_TRANSIENT = ("timed out", "not responding", "try again", "transient", "unable to contact")
_HINTS = {
    "presently disabled": "the job cannot be requeued: submit it with --requeue "
    "(or set JobRequeue=1 in slurm.conf)",
    "batch job": "only batch jobs can be requeued: submit with sbatch, not salloc/srun",
    "access denied": "you may only requeue your own jobs",
    "invalid job id": "the job id is wrong or the job has already been purged",
}


@dataclass(frozen=True)
class RequeueResult:
    job_id: str
    via: str
    """"pyslurm" or "scontrol"."""
    already: bool = False
    """Slurm had already requeued the job ("Job is pending execution")."""
    attempts: int = 1


def requeue(
    job_id: str, *, numeric_id: str = "", budget: float = 30.0, pause: float = 1.0
) -> RequeueResult:
    """Requeue ``job_id`` (``JOBID`` or ``ARRAYJOB_TASK``) within ``budget`` seconds.

    ``numeric_id`` is the task's own ``SLURM_JOB_ID``, which pyslurm needs for
    an array task; it defaults to ``job_id``.
    """
    res = _requeue_pyslurm(numeric_id or job_id)
    if res is not None:
        return res
    end = time.monotonic() + budget
    attempt = 0
    while True:
        attempt += 1
        left = end - time.monotonic()
        try:
            out = run_slurm("scontrol", "requeue", job_id, timeout=max(left, 1.0))
        except SlurmCommandMissing:
            raise
        except SlurmError as e:  # our own timeout: transient by nature
            message = str(e)
        else:
            if out.ok:
                return RequeueResult(job_id, "scontrol", attempts=attempt)
            message = out.describe()
            if _PENDING in message.lower():
                return RequeueResult(job_id, "scontrol", already=True, attempts=attempt)
        low = message.lower()
        hint = next((h for k, h in _HINTS.items() if k in low), "")
        transient = any(t in low for t in _TRANSIENT)
        if not transient or time.monotonic() + pause >= end:
            raise SlurmError(f"requeue of job {job_id} failed: {message}" + (f"; {hint}" if hint else ""))
        log.warning("requeue of job %s failed (%s); retrying", job_id, message)
        time.sleep(pause)  # back-off between RPCs to a struggling slurmctld, not a sync wait


def _requeue_pyslurm(job_id: str) -> RequeueResult | None:
    """Requeue through pyslurm, or None when pyslurm is not importable."""
    try:
        import pyslurm
    except ImportError:
        return None
    try:
        job: Any = pyslurm.Job(int(job_id))
        job.requeue()
    except Exception as e:  # pyslurm raises RPCError; its module path varies by release
        if _PENDING in str(e).lower():
            return RequeueResult(job_id, "pyslurm", already=True)
        log.warning("pyslurm requeue of %s failed (%s); trying scontrol", job_id, e)
        return None
    return RequeueResult(job_id, "pyslurm")


def update_pending(job_id: str, fields: dict[str, str], *, timeout: float = 10.0) -> None:
    """``scontrol update JobId=<id> Key=Value…`` on a job that is pending again.

    Slurm 22.05 refuses ``ExcNodeList`` and ``NumNodes`` on a running job ("Job
    is no longer pending execution") and takes them once ``scontrol requeue``
    has made it pending (measured: a requeued two-node job given
    ``ExcNodeList=node1 NumNodes=1 NumTasks=1`` then ran on one other node).
    """
    out = run_slurm("scontrol", "update", f"JobId={job_id}", *(f"{k}={v}" for k, v in fields.items()),
                    timeout=timeout)  # fmt: skip
    if not out.ok:
        raise SlurmError(f"cannot update job {job_id} ({' '.join(f'{k}={v}' for k, v in fields.items())}): "
                         f"{out.describe()}")  # fmt: skip

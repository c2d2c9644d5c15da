"""Slurm: the job's context from ``SLURM_*``, job info and requeue.

pyslurm is used when it imports; the ``scontrol`` CLI is the tested default
(pyslurm cannot be built against Slurm 22.05 from PyPI). Every command runs
through :mod:`slurm_ckpt.slurm.command`, the one seam.
"""

from __future__ import annotations

from .command import CommandResult, SlurmCommandMissing, binary, run_slurm
from .env import SlurmEnv
from .job import (
    JobInfo,
    hostnames,
    parse_duration,
    parse_show_job,
    parse_time,
    partition_nodes,
    show_job,
)
from .requeue import RequeueResult, requeue, update_pending

__all__ = [
    "CommandResult",
    "JobInfo",
    "RequeueResult",
    "SlurmCommandMissing",
    "SlurmEnv",
    "binary",
    "hostnames",
    "parse_duration",
    "parse_show_job",
    "parse_time",
    "partition_nodes",
    "requeue",
    "run_slurm",
    "show_job",
    "update_pending",
]

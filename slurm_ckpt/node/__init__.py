"""Node hooks: what the prolog, epilog and TaskProlog do on each compute node.

The shims in ``prolog/`` and ``epilog/`` call ``slurm-ckpt node prolog|epilog``
as root, and ``slurm-ckpt node taskprolog`` as the user; the wrapper calls
:func:`join_io_cgroup`. torch is never imported on these paths: hooks run
for every job and must start fast.
"""

from __future__ import annotations

from .cgroup import join_io_cgroup
from .epilog import run_epilog
from .job import InvalidJob, Job
from .ledger import Grant, Ledger
from .prolog import run_prolog
from .report import JobReport
from .stageout import StageResult
from .taskprolog import task_prolog

__all__ = [
    "Grant",
    "InvalidJob",
    "Job",
    "JobReport",
    "Ledger",
    "StageResult",
    "join_io_cgroup",
    "run_epilog",
    "run_prolog",
    "task_prolog",
]

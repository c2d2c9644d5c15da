"""Node hooks: what the prolog, epilog and TaskProlog do on each compute node.

The shims in ``prolog/`` and ``epilog/`` call ``slurm-ckpt node prolog|epilog``
as root, and ``slurm-ckpt node taskprolog`` as the user; the wrapper calls
:func:`join_io_cgroup`. torch is never imported on these paths: hooks run
for every job and must start fast, so each name here is imported on first
use, and a hook loads only the modules it runs.
"""

from __future__ import annotations

import importlib
import typing

if typing.TYPE_CHECKING:
    from .cgroup import join_io_cgroup
    from .epilog import run_epilog
    from .job import InvalidJob, Job
    from .ledger import Grant, Ledger
    from .prolog import run_prolog
    from .report import JobReport
    from .stageresult import StageResult
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

_HOME = {
    "Grant": "ledger",
    "InvalidJob": "job",
    "Job": "job",
    "JobReport": "report",
    "Ledger": "ledger",
    "StageResult": "stageresult",
    "join_io_cgroup": "cgroup",
    "run_epilog": "epilog",
    "run_prolog": "prolog",
    "task_prolog": "taskprolog",
}


def __getattr__(name: str) -> typing.Any:
    if name in _HOME:
        value = getattr(importlib.import_module(f".{_HOME[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})

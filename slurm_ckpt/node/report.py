"""The prolog's report for one job: its scratch, I/O cgroup, warnings and check figures.

Written by the prolog to ``<scratch.base>/.slurm-ckpt/job_<id>.json``
(owned by the job's user, mode 0400, in a root-owned dir the user cannot
list); read by the TaskProlog, which turns it into ``export``/``print`` lines
for the task, and by ``slurm-ckpt doctor``. The epilog deletes it and never
trusts it.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .escape import escape

__all__ = ["JobReport", "report_path", "task_prolog_lines"]


def report_path(state_dir: Path, job_id: str) -> Path:
    return state_dir / f"job_{job_id}.json"


@dataclass
class JobReport:
    job_id: str
    scratch: str | None = None
    size: int = 0
    asked: int = 0
    enforce: str = "none"
    io_cgroup: str | None = None
    warnings: list[str] = field(default_factory=list)
    checks: dict[str, Any] = field(default_factory=dict)
    time: float = field(default_factory=time.time)

    def write(self, state_fd: int, uid: int, gid: int) -> None:
        """Write atomically into the state dir, readable only by the job's user."""
        name = f"job_{self.job_id}.json"
        tmp = f".{name}.{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o400, dir_fd=state_fd)  # fmt: skip
        try:
            os.write(fd, json.dumps(asdict(self), indent=1).encode())
            os.fchown(fd, uid, gid)
            os.fchmod(fd, 0o400)
        finally:
            os.close(fd)
        os.rename(tmp, name, src_dir_fd=state_fd, dst_dir_fd=state_fd)

    @classmethod
    def read(cls, path: Path) -> JobReport | None:
        try:
            data = json.loads(path.read_bytes())
            return cls(**data)
        except (OSError, ValueError, TypeError):
            return None


def _line(text: str) -> str:
    # One line each: slurmstepd reads the TaskProlog's output line by line, and a
    # newline smuggled in through a job field must not become an `export`.
    return escape(text).strip()


def task_prolog_lines(report: JobReport | None, first_task: bool) -> list[str]:
    """``export NAME=value`` and ``print ...`` lines for slurmstepd.

    Warnings are printed by the first task of each node only, so an 8-task
    step does not repeat them eight times.
    """
    if report is None:
        return []
    out = []
    if report.scratch:
        out.append(f"export SLURM_CKPT_SCRATCH={_line(report.scratch)}")
    if report.io_cgroup:
        out.append(f"export SLURM_CKPT_IO_CGROUP={_line(report.io_cgroup)}")
    if first_task:
        out += [f"print slurm-ckpt: warning: {_line(w)}" for w in report.warnings]
    return out

"""The TaskProlog: runs as the job's user for each task; prints lines slurmstepd applies.

``export SLURM_CKPT_SCRATCH=...`` (and ``SLURM_CKPT_IO_CGROUP``) set the
task's environment; ``print ...`` lines reach the job's output: that is how
the prolog's warnings reach the user.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

from ..config import job_dir_name, load_config
from ..errors import ConfigError
from .report import SCRATCH_COPY, JobReport, report_path, task_prolog_lines
from .scratch import STATE_DIR

__all__ = ["task_prolog"]


def task_prolog(env: Mapping[str, str] | None = None) -> list[str]:
    """The lines for this task; [] when the prolog left no report. Never raises for bad input."""
    env = os.environ if env is None else env
    job_id = env.get("SLURM_JOB_ID", "")
    if not re.fullmatch(r"[0-9]{1,18}", job_id):
        return []
    try:
        cfg = load_config(env=env)
    except ConfigError as e:
        return [f"print slurm-ckpt: warning: config error, no scratch info: {e}".replace("\n", " ")]
    base = Path(cfg.scratch.base)
    # Root's report is readable by this user through an ACL, or else as a copy in the job's scratch.
    report = JobReport.read(report_path(base / STATE_DIR, job_id)) or JobReport.read(
        base / job_dir_name(job_id) / SCRATCH_COPY)
    return task_prolog_lines(report, first_task=env.get("SLURM_LOCALID", "0") == "0")

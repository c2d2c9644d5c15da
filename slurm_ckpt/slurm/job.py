"""A job as slurmctld sees it: ``scontrol show job -o`` parsed into :class:`JobInfo`.

Slurm 22.05's scontrol has no ``--json``, so we parse its one-line ``Key=Value``
form. Values may contain spaces (``JobName=my run``, ``Command=/a b/train.sh``);
keys always start with an upper-case letter, so a value runs until the next
`` Key=``. A free-text value that itself contains `` Upper=`` (a hostile
``--comment``) can still fool that split; the fields we rely on come before the
free-text ones and are unaffected.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from ..errors import SlurmError
from .command import run_slurm

__all__ = ["JobInfo", "parse_duration", "parse_show_job", "parse_time", "show_job"]

_KEY = re.compile(r"(?:^|\s)([A-Z][A-Za-z0-9_:/]*)=")
_NONE = {"", "Unknown", "None", "N/A", "(null)", "UNLIMITED", "Partition_Limit", "NOT_SET", "INFINITE"}


def parse_show_job(text: str) -> dict[str, str]:
    """The ``Key=Value`` fields of the first record in ``scontrol show job -o`` output."""
    line = next((ln for ln in text.splitlines() if ln.strip()), "")
    matches = list(_KEY.finditer(line))
    fields: dict[str, str] = {}
    for i, m in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(line)
        fields.setdefault(m.group(1), line[m.end() : end].strip())
    return fields


def parse_time(value: str) -> float | None:
    """Epoch seconds of a Slurm timestamp (``2024-05-09T07:35:25``, local time), or None."""
    if value in _NONE:
        return None
    try:
        return datetime.strptime(value, "%Y-%m-%dT%H:%M:%S").timestamp()
    except ValueError:
        return None


def parse_duration(value: str) -> int | None:
    """Seconds of a Slurm duration: ``[D-]HH:MM:SS``, ``MM:SS`` or minutes; None if unlimited."""
    if value in _NONE:
        return None
    days = 0
    try:
        if "-" in value:
            d, value = value.split("-", 1)
            days = int(d)
        parts = [int(p) for p in value.split(":")]
    except ValueError:
        return None
    if len(parts) == 1:  # bare minutes, as sbatch --time=M is shown by some tools
        h, m, s = 0, parts[0], 0
    elif len(parts) == 2:
        h, m, s = 0, *parts
    else:
        h, m, s = parts[-3:]
    return ((days * 24 + h) * 60 + m) * 60 + s


@dataclass(frozen=True)
class JobInfo:
    """The fields the wrapper decides with. ``fields`` keeps every raw value."""

    job_id: str
    state: str
    """JobState: RUNNING, CANCELLED, TIMEOUT, PREEMPTED, PENDING, REQUEUED, COMPLETING…"""
    reason: str = ""
    end_time: float | None = None
    """When Slurm will end the job (epoch seconds); None without a time limit.
    After a scancel it is the cancel time."""
    start_time: float | None = None
    time_limit: int | None = None
    """Seconds; None when unlimited."""
    restarts: int = 0
    requeue_allowed: bool = True
    array_job_id: str = ""
    array_task_id: str = ""
    fields: dict[str, str] | None = None

    @classmethod
    def from_fields(cls, fields: dict[str, str]) -> JobInfo:
        if "JobId" not in fields or "JobState" not in fields:
            raise SlurmError(f"unexpected scontrol output, no JobId/JobState in {sorted(fields)}")

        def _int(key: str) -> int:
            try:
                return int(fields.get(key, "0"))
            except ValueError:
                return 0

        array_job = fields.get("ArrayJobId", "")
        array_task = fields.get("ArrayTaskId", "")
        return cls(
            job_id=fields["JobId"],
            state=fields["JobState"],
            reason=fields.get("Reason", ""),
            end_time=parse_time(fields.get("EndTime", "")),
            start_time=parse_time(fields.get("StartTime", "")),
            time_limit=parse_duration(fields.get("TimeLimit", "")),
            restarts=_int("Restarts"),
            requeue_allowed=fields.get("Requeue", "1") != "0",
            array_job_id="" if array_job in _NONE else array_job,
            array_task_id="" if array_task in _NONE else array_task,
            fields=fields,
        )

    @property
    def seconds_left(self) -> float | None:
        return None if self.end_time is None else self.end_time - time.time()

    @property
    def limit_time(self) -> float | None:
        """StartTime + TimeLimit: when the time limit ends the run (None if unlimited).

        Unlike EndTime, a scancel does not move it. Suspended time is not added.
        """
        if self.start_time is None or self.time_limit is None:
            return None
        return self.start_time + self.time_limit


def show_job(job_id: str, *, timeout: float = 20.0) -> JobInfo:
    """Ask slurmctld about ``job_id``: pyslurm when it imports, else ``scontrol show job -o``."""
    info = _show_job_pyslurm(job_id)
    if info is not None:
        return info
    res = run_slurm("scontrol", "show", "job", "-o", job_id, timeout=timeout)
    if not res.ok:
        raise SlurmError(f"cannot read job {job_id}: {res.describe()}")
    return JobInfo.from_fields(parse_show_job(res.stdout))


def _show_job_pyslurm(job_id: str) -> JobInfo | None:
    """pyslurm's view of the job, or None when pyslurm is absent or answers oddly.

    pyslurm's attribute types changed between releases; anything unexpected
    falls back to scontrol rather than guessing.
    """
    try:
        import pyslurm

        job: Any = pyslurm.Job.load(int(job_id))
        end = job.end_time
        end_time = end.timestamp() if isinstance(end, datetime) else (float(end) if end else None)
        limit = getattr(job, "time_limit", None)  # minutes in pyslurm
        return JobInfo(
            job_id=str(job_id),
            state=str(job.state),
            reason=str(getattr(job, "state_reason", "") or ""),
            end_time=end_time,
            time_limit=int(limit) * 60 if isinstance(limit, int | float) and limit else None,
            restarts=int(getattr(job, "requeue_count", 0) or 0),
            requeue_allowed=bool(getattr(job, "is_requeueable", True)),
            array_job_id=str(getattr(job, "array_id", "") or ""),
            array_task_id=str(getattr(job, "array_task_id", "") or ""),
        )
    except Exception:  # any pyslurm trouble means: use scontrol
        return None


def hostnames(expr: str, *, timeout: float = 10.0) -> tuple[str, ...]:
    """``node[1-3],gpu7`` -> ``("node1", "node2", "node3", "gpu7")`` (``scontrol show hostnames``)."""
    if expr.strip() in _NONE:
        return ()
    res = run_slurm("scontrol", "show", "hostnames", expr, timeout=timeout)
    if not res.ok:
        raise SlurmError(f"cannot expand node list {expr!r}: {res.describe()}")
    return tuple(res.stdout.split())


def partition_nodes(name: str, *, timeout: float = 10.0) -> int:
    """TotalNodes of partition ``name`` (0 when Slurm does not say)."""
    res = run_slurm("scontrol", "show", "partition", "-o", name, timeout=timeout)
    if not res.ok:
        raise SlurmError(f"cannot read partition {name!r}: {res.describe()}")
    try:
        return int(parse_show_job(res.stdout).get("TotalNodes", "0"))
    except ValueError:
        return 0

"""``slurm-ckpt run`` in Slurm mode: rank, array ids, requeue outcomes, cancel detection.

Real wrapper, real child, real signals; Slurm is replaced at its one seam
(``$SCONTROL``) by a stand-in executable that answers ``show job -o`` with a
line in real 22.05 format and records ``requeue`` calls, so each outcome
(pending execution, no scontrol, cancelled, requeued by Slurm itself) can be
set up. The same flows against a real cluster are the end-to-end tests in
tests/slurm.
"""

from __future__ import annotations

import time
from datetime import datetime
from pathlib import Path

import pytest

from tests.integration.test_wrapper import CHILD, Run, start


def _stamp(t: float) -> str:
    return datetime.fromtimestamp(t).strftime("%Y-%m-%dT%H:%M:%S")


@pytest.fixture
def slurm(tmp_path: Path) -> Path:
    d = tmp_path / "fake"
    d.mkdir()
    exe = d / "scontrol"
    exe.write_text(
        "#!/bin/bash\n"
        f'd="{d}"\n'
        'echo "$*" >> "$d/calls"\n'
        'case "$1" in\n'
        '  show) cat "$d/show" ;;\n'
        '  requeue) if [ -f "$d/requeue_err" ]; then cat "$d/requeue_err" >&2; exit 1; fi ;;\n'
        "esac\n"
    )
    exe.chmod(0o755)
    job_line(d)
    return d


def job_line(d: Path, *, state: str = "RUNNING", started_ago: float = 30, limit_s: int = 600,
             restarts: int = 0) -> None:  # fmt: skip
    now = time.time()
    start = now - started_ago
    (d / "show").write_text(
        f"JobId=77 JobName=train UserId=u(1) GroupId=g(1) JobState={state} Reason=None "
        f"Dependency=(null) Requeue=1 Restarts={restarts} BatchFlag=1 Reboot=0 ExitCode=0:0 "
        f"TimeLimit=00:{limit_s // 60:02d}:00 StartTime={_stamp(start)} "
        f"EndTime={_stamp(start + limit_s)} Partition=debug NodeList=n1\n"
    )


def calls(d: Path) -> list[str]:
    return (d / "calls").read_text().splitlines() if (d / "calls").exists() else []


def run_in_job(tmp_path: Path, d: Path, *flags: str, env: dict[str, str] | None = None,
               child: tuple[str, ...] = ("--steps", "100000", "--step-time", "0.002")) -> Run:  # fmt: skip
    job_env = {"SLURM_JOB_ID": "77", "SLURM_PROCID": "0", "SLURM_NTASKS": "1",
               "SCONTROL": str(d / "scontrol"), **(env or {})}  # fmt: skip
    return start(tmp_path, ["--preempt-after", "0.3", *flags], [*CHILD, *child], **job_env).finish()


def test_rank0_requeues_once_with_the_end_time_deadline(tmp_path: Path, slurm: Path) -> None:
    r = run_in_job(tmp_path, slurm, "--margin", "20")
    assert r.code == 0, r.stderr
    assert [c for c in calls(slurm) if c.startswith("requeue")] == ["requeue 77"]
    req = r.of("request")[0]
    assert req["job_state"] == "RUNNING"
    # EndTime is ~570 s away: the wait lasts until EndTime - margin
    assert 530 < float(req["deadline_in"]) < 551
    rq = r.of("requeue")[0]
    assert (rq["via"], rq["already"], rq["job"]) == ("scontrol", "0", "77")
    assert float(rq["t"]) >= float(r.of("committed")[0]["t"])  # signal -> committed -> requeue


def test_array_task_requeues_jobid_taskid(tmp_path: Path, slurm: Path) -> None:
    r = run_in_job(tmp_path, slurm, env={"SLURM_ARRAY_JOB_ID": "70", "SLURM_ARRAY_TASK_ID": "7"})
    assert r.code == 0, r.stderr
    assert "requeue 70_7" in calls(slurm)


def test_other_ranks_never_requeue(tmp_path: Path, slurm: Path) -> None:
    r = run_in_job(tmp_path, slurm, env={"SLURM_PROCID": "1", "SLURM_NTASKS": "2"})
    assert r.code == 0, r.stderr
    assert r.of("committed")
    assert not [c for c in calls(slurm) if c.startswith("requeue")]
    assert r.of("no-requeue")[0]["reason"] == "not-rank-0"


def test_pending_execution_is_success(tmp_path: Path, slurm: Path) -> None:
    (slurm / "requeue_err").write_text("Job is pending execution for job 77")
    r = run_in_job(tmp_path, slurm)
    assert r.code == 0
    assert r.of("requeue")[0]["already"] == "1"


def test_refused_requeue_keeps_the_child_status_and_says_why(tmp_path: Path, slurm: Path) -> None:
    (slurm / "requeue_err").write_text("Requested operation is presently disabled for job 77")
    r = run_in_job(tmp_path, slurm)
    no = r.of("no-requeue")[0]
    assert no["reason"] == "requeue-failed" and "--requeue" in no["msg"]
    assert r.code == 0  # the child's own status


def test_no_scontrol_falls_back_to_requeue_exit(tmp_path: Path, slurm: Path) -> None:
    missing = {"SCONTROL": str(slurm / "absent"), "SLURM_CKPT_WRAPPER_REQUEUE_EXIT": "85"}
    r = run_in_job(tmp_path, slurm, env=missing)
    assert r.code == 85
    assert r.of("requeue")[0]["via"] == "RequeueExit"
    r2 = run_in_job(tmp_path, slurm, env={"SCONTROL": str(slurm / "absent")})
    assert r2.code == 0
    assert r2.of("no-requeue")[0]["reason"] == "no-scontrol"


def test_scancel_is_not_requeued(tmp_path: Path, slurm: Path) -> None:
    # What scontrol shows while a scancelled job's processes are being ended.
    job_line(slurm, state="COMPLETING", started_ago=30, limit_s=600)
    r = run_in_job(tmp_path, slurm)
    assert r.of("committed")  # the checkpoint is still taken
    no = r.of("no-requeue")[0]
    assert no["reason"] == "cancelled" and "before the time limit" in no["msg"]
    assert not [c for c in calls(slurm) if c.startswith("requeue")]


def test_time_limit_is_requeued(tmp_path: Path, slurm: Path) -> None:
    job_line(slurm, state="COMPLETING", started_ago=600, limit_s=600)
    r = run_in_job(tmp_path, slurm)
    assert "requeue 77" in calls(slurm), r.stderr


def test_job_requeued_by_slurm_itself(tmp_path: Path, slurm: Path) -> None:
    job_line(slurm, state="PENDING", restarts=1)  # PreemptMode=REQUEUE got there first
    r = run_in_job(tmp_path, slurm)
    assert r.code == 0
    rq = r.of("requeue")[0]
    assert (rq["via"], rq["already"]) == ("slurm", "1")
    assert not [c for c in calls(slurm) if c.startswith("requeue")]


def test_restart_count_reaches_the_default_limit(tmp_path: Path, slurm: Path) -> None:
    r = run_in_job(tmp_path, slurm, env={"SLURM_RESTART_COUNT": "10"})
    assert r.of("no-requeue")[0]["reason"] == "max-requeues"
    assert not [c for c in calls(slurm) if c.startswith("requeue")]


def test_outside_slurm_without_local_is_a_usage_error(tmp_path: Path) -> None:
    r = start(tmp_path, [], [*CHILD, "--steps", "1"]).finish()
    assert r.code == 2
    assert "--local" in r.stderr

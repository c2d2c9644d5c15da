"""The Slurm backend: ``scontrol show job -o`` parsing, the job's env, requeue outcomes.

The parsing tests use output captured from the real Slurm 22.05 cluster of
tests/slurm (a hostile ``--comment``, an array task, a cancelled job). The
requeue tests put a stand-in ``scontrol`` executable behind the one seam
(``$SCONTROL``) that replays the messages real scontrol printed there; real
requeues are covered by the end-to-end tests in tests/slurm. pyslurm cannot be
built against 22.05, so its backend is exercised with a stand-in module.
"""

from __future__ import annotations

import sys
import time
import types
from datetime import datetime
from pathlib import Path

import pytest

from slurm_ckpt.errors import SlurmError
from slurm_ckpt.slurm import (
    JobInfo,
    SlurmCommandMissing,
    SlurmEnv,
    parse_duration,
    parse_show_job,
    parse_time,
    requeue,
    show_job,
)

# Captured from `scontrol show job -o` on Slurm 22.05.8 (tests/slurm cluster).
RUNNING = (
    "JobId=2 JobName=my run UserId=root(0) GroupId=root(0) MCS_label=N/A Priority=4294901758 Nice=0 "
    "Account=(null) QOS=(null) JobState=RUNNING Reason=None Dependency=(null) Requeue=1 Restarts=0 "
    "BatchFlag=1 Reboot=0 ExitCode=0:0 RunTime=00:00:01 TimeLimit=00:05:00 TimeMin=N/A "
    "SubmitTime=2026-11-29T20:17:52 EligibleTime=2026-11-29T20:17:52 AccrueTime=2026-11-29T20:17:52 "
    "StartTime=2026-11-29T20:17:53 EndTime=2026-11-29T20:22:53 Deadline=N/A SuspendTime=None "
    "SecsPreSuspend=0 LastSchedEval=2026-11-29T20:17:53 Scheduler=Backfill Partition=debug "
    "AllocNode:Sid=localhost:4430 ReqNodeList=(null) ExcNodeList=(null) NodeList=vm BatchHost=vm "
    "NumNodes=1 NumCPUs=1 NumTasks=1 CPUs/Task=1 ReqB:S:C:T=0:0:*:* TRES=cpu=1,node=1,billing=1 "
    "Socks/Node=* NtasksPerN:B:S:C=0:0:*:* CoreSpec=* MinCPUsNode=1 MinMemoryNode=0 MinTmpDiskNode=0 "
    "Features=(null) DelayBoot=00:00:00 OverSubscribe=OK Contiguous=0 Licenses=(null) Network=(null) "
    "Command=(null) WorkDir=/tmp/job Comment=a b=c Reason=x  StdErr=/dev/null StdIn=/dev/null "
    "StdOut=/dev/null Power= \n"
)
ARRAY_TASK = (
    "JobId=4 ArrayJobId=3 ArrayTaskId=3 JobName=wrap UserId=root(0) GroupId=root(0) MCS_label=N/A "
    "Priority=4294901757 Nice=0 Account=(null) QOS=(null) JobState=RUNNING Reason=None "
    "Dependency=(null) Requeue=1 Restarts=0 BatchFlag=1 Reboot=0 ExitCode=0:0 RunTime=00:00:01 "
    "TimeLimit=1-00:00:00 TimeMin=N/A SubmitTime=2026-11-29T20:17:54 EligibleTime=2026-11-29T20:17:55 "
    "AccrueTime=Unknown StartTime=2026-11-29T20:17:55 EndTime=2026-11-30T20:17:55 Deadline=N/A "
    "Partition=debug NodeList=vm StdOut=/dev/null Power= \n"
)
MESSAGES = {  # what real scontrol printed on stderr, with exit status 1
    "pending": "Job is pending execution for job 6",
    "disabled": "Requested operation is presently disabled for job 5",
    "invalid": "Invalid job id specified for job 999999",
    "transient": "Socket timed out on send/recv operation",
}


def test_parse_real_running_job_with_hostile_comment() -> None:
    f = parse_show_job(RUNNING)
    assert f["JobName"] == "my run"  # a value with a space
    assert f["Reason"] == "None"  # the comment's "Reason=x" does not win
    assert f["Comment"].startswith("a b=c")
    info = JobInfo.from_fields(f)
    assert (info.job_id, info.state, info.restarts, info.requeue_allowed) == ("2", "RUNNING", 0, True)
    assert info.time_limit == 300
    assert info.end_time == datetime(2026, 11, 29, 20, 22, 53).timestamp()
    assert info.limit_time == info.end_time  # StartTime + TimeLimit
    assert (info.array_job_id, info.array_task_id) == ("", "")


def test_parse_real_array_task() -> None:
    info = JobInfo.from_fields(parse_show_job(ARRAY_TASK))
    assert (info.job_id, info.array_job_id, info.array_task_id) == ("4", "3", "3")
    assert info.time_limit == 86400


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("00:05:00", 300), ("1-00:00:00", 86400), ("2-03:04:05", 183845), ("10:30", 630), ("7", 420),
     ("UNLIMITED", None), ("Partition_Limit", None), ("garbage", None), ("1-xx", None)],
)  # fmt: skip
def test_parse_duration(text: str, seconds: int | None) -> None:
    assert parse_duration(text) == seconds


def test_parse_time_unknown_and_local() -> None:
    assert parse_time("Unknown") is None and parse_time("None") is None and parse_time("junk") is None
    assert parse_time("2026-11-29T20:17:53") == datetime(2026, 11, 29, 20, 17, 53).timestamp()


def test_missing_fields_is_a_clear_error() -> None:
    with pytest.raises(SlurmError, match="JobId/JobState"):
        JobInfo.from_fields(parse_show_job("slurm_load_jobs error: Invalid job id specified"))


def test_env_requeue_id_and_restarts() -> None:
    env = SlurmEnv.from_env({"SLURM_JOB_ID": "4", "SLURM_ARRAY_JOB_ID": "3", "SLURM_ARRAY_TASK_ID": "3",
                             "SLURM_PROCID": "1", "SLURM_NTASKS": "2"})  # fmt: skip
    assert (env.requeue_id, env.procid, env.ntasks, env.restart_count) == ("3_3", 1, 2, 0)
    plain = SlurmEnv.from_env({"SLURM_JOB_ID": "9", "SLURM_RESTART_COUNT": "2", "SLURM_PROCID": "x"})
    assert (plain.requeue_id, plain.restart_count, plain.procid, plain.in_job) == ("9", 2, 0, True)
    assert not SlurmEnv.from_env({}).in_job


@pytest.fixture
def fake_scontrol(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A stand-in scontrol at the seam: logs its argv, replays canned answers from files."""
    exe = tmp_path / "scontrol"
    exe.write_text(
        "#!/bin/bash\n"
        f'd="{tmp_path}"\n'
        'echo "$*" >> "$d/calls"\n'
        'n=$(wc -l < "$d/calls")\n'
        'if [ -f "$d/sleep" ]; then sleep "$(cat "$d/sleep")"; fi\n'
        'case "$1" in\n'
        '  show) cat "$d/show"; exit 0 ;;\n'
        '  requeue) f="$d/requeue.$n"; [ -f "$f" ] || f="$d/requeue";\n'
        '           if [ -f "$f" ]; then cat "$f" >&2; exit 1; fi; exit 0 ;;\n'
        "esac\n"
    )
    exe.chmod(0o755)
    monkeypatch.setenv("SCONTROL", str(exe))
    monkeypatch.delitem(sys.modules, "pyslurm", raising=False)
    return tmp_path


def _calls(d: Path) -> list[str]:
    return (d / "calls").read_text().splitlines() if (d / "calls").exists() else []


def test_requeue_ok(fake_scontrol: Path) -> None:
    res = requeue("3_3", numeric_id="4")
    assert (res.via, res.already, res.job_id) == ("scontrol", False, "3_3")
    assert _calls(fake_scontrol) == ["requeue 3_3"]


def test_pending_execution_counts_as_success(fake_scontrol: Path) -> None:
    (fake_scontrol / "requeue").write_text(MESSAGES["pending"])
    res = requeue("6")
    assert res.already and res.attempts == 1


def test_disabled_requeue_fails_at_once_with_a_hint(fake_scontrol: Path) -> None:
    (fake_scontrol / "requeue").write_text(MESSAGES["disabled"])
    with pytest.raises(SlurmError, match="--requeue"):
        requeue("5", pause=0.01)
    assert len(_calls(fake_scontrol)) == 1  # a refusal is not retried


def test_invalid_job_names_the_cause(fake_scontrol: Path) -> None:
    (fake_scontrol / "requeue").write_text(MESSAGES["invalid"])
    with pytest.raises(SlurmError, match="purged"):
        requeue("999999", pause=0.01)


def test_transient_failure_is_retried(fake_scontrol: Path) -> None:
    (fake_scontrol / "requeue.1").write_text(MESSAGES["transient"])
    res = requeue("7", pause=0.01)
    assert res.attempts == 2 and not res.already
    assert _calls(fake_scontrol) == ["requeue 7", "requeue 7"]


def test_hung_scontrol_is_bounded(fake_scontrol: Path) -> None:
    (fake_scontrol / "sleep").write_text("5")
    t0 = time.monotonic()
    with pytest.raises(SlurmError):
        requeue("7", budget=1.0, pause=0.2)
    assert time.monotonic() - t0 < 4


def test_missing_scontrol(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delitem(sys.modules, "pyslurm", raising=False)
    monkeypatch.setenv("SCONTROL", str(tmp_path / "absent"))
    with pytest.raises(SlurmCommandMissing, match="RequeueExit"):
        requeue("7")
    monkeypatch.delenv("SCONTROL")
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SlurmCommandMissing):
        show_job("7")


def test_show_job_through_the_seam(fake_scontrol: Path) -> None:
    (fake_scontrol / "show").write_text(ARRAY_TASK)
    info = show_job("4")
    assert info.array_task_id == "3"
    assert _calls(fake_scontrol) == ["show job -o 4"]


def _fake_pyslurm(monkeypatch: pytest.MonkeyPatch, error: str | None) -> list[int]:
    calls: list[int] = []

    class Job:
        def __init__(self, job_id: int) -> None:
            self.job_id = job_id

        def requeue(self) -> None:
            calls.append(self.job_id)
            if error:
                raise RuntimeError(error)

    monkeypatch.setitem(sys.modules, "pyslurm", types.SimpleNamespace(Job=Job))
    return calls


def test_pyslurm_used_when_importable(fake_scontrol: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _fake_pyslurm(monkeypatch, None)
    res = requeue("3_3", numeric_id="4")
    assert (res.via, calls, _calls(fake_scontrol)) == ("pyslurm", [4], [])


def test_pyslurm_pending_is_success(fake_scontrol: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_pyslurm(monkeypatch, "Job is pending execution")
    assert requeue("4").already


def test_pyslurm_failure_falls_back_to_scontrol(fake_scontrol: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_pyslurm(monkeypatch, "slurm_requeue: Unexpected message received")
    res = requeue("3_3", numeric_id="4")
    assert res.via == "scontrol"
    assert _calls(fake_scontrol) == ["requeue 3_3"]

"""Every requeue guard, and cancel-vs-preemption, as pure decisions."""

from __future__ import annotations

import dataclasses
import signal
import time

import pytest

from slurm_ckpt.slurm import JobInfo
from slurm_ckpt.wrapper.policy import LIMIT_SLACK, RunFacts, cancel_reason, decide_requeue
from slurm_ckpt.wrapper.supervisor import Timing

GOOD = RunFacts(requested=True, rank=0, restarts=0, max_requeues=3, baseline_step=100, new_step=120)


def test_requeues_after_a_requested_checkpoint_that_made_progress() -> None:
    d = decide_requeue(GOOD)
    assert d.requeue and d.reason == "requeue" and "120" in d.detail


def test_first_checkpoint_ever_counts_as_progress() -> None:
    assert decide_requeue(dataclasses.replace(GOOD, baseline_step=None, new_step=5)).requeue


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"requested": False}, "not-requested"),
        ({"rank": 1}, "not-rank-0"),
        ({"cancelled": "SIGINT"}, "cancelled"),
        ({"restarts": 3}, "max-requeues"),
        ({"restarts": 7}, "max-requeues"),
        ({"max_requeues": 0}, "max-requeues"),
        ({"new_step": None}, "no-progress"),
        ({"new_step": 100}, "no-progress"),  # re-saved the step it resumed from
        ({"new_step": 90}, "no-progress"),
    ],
)
def test_guards(change: dict[str, object], reason: str) -> None:
    d = decide_requeue(dataclasses.replace(GOOD, **change))  # type: ignore[arg-type]
    assert not d.requeue
    assert d.reason == reason
    assert d.detail  # every refusal says why, for the log


def test_max_requeues_message_says_what_to_do() -> None:
    d = decide_requeue(dataclasses.replace(GOOD, restarts=3))
    assert "--max-requeues is 3" in d.detail and "resubmit" in d.detail


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"exit_code": 3}, "crashed"),
        ({"exit_code": 139, "requested": False}, "crashed"),  # a segfault with no request
        ({"exit_code": 3, "rank": 1}, "crashed"),
        ({"exit_code": 137, "killed_at_deadline": True}, "requeue"),  # our kill, not a crash
        ({"exit_code": 130, "cancelled": "SIGINT"}, "cancelled"),
        ({"exit_code": None}, "requeue"),  # never reaped: no code to pass through
        ({"exit_code": 0}, "requeue"),
    ],
)
def test_a_command_that_fails_on_its_own_crashed(change: dict[str, object], reason: str) -> None:
    facts = dataclasses.replace(GOOD, **change)  # type: ignore[arg-type]
    d = decide_requeue(facts)
    assert d.reason == reason and d.requeue == (reason == "requeue")
    assert facts.crashed == (reason == "crashed")
    if reason == "crashed":
        assert str(facts.exit_code) in d.detail and not facts.needs_job  # no Slurm query for it


def test_a_job_slurm_requeued_itself_is_not_requeued_again() -> None:
    info = JobInfo(job_id="7", state="RUNNING", restarts=1)
    assert GOOD.needs_job
    d = decide_requeue(dataclasses.replace(GOOD, job=info))
    assert (d.requeue, d.reason) == (False, "already-requeued") and "Restarts=1" in d.detail
    # Restarts as this run knows them (SLURM_RESTART_COUNT): not a new requeue.
    assert decide_requeue(dataclasses.replace(GOOD, job=info, restarts=1)).requeue
    # Only rank 0 asks and acts on it.
    assert not dataclasses.replace(GOOD, rank=1).needs_job
    assert decide_requeue(dataclasses.replace(GOOD, job=info, rank=1)).reason == "not-rank-0"
    assert not dataclasses.replace(GOOD, requested=False).needs_job


def test_the_job_state_at_decision_time_can_mean_a_cancel() -> None:
    now = time.time()
    scancelled = _job("COMPLETING", started_ago=10, limit=600)
    d = decide_requeue(dataclasses.replace(GOOD, job=scancelled, now=now))
    assert (d.requeue, d.reason) == (False, "cancelled") and "before the time limit" in d.detail
    timed_out = _job("COMPLETING", started_ago=630, limit=600)
    assert decide_requeue(dataclasses.replace(GOOD, job=timed_out, now=now)).requeue


def _job(state: str, *, started_ago: float, limit: int | None) -> JobInfo:
    now = time.time()
    return JobInfo(job_id="7", state=state, start_time=now - started_ago, time_limit=limit,
                   end_time=now)  # fmt: skip


def test_cancel_vs_preemption_vs_timeout() -> None:
    now = time.time()
    assert cancel_reason(None, now) == ""  # unknown: let the other guards decide
    assert cancel_reason(_job("RUNNING", started_ago=10, limit=600), now) == ""  # scancel --signal=TERM
    assert cancel_reason(_job("PREEMPTED", started_ago=10, limit=600), now) == ""
    assert "CANCELLED" in cancel_reason(_job("CANCELLED", started_ago=10, limit=600), now)
    # scancel: COMPLETING long before the limit
    assert "before the time limit" in cancel_reason(_job("COMPLETING", started_ago=10, limit=600), now)
    # time limit: COMPLETING at or after StartTime + TimeLimit
    assert cancel_reason(_job("COMPLETING", started_ago=600, limit=600), now) == ""
    assert cancel_reason(_job("COMPLETING", started_ago=630, limit=600), now) == ""
    assert cancel_reason(_job("COMPLETING", started_ago=600 - LIMIT_SLACK / 2, limit=600), now) == ""
    # no time limit: only a scancel (or a cancelling preemption) ends it
    assert "no time limit" in cancel_reason(_job("COMPLETING", started_ago=10, limit=None), now)


def test_deadline_rules() -> None:
    t = Timing(margin=15, kill_wait=30, wait=300)
    now, wall = 1000.0, 50_000.0
    far = JobInfo(job_id="1", state="RUNNING", end_time=wall + 120)
    assert t.deadline(signal.SIGUSR1, far, now, wall) == now + 105  # EndTime - margin
    assert t.deadline(signal.SIGTERM, far, now, wall) == now + 15  # SIGKILL follows KillWait after TERM
    late = JobInfo(job_id="1", state="RUNNING", end_time=wall + 5)
    assert t.deadline(signal.SIGUSR1, late, now, wall) == now + 15  # less lead time than the margin
    assert t.deadline(signal.SIGUSR1, None, now, wall) == now + 300  # no end time: wrapper.wait
    unlimited = JobInfo(job_id="1", state="RUNNING", end_time=None)
    assert t.deadline(signal.SIGUSR1, unlimited, now, wall) == now + 300
    short = Timing(margin=25, kill_wait=30, wait=300)
    assert short.term_window == 15  # never less than half of KillWait

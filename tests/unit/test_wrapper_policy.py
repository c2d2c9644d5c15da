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

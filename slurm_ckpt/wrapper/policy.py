"""When the wrapper requeues, and when it must not: one pure function.

Kept free of Slurm, signals and processes so every guard is tested directly.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CANCELLED_STATES", "Decision", "RunFacts", "decide_requeue"]

# JobStates that mean a person ended the job. A preempted job is PREEMPTED or
# (PreemptMode=REQUEUE) already PENDING/REQUEUED; a time limit is TIMEOUT.
CANCELLED_STATES = frozenset({"CANCELLED"})


@dataclass(frozen=True)
class RunFacts:
    """What one run of the command ended with."""

    requested: bool
    """A checkpoint-and-stop was requested (signal, or --preempt-after)."""
    cancelled: str = ""
    """Why the run counts as cancelled ("" if it does not): SIGINT, JobState=CANCELLED."""
    rank: int = 0
    restarts: int = 0
    """Requeues before this run (SLURM_RESTART_COUNT, or local restarts)."""
    max_requeues: int = 10
    baseline_step: int | None = None
    """Newest valid checkpoint when the run started."""
    new_step: int | None = None
    """Newest checkpoint committed during this run, if any."""


@dataclass(frozen=True)
class Decision:
    requeue: bool
    reason: str
    """Short stable token for logs and tests: "requeue", "max-requeues", …"""
    detail: str


def decide_requeue(f: RunFacts) -> Decision:
    """Requeue only after a requested checkpoint that made progress, from rank 0, within limits."""
    if not f.requested:
        return Decision(False, "not-requested",
                        "the command ended on its own (no checkpoint was requested)")  # fmt: skip
    if f.rank != 0:
        return Decision(False, "not-rank-0",
                        f"rank {f.rank} never requeues; global rank 0 does")  # fmt: skip
    if f.cancelled:
        return Decision(False, "cancelled",
                        f"the job was cancelled ({f.cancelled}), not preempted")  # fmt: skip
    if f.restarts >= f.max_requeues:
        return Decision(
            False, "max-requeues",
            f"requeue limit reached: the job already ran {f.restarts + 1} time(s) "
            f"and --max-requeues is {f.max_requeues}; resubmit it to go on",
        )  # fmt: skip
    progressed = f.new_step is not None and (f.baseline_step is None or f.new_step > f.baseline_step)
    if not progressed:
        was = "none" if f.baseline_step is None else f"step {f.baseline_step}"
        return Decision(
            False, "no-progress",
            f"no new checkpoint was committed during this run (newest is still {was}); "
            "requeueing would loop without progress",
        )  # fmt: skip
    return Decision(True, "requeue", f"checkpoint step {f.new_step} committed during this run")

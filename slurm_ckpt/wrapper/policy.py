"""When the wrapper requeues, and when it must not: pure functions.

Kept free of Slurm, signals and processes so every guard is tested directly:
the wrapper gathers the facts of a run (:class:`RunFacts`), and
:func:`decide_requeue` alone decides from them; after a hang, the nodes'
reports (:class:`HangFacts`) go to :func:`decide_hang`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ..slurm import JobInfo

__all__ = [
    "CANCELLED_STATES",
    "Decision",
    "HangDecision",
    "HangFacts",
    "NodeReport",
    "RankProgress",
    "RunFacts",
    "cancel_reason",
    "decide_hang",
    "decide_requeue",
]

# Slurm 22.05's CLI shows COMPLETING while a job's processes are being ended,
# hiding whether it was CANCELLED, TIMEOUT or PREEMPTED underneath (measured:
# `squeue -t CANCELLED` does not match it either). So a job is taken as
# cancelled when it shows CANCELLED, or shows COMPLETING before its time limit
# has run out: a time limit ends it only after StartTime + TimeLimit.
CANCELLED_STATES = frozenset({"CANCELLED"})
LIMIT_SLACK = 5.0
"""Seconds of clock granularity allowed around StartTime + TimeLimit."""


def cancel_reason(info: JobInfo | None, now: float) -> str:
    """Why the job counts as cancelled by a person ("" if it does not).

    Unknown job info counts as not cancelled: the requeue guards still bound
    what a wrong guess can cost. With ``PreemptMode=CANCEL`` a preemption looks
    the same as a scancel here; ``PreemptMode=REQUEUE`` (Slurm requeues the job
    itself) or ``preempt_send_user_signal`` avoid that.
    """
    if info is None:
        return ""
    if info.state in CANCELLED_STATES:
        return f"JobState={info.state}"
    if info.state == "COMPLETING":
        limit = info.limit_time
        if limit is None:
            return "JobState=COMPLETING and the job has no time limit: a scancel"
        if now < limit - LIMIT_SLACK:
            return (f"JobState=COMPLETING {limit - now:.0f}s before the time limit: a scancel, "
                    "not a timeout")  # fmt: skip
    return ""


@dataclass(frozen=True)
class RunFacts:
    """What one run of the command ended with."""

    requested: bool
    """A checkpoint-and-stop was requested (signal, or --preempt-after)."""
    cancelled: str = ""
    """Why the run counts as cancelled ("" if it does not): SIGINT, or the job's
    state when the request came (:func:`cancel_reason`)."""
    exit_code: int | None = 0
    """The command's exit code (128+N for signal N); None if it was never reaped."""
    killed_at_deadline: bool = False
    """The wrapper ended the command at the deadline, so its exit code says nothing of its own."""
    job: JobInfo | None = None
    """Slurm's view of the job at decision time (asked by rank 0 after a request); None otherwise."""
    now: float = 0.0
    """When the decision is made (``time.time()``), for :func:`cancel_reason` on ``job``."""
    rank: int = 0
    restarts: int = 0
    """Requeues before this run (SLURM_RESTART_COUNT, or local restarts)."""
    max_requeues: int = 10
    baseline_step: int | None = None
    """Newest valid checkpoint when the run started."""
    new_step: int | None = None
    """Newest checkpoint committed during this run, if any."""

    @property
    def crashed(self) -> bool:
        """The command failed on its own: not ended at the deadline, not cancelled, non-zero."""
        return not self.killed_at_deadline and not self.cancelled and self.exit_code not in (None, 0)

    @property
    def needs_job(self) -> bool:
        """Whether Slurm's view of the job can change the decision (so is worth a query):
        rank 0's, after a request, when the command did not crash."""
        return self.requested and self.rank == 0 and not self.crashed


@dataclass(frozen=True)
class Decision:
    requeue: bool
    reason: str
    """Short stable token for logs and tests: "requeue", "max-requeues", …"""
    detail: str


def decide_requeue(f: RunFacts) -> Decision:
    """Requeue only after a requested checkpoint that made progress, from rank 0, within limits.

    Not when the command crashed (its code is passed through), nor when Slurm
    has requeued the job itself (``Restarts`` grew: PreemptMode=REQUEUE).
    """
    if f.crashed:
        return Decision(False, "crashed",
                        f"the command exited with code {f.exit_code}; passing it through, no requeue")  # fmt: skip
    if f.needs_job and f.job is not None and f.job.restarts > f.restarts:
        return Decision(False, "already-requeued",
                        f"Slurm has requeued the job itself (Restarts={f.job.restarts})")  # fmt: skip
    cancelled = f.cancelled or cancel_reason(f.job, f.now)
    if not f.requested and not cancelled:
        return Decision(False, "not-requested",
                        "the command ended on its own (no checkpoint was requested)")  # fmt: skip
    if cancelled:
        return Decision(False, "cancelled",
                        f"the job was cancelled ({cancelled}), not preempted")  # fmt: skip
    if f.rank != 0:
        return Decision(False, "not-rank-0",
                        f"rank {f.rank} never requeues; global rank 0 does")  # fmt: skip
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


@dataclass(frozen=True)
class RankProgress:
    """One rank's last heartbeat, as its node's wrapper saw it when the node stalled."""

    pid: int
    step: int
    where: str
    """``compute``, ``collective`` or ``checkpoint`` (``protocol.WHERE``)."""
    idle: float
    """Seconds since its step last changed."""


@dataclass(frozen=True)
class NodeReport:
    """A stalled node's ranks, written by that node's wrapper for rank 0's."""

    node: str
    ranks: tuple[RankProgress, ...]

    @property
    def step(self) -> int:
        return max((r.step for r in self.ranks), default=-1)


@dataclass(frozen=True)
class HangFacts:
    """What rank 0's wrapper knows once its node made no step progress for ``timeout`` seconds."""

    timeout: float
    nodes: tuple[str, ...]
    """The job's nodes."""
    reports: Mapping[str, NodeReport]
    """The stalled nodes' reports, by node; a node missing here did not report in time."""
    rank: int = 0
    restarts: int = 0
    max_requeues: int = 10
    excluded: tuple[str, ...] = ()
    """Nodes already in the job's ExcNodeList."""
    required: tuple[str, ...] = ()
    """The job's ReqNodeList (``sbatch -w``)."""
    partition_nodes: int = 0
    """Nodes in the job's partition (0: unknown, so no shrinking)."""
    num_nodes: int = 0
    num_tasks: int = 0


@dataclass(frozen=True)
class HangDecision:
    requeue: bool
    reason: str
    """Short stable token: "requeue", "hang-unlocated", "not-rank-0", "max-requeues", "no-nodes-left"."""
    detail: str
    bad: tuple[str, ...] = ()
    """The nodes blamed for the hang."""
    exclude: tuple[str, ...] = ()
    """The job's ExcNodeList after the requeue (earlier exclusions kept)."""
    num_nodes: int | None = None
    """NumNodes to set on the requeued job when fewer nodes are left than it asks; None: unchanged."""
    num_tasks: int | None = None
    required: tuple[str, ...] | None = None
    """ReqNodeList to set, without the excluded nodes (a job that requires an excluded node
    never starts: Reason=BadConstraints); None: unchanged."""


def _blame(f: HangFacts) -> tuple[tuple[str, ...], str]:
    """The nodes that held the job up, and why; ``()`` when none can be told apart.

    In order: a node with a rank stuck in its own code while others wait in a
    collective; else a node whose ranks are behind the others' step (stuck in
    another collective); else a node that never reported (its wrapper is gone:
    a dead node).
    """
    reports = [f.reports[n] for n in f.nodes if n in f.reports]
    stuck = tuple(r.node for r in reports if any(p.where == "compute" for p in r.ranks))
    waiting = [r for r in reports if r.node not in stuck]
    if stuck and (waiting or len(f.nodes) == 1):
        return stuck, "a rank stopped in its own code while the others waited in a collective"
    if reports and not stuck:
        top = max(r.step for r in reports)
        behind = tuple(r.node for r in reports if r.step < top)
        if behind:
            return behind, f"its ranks stopped before step {top}, which the others reached"
    silent = tuple(n for n in f.nodes if n not in f.reports)
    if silent and reports and not stuck:
        return silent, "its wrapper never reported while every other rank waited in a collective"
    return (), ""


def decide_hang(f: HangFacts) -> HangDecision:
    """After no step progress for ``timeout`` seconds: which node to blame, and whether
    global rank 0 requeues the job without it (``ExcNodeList``), on fewer nodes if
    the partition has too few left.

    No checkpoint is asked for: a rank stuck in a collective cannot save, and the
    newest committed checkpoint is what the requeued job resumes from.
    """
    bad, why = _blame(f)
    if not bad:
        seen = ", ".join(f"{r.node}: step {r.step} ({'/'.join(sorted({p.where for p in r.ranks}))})"
                         for r in f.reports.values()) or "no node reported"  # fmt: skip
        return HangDecision(False, "hang-unlocated",
                            f"no step progress for {f.timeout:.0f}s, but no node stands out ({seen}); "
                            "not requeueing onto the same nodes")  # fmt: skip
    blamed = f"no step progress for {f.timeout:.0f}s; blaming {','.join(bad)}: {why}"
    if f.rank != 0:
        return HangDecision(False, "not-rank-0", f"{blamed}; global rank 0 requeues", bad=bad)
    if f.restarts >= f.max_requeues:
        return HangDecision(False, "max-requeues",
                            f"{blamed}; requeue limit reached (--max-requeues {f.max_requeues})", bad=bad)  # fmt: skip
    exclude = tuple(sorted({*f.excluded, *bad}))
    num_nodes = num_tasks = None
    if f.partition_nodes:
        left = f.partition_nodes - len(exclude)
        if left < 1:
            return HangDecision(False, "no-nodes-left",
                                f"{blamed}; no node of the partition is left once {','.join(exclude)} "
                                "are excluded", bad=bad, exclude=exclude)  # fmt: skip
        if f.num_nodes > left:
            num_nodes = left
            if f.num_tasks and f.num_tasks % f.num_nodes == 0:
                num_tasks = f.num_tasks // f.num_nodes * left
    required = None
    if set(f.required) & set(exclude):
        required = tuple(n for n in f.required if n not in exclude)
    shrink = "" if num_nodes is None else f", on {num_nodes} node(s)"
    return HangDecision(True, "requeue", f"{blamed}; requeueing without {','.join(exclude)}{shrink}",
                        bad=bad, exclude=exclude, num_nodes=num_nodes, num_tasks=num_tasks,
                        required=required)  # fmt: skip

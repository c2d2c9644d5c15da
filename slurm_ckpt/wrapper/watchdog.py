"""The hang watchdog: step progress of this node's ranks, and the nodes' reports.

With ``wrapper.hang_timeout`` set, the trainer's heartbeats (``progress <pid>
<step> <where>`` on the control channel) feed a :class:`Watchdog`. The node is
stalled once none of its ranks has reached a new step for that long; a rank
inside slurm-ckpt (a long save or load) counts as making progress. The wrapper
then writes a :class:`~.policy.NodeReport` into the shared run dir, where
global rank 0's wrapper gathers every node's report and
:func:`~.policy.decide_hang` decides.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ..protocol import Message
from .policy import NodeReport, RankProgress

__all__ = ["Watchdog", "gather", "heartbeat_interval", "read_report", "report_dir", "write_report"]


def heartbeat_interval(timeout: float) -> float:
    """Seconds between a rank's heartbeats: often enough to notice a hang within
    ``timeout`` plus a quarter of it, and never more than one a second."""
    return min(max(timeout / 4, 1.0), 10.0)


@dataclass
class _Rank:
    step: int
    where: str
    changed: float


class Watchdog:
    """This node's ranks' last step and when it changed (``time.monotonic``)."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.ranks: dict[int, _Rank] = {}

    def beat(self, msg: Message, now: float) -> None:
        r = self.ranks.get(msg.pid)
        if r is None:
            self.ranks[msg.pid] = _Rank(msg.step, msg.where, now)
            return
        if msg.step != r.step or msg.where == "checkpoint":
            r.changed = now
        r.step, r.where = msg.step, msg.where

    def pause(self, seconds: float) -> None:
        """Leave ``seconds`` out of every rank's idle time: the wrapper did not run
        then (stopped with its ranks, its node frozen), so it saw no hang."""
        for r in self.ranks.values():
            r.changed += seconds

    def forget(self, pid: int) -> None:
        """A rank that exited stops counting."""
        self.ranks.pop(pid, None)

    @property
    def deadline(self) -> float | None:
        """When the node counts as stalled if no rank moves on before; None before any heartbeat."""
        if not self.ranks:
            return None
        return max(r.changed for r in self.ranks.values()) + self.timeout

    def report(self, node: str, now: float) -> NodeReport:
        ranks = tuple(RankProgress(pid, r.step, r.where, round(now - r.changed, 2))
                      for pid, r in sorted(self.ranks.items()))  # fmt: skip
        return NodeReport(node, ranks)


def report_dir(run_dir: Path, job_id: str, restarts: int) -> Path:
    """Where the nodes of one run of the job put their reports (in the shared run dir)."""
    return run_dir / ".watchdog" / f"job_{job_id}.{restarts}"


def clear_reports(run_dir: Path, job_id: str, before: int) -> None:
    """Remove the reports of the job's runs before ``before`` (their decision is in the log),
    and ``.watchdog`` itself once empty."""
    top = run_dir / ".watchdog"
    for d in top.glob(f"job_{job_id}.*"):
        run = d.name.rpartition(".")[2]
        if run.isdigit() and int(run) < before:
            shutil.rmtree(d, ignore_errors=True)
    with contextlib.suppress(OSError):
        top.rmdir()


def write_report(where: Path, report: NodeReport) -> Path:
    """Write ``report`` as ``<where>/<node>.json``: tmp, then rename, so a reader never
    sees half of it (no fsync: it matters only while the job runs)."""
    where.mkdir(parents=True, exist_ok=True)
    path = where / f"{report.node}.json"
    tmp = where / f".{report.node}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(asdict(report)))
    os.replace(tmp, path)
    return path


def read_report(path: Path) -> NodeReport | None:
    try:
        data = json.loads(path.read_text())
        return NodeReport(str(data["node"]), tuple(RankProgress(**r) for r in data["ranks"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def gather(where: Path, nodes: tuple[str, ...], until: float, *, poll: float = 0.2) -> dict[str, NodeReport]:
    """Every node's report, waiting until all of ``nodes`` reported or ``until``
    (monotonic) passes. The reports come through the shared run dir, so this polls it."""
    while True:
        got = {}
        for node in nodes:
            with contextlib.suppress(OSError):
                r = read_report(where / f"{node}.json")
                if r is not None:
                    got[node] = r
        if len(got) == len(nodes) or time.monotonic() >= until:
            return got
        time.sleep(poll)

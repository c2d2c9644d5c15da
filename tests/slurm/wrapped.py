"""Helpers for end-to-end tests of ``slurm-ckpt run`` on the test cluster.

A test submits ``srun slurm-ckpt run -- python trainer.py`` (see
:func:`script`), signals it, and reads back what happened from three sources:
the wrapper's event lines in the job output (:func:`runs`), slurmctld's log
(:func:`requeue_log_times`) and the trainer's ``done-rank<R>.txt`` digests,
which must equal those of an uninterrupted run (:func:`reference_digests`).
"""

from __future__ import annotations

import os
import shlex
import socket
import subprocess
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from tests.slurm.harness import HERE, REPO, VENV_BIN, Cluster, Job

__all__ = [
    "PYTHON",
    "SLURM_CKPT",
    "TRAINER",
    "Run",
    "done_digests",
    "free_port",
    "reference_digests",
    "requeue_log_times",
    "runs",
    "script",
    "timing_report",
]

TRAINER = HERE / "trainer.py"
PYTHON = VENV_BIN / "python"
SLURM_CKPT = VENV_BIN / "slurm-ckpt"
_PREFIX = "slurm-ckpt run:"


@dataclass
class Run:
    """One run of the wrapper (one Slurm run of the job, one rank), from its event lines."""

    rank: int
    restarts: int
    events: list[dict[str, str]] = field(default_factory=list)

    def find(self, event: str, **match: str) -> list[dict[str, str]]:
        return [e for e in self.events
                if e["event"] == event and all(e.get(k) == v for k, v in match.items())]  # fmt: skip

    def t(self, event: str, **match: str) -> float | None:
        """Seconds from the checkpoint request to the first such event (the wrapper's ``t``)."""
        for e in self.find(event, **match):
            if "t" in e:
                return float(e["t"])
        return None


def runs(output: str) -> list[Run]:
    """Wrapper runs in order of appearance; each ``event=start`` line begins one per rank."""
    out: list[Run] = []
    current: dict[int, Run] = {}
    for line in output.splitlines():
        if not line.startswith(_PREFIX):
            continue
        fields = dict(tok.partition("=")[::2] for tok in shlex.split(line[len(_PREFIX) :]))
        rank = int(fields.get("rank", "0"))
        if fields.get("event") == "start":
            current[rank] = Run(rank, int(fields.get("restarts", "0")))
            out.append(current[rank])
        if rank in current:
            current[rank].events.append(fields)
    return out


def script(workdir: Path, trainer_args: str, *, wrapper_args: str = "", srun_args: str = "",
           pre: str = "") -> str:  # fmt: skip
    """The batch script: run dir in the workdir, the repo's venv by absolute path."""
    return (
        f"export SLURM_CKPT_DIR={workdir}/run\n"
        f"{pre}"
        f"srun {srun_args} {SLURM_CKPT} run {wrapper_args} -- "
        f"{PYTHON} {TRAINER} --out {workdir}/out {trainer_args}\n"
    )


def done_digests(workdir: Path, world: int = 1) -> list[str]:
    """The final ``step digest`` of each rank (a missing rank reads as "")."""
    out = []
    for rank in range(world):
        path = workdir / "out" / f"done-rank{rank}.txt"
        out.append(path.read_text().strip() if path.exists() else "")
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def reference_digests(workdir: Path, trainer_args: str, world: int = 1) -> list[str]:
    """Digests of an uninterrupted run with the same seed, run here without Slurm or checkpoints."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world))
    # Timing flags last, so they win: they do not change the weights.
    argv = [str(PYTHON), str(TRAINER), "--out", str(workdir / "out"), "--no-ckpt",
            *shlex.split(trainer_args), "--step-time", "0", "--first-step-time", "0"]  # fmt: skip
    procs = [subprocess.Popen(argv, env={**env, "RANK": str(r)}, cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(world)]  # fmt: skip
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    for p, text in zip(procs, outputs, strict=True):
        if p.returncode != 0:
            raise RuntimeError(f"reference run failed ({p.returncode}):\n{text}")
    return done_digests(workdir, world)


def requeue_log_times(cluster: Cluster, job: Job) -> list[float]:
    """When slurmctld requeued ``job`` (its "Requeuing JobId=N" log lines), as epoch seconds."""
    out = []
    marker = f"Requeuing JobId={job.id}"
    for line in (cluster.root / "log" / "slurmctld.log").read_text(errors="replace").splitlines():
        if line.startswith("[") and line.rstrip().endswith(marker):
            stamp = line[1 : line.index("]")]
            out.append(datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%S.%f").timestamp())
    return out


def timing_report(
    title: str, test: str, rows: list[tuple[str, Run, float | None, float | None]]
) -> str:
    """Lines for the figures summary: per signal, seconds to committed and to requeue.

    Each row: (what was sent, the run that got it, the time the test sent it
    or None, slurmctld's "Requeuing" time or None).
    """
    lines = [title, f"  reproduce: .venv/bin/pytest {test}"]
    for what, run, sent, requeued in rows:
        committed, requeue = run.t("committed"), run.t("requeue")
        line = (f"  run {run.restarts} rank {run.rank} {what}: request->committed "
                f"{_s(committed)}, request->requeue RPC done {_s(requeue)} (wrapper clock)")  # fmt: skip
        if sent is not None and requeued is not None:
            line += f"; scancel->slurmctld 'Requeuing' {requeued - sent:.2f} s"
        lines.append(line)
    lines.append(f"  measured {time.strftime('%Y-%m-%d %H:%M:%S')}")
    return "\n".join(lines)


def _s(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f} s"

"""An FSDP2 job requeued onto another node count, on the real three-node cluster, with the node hooks.

``tests/slurm/fsdp_trainer.py`` (FSDP2 over gloo, AdamW, its state saved with
``Checkpointer`` under ``srun slurm-ckpt run``) starts with 2 ranks on 2
nodes. USR1: both ranks save their shards on their nodes' scratch (the
``CrossNode`` placement), rank 0 requeues. While the job is pending, one of
its nodes is drained and the job is cut to 1 node: it resumes with 1 rank
from the 2-rank checkpoint. USR1 again (that rank saves to its scratch, the
``Local`` placement with tiers), requeue, the node is back and the job grows
to 3 nodes: 3 ranks resume from the 1-rank checkpoint and train to the end.

The trainer's weights do not depend on the world size (see its docstring),
so the final parameters and optimizer moments must equal, bit for bit, an
uninterrupted run's at 3 ranks (and at 2: the same digest).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from slurm_ckpt.store import verify_checkpoint
from slurm_ckpt.store.manifest import is_chunked
from tests.slurm.harness import HERE, REPO, Cluster, Job
from tests.slurm.test_multinode_e2e import Hooks
from tests.slurm.wrapped import PYTHON, SLURM_CKPT, free_port

pytestmark = [pytest.mark.slurm, pytest.mark.root]

Figures = Callable[[str, str], Path]

TRAINER = HERE / "fsdp_trainer.py"
ARGS = "--steps 120 --every 50"
THIS = "tests/slurm/test_fsdp_requeue_e2e.py"
_START = re.compile(r"^fsdp: start rank=(\d+) world=(\d+) from=(\d+) restart=(\d+) host=(\S+)$", re.MULTILINE)


def reference(workdir: Path, world: int, steps: int = 120) -> str:
    """The digest of an uninterrupted run of ``steps`` at ``world`` ranks, run here without Slurm or checkpoints."""
    out = workdir / f"reference-{world}-{steps}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1"}
    argv = [str(PYTHON), str(TRAINER), "--out", str(out), "--no-ckpt", *shlex.split(ARGS), "--steps", str(steps)]
    procs = [subprocess.Popen(argv, env={**env, "RANK": str(r)}, cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(world)]  # fmt: skip
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    failed = [f"rank {r} exited {p.returncode}:\n{text[-3000:]}" for r, (p, text) in enumerate(zip(procs, outputs, strict=True))
              if p.returncode != 0]  # fmt: skip
    assert not failed, f"reference run at {world} ranks failed:\n" + "\n".join(failed)
    done, w, digest = (out / "done.txt").read_text().split()
    assert (int(done), int(w)) == (steps, world)
    return digest


def _past_step(job: Job, restart: int, step: int) -> None:
    """Wait until a rank of run ``restart`` printed ``fsdp: step STEP``."""

    def seen(_: dict[str, str]) -> bool:
        out = job.output()
        starts = [m.start() for m in _START.finditer(out) if int(m.group(4)) == restart]
        return bool(starts) and f"fsdp: step {step}\n" in out[min(starts) :]

    job.wait_for(f"run {restart} past step {step}", seen, 180)


def _stopped(job: Job) -> list[int]:
    return sorted({int(s) for s in re.findall(r"^fsdp: stopping at step=(\d+)", job.output(), re.MULTILINE)})


def _requeued(job: Job, restarts: int) -> None:
    job.wait_for(f"requeued ({restarts}) and PENDING",
                 lambda r: r.get("Restarts") == str(restarts) and r.get("JobState") == "PENDING", 120)  # fmt: skip


def _hosts(cluster: Cluster, job: Job) -> list[str]:
    return cluster.run("scontrol", "show", "hostnames", job.info()["NodeList"]).split()


def test_fsdp2_requeued_from_2_nodes_to_1_then_3_ends_with_the_uninterrupted_runs_weights(
    slurm_cluster3: Cluster, slurm_workdir: Path, figures: Figures
) -> None:
    Hooks(slurm_cluster3, slurm_workdir)
    run_dir = slurm_workdir / "run"
    body = (f"export SLURM_CKPT_DIR={run_dir}\n"
            'export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)\n'
            "export MASTER_PORT=29541\n"
            # One task per node of this run's allocation: the batch step's SLURM_NTASKS keeps the count
            # the job was submitted with, and srun would take it as -n.
            'srun -N "$SLURM_NNODES" -n "$SLURM_NNODES" '
            f"{SLURM_CKPT} run -- {PYTHON} {TRAINER} --out {slurm_workdir}/out {ARGS} --step-time 0.05\n")  # fmt: skip
    job = slurm_cluster3.sbatch(body, "-N2", "--ntasks-per-node=1", "--requeue",
                                "--comment=ckpt_scratch=32M ckpt_size=1M", workdir=slurm_workdir, name="fsdp")  # fmt: skip
    # Run 0: 2 ranks on 2 nodes.
    _past_step(job, 0, 20)
    first = _hosts(slurm_cluster3, job)
    job.signal("USR1")
    _requeued(job, 1)
    gone = first[1]
    slurm_cluster3.run("scontrol", "update", f"NodeName={gone}", "State=DRAIN", "Reason=fsdp-requeue-test")
    slurm_cluster3.run("scontrol", "update", f"JobId={job.id}", "NumNodes=1-1", "NumTasks=1")
    job.skip_requeue_wait(restarts=1)
    job.wait_running(timeout=90)
    second = _hosts(slurm_cluster3, job)
    (s1,) = _stopped(job)
    # What run 1 resumes from: the 2-rank checkpoint, one shard per node, assembled on the durable
    # tier (checked now: retention may remove it later).
    m1 = verify_checkpoint(run_dir / f"step-{s1:09d}", full=True)
    assert is_chunked(m1) and m1.world_size == 2 and {s["host"] for s in m1.extra["shards"].values()} == set(first)
    # Run 1: 1 rank on a node that is left.
    _past_step(job, 1, (s1 // 10 + 2) * 10)
    job.signal("USR1")
    _requeued(job, 2)
    slurm_cluster3.run("scontrol", "update", f"NodeName={gone}", "State=RESUME")
    slurm_cluster3.run("scontrol", "update", f"JobId={job.id}", "NumNodes=3-3", "NumTasks=3")
    job.skip_requeue_wait(restarts=2)
    job.wait_running(timeout=90)
    third = _hosts(slurm_cluster3, job)
    _, s2 = _stopped(job)
    m2 = verify_checkpoint(run_dir / f"step-{s2:09d}", full=True)  # saved by 1 rank, copied by the drain
    assert is_chunked(m2) and m2.world_size == 1 and m2.host == second[0]
    # Run 2: 3 ranks on 3 nodes, to the end.
    job.wait_state("COMPLETED", timeout=240)

    assert len(first) == 2 and second != [gone] and len(second) == 1 and sorted(third) == ["node1", "node2", "node3"]
    s1, s2 = _stopped(job)
    starts = sorted((int(restart), int(rank), int(world), int(frm)) for rank, world, frm, restart, _ in _START.findall(job.output()))
    assert starts == [(0, 0, 2, 0), (0, 1, 2, 0), (1, 0, 1, s1), (2, 0, 3, s2), (2, 1, 3, s2), (2, 2, 3, s2)], starts
    steps, world, digest = (slurm_workdir / "out" / "done.txt").read_text().split()
    assert (int(steps), int(world)) == (120, 3)
    want = reference(slurm_workdir, 3)
    assert digest == want
    assert reference(slurm_workdir, 2) == want  # the math is world-size exact, as the trainer says
    figures("fsdp-requeue-node-count", "\n".join([
        "FSDP2 (gloo, AdamW) requeued onto another node count: 2 nodes -> 1 -> 3, with the node hooks",
        f"  reproduce: .venv/bin/pytest {THIS}",
        f"  run 0: 2 ranks on {','.join(first)}, USR1, stopped at step {s1}: one shard per node on scratch, "
        "assembled on the durable tier",
        f"  {gone} drained, job cut to 1 node; run 1: 1 rank on {second[0]}, resumed from step {s1} "
        f"(saved by 2 ranks), USR1, stopped at step {s2}",
        f"  {gone} back, job grown to 3 nodes; run 2: 3 ranks on {','.join(third)}, resumed from step {s2} "
        "(saved by 1 rank), trained to step 120",
        f"  final parameters and AdamW moments: sha256 {digest[:16]}..., equal to an uninterrupted run's at 3 "
        "ranks and at 2 ranks",
    ]))  # fmt: skip

"""A node lost with the only copy of the newest step: peer replicas bring it back, on the real three-node cluster.

``tests/slurm/fsdp_trainer.py`` (FSDP2 over gloo, AdamW, world-size exact)
runs under ``srun slurm-ckpt run`` on 3 nodes with the node hooks installed,
``--comment ckpt_replicas=1`` (the prolog reserves room for one peer's
replicas and the TaskProlog exports the count) and the in-job drain off, so
every step it saves lives on the nodes' scratch only. Each node's shard is
copied to the next node's scratch.

Once step 100 is replicated, the third node is lost: every process in its
mount namespace is SIGKILLed (slurmd, slurmstepd, the task) and its link cut,
so its tmpfs scratch is gone with it. Slurm marks it down and requeues the
job (NODE_FAIL). The two surviving nodes' epilogs stage out their own shards
and the replicas they hold: between them, all three shards of step 100,
assembled on the durable tier. The job (``--nodes=2-3 --ntasks=3``) starts
again on the 2 nodes that are left, with no one changing it, resumes from step 100 at world size 2 and trains to the end; its final
parameters and AdamW moments equal, bit for bit, an uninterrupted run's.

The timeline (commit, loss, requeue, resume, done) goes to the figures summary.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from slurm_ckpt.store import verify_checkpoint
from slurm_ckpt.store.manifest import is_chunked
from tests.slurm.harness import HERE, Cluster, Job, poll
from tests.slurm.test_fsdp_requeue_e2e import _START, reference
from tests.slurm.test_multinode_e2e import Hooks, _kill_node
from tests.slurm.wrapped import PYTHON, SLURM_CKPT

pytestmark = [pytest.mark.slurm, pytest.mark.root]

Figures = Callable[[str, str], Path]

TRAINER = HERE / "fsdp_trainer.py"
STEPS, EVERY = 300, 100
THIS = "tests/slurm/test_replicas_e2e.py"


def _hosts(cluster: Cluster, job: Job) -> list[str]:
    return cluster.run("scontrol", "show", "hostnames", job.info()["NodeList"]).split()


def test_fsdp2_step_on_scratch_only_survives_a_lost_node_through_replicas_and_resumes_on_two_nodes_bit_exact(
    slurm_cluster3: Cluster, slurm_workdir: Path, figures: Figures
) -> None:
    hooks = Hooks(slurm_cluster3, slurm_workdir)
    run_dir = slurm_workdir / "run"
    body = (f"export SLURM_CKPT_DIR={run_dir}\n"
            "export SLURM_CKPT_STORAGE_DRAIN=0\n"  # steps stay on scratch: only replicas can save them
            'export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)\n'
            "export MASTER_PORT=29561\n"
            'srun -N "$SLURM_NNODES" -n "$SLURM_NNODES" '
            f"{SLURM_CKPT} run -- {PYTHON} {TRAINER} --out {slurm_workdir}/out --steps {STEPS} --every {EVERY} "
            "--step-time 0.1\n")  # fmt: skip
    # Slurm starts a --nodes=2-3 job on 2 nodes if only 2 are free then: wait for all 3
    # (an earlier test's lost node may still be coming back).
    for node in slurm_cluster3.node_names:
        poll(f"{node} idle", lambda n=node: slurm_cluster3.node_state(n).upper().split("+")[0] == "IDLE" or None, 120)
    t0 = time.time()
    # A range of node counts and the most nodes' tasks, as docs/replicas.md says: the
    # requeued job starts on the nodes left (--ntasks-per-node=1 would start it on 2).
    job = slurm_cluster3.sbatch(body, "--nodes=2-3", "--ntasks=3", "--requeue",
                                "--comment=ckpt_scratch=24M ckpt_size=1M ckpt_replicas=1",
                                workdir=slurm_workdir, name="replicas")  # fmt: skip
    job.wait_running(timeout=90)
    first = _hosts(slurm_cluster3, job)
    lost = first[-1]
    survivors = first[:-1]
    try:
        # Step 100 committed on every node's scratch and replicated to the next node's.
        def replicated(_: dict[str, str]) -> bool:
            index = run_dir / ".replicas.json"
            try:
                return json.loads(index.read_text()).get(str(EVERY), {}).get("nodes") == 2
            except (OSError, ValueError):
                return False

        job.wait_for(f"step {EVERY} replicated on 2 nodes", replicated, 120)
        t_replicated = time.time()
        out = job.output()
        assert f"fsdp: committed step={EVERY} " in out and f"fsdp: committed step={2 * EVERY} " not in out
        assert not list(run_dir.glob("step-*")), "the drain is off: nothing may be on the durable tier yet"
        for k, node in enumerate(first):
            prev = (k - 1) % len(first)
            rep = hooks.scratch(node, job) / "ckpt" / "replicas" / f"rank-{prev:05d}" / f"step-{EVERY:09d}"
            assert (rep / "MANIFEST.json").is_file(), rep
            entry = hooks.ledger(node)[job.id]
            assert entry["replicas"] == 1 and entry["size"] == 48 * 2**20
        ls_before = _ls(run_dir)
        # Lose the node with rank 2's shard: its processes killed, its link cut, its scratch gone.
        t_lost = time.time()
        killed = _kill_node(slurm_cluster3, lost)
        job.wait_for("requeued after the node failure",
                     lambda r: int(r.get("Restarts", "0") or 0) >= 1 and r.get("JobState") == "PENDING", 180)  # fmt: skip
        t_requeued = time.time()
        hooks.wait_epilogs(job, len(survivors))
        stage = {n: (status, detail) for status, n, _, detail in hooks.stage_outs(job)}
        assert set(stage) == set(survivors), stage
        man = verify_checkpoint(run_dir / f"step-{EVERY:09d}", full=True)
        assert is_chunked(man) and man.world_size == 3
        from_replica = {k: v["staged_from"] for k, v in man.extra["shards"].items() if "/replicas/" in v["staged_from"]}
        assert "rank-00002" in from_replica, man.extra["shards"]
        job.skip_requeue_wait(restarts=1, timeout=120)
        job.wait_running(timeout=90)
        second = _hosts(slurm_cluster3, job)
        t_resumed = time.time()
        job.wait_state("COMPLETED", timeout=300)
        t_done = time.time()
    finally:
        # The lost node is gone for good: give the next tests a whole cluster again.
        slurm_cluster3.down()
        slurm_cluster3.up(owner=os.getpid())
    starts = sorted({(int(restart), int(rank), int(world), int(frm))
                     for rank, world, frm, restart, _ in _START.findall(job.output())})  # fmt: skip
    restart = max(s[0] for s in starts)
    assert [s[1:] for s in starts if s[0] == 0] == [(0, 3, 0), (1, 3, 0), (2, 3, 0)], starts
    assert [s[1:] for s in starts if s[0] == restart] == [(0, 2, EVERY), (1, 2, EVERY)], starts
    assert sorted(second) == sorted(survivors)
    steps, world, digest = (slurm_workdir / "out" / "done.txt").read_text().split()
    assert (int(steps), int(world)) == (STEPS, 2)
    want = reference(slurm_workdir, 3, steps=STEPS)
    assert digest == want
    assert reference(slurm_workdir, 2, steps=STEPS) == want
    figures("replicas-node-loss", "\n".join([
        "FSDP2 (gloo, AdamW) on 3 nodes with scratch.replicas=1 and the in-job drain off; a node lost",
        f"  reproduce: .venv/bin/pytest {THIS}",
        f"  {time.time() - t0:.0f} s in all; seconds from submission:",
        f"  {t_replicated - t0:7.1f}  step {EVERY} committed on the 3 nodes' scratch only and replicated "
        f"(ring {' -> '.join([*first, first[0]])}); ls: {ls_before}",
        f"  {t_lost - t0:7.1f}  {lost} lost: its {killed} processes SIGKILLed (slurmd, the step's), link cut, "
        "tmpfs scratch gone",
        f"  {t_requeued - t0:7.1f}  Slurm marked it down, job requeued (NODE_FAIL); epilogs on "
        f"{', '.join(survivors)}: " + "; ".join(f"{n}: {s}" for n, (s, _) in sorted(stage.items())),
        f"           step {EVERY} assembled on the durable tier from {len(man.extra['shards'])} shards, "
        f"rank-00002's from {lost}'s replica on {first[0]}",
        f"  {t_resumed - t0:7.1f}  running again on {','.join(second)}: 2 ranks resumed from step {EVERY}",
        f"  {t_done - t0:7.1f}  done: {STEPS} steps; final parameters and AdamW moments sha256 {digest[:16]}..., "
        "equal to an uninterrupted run's at 3 ranks and at 2",
    ]))  # fmt: skip


def _ls(run_dir: Path) -> str:
    import subprocess

    out = subprocess.run([str(SLURM_CKPT), "ls", "--dir", str(run_dir)], capture_output=True, text=True,
                         check=True, timeout=60).stdout  # fmt: skip
    rows = [" ".join(line.split()) for line in out.splitlines()[1:]]
    return "; ".join(re.sub(r" \d{4}-\d\d-\d\d \d\d:\d\d:\d\d", "", r) for r in rows)

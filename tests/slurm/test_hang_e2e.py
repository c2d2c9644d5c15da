"""A rank hung in a collective, on the real three-node cluster: found, its node excluded, resumed.

A two-node job (one rank per node, gloo) runs ``tests/slurm/trainer.py`` under
``srun slurm-ckpt run --hang-timeout 10``. At step 50 of the first run, rank 1
(on node2) stops before the step's all_reduce and sleeps; rank 0 waits in that
all_reduce. Both wrappers see no step progress for 10 s; node2's report says
its rank is in its own code, node1's that its rank waits in a collective. Rank
0 requeues the job with ``ExcNodeList=node2`` (and ``ReqNodeList=node1``: the
job was submitted with ``-w node1,node2``). The checkpoint of step 40 is
intact, and the requeued run, on node1 and node3, resumes from it and ends
with the weights of an uninterrupted run. The same with rank 0 hung: its own
wrapper excludes its own node, and the job goes on on node2 and node3.

Then an FSDP2 job on all three nodes, whose rank on node3 hangs: requeued
without node3 onto the two nodes left (NumNodes, NumTasks), it resumes from the
3-rank checkpoint at 2 ranks.

A dead node: at step 50 rank 1's trainer SIGSTOPs its own wrapper, then
itself, so node2 (whose slurmd still answers) sends no heartbeat and writes no
report. Node1's wrapper stalls, rank 0 waits 10 s more for node2's report,
blames node2 for never reporting and requeues without it; the stopped
processes are gone once the job is pending again, node2 is not drained, and
the requeued run resumes from step 40 on node1 and node3 as above.

The seconds from the hang to slurmctld's requeue, against the configured
timeout, go to the figures summary.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest

from slurm_ckpt.store import find_latest, verify_checkpoint
from slurm_ckpt.wrapper.watchdog import heartbeat_interval
from tests.slurm.harness import HERE, Cluster, Job
from tests.slurm.test_fsdp_requeue_e2e import reference as fsdp_reference
from tests.slurm.wrapped import PYTHON, SLURM_CKPT, done_digests, requeue_log_times, runs, script

pytestmark = [pytest.mark.slurm, pytest.mark.root]

THIS = "tests/slurm/test_hang_e2e.py"
TIMEOUT = 10
ARGS = "--steps 120 --every 20 --step-time 0.05"
TWO = ("-N2", "--ntasks-per-node=1")
PRE = ('export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)\n'
       "export MASTER_PORT=29541\n")  # fmt: skip


def _lines(job: Job, what: str) -> list[dict[str, str]]:
    return [dict(kv.split("=", 1) for kv in m.group(1).split() if "=" in kv)
            for m in re.finditer(rf"^trainer: {what} (.*)$", job.output(), re.MULTILINE)]  # fmt: skip


@pytest.mark.parametrize(("hung", "bad", "good", "after"), [(1, "node2", "node1", "node[1,3]"),
                                                          (0, "node1", "node2", "node[2-3]")])  # fmt: skip
def test_a_rank_hung_in_a_collective_is_found_and_its_node_excluded(
    slurm_cluster3: Cluster, slurm_workdir: Path, reference: Callable[[str, int], list[str]],
    figures: Callable[[str, str], Path], hung: int, bad: str, good: str, after: str,
) -> None:  # fmt: skip
    body = script(slurm_workdir, f"{ARGS} --hang-at 50 --hang-rank {hung}", wrapper_args=f"--hang-timeout {TIMEOUT}",
                  srun_args=" ".join(TWO), pre=PRE)  # fmt: skip
    job = slurm_cluster3.sbatch(body, *TWO, "--requeue", "-w", "node1,node2", workdir=slurm_workdir,
                                name="hang")  # fmt: skip
    job.wait_output(r"^trainer: hanging at step=50", timeout=120)
    hung_at = float(_lines(job, "hanging at")[0]["t"])

    rec = job.wait_for("requeued (Restarts=1) and PENDING",
                       lambda r: r.get("Restarts") == "1" and r.get("JobState") == "PENDING",
                       6 * TIMEOUT)  # fmt: skip
    assert rec["ExcNodeList"] == bad, rec
    assert rec["ReqNodeList"] == good, rec  # sbatch -w node1,node2 without the bad node
    requeued = requeue_log_times(slurm_cluster3, job)
    assert len(requeued) == 1
    detect = requeued[0] - hung_at
    assert TIMEOUT <= detect <= 2 * TIMEOUT + 5, detect

    # The previous checkpoint is intact: nothing was forced from the stuck ranks.
    cand = find_latest([slurm_workdir / "run"], full=True)
    assert cand is not None and cand.step == 40
    verify_checkpoint(cand.path, full=True)

    first = [r for r in runs(job.output()) if r.restarts == 0]
    assert sorted(r.rank for r in first) == [0, 1]
    by_rank = {r.rank: r for r in first}
    stuck, waiting = by_rank[hung].find("hang")[0], by_rank[1 - hung].find("hang")[0]
    assert stuck["node"] == bad and stuck["ranks"].split(":")[1:3] == ["49", "compute"], stuck
    assert waiting["node"] == good and waiting["ranks"].split(":")[1:3] == ["49", "collective"], waiting
    decision = by_rank[0].find("hang-decision")
    assert [(d["reason"], d["bad"], d["reported"]) for d in decision] == [("requeue", bad, "2")]
    assert by_rank[0].find("requeue", exclude=bad)
    assert [e["reason"] for e in by_rank[1].find("no-requeue")] == ["not-rank-0"]
    assert not by_rank[0].find("forward") and not by_rank[1].find("forward")  # no checkpoint asked

    reports = slurm_workdir / "run" / ".watchdog" / f"job_{job.id}.0"
    assert {p.name for p in reports.iterdir()} == {f"{bad}.json", f"{good}.json"}
    job.skip_requeue_wait(restarts=1)
    job.wait_state("COMPLETED", timeout=180)
    assert job.info()["NodeList"] == after
    assert not reports.parent.exists()  # the next run's rank 0 removed the reports
    starts = sorted((d["restart"], d["rank"], d["from"]) for d in _lines(job, "start"))
    assert starts == [("0", "0", "0"), ("0", "1", "0"), ("1", "0", "40"), ("1", "1", "40")]
    assert done_digests(slurm_workdir, 2) == reference(ARGS, 2)

    figures(f"hang-e2e-rank{hung}", "\n".join([
        f"hang watchdog: rank {hung} of a 2-node gloo job never joins step 50's all_reduce",
        f"  reproduce: .venv/bin/pytest {THIS}",
        f"  hang_timeout {TIMEOUT} s: hang -> slurmctld requeue {detect:.1f} s "
        f"(ExcNodeList={bad}; resumed from step 40 on {after}; weights as an uninterrupted run)",
    ]))  # fmt: skip


FSDP = HERE / "fsdp_trainer.py"
_FSDP_START = re.compile(r"^fsdp: start rank=(\d+) world=(\d+) from=(\d+) restart=(\d+) host=(\S+)$", re.MULTILINE)


def test_fsdp2_on_every_node_hangs_and_resumes_on_the_nodes_left(
    slurm_cluster3: Cluster, slurm_workdir: Path, figures: Callable[[str, str], Path],
) -> None:  # fmt: skip
    """A 3-node FSDP2 job on the 3-node cluster; rank 2 (node3) hangs: the job is requeued
    without node3 on 2 nodes (NumNodes, NumTasks), and resumes from the 3-rank checkpoint
    at 2 ranks, ending with the weights of an uninterrupted run (the trainer is world-size exact)."""
    run_dir = slurm_workdir / "run"
    args = "--steps 120 --every 20"
    body = (f"export SLURM_CKPT_DIR={run_dir}\n{PRE}"
            # One task per node of this run's allocation (the batch step's SLURM_NTASKS keeps the count
            # the job was submitted with).
            'srun -N "$SLURM_NNODES" -n "$SLURM_NNODES" '
            f"{SLURM_CKPT} run --hang-timeout {TIMEOUT} -- {PYTHON} {FSDP} --out {slurm_workdir}/out {args} "
            "--step-time 0.05 --hang-at 50 --hang-rank 2\n")  # fmt: skip
    job = slurm_cluster3.sbatch(body, "-N3", "--ntasks-per-node=1", "--requeue", workdir=slurm_workdir,
                                name="fsdp-hang")  # fmt: skip
    job.wait_output(r"^fsdp: hanging at step=50", timeout=240)
    hung_at = float(re.search(r"^fsdp: hanging at step=50 rank=2 t=([\d.]+)", job.output(), re.MULTILINE)[1])
    rec = job.wait_for("requeued (Restarts=1) and PENDING",
                       lambda r: r.get("Restarts") == "1" and r.get("JobState") == "PENDING",
                       6 * TIMEOUT)  # fmt: skip
    (requeued,) = requeue_log_times(slurm_cluster3, job)
    detect = requeued - hung_at
    assert rec["ExcNodeList"] == "node3" and rec["NumTasks"] == "2", rec
    cand = find_latest([run_dir], full=True)
    assert cand is not None and cand.step == 40 and cand.manifest.world_size == 3
    decision = [d for r in runs(job.output()) for d in r.find("hang-decision")]
    assert [(d["reason"], d["bad"], d["reported"]) for d in decision] == [("requeue", "node3", "3")]

    job.skip_requeue_wait(restarts=1)
    job.wait_state("COMPLETED", timeout=300)
    assert job.info()["NodeList"] == "node[1-2]"
    starts = sorted((int(restart), int(rank), int(world), int(frm))
                    for rank, world, frm, restart, _ in _FSDP_START.findall(job.output()))  # fmt: skip
    assert starts == [(0, 0, 3, 0), (0, 1, 3, 0), (0, 2, 3, 0), (1, 0, 2, 40), (1, 1, 2, 40)], starts
    steps, world, digest = (slurm_workdir / "out" / "done.txt").read_text().split()
    assert (int(steps), int(world)) == (120, 2)
    assert digest == fsdp_reference(slurm_workdir, 2)
    figures("hang-e2e-fsdp-shrink", "\n".join([
        "hang watchdog: rank 2 of a 3-node FSDP2 job (the cluster's 3 nodes) never joins step 50's collectives",
        f"  reproduce: .venv/bin/pytest {THIS}::test_fsdp2_on_every_node_hangs_and_resumes_on_the_nodes_left",
        f"  hang_timeout {TIMEOUT} s: hang -> slurmctld requeue {detect:.1f} s (ExcNodeList=node3, NumNodes=2, "
        "NumTasks=2); resumed from the 3-rank step 40 at 2 ranks; weights as an uninterrupted run",
    ]))  # fmt: skip


def _leftovers(workdir: Path) -> list[str]:
    """Processes anywhere on this machine (the nodes share its pid namespace) whose
    command line names ``workdir``: the job's wrappers and trainers."""
    out = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (proc / "stat").read_text().rpartition(")")[2].split()[0]
        except OSError:
            continue  # exited meanwhile
        if str(workdir) in argv:
            out.append(f"{proc.name} {state} {argv}")
    return out


def test_a_frozen_node_that_never_reports_is_blamed_and_excluded(
    slurm_cluster3: Cluster, slurm_workdir: Path, reference: Callable[[str, int], list[str]],
    figures: Callable[[str, str], Path],
) -> None:  # fmt: skip
    """Node2 freezes whole at step 50: its trainer SIGSTOPs its own wrapper, then itself.
    Node2 writes no report; rank 0 blames it for never reporting and requeues without it."""
    body = script(slurm_workdir, f"{ARGS} --freeze-at 50 --freeze-rank 1", wrapper_args=f"--hang-timeout {TIMEOUT}",
                  srun_args=" ".join(TWO), pre=PRE)  # fmt: skip
    job = slurm_cluster3.sbatch(body, *TWO, "--requeue", "-w", "node1,node2", workdir=slurm_workdir,
                                name="freeze")  # fmt: skip
    job.wait_output(r"^trainer: freezing at step=50", timeout=120)
    (frozen,) = _lines(job, "freezing at")
    frozen_at = float(frozen["t"])

    rec = job.wait_for("requeued (Restarts=1) and PENDING",
                       lambda r: r.get("Restarts") == "1" and r.get("JobState") == "PENDING",
                       6 * TIMEOUT)  # fmt: skip
    # PENDING again: Slurm has ended every process of the first run, the stopped ones included,
    # without draining node2 (a process that outlives SIGKILL would: "kill task failed").
    assert _leftovers(slurm_workdir) == []
    assert "DRAIN" not in slurm_cluster3.node_state("node2")
    assert rec["ExcNodeList"] == "node2", rec
    assert rec["ReqNodeList"] == "node1", rec
    (requeued,) = requeue_log_times(slurm_cluster3, job)
    # Node1 stalls T s after its last new step (heard up to one heartbeat after the freeze),
    # then rank 0 waits T more for node2's report, which never comes.
    detect = requeued - frozen_at
    assert 2 * TIMEOUT - 1 <= detect <= 2 * TIMEOUT + heartbeat_interval(TIMEOUT) + 5, detect

    cand = find_latest([slurm_workdir / "run"], full=True)
    assert cand is not None and cand.step == 40
    verify_checkpoint(cand.path, full=True)

    first = [r for r in runs(job.output()) if r.restarts == 0]
    assert sorted(r.rank for r in first) == [0, 1]
    by_rank = {r.rank: r for r in first}
    # The process stopped was rank 1's wrapper: the parent of the trainer it started.
    (child,) = by_rank[1].find("child-start")
    starts0 = {d["rank"]: d for d in _lines(job, "start") if d["restart"] == "0"}
    assert child["pid"] == starts0["1"]["pid"]
    # Node2 stayed stopped through node1's stall and rank 0's wait, until Slurm ended the job
    # for the requeue (SIGCONT, SIGTERM, then SIGKILL: before slurmctld logs "Requeuing");
    # thawed, its wrapper reports no hang it did not see.
    (thawed,) = _lines(job, "thawed at")
    frozen_for = float(thawed["t"]) - frozen_at
    assert 2 * TIMEOUT - 1 <= frozen_for <= detect, (frozen_for, detect)
    assert not by_rank[1].find("hang")
    (hang,) = by_rank[0].find("hang")
    assert hang["node"] == "node1" and hang["ranks"].split(":")[1:3] == ["49", "collective"], hang
    decision = by_rank[0].find("hang-decision")
    assert [(d["reason"], d["bad"], d["reported"], d["nodes"]) for d in decision] == [
        ("requeue", "node2", "1", "2")]  # fmt: skip
    assert "never reported" in decision[0]["msg"]
    assert by_rank[0].find("requeue", exclude="node2")

    reports = slurm_workdir / "run" / ".watchdog" / f"job_{job.id}.0"
    assert {p.name for p in reports.iterdir()} == {"node1.json"}
    job.skip_requeue_wait(restarts=1)
    job.wait_state("COMPLETED", timeout=180)
    assert job.info()["NodeList"] == "node[1,3]"
    assert not reports.parent.exists()
    starts = sorted((d["restart"], d["rank"], d["from"]) for d in _lines(job, "start"))
    assert starts == [("0", "0", "0"), ("0", "1", "0"), ("1", "0", "40"), ("1", "1", "40")]
    assert done_digests(slurm_workdir, 2) == reference(ARGS, 2)

    figures("hang-e2e-frozen-node", "\n".join([
        "hang watchdog: node2 of a 2-node gloo job freezes whole (wrapper and trainer SIGSTOPped) at step 50",
        f"  reproduce: .venv/bin/pytest {THIS}::test_a_frozen_node_that_never_reports_is_blamed_and_excluded",
        f"  hang_timeout {TIMEOUT} s: freeze -> slurmctld requeue {detect:.1f} s (stall + {TIMEOUT} s waiting for "
        f"node2's report; node2 thawed by Slurm's SIGCONT after {frozen_for:.1f} s; ExcNodeList=node2; "
        "resumed from step 40 on node[1,3]; weights as an uninterrupted run)",
    ]))  # fmt: skip

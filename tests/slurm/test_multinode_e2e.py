"""Two-node jobs on the real three-node cluster, with Prolog, Epilog and TaskProlog installed.

Each node has its own tmpfs scratch (the prolog's per-job dir on it); all
share the durable run dir. One rank per node, gloo over the namespaces'
network. The trainer is ``tests/slurm/trainer.py`` under ``srun slurm-ckpt
run``; its final weights are compared bit for bit with an uninterrupted
two-rank run (``reference``).

a. USR1 reaches both nodes, both save, rank 0 requeues once, exact resume.
b. With the in-job drain off, the epilogs stage each node's shard out; the
   first node is drained after the requeue and the job resumes on the other
   two from the staged-out copy, exactly.
c. A node dies (all its processes SIGKILLed, its link cut) while rank 1 is in
   the middle of a save that rank 0 finished: the previous whole checkpoint
   is what resume returns; the surviving node's epilog stages its orphan
   shard (never assembled) and cleans its scratch. The cluster is restarted.
d. The second node's ledger is full: no scratch there, a warning, and that
   rank's shards go straight to the durable tier.

The seconds from signal to a committed cross-node checkpoint and each node's
stage-out time go to the figures summary.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from slurm_ckpt.node.ledger import Ledger
from slurm_ckpt.store import find_latest, verify_checkpoint
from tests.slurm.harness import Cluster, Job
from tests.slurm.test_hooks_e2e import install_hooks
from tests.slurm.wrapped import PYTHON, SLURM_CKPT, done_digests, runs, script

pytestmark = [pytest.mark.slurm, pytest.mark.root]

Figures = Callable[[str, str], Path]
Reference = Callable[[str, int], list[str]]

ARGS = "--steps 160 --every 50 --step-time 0.02"
THIS = "tests/slurm/test_multinode_e2e.py"
TWO = ("-N2", "--ntasks-per-node=1")
PRE = ('export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)\n'
       "export MASTER_PORT=29531\n")  # fmt: skip
_STAGE = re.compile(r"job (\d+): INFO: stage-out (\S+): ['\"](?:on (node\d) in ([\d.]+)s: )?(.*)['\"]$")


class Hooks:
    """The node hooks installed into a test's workdir and configured on the cluster."""

    def __init__(self, cluster: Cluster, workdir: Path) -> None:
        self.cluster = cluster
        self.dir = workdir / "hooks"
        self.base = cluster.scratch / "slurm-ckpt"
        install_hooks(self.dir, self.base, workdir / "root")
        cluster.configure({"Prolog": self.dir / "slurm-ckpt-prolog", "Epilog": self.dir / "slurm-ckpt-epilog",
                           "TaskProlog": self.dir / "slurm-ckpt-taskprolog", "PrologFlags": "Alloc",
                           "PrologEpilogTimeout": 60})  # fmt: skip

    def log(self) -> str:
        path = self.dir / "hooks.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def epilogs_done(self, job: Job) -> int:
        return self.log().count(f"job {job.id}: INFO: epilog done")

    def wait_epilogs(self, job: Job, count: int) -> None:
        job.wait_for(f"{count} epilog(s) done", lambda _: self.epilogs_done(job) >= count, 60)

    def stage_outs(self, job: Job) -> list[tuple[str, str, float, str]]:
        """(status, node, seconds, detail) of every stage-out of this job's shards."""
        out = []
        for line in self.log().splitlines():
            m = _STAGE.search(line)
            if m and m.group(1) == job.id and m.group(3):
                out.append((m.group(2), m.group(3), float(m.group(4)), m.group(5)))
        return out

    def scratch(self, node: str, job: Job) -> Path:
        return self.cluster.on_node(node, self.base / f"job_{job.id}")

    def ledger(self, node: str) -> dict[str, Any]:
        path = self.cluster.on_node(node, self.base / ".slurm-ckpt" / "ledger.json")
        return dict(json.loads(path.read_text())) if path.exists() else {}


def _trainer_lines(job: Job, what: str) -> list[dict[str, str]]:
    """``trainer: WHAT k=v ...`` lines as dicts, in order (both ranks interleaved)."""
    out = []
    for m in re.finditer(rf"^trainer: {what} (.*)$", job.output(), re.MULTILINE):
        out.append(dict(kv.split("=", 1) for kv in m.group(1).split() if "=" in kv))
    return out


def _past_step(job: Job, restart: int, step: int, ranks: int = 2) -> None:
    """Wait until every rank of run ``restart`` printed ``trainer: step STEP``."""

    def seen(_: dict[str, str]) -> bool:
        out = job.output()
        starts = [m.end() for m in re.finditer(rf"restart={restart}\n", out)]
        return bool(starts) and out[min(starts) :].count(f"trainer: step {step}\n") >= ranks

    job.wait_for(f"run {restart} past step {step} on every rank", seen, 120)


def _hosts(cluster: Cluster, job: Job) -> list[str]:
    """The nodes the job runs on now, in rank order (one rank per node)."""
    return cluster.run("scontrol", "show", "hostnames", job.info()["NodeList"]).split()


def _start_time(job: Job) -> float:
    return datetime.strptime(job.info()["StartTime"], "%Y-%m-%dT%H:%M:%S").timestamp()


def _submit(cluster: Cluster, workdir: Path, name: str, *options: str, env: dict[str, str] | None = None,
            args: str = ARGS) -> Job:  # fmt: skip
    body = script(workdir, args, srun_args=" ".join(TWO), pre=PRE)
    return cluster.sbatch(body, *TWO, "--comment=ckpt_scratch=32M ckpt_size=1M", *options,
                          workdir=workdir, name=name, env=env)  # fmt: skip


def _committed_manifest(run_dir: Path) -> Any:
    cand = find_latest([run_dir], full=True)
    assert cand is not None, f"no committed checkpoint in {run_dir}"
    return cand.manifest


def _check_requeued_once(cluster: Cluster, job: Job) -> tuple[Any, Any]:
    rec = job.info()
    assert rec["Restarts"] == "1", rec
    wrapper_runs = runs(job.output())
    assert sorted((r.restarts, r.rank) for r in wrapper_runs) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    requeues = [(r.restarts, r.rank) for r in wrapper_runs for _ in r.find("requeue")]
    assert requeues == [(0, 0)], requeues  # rank 0 of the first run, exactly once
    first0 = next(r for r in wrapper_runs if (r.restarts, r.rank) == (0, 0))
    first1 = next(r for r in wrapper_runs if (r.restarts, r.rank) == (0, 1))
    # The signal reached both nodes' wrappers.
    assert first0.find("signal", signal="USR1", action="request")
    assert first1.find("signal", signal="USR1", action="request")
    return first0, first1


def _resumed(job: Job) -> list[tuple[int, int, int]]:
    """(restart, rank, step resumed from) of every trainer start."""
    return sorted(
        (int(d["restart"]), int(d["rank"]), int(d["from"])) for d in _trainer_lines(job, "start")
    )


def test_a_usr1_on_two_nodes_saves_both_shards_requeues_once_resumes_bit_identical(
    slurm_cluster3: Cluster, slurm_workdir: Path, reference: Reference, figures: Figures
) -> None:
    hooks = Hooks(slurm_cluster3, slurm_workdir)
    job = _submit(slurm_cluster3, slurm_workdir, "a", "--requeue", "-w", "node1,node2")
    _past_step(job, 0, 60)
    sent = job.signal("USR1")
    job.skip_requeue_wait(restarts=1)
    job.wait_state("COMPLETED", timeout=120)

    _check_requeued_once(slurm_cluster3, job)
    stopped = sorted({int(d["step"]) for d in _trainer_lines(job, "stopping at")})
    assert len(stopped) == 1, stopped
    step = stopped[0]
    assert _resumed(job) == [(0, 0, 0), (0, 1, 0), (1, 0, step), (1, 1, step)]
    assert done_digests(slurm_workdir, 2) == reference(ARGS, 2)
    # The emergency checkpoint on the durable tier: one shard from each node.
    man = verify_checkpoint(slurm_workdir / "run" / f"step-{step:09d}", full=True)
    shards = man.extra["shards"]
    assert {s["host"] for s in shards.values()} == {"node1", "node2"}
    assert all(
        s["staged_from"].startswith(f"node{i + 1}:")
        for i, s in enumerate(shards[k] for k in sorted(shards))
    )
    # Both nodes' scratch and ledger entries are gone after the last epilogs.
    hooks.wait_epilogs(job, 4)
    for node in ("node1", "node2"):
        assert not hooks.scratch(node, job).exists()
        assert job.id not in hooks.ledger(node)
    local = [float(d["t"]) for d in _trainer_lines(job, "committed") if int(d["step"]) == step]
    assert len(local) == 2
    figures("multinode-e2e-a-usr1", "\n".join([
        "(a) scancel --signal=USR1 to a 2-node job (one rank per node, gloo): cross-node checkpoint",
        f"  reproduce: .venv/bin/pytest {THIS}::test_a_usr1_on_two_nodes_saves_both_shards_requeues_once_resumes_bit_identical",
        f"  step {step}: signal -> both shards committed on their nodes' scratch {max(local) - sent:.2f} s",
        f"  signal -> committed on the durable tier (last shard drained, manifest + rename) "
        f"{man.extra['assembled_at'] - sent:.2f} s, by {man.extra['assembled_by']}",
        f"  final weights bit-identical to an uninterrupted 2-rank run: {done_digests(slurm_workdir, 2)[0][:20]}...",
    ]))  # fmt: skip


def test_b_after_requeue_first_node_drained_resume_on_other_nodes_from_epilog_staged_copy(
    slurm_cluster3: Cluster, slurm_workdir: Path, reference: Reference, figures: Figures
) -> None:
    hooks = Hooks(slurm_cluster3, slurm_workdir)
    # No in-job drain: only the epilogs can get the shards off the nodes.
    job = _submit(
        slurm_cluster3, slurm_workdir, "b", "--requeue", env={"SLURM_CKPT_STORAGE_DRAIN": "false"}
    )
    _past_step(job, 0, 60)
    first = _hosts(slurm_cluster3, job)
    sent = job.signal("USR1")
    job.wait_for(
        "requeued and PENDING",
        lambda r: r.get("Restarts") == "1" and r.get("JobState") == "PENDING",
        90,
    )
    slurm_cluster3.run("scontrol", "update", f"NodeName={first[0]}", "State=DRAIN", "Reason=test-b")
    job.skip_requeue_wait(restarts=1)
    job.wait_running(timeout=60)
    second = _hosts(slurm_cluster3, job)
    job.wait_state("COMPLETED", timeout=120)

    _check_requeued_once(slurm_cluster3, job)
    assert len(first) == len(second) == 2 and first[0] not in second, (first, second)
    step = int(_trainer_lines(job, "stopping at")[0]["step"])
    assert _resumed(job) == [(0, 0, 0), (0, 1, 0), (1, 0, step), (1, 1, step)]
    assert done_digests(slurm_workdir, 2) == reference(ARGS, 2)
    man = verify_checkpoint(slurm_workdir / "run" / f"step-{step:09d}", full=True)
    assert " epilog " in man.extra["assembled_by"], man.extra
    hooks.wait_epilogs(job, 4)
    # Run 0's epilogs staged their node's shard (the drain is off); exactly one
    # of them completed the checkpoint.
    staged = [s for s in hooks.stage_outs(job) if s[0] == "staged"]
    stages = staged[:2]
    assert sorted(node for _, node, _, _ in stages) == sorted(first), staged
    assert sum("(complete)" in detail for *_, detail in stages) == 1, stages
    # Run 1 started at once (StartTime=now), within slurmd's credential cache
    # time: on the node the job had run on before, slurmd skips the Prolog, so
    # that rank had no scratch and saved straight to the durable tier.
    final = _committed_manifest(slurm_workdir / "run")
    assert final.step == 150 and sorted(final.extra["shards"]) == ["rank-00000", "rank-00001"]
    # Slurm kept the job COMPLETING until both epilogs were done: the second run started later.
    assert man.extra["assembled_at"] < _start_time(job) + 1
    for node in {*first, *second}:
        assert not hooks.scratch(node, job).exists()
        assert job.id not in hooks.ledger(node)
    figures("multinode-e2e-b-drained-node", "\n".join([
        "(b) USR1, requeue, first node drained; epilog stage-out (storage.drain: false), resume on other nodes",
        f"  reproduce: .venv/bin/pytest {THIS}::test_b_after_requeue_first_node_drained_resume_on_other_nodes_from_epilog_staged_copy",
        f"  run 0 on {first}, run 1 on {second}; resumed step {step}, bit-identical",
        *[f"  stage-out on {node}: {sec:.3f} s ({detail[:90]})" for _, node, sec, detail in stages],
        f"  signal -> committed on the durable tier by {man.extra['assembled_by']}: {man.extra['assembled_at'] - sent:.2f} s",
    ]))  # fmt: skip


DEATH_TRAINER = """\
import os, socket, sys, time
from pathlib import Path
import torch, torch.distributed as dist
from slurm_ckpt import Checkpointer
from slurm_ckpt.placement import CrossNode

rank, world = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
dist.init_process_group("gloo", init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
                        rank=rank, world_size=world)
work = Path(sys.argv[1])
ckpt = Checkpointer()
state = ckpt.load_latest()
print(f"death: rank={rank} host={socket.gethostname()} resumed={ckpt.loaded_step}", flush=True)
if sys.argv[2] == "resume":
    ckpt.close()
    dist.destroy_process_group()
    sys.exit(0)
ckpt.save({"w": torch.full((4096,), float(rank + 10))}, step=10)
ckpt.wait()
dist.barrier()  # both shards drained: step 10 is committed on the durable tier
print(f"death: rank={rank} saved 10", flush=True)
if rank == 1:
    def stall(tmp):
        (tmp / "tensors-00000.safetensors").write_bytes(bytes(4096))  # half a shard
        (work / "rank1-inside-save").touch()
        time.sleep(600)
    assert isinstance(ckpt.placement, CrossNode)
    ckpt.placement.commit(20, stall)
else:
    ckpt.save({"w": torch.full((4096,), float(rank + 20))}, step=20)
print("death: unreachable", flush=True)
"""


def _kill_node(cluster: Cluster, node: str) -> int:
    """Power-cut ``node``: SIGKILL every process in its mount namespace (slurmd, slurmstepd,
    the task), then cut its link. Its tmpfs scratch goes with its last process."""
    mntns = (cluster.root / "run" / f"{node}.mntns").read_text().strip()
    pids = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if os.readlink(f"/proc/{pid}/ns/mnt") == mntns:
                    pids.append(int(pid))
            except OSError:
                continue
    assert mntns != os.readlink("/proc/self/ns/mnt") and pids
    for pid in pids:
        os.kill(pid, 9)
    subprocess.run(["ip", "link", "set", cluster.node_link(node), "down"], check=True)
    return len(pids)


def test_c_node_death_mid_save_resume_gets_previous_whole_checkpoint_survivor_cleaned(
    slurm_cluster3: Cluster, slurm_workdir: Path, figures: Figures
) -> None:
    hooks = Hooks(slurm_cluster3, slurm_workdir)
    (slurm_workdir / "death.py").write_text(DEATH_TRAINER)
    run_dir = slurm_workdir / "run"
    body = (f"export SLURM_CKPT_DIR={run_dir}\n{PRE}"
            f"srun {' '.join(TWO)} {SLURM_CKPT} run -- {PYTHON} {slurm_workdir}/death.py {slurm_workdir} save\n")  # fmt: skip
    job = slurm_cluster3.sbatch(body, *TWO, "-w", "node1,node2", "--no-requeue", "--comment=ckpt_scratch=32M",
                                workdir=slurm_workdir, name="c")  # fmt: skip
    shard0 = (
        hooks.scratch("node1", job) / "ckpt" / "rank-00000" / "step-000000020" / "MANIFEST.json"
    )
    inside = slurm_workdir / "rank1-inside-save"
    try:
        job.wait_for("rank 0's shard of step 20 committed on node1, rank 1 inside its save",
                     lambda _: shard0.exists() and inside.exists(), 120)  # fmt: skip
        assert find_latest([run_dir]).step == 10
        killed_at = time.time()
        killed = _kill_node(slurm_cluster3, "node2")
        rec = job.wait_finished(timeout=120)
        ended = time.time()
        assert rec["JobState"] in ("FAILED", "NODE_FAIL"), rec
        assert rec.get("Restarts", "0") == "0"
        # The surviving node's epilog staged its orphan shard and cleaned its scratch.
        job.wait_for(
            "node1's epilog",
            lambda _: any(n == "node1" for _, n, _, _ in hooks.stage_outs(job)),
            60,
        )
        job.wait_for(
            "node1's scratch removed", lambda _: not hooks.scratch("node1", job).exists(), 30
        )
        assert job.id not in hooks.ledger("node1")
        stage = [s for s in hooks.stage_outs(job) if s[1] == "node1"]
        assert stage[0][0] == "staged" and "waiting for other nodes' shards" in stage[0][3], stage
        staged = list(run_dir.glob(".shards-step-000000020-*/rank-*"))
        assert [p.name for p in staged] == ["rank-00000"]
        # Discovery: the previous whole checkpoint, never step 20 with a shard missing.
        resume = subprocess.run([str(SLURM_CKPT), "resume", "--dir", str(run_dir), "--json"],
                                capture_output=True, text=True, check=False, timeout=60)  # fmt: skip
        assert resume.returncode == 0, resume.stderr
        assert json.loads(resume.stdout)["step"] == 10
        man = _committed_manifest(run_dir)
        assert man.step == 10 and sorted(man.extra["shards"]) == ["rank-00000", "rank-00001"]
        # The job run again on the nodes that are left: every rank resumes from step 10.
        again = slurm_cluster3.sbatch(body.replace(" save\n", " resume\n"), *TWO, "-w", "node1,node3",
                                      workdir=slurm_workdir, name="c-resume")  # fmt: skip
        again.wait_state("COMPLETED", timeout=120)
        resumed = sorted(
            re.findall(
                r"^death: rank=(\d) host=(node\d) resumed=(\S+)$", again.output(), re.MULTILINE
            )
        )
        assert resumed == [("0", "node1", "10"), ("1", "node3", "10")], again.output()[-3000:]
    finally:
        # node2 is gone for good: give the next tests a whole cluster again.
        slurm_cluster3.down()
        slurm_cluster3.up(owner=os.getpid())
    figures("multinode-e2e-c-node-death", "\n".join([
        f"(c) node2 killed (SIGKILL of its {killed} processes, link cut) while rank 1 was inside a save",
        f"  reproduce: .venv/bin/pytest {THIS}::test_c_node_death_mid_save_resume_gets_previous_whole_checkpoint_survivor_cleaned",
        f"  job {rec['JobState']} {ended - killed_at:.1f} s after the kill; resume -> step 10 (step 20 has 1 of 2 shards)",
        f"  node1 epilog: {stage[0][0]} in {stage[0][2]:.3f} s; its scratch and ledger entry removed",
    ]))  # fmt: skip


def test_d_node_without_scratch_saves_its_shard_straight_to_durable_with_a_warning(
    slurm_cluster3: Cluster, slurm_workdir: Path, reference: Reference
) -> None:
    hooks = Hooks(slurm_cluster3, slurm_workdir)
    # Fill node2's scratch ledger with another job's reservation.
    state_dir = slurm_cluster3.on_node("node2", hooks.base / ".slurm-ckpt")
    state_dir.mkdir(parents=True, exist_ok=True)
    other = slurm_cluster3.on_node("node2", hooks.base / "job_999999")
    other.mkdir(exist_ok=True)  # the holder's dir exists: its reservation is not stale
    ledger = Ledger(state_dir, 256 * 1024**2)
    ledger.reserve("999999", 256 * 1024**2, uid=0, policy="shrink", min_size=1)
    try:
        job = _submit(slurm_cluster3, slurm_workdir, "d", "-w", "node1,node2")
        job.wait_state("COMPLETED", timeout=150)
        out = job.output()
        assert done_digests(slurm_workdir, 2) == reference(ARGS, 2)
        # The prolog's warning (via the TaskProlog) and the library's, in the job output.
        assert "slurm-ckpt: warning: this job asked for 32.0MiB of node-local scratch" in out
        assert re.search(
            r"rank 1 on node2 has no node-local scratch: its shards go straight to the durable", out
        )
        man = _committed_manifest(slurm_workdir / "run")
        assert man.step == 150
        shards = man.extra["shards"]
        assert shards["rank-00000"]["host"] == "node1" and shards["rank-00000"][
            "staged_from"
        ].startswith("node1:")
        assert (
            shards["rank-00001"]["host"] == "node2" and shards["rank-00001"]["staged_from"] is None
        )
        hooks.wait_epilogs(job, 2)
        assert not hooks.scratch("node1", job).exists() and not hooks.scratch("node2", job).exists()
        assert job.id not in hooks.ledger("node1") and job.id not in hooks.ledger("node2")
    finally:
        ledger.release("999999")
        other.rmdir()

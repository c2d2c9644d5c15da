"""The node hooks under the real local Slurm: Prolog, Epilog and TaskProlog configured.

One job gets its scratch and environment from the hooks, checkpoints to
scratch only, is requeued; its epilog stages the newest checkpoint out while
the test holds the durable run dir's lock, and the requeued job is shown
not to start before that stage-out ends, even when asked to start at once;
it then resumes from the staged copy. Afterwards its scratch and ledger entry
are gone and the prolog's warning is in the job's output.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import filelock
import pytest

from tests.slurm.harness import REPO, Cluster

pytestmark = [pytest.mark.slurm, pytest.mark.root]

TRAINER = """\
import json, os, sys, time
from pathlib import Path
from slurm_ckpt.store import RunDir, find_latest, load_state
from slurm_ckpt.store.codec import encode_state
from slurm_ckpt.store.writer import write_state

durable = Path(sys.argv[1])
scratch = os.environ.get("SLURM_CKPT_SCRATCH")
run = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
print(f"run {run} start {time.time():.3f} scratch {scratch}", flush=True)
fast = Path(scratch) / "ckpt"
cand = find_latest([fast, durable])
if cand is not None:
    state = load_state(cand.path, cand.manifest)
    print(f"resumed step {state['step']} from {cand.path}", flush=True)
if run == 0:
    # Fast tier only, with the tier file the Checkpointer writes: nothing drains,
    # so the epilog's stage-out is the only way step 3 reaches durable storage.
    fast.mkdir(parents=True)
    (fast / "TIER.json").write_text(json.dumps({"durable": str(durable)}))
    rd = RunDir(fast)
    for step in (1, 2, 3):
        enc = encode_state({"step": step, "blob": os.urandom(1 << 20)})
        rd.commit(step, lambda tmp: write_state(tmp, enc), nbytes=enc.nbytes)
    rd.unlock()
    print("saved 3", flush=True)
    time.sleep(600)  # until the test requeues the job
print("done", flush=True)
"""


def install_hooks(d: Path, base: Path, root: Path) -> None:
    """The README's install step (scripts/install-hooks.sh) into ``d``, with a test config.

    The stage-out may write anywhere in the test's workdir (``d``'s parent), where the
    tests' jobs put their SLURM_CKPT_DIR, as well as under ``root``.
    """
    config = d.with_name("config.yaml")
    config.write_text(
        f"scratch:\n  base: {base}\n  default_size: 16M\n  min_size: 1M\n  headroom: 64M\n"
        f"  prolog_timeout: 15\n  epilog_timeout: 40\nstorage:\n  root: {root}\n"
        f"  stage_out_roots: [{root}, {d.parent}]\n"
    )
    subprocess.run(["bash", str(REPO / "scripts" / "install-hooks.sh"), "--dest", str(d),
                    "--bin", str(Path(sys.executable).with_name("slurm-ckpt")), "--config", str(config),
                    "--log", str(d / "hooks.log")], check=True, capture_output=True, timeout=60)  # fmt: skip
    # Watchdogs below the test cluster's PrologEpilogTimeout=60.
    with open(d / "hooks.env", "a") as f:
        f.write("SLURM_CKPT_PROLOG_WATCHDOG=20\nSLURM_CKPT_EPILOG_WATCHDOG=50\n")


def log_time(line: str) -> float:
    """Epoch seconds of a hook log line (``2025-01-01 10:00:00,123 ...``, local time)."""
    stamp = " ".join(line.split()[:2])
    return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def test_scratch_stage_out_and_resume_under_slurm(
    slurm_cluster: Cluster, slurm_workdir: Path
) -> None:
    node = slurm_cluster.node_names[0]
    base = slurm_cluster.scratch / "slurm-ckpt"
    durable = slurm_workdir / "durable"
    hooks = slurm_workdir / "hooks"
    install_hooks(hooks, base, slurm_workdir / "root")
    (slurm_workdir / "trainer.py").write_text(TRAINER)
    slurm_cluster.configure({"Prolog": hooks / "slurm-ckpt-prolog", "Epilog": hooks / "slurm-ckpt-epilog",
                             "TaskProlog": hooks / "slurm-ckpt-taskprolog", "PrologFlags": "Alloc",
                             "PrologEpilogTimeout": 60})  # fmt: skip
    job = slurm_cluster.sbatch(f"srun {sys.executable} trainer.py {durable}\n", "--requeue",
                               "--comment=ckpt_scratch=999G ckpt_size=1M", workdir=slurm_workdir,
                               name="hooks")  # fmt: skip
    job.wait_output(r"saved 3", timeout=90)
    scratch = f"{base}/job_{job.id}"
    out = job.output()
    assert "run 0 start" in out and f"scratch {scratch}" in out
    # The prolog's over-reservation warning reached the job's output via the TaskProlog.
    assert "slurm-ckpt: warning: this job asked for 999.0GiB of node-local scratch" in out
    on_node = slurm_cluster.on_node(node, scratch)
    assert (on_node / "ckpt" / "step-000000003").is_dir()
    ledger = slurm_cluster.on_node(node, base / ".slurm-ckpt" / "ledger.json")
    assert job.id in json.loads(ledger.read_text())
    assert not durable.exists()  # only on scratch

    # Hold the durable run dir's lock: the stage-out (as the job's user) waits on it.
    durable.mkdir()
    lock = filelock.FileLock(str(durable / ".lock"))
    lock.acquire()
    try:
        slurm_cluster.run("scontrol", "requeue", job.id)
        job.wait_for("the requeue to end the run", lambda r: r.get("JobState") != "RUNNING", 30)
        # For 5 s, keep asking Slurm to start the job now: it must not, its epilog is running.
        states = set()
        end = time.monotonic() + 5
        while time.monotonic() < end:
            slurm_cluster.run("scontrol", "update", f"JobId={job.id}", "StartTime=now", check=False)
            states.add(job.info().get("JobState", ""))
            assert job.output().count("run 1 start") == 0
        assert "RUNNING" not in states
        assert not list(durable.glob("step-*"))
    finally:
        lock.release()
    job.skip_requeue_wait()
    job.wait_output(r"done", timeout=90)
    job.wait_state("COMPLETED", timeout=60)
    out = job.output()
    assert f"resumed step 3 from {durable}/step-000000003" in out

    log = (hooks / "hooks.log").read_text().splitlines()
    staged = next(line for line in log if f"job {job.id}: INFO: stage-out staged" in line)
    run1 = float(out.split("run 1 start ")[1].split()[0])
    assert log_time(staged) < run1, "the requeued job started before its stage-out ended"
    # After the final epilog: no scratch, no reservation.
    job.wait_for("the last epilog", lambda r: sum(f"job {job.id}: INFO: epilog done" in x for x in
                 (hooks / "hooks.log").read_text().splitlines()) >= 2, 60)  # fmt: skip
    assert not on_node.exists()
    assert job.id not in json.loads(ledger.read_text())
    print(
        f"\nstates seen while the epilog held the job: {sorted(states)}; "
        f"stage-out ended {run1 - log_time(staged):.1f}s before the requeued run started"
    )


KEPT_TRAINER = """\
import json, os, sys, time
from pathlib import Path
from slurm_ckpt.store import RunDir, find_latest
from slurm_ckpt.store.codec import encode_state
from slurm_ckpt.store.writer import write_state

good, bad = Path(sys.argv[1]), Path(sys.argv[2])
fast = Path(os.environ["SLURM_CKPT_SCRATCH"]) / "ckpt"
run = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
cand = find_latest([fast]) if fast.exists() else None
print(f"run {run}: scratch has step {cand.step if cand else None}", flush=True)
if run == 0:
    fast.mkdir(parents=True)
    # A durable dir under a file: the stage-out after this run fails, and scratch is kept.
    (fast / "TIER.json").write_text(json.dumps({"durable": str(bad)}))
    rd = RunDir(fast)
    enc = encode_state({"step": 5, "blob": os.urandom(1 << 16)})
    rd.commit(5, lambda tmp: write_state(tmp, enc), nbytes=enc.nbytes)
    rd.unlock()
    print("saved 5", flush=True)
    time.sleep(600)  # until the test requeues the job
(fast / "TIER.json").write_text(json.dumps({"durable": str(good)}))
print("done", flush=True)
"""


def test_a_requeued_run_gets_back_the_scratch_its_epilog_kept(slurm_cluster: Cluster, slurm_workdir: Path) -> None:
    """Job-id reuse is told from a requeue by the restart count, as Slurm 22.05 passes it:
    the epilog after the requeue records the count, and the next run's prolog, seeing the
    same count, adopts the kept scratch (its checkpoint is there); the last epilog then
    stages it out and removes everything."""
    node = slurm_cluster.node_names[0]
    base = slurm_cluster.scratch / "slurm-ckpt"
    hooks = slurm_workdir / "hooks"
    install_hooks(hooks, base, slurm_workdir / "root")
    (slurm_workdir / "trainer.py").write_text(KEPT_TRAINER)
    (slurm_workdir / "a-file").write_text("not a dir")
    good, bad = slurm_workdir / "durable", slurm_workdir / "a-file" / "run"
    slurm_cluster.configure({"Prolog": hooks / "slurm-ckpt-prolog", "Epilog": hooks / "slurm-ckpt-epilog",
                             "TaskProlog": hooks / "slurm-ckpt-taskprolog", "PrologFlags": "Alloc",
                             "PrologEpilogTimeout": 60})  # fmt: skip
    job = slurm_cluster.sbatch(f"srun {sys.executable} trainer.py {good} {bad}\n", "--requeue",
                               workdir=slurm_workdir, name="kept")  # fmt: skip
    job.wait_output(r"saved 5", timeout=90)
    assert "run 0: scratch has step None" in job.output()
    ledger = slurm_cluster.on_node(node, base / ".slurm-ckpt" / "ledger.json")

    def epilogs() -> int:
        return (hooks / "hooks.log").read_text().count(f"job {job.id}: INFO: epilog done")

    slurm_cluster.run("scontrol", "requeue", job.id)
    job.wait_for("the first epilog", lambda r: epilogs() >= 1, 60)
    kept = json.loads(ledger.read_text())[job.id]
    assert "stage-out failed" in kept["kept"] and kept["restarts"] == 1, kept
    job.skip_requeue_wait()
    job.wait_output(r"done", timeout=90)
    assert "run 1: scratch has step 5" in job.output()
    job.wait_state("COMPLETED", timeout=60)
    job.wait_for("the last epilog", lambda r: epilogs() >= 2, 60)
    assert (good / "step-000000005").is_dir()
    assert not slurm_cluster.on_node(node, base / f"job_{job.id}").exists()
    assert job.id not in json.loads(ledger.read_text())


HOSTILE = """\
import json, os, sys
from pathlib import Path
from slurm_ckpt.store import RunDir
from slurm_ckpt.store.codec import encode_state
from slurm_ckpt.store.writer import write_state

scratch = Path(os.environ["SLURM_CKPT_SCRATCH"])
report = Path(sys.argv[1])
print(f"scratch {scratch}", flush=True)
# The prolog's report: readable, but no write, no chmod, no hardlink to fill scratch with.
print("report readable", json.loads(report.read_text())["scratch"] == str(scratch), flush=True)
for what, act in (("chmod", lambda: report.chmod(0o644)), ("append", lambda: open(report, "a")),
                  ("hardlink", lambda: os.link(report, scratch / "mine"))):
    try:
        act()
        print(f"report {what} allowed", flush=True)
    except OSError as e:
        print(f"report {what} refused: {e.strerror}", flush=True)
fast = scratch / "ckpt"
rd = RunDir(fast)
enc = encode_state({"step": 7, "blob": os.urandom(1 << 16)})
rd.commit(7, lambda tmp: write_state(tmp, enc), nbytes=enc.nbytes)
rd.unlock()
# The tier file names the node's memory as the durable run dir.
(fast / "TIER.json").write_text(json.dumps({"durable": sys.argv[2]}))
print("saved", flush=True)
"""


def test_a_hostile_users_job_under_slurm(slurm_cluster: Cluster, slurm_workdir: Path) -> None:
    """A job of an ordinary user: the TaskProlog reads root's report for it, the report does
    not let it grow, and its epilog refuses a TIER.json naming /dev/shm, staging to the default."""
    import os
    import pwd
    import secrets

    name = f"sckt{secrets.token_hex(3)}"
    subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", "--user-group", name],
                   check=True, capture_output=True, timeout=60)  # fmt: skip
    try:
        pw = pwd.getpwnam(name)
        node = slurm_cluster.node_names[0]
        base = slurm_cluster.scratch / "slurm-ckpt"
        root = slurm_workdir / "root"
        hooks = slurm_workdir / "hooks"
        install_hooks(hooks, base, root)
        (root / name).mkdir(parents=True)
        os.chown(root / name, pw.pw_uid, pw.pw_gid)
        jobdir = slurm_workdir / "job"
        jobdir.mkdir()
        os.chown(jobdir, pw.pw_uid, pw.pw_gid)
        (jobdir / "hostile.py").write_text(HOSTILE)
        shm = f"/dev/shm/{name}"
        slurm_cluster.configure({"Prolog": hooks / "slurm-ckpt-prolog", "Epilog": hooks / "slurm-ckpt-epilog",
                                 "TaskProlog": hooks / "slurm-ckpt-taskprolog", "PrologFlags": "Alloc",
                                 "PrologEpilogTimeout": 60})  # fmt: skip
        job = slurm_cluster.sbatch(
            f'srun {sys.executable} hostile.py "{base}/.slurm-ckpt/job_$SLURM_JOB_ID.json" {shm}\n',
            f"--uid={name}", f"--gid={name}", workdir=jobdir, name="hostile",
        )
        job.wait_state("COMPLETED", timeout=90)
        log = hooks / "hooks.log"
        job.wait_for("its epilog", lambda r: f"job {job.id}: INFO: epilog done" in log.read_text(), 60)
        out = job.output()
        assert f"scratch {base}/job_{job.id}" in out and "report readable True" in out, out
        assert "allowed" not in out and out.count("refused") == 3, out
        staged = root / name / f"job_{job.id}" / "step-000000007"
        assert staged.is_dir() and staged.stat().st_uid == pw.pw_uid
        assert not slurm_cluster.on_node(node, shm).exists() and not Path(shm).exists()
        assert log.stat().st_mode & 0o777 == 0o600 and log.stat().st_uid == 0
        text = log.read_text()
        assert f"job {job.id}: WARNING: stage-out: not staging to {shm}: not under a stage-out root" in text
        assert not slurm_cluster.on_node(node, base / f"job_{job.id}").exists()
    finally:
        subprocess.run(["userdel", name], capture_output=True, timeout=60)

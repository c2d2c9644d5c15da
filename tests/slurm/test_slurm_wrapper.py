"""``srun slurm-ckpt run`` on the real cluster: signal -> checkpoint -> requeue -> resume.

Each test submits ``tests/slurm/trainer.py`` under the wrapper, drives it with
real Slurm signals and checks the outcome three ways: Slurm's view (JobState,
Restarts, ExitCode, slurmctld's "Requeuing" lines), the wrapper's event lines,
and the trainer's final weights, which must be bit-identical (SHA-256 of the
raw parameter bytes) to an uninterrupted run with the same seed. The seconds
from signal to committed checkpoint to requeue go to the figures summary.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.slurm.harness import Cluster, Job
from tests.slurm.wrapped import (
    PYTHON,
    SLURM_CKPT,
    done_digests,
    free_port,
    requeue_log_times,
    runs,
    script,
    timing_report,
)

pytestmark = pytest.mark.slurm

Figures = Callable[[str, str], Path]
Reference = Callable[[str, int], list[str]]

# ~9 s of simulated compute in an uninterrupted run; signals land around step 40-60.
ARGS = "--steps 300 --every 50 --step-time 0.03"
# The same, but only the first run is paced (for the signal to land mid-run): a resumed
# run that no test signals has nothing to wait for.
ONE_STOP = "--steps 300 --every 50 --first-step-time 0.03 --step-time 0"
THIS = "tests/slurm/test_slurm_wrapper.py"


def _started(job: Job, restarts: int, past: int = 40) -> int:
    """Wait until run ``restarts`` of the trainer is ``past`` steps beyond where it resumed.

    Returns the step it resumed from. The trainer prints every 20th step.
    """
    start = job.wait_output(rf"^trainer: start rank=0 .* from=(\d+) .*restart={restarts}$", 90)
    resumed = int(start.group(1))
    step = (resumed + past + 19) // 20 * 20
    pattern = re.compile(rf"^trainer: step {step}$", re.MULTILINE)
    job.wait_for(f"run {restarts} of the trainer past step {step}",
                 lambda _: pattern.search(job.output(), start.end()) is not None, 90)  # fmt: skip
    return resumed


def _resumed_from(job: Job) -> list[tuple[int, int]]:
    """(restart, step resumed from) of every trainer start."""
    return [(int(r), int(s)) for s, r in
            re.findall(r"^trainer: start rank=0 world=\d+ from=(\d+) pid=\d+ restart=(\d+)$",
                       job.output(), re.MULTILINE)]  # fmt: skip


def _stopped_at(job: Job) -> list[int]:
    return [
        int(s) for s in re.findall(r"^trainer: stopping at step=(\d+)", job.output(), re.MULTILINE)
    ]


def test_manual_usr1_checkpoints_requeues_and_resumes_bit_identical(
    slurm_cluster: Cluster, slurm_workdir: Path, reference: Reference, figures: Figures
) -> None:
    """(a) scancel --signal=USR1, twice back to back: one checkpoint, one requeue, exact resume."""
    job = slurm_cluster.sbatch(script(slurm_workdir, ONE_STOP), "--requeue", workdir=slurm_workdir,
                               name="usr1")  # fmt: skip
    _started(job, 0)
    sent = job.signal("USR1")
    # A second signal must do nothing harmful; it may also find the job already requeueing.
    slurm_cluster.run("scancel", "--signal=USR1", job.id, check=False)
    job.skip_requeue_wait(restarts=1)
    rec = job.wait_state("COMPLETED", timeout=120)

    assert rec["Restarts"] == "1"
    requeued = requeue_log_times(slurm_cluster, job)
    assert len(requeued) == 1
    # The second USR1 also hits the wrapper's own scontrol calls; they must survive it.
    assert "cannot read job" not in job.output()
    first, second = runs(job.output())
    assert first.find("signal", signal="USR1", action="request")
    assert len(first.find("requeue")) == 1 and not second.find("requeue")
    stopped = _stopped_at(job)
    assert len(stopped) == 1 and first.find("committed", step=str(stopped[0]))
    assert _resumed_from(job) == [(0, 0), (1, stopped[0])]
    assert done_digests(slurm_workdir) == reference(ONE_STOP, 1)
    figures("slurm-e2e-a-manual-usr1", timing_report(
        "(a) scancel --signal=USR1 -> checkpoint -> requeue", f"{THIS}::{_name()}",
        [("USR1 (scancel)", first, sent, requeued[0])]))  # fmt: skip


def test_time_limit_signal_checkpoints_requeues_and_resumes(
    slurm_cluster: Cluster, slurm_workdir: Path, reference: Reference, figures: Figures
) -> None:
    """(b) --time=2 --signal=USR1@100, no manual signal.

    slurmctld checks time limits every 30 s, so USR1 comes 20-50 s into the
    run; the first run is slowed (0.25 s a step) to still be training then.
    """
    args = ARGS + " --first-step-time 0.25"
    job = slurm_cluster.sbatch(script(slurm_workdir, args), "--requeue", "--time=2",
                               "--signal=USR1@100", workdir=slurm_workdir, name="timer")  # fmt: skip
    job.skip_requeue_wait(restarts=1, timeout=120)
    rec = job.wait_state("COMPLETED", timeout=120)

    assert rec["Restarts"] == "1"
    first, second = runs(job.output())
    assert first.find("signal", signal="USR1", action="request")
    assert first.find("requeue") and not second.find("requeue")
    stopped = _stopped_at(job)
    assert len(stopped) == 1 and 0 < stopped[0] < 300
    assert _resumed_from(job) == [(0, 0), (1, stopped[0])]
    assert done_digests(slurm_workdir) == reference(args, 1)
    figures("slurm-e2e-b-time-limit", timing_report(
        "(b) --time=2 --signal=USR1@100 -> checkpoint -> requeue", f"{THIS}::{_name()}",
        [("USR1 (time limit)", first, None, None)]))  # fmt: skip


def test_dataloader_workers_survive_usr1_and_sigterm(
    slurm_cluster: Cluster, slurm_workdir: Path, reference: Reference, figures: Figures
) -> None:
    """(b2) num_workers=2: Slurm signals every process of the step, workers included."""
    args = ARGS + " --workers 2"
    job = slurm_cluster.sbatch(script(slurm_workdir, args), "--requeue", workdir=slurm_workdir,
                               name="workers")  # fmt: skip
    _started(job, 0)
    sent_usr1 = job.signal("USR1")
    job.skip_requeue_wait(restarts=1)
    _started(job, 1)
    sent_term = job.signal("TERM")
    job.skip_requeue_wait(restarts=2)
    rec = job.wait_state("COMPLETED", timeout=120)

    assert rec["Restarts"] == "2"
    out = job.output()
    assert "DataLoader worker" not in out and "Traceback" not in out
    first, second, third = runs(out)
    assert first.find("signal", signal="USR1", action="request")
    assert second.find("signal", signal="TERM", action="request")
    for run in (first, second):
        assert run.find("child-exit", code="0") and len(run.find("requeue")) == 1
        assert all("stragglers" not in e for e in run.find("teardown"))
    assert not third.find("requeue")
    assert [r for r, _ in _resumed_from(job)] == [0, 1, 2]
    assert [s for _, s in _resumed_from(job)][1:] == _stopped_at(job)
    assert done_digests(slurm_workdir) == reference(args, 1)
    requeued = requeue_log_times(slurm_cluster, job)
    figures("slurm-e2e-b2-dataloader-workers", timing_report(
        "(b2) num_workers=2: USR1 then SIGTERM, each -> checkpoint -> requeue", f"{THIS}::{_name()}",
        [("USR1 (scancel)", first, sent_usr1, requeued[0]),
         ("TERM (scancel)", second, sent_term, requeued[1])]))  # fmt: skip


def test_two_ranks_save_shards_requeue_once_and_resume(
    slurm_cluster: Cluster, slurm_workdir: Path, reference: Reference, figures: Figures
) -> None:
    """(c) srun -n 2 with gloo: both ranks save a shard of one checkpoint; one requeue."""
    pre = f"export MASTER_ADDR=127.0.0.1 MASTER_PORT={free_port()}\n"
    job = slurm_cluster.sbatch(script(slurm_workdir, ONE_STOP, srun_args="-n 2", pre=pre),
                               "--requeue", "-n", "2", workdir=slurm_workdir, name="ranks")  # fmt: skip
    _started(job, 0)
    sent = job.signal("USR1")
    job.wait_output(r"^trainer: stopping at step=", count=2)
    stops = re.findall(r"^trainer: stopping at step=(\d+)", job.output(), re.MULTILINE)
    assert stops[0] == stops[1]  # both ranks, at the same step
    step = int(stops[0])
    # One checkpoint, a shard per rank (looked at now: retention prunes it later).
    ckpt = slurm_workdir / "run" / f"step-{step:09d}"
    assert sorted(p.name for p in ckpt.glob("rank-*")) == ["rank-00000", "rank-00001"]
    assert (ckpt / "MANIFEST.json").is_file()
    job.skip_requeue_wait(restarts=1)
    rec = job.wait_state("COMPLETED", timeout=120)

    assert rec["Restarts"] == "1"
    requeued = requeue_log_times(slurm_cluster, job)
    assert len(requeued) == 1
    by = {(r.rank, r.restarts): r for r in runs(job.output())}
    assert sorted(by) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert len(by[0, 0].find("requeue")) == 1
    assert (
        not by[1, 0].find("requeue")
        and not by[0, 1].find("requeue")
        and not by[1, 1].find("requeue")
    )
    assert len(_stopped_at(job)) == 2
    starts = re.findall(r"^trainer: start rank=(\d) world=2 from=(\d+) pid=\d+ restart=1$",
                        job.output(), re.MULTILINE)  # fmt: skip
    assert sorted(starts) == [("0", str(step)), ("1", str(step))]
    assert done_digests(slurm_workdir, 2) == reference(ONE_STOP, 2)
    figures("slurm-e2e-c-two-ranks", timing_report(
        "(c) srun -n 2, gloo: USR1 -> sharded checkpoint -> one requeue", f"{THIS}::{_name()}",
        [("USR1 (scancel)", by[0, 0], sent, requeued[0])]))  # fmt: skip


def test_sigterm_checkpoints_and_requeues(
    slurm_cluster: Cluster, slurm_workdir: Path, reference: Reference, figures: Figures
) -> None:
    """(e) Preemption-like scancel --signal=TERM: the job stays RUNNING, so it is no cancel."""
    job = slurm_cluster.sbatch(script(slurm_workdir, ONE_STOP), "--requeue", workdir=slurm_workdir,
                               name="term")  # fmt: skip
    _started(job, 0)
    sent = job.signal("TERM")
    job.skip_requeue_wait(restarts=1)
    rec = job.wait_state("COMPLETED", timeout=120)

    assert rec["Restarts"] == "1"
    first, second = runs(job.output())
    assert first.find("signal", signal="TERM", action="request")
    assert first.find("requeue") and not second.find("requeue")
    assert _resumed_from(job) == [(0, 0), (1, _stopped_at(job)[0])]
    assert done_digests(slurm_workdir) == reference(ONE_STOP, 1)
    requeued = requeue_log_times(slurm_cluster, job)
    figures("slurm-e2e-e-sigterm", timing_report(
        "(e) scancel --signal=TERM -> checkpoint -> requeue", f"{THIS}::{_name()}",
        [("TERM (scancel)", first, sent, requeued[0])]))  # fmt: skip


def test_max_requeues_stops_the_second_time(slurm_cluster: Cluster, slurm_workdir: Path) -> None:
    """(d) --max-requeues 1 and two signals: the second checkpoints but does not requeue."""
    job = slurm_cluster.sbatch(script(slurm_workdir, ARGS, wrapper_args="--max-requeues 1"),
                               "--requeue", workdir=slurm_workdir, name="maxrq")  # fmt: skip
    _started(job, 0)
    job.signal("USR1")
    job.skip_requeue_wait(restarts=1)
    _started(job, 1)
    job.signal("USR1")
    rec = job.wait_finished(timeout=60)

    assert (rec["JobState"], rec["Restarts"], rec["ExitCode"]) == ("COMPLETED", "1", "0:0")
    assert len(requeue_log_times(slurm_cluster, job)) == 1
    first, second = runs(job.output())
    assert first.find("requeue")
    assert not second.find("requeue")
    (why,) = second.find("no-requeue")
    assert why["reason"] == "max-requeues"
    assert "--max-requeues is 1" in why["msg"]
    assert len(_stopped_at(job)) == 2  # the second signal still got its checkpoint
    assert not done_digests(slurm_workdir)[0]


NO_CKPT_CHILD = """\
import time
from slurm_ckpt import Checkpointer
ckpt = Checkpointer()
print("child: listening", flush=True)
while not ckpt.preempted:
    time.sleep(0.05)
print("child: stopping without a checkpoint", flush=True)
"""


def test_no_progress_guard_does_not_requeue(slurm_cluster: Cluster, slurm_workdir: Path) -> None:
    """(d) A run that commits no new checkpoint after the signal is not requeued."""
    (slurm_workdir / "child.py").write_text(NO_CKPT_CHILD)
    body = (f"export SLURM_CKPT_DIR={slurm_workdir}/run\n"
            f"srun {SLURM_CKPT} run -- {PYTHON} {slurm_workdir}/child.py\n")  # fmt: skip
    job = slurm_cluster.sbatch(body, "--requeue", workdir=slurm_workdir, name="noprog")
    job.wait_output(r"^child: listening$")
    job.signal("USR1")
    rec = job.wait_finished(timeout=60)

    assert (rec["JobState"], rec["Restarts"]) == ("COMPLETED", "0")
    assert "child: stopping without a checkpoint" in job.output()
    (run,) = runs(job.output())
    (why,) = run.find("no-requeue")
    assert why["reason"] == "no-progress"
    assert not run.find("requeue")
    assert requeue_log_times(slurm_cluster, job) == []


def test_crashed_child_fails_the_job_with_its_code(
    slurm_cluster: Cluster, slurm_workdir: Path
) -> None:
    """(d) A crash is passed through: FAILED, the child's exit code, no requeue."""
    job = slurm_cluster.sbatch(script(slurm_workdir, ARGS + " --crash-at 30 --crash-code 3"),
                               "--requeue", workdir=slurm_workdir, name="crash")  # fmt: skip
    rec = job.wait_finished(timeout=60)

    assert (rec["JobState"], rec["ExitCode"], rec["Restarts"]) == ("FAILED", "3:0", "0")
    (run,) = runs(job.output())
    assert run.find("child-exit", code="3")
    (why,) = run.find("no-requeue")
    assert why["reason"] == "crashed"
    assert requeue_log_times(slurm_cluster, job) == []


def _name() -> str:
    """The running test's name, for the reproduce line."""
    return os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0].split("::")[-1]

"""Lightning, HF Trainer and Accelerate under ``srun slurm-ckpt run`` on the real cluster.

Each framework's example (``examples/*_train.py``, CPU, a tiny model) runs as
a ``--requeue --signal=USR1@120`` batch job under the wrapper. The test sends the checkpoint
signal (``scancel --signal=USR1``) twice, at two points mid-epoch; each time
the trainer must commit a checkpoint at the next step and exit 0, the wrapper
must requeue the job, and the next run must resume from that checkpoint. The
job must end COMPLETED after two restarts with the losses of every step and
the final weights (SHA-256 of the raw bytes) equal to those of one run that
never stopped, computed here without Slurm.

The peers' own handling of the same signal, measured with the same models
(``peer_trainer.py``), runs when ``SLURM_CKPT_MEASURE_PEERS=1`` is set: it is
a measurement for the docs (it records what happens and asserts only how each
peer reacts), not a check of slurm-ckpt.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.slurm.harness import REPO, Cluster, Job
from tests.slurm.wrapped import PYTHON, SLURM_CKPT, requeue_log_times, runs, timing_report

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

Figures = Callable[[str, str], Path]
EXAMPLES = REPO / "examples"
PEER = Path(__file__).resolve().parent / "peer_trainer.py"
THIS = "tests/slurm/test_frameworks_e2e.py"
STEPS, EVERY, STEP_TIME = 60, 15, 0.25
# The measurement of the peers is opt-in; read here, before the suite's fixture clears SLURM_CKPT_*.
MEASURE_PEERS = os.environ.get("SLURM_CKPT_MEASURE_PEERS", "") not in ("", "0")

# name -> (example, its line prefix, the module it needs)
FRAMEWORKS = {
    "lightning": ("lightning_train.py", "lightning", "lightning.pytorch"),
    "hf_trainer": ("hf_trainer_train.py", "hf", "transformers"),
    "accelerate": ("accelerate_train.py", "accelerate", "accelerate"),
}
_OFFLINE = "export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1\n"


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[str, str]]:
    """``reference(framework)``: (metrics.jsonl text, weights digest) of an unstopped run, no Slurm."""
    cache: dict[str, tuple[str, str]] = {}

    def get(framework: str) -> tuple[str, str]:
        if framework not in cache:
            out = tmp_path_factory.mktemp(f"ref-{framework}")
            env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
            env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
            argv = [str(PYTHON), str(EXAMPLES / FRAMEWORKS[framework][0]), "--steps", str(STEPS),
                    "--no-ckpt", "--out", str(out)]  # fmt: skip
            proc = subprocess.run(argv, env=env, cwd=out, capture_output=True, text=True, timeout=400,
                                  check=False)  # fmt: skip
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
            cache[framework] = ((out / "metrics.jsonl").read_text(), (out / "done.txt").read_text().strip())
        return cache[framework]

    return get


def _steps(workdir: Path) -> list[int]:
    path = workdir / "out" / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


def _running_past(job: Job, workdir: Path, prefix: str, restarts: int, past: int) -> int:
    """Wait until run ``restarts`` started and its metrics passed ``past`` steps beyond its start."""
    start = job.wait_output(rf"^{prefix}: start from=(\d+) restart={restarts}$", 180)
    resumed = int(start.group(1))
    job.wait_for(f"run {restarts} past {past} steps",
                 lambda _: bool(_steps(workdir)) and _steps(workdir)[-1] >= resumed + past,
                 180)  # fmt: skip
    return resumed


@pytest.mark.parametrize("framework", list(FRAMEWORKS))
def test_requeued_twice_resumes_bit_identical(slurm_cluster: Cluster, slurm_workdir: Path, framework: str,
                                              reference: Callable[[str], tuple[str, str]],
                                              figures: Figures) -> None:  # fmt: skip
    example, prefix, module = FRAMEWORKS[framework]
    pytest.importorskip(module)
    script = (f"export SLURM_CKPT_DIR={slurm_workdir}/run\n{_OFFLINE}"
              f"srun {SLURM_CKPT} run -- {PYTHON} {EXAMPLES / example} --steps {STEPS} --every {EVERY} "
              f"--step-time {STEP_TIME} --out {slurm_workdir}/out\n")  # fmt: skip
    # The job script's lines as the docs give them, --signal included; the two
    # interruptions come from scancel, whose USR1 reaches the srun tasks the same
    # way, at a step the test chooses (slurmctld sends the time-limit signal only
    # at its 30 s checks, too coarse to land twice mid-epoch).
    job = slurm_cluster.sbatch(script, "--requeue", "--signal=USR1@120", "--time=30",
                               workdir=slurm_workdir, name=framework)  # fmt: skip
    sent = []
    for restarts in (0, 1):
        _running_past(job, slurm_workdir, prefix, restarts, past=10)
        sent.append(job.signal("USR1"))
        job.skip_requeue_wait(restarts=restarts + 1, timeout=120)
    rec = job.wait_state("COMPLETED", timeout=300)

    out = job.output()
    assert rec["Restarts"] == "2"
    stops = [int(s) for s in re.findall(rf"^{prefix}: stopping at step=(\d+)", out, re.MULTILINE)]
    starts = [int(s) for s in re.findall(rf"^{prefix}: start from=(\d+) restart=\d+$", out, re.MULTILINE)]
    assert len(stops) == 2 and 10 <= stops[0] < stops[1] < STEPS
    assert starts == [0, *stops]  # each run resumed where the one before it stopped
    first, second, third = runs(out)
    for run, stop in ((first, stops[0]), (second, stops[1])):
        assert run.find("signal", signal="USR1", action="request")
        assert run.find("committed", step=str(stop)) and len(run.find("requeue")) == 1
    assert not third.find("requeue")
    ref_metrics, ref_digest = reference(framework)
    assert _steps(slurm_workdir) == list(range(1, STEPS + 1))  # the history goes on, nothing redone
    assert (slurm_workdir / "out" / "metrics.jsonl").read_text() == ref_metrics
    assert (slurm_workdir / "out" / "done.txt").read_text().strip() == ref_digest
    requeued = requeue_log_times(slurm_cluster, job)
    figures(f"slurm-e2e-{framework}", timing_report(
        f"{framework} under srun slurm-ckpt run: USR1 twice -> checkpoint -> requeue -> resume; "
        f"stopped at steps {stops}, final weights {ref_digest[:16]} = unstopped run", f"{THIS}::{_name()}",
        [("USR1 (scancel)", first, sent[0], requeued[0]),
         ("USR1 (scancel)", second, sent[1], requeued[1])]))  # fmt: skip


PEERS = {"lightning": "lightning", "hf_trainer": "hf", "accelerate": "accelerate"}


@pytest.mark.skipif(not MEASURE_PEERS, reason="a measurement of the peers; set SLURM_CKPT_MEASURE_PEERS=1")
@pytest.mark.parametrize("framework", list(PEERS))
def test_measure_peer_on_usr1(slurm_cluster: Cluster, slurm_workdir: Path, framework: str,
                              reference: Callable[[str], tuple[str, str]], figures: Figures) -> None:  # fmt: skip
    """The framework alone under ``srun``, the same scancel --signal=USR1 mid-run (step ~20)."""
    pytest.importorskip(FRAMEWORKS[framework][2])
    argv = [str(PYTHON), str(PEER), PEERS[framework], "--steps", str(STEPS), "--every", str(EVERY),
            "--step-time", str(STEP_TIME), "--out", f"{slurm_workdir}/out"]  # fmt: skip
    job = slurm_cluster.sbatch(f"{_OFFLINE}srun {shlex.join(argv)}\n", "--requeue", workdir=slurm_workdir,
                               name=f"peer-{framework}")  # fmt: skip
    job.wait_output(r"^peer: start from=\S+ restart=0$", 180)
    job.wait_for("past step 20", lambda _: bool(_steps(slurm_workdir)) and _steps(slurm_workdir)[-1] >= 20, 180)
    at = _steps(slurm_workdir)[-1]
    job.signal("USR1")
    if framework == "lightning":
        job.skip_requeue_wait(restarts=1, timeout=120)
    rec = job.wait_finished(timeout=300)
    out = job.output()
    steps = _steps(slurm_workdir)
    done = slurm_workdir / "out" / "done.txt"
    digest = done.read_text().strip() if done.exists() else ""
    ref_metrics, ref_digest = reference(framework)
    hpc = sorted(p.name for p in (slurm_workdir / "out").glob("hpc_ckpt_*.ckpt"))
    said = re.findall(r"^(?:peer:.*|.*(?:Requeu|requeu|SIGTERM|srun: error).*)$", out, re.MULTILINE)
    lines = [
        f"peer {framework} alone under srun, --requeue, scancel --signal=USR1 at step ~{at}",
        f"  reproduce: SLURM_CKPT_MEASURE_PEERS=1 .venv/bin/pytest {THIS}::{_name()}",
        f"  JobState={rec.get('JobState')} Restarts={rec.get('Restarts')} ExitCode={rec.get('ExitCode')}",
        f"  steps logged={len(steps)} distinct={len(set(steps))} redone={len(steps) - len(set(steps))} "
        f"last={steps[-1] if steps else None}",
        f"  hpc checkpoints: {hpc}",
        f"  final weights: {'none (did not finish)' if not digest else digest[:16]} "
        f"({'= unstopped run' if digest == ref_digest else 'differs from unstopped run ' + ref_digest[:16]})",
        "  output: " + " | ".join(said)[-1500:],
    ]
    figures(f"peer-{framework}", "\n".join(lines))
    if framework == "lightning":
        # Lightning's handler saved an hpc checkpoint and requeued the job itself.
        assert rec["Restarts"] == "1" and hpc
    else:
        # No handler: USR1's default action ends the trainer; nobody requeues.
        assert rec["Restarts"] == "0" and not digest
    assert ref_metrics  # the reference run the record compares against ran


def _name() -> str:
    """The running test's name, for the reproduce line."""
    return os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0].split("::")[-1]

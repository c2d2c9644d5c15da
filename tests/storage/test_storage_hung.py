"""Saves while the durable tier hangs (servers stopped): bounded by ``storage.hang_timeout``.

A call blocked on a hung FUSE mount cannot be interrupted, so the bound is a
worker the trainer stops waiting for. Without scratch the save fails typed and
the previous checkpoint stays the newest; with scratch it commits there and
the copy to the durable tier catches up once the servers are back. Each test
stops servers inside :meth:`Lab.hung`, whose watchdog continues them whatever
the test is doing.
"""

from __future__ import annotations

import errno
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_ckpt import Checkpointer, StorageHung
from slurm_ckpt.config import Config, Duration, MetricsConfig, StorageConfig
from slurm_ckpt.node import run_epilog, run_prolog
from slurm_ckpt.node.stageresult import StageResult
from slurm_ckpt.placement import Local
from slurm_ckpt.store import find_latest
from tests.faults.helpers import check_state, state
from tests.node.conftest import pub_tmp, scratch_base, user  # noqa: F401 - fixtures
from tests.node.helpers import User, make_cfg, owned_tree, write_ckpt
from tests.storage.lab import Lab

pytestmark = pytest.mark.root

HANG = 4.0
"""storage.hang_timeout of these tests, in seconds."""
MARGIN = 15.0
"""Slack on every time bound: the machine is shared."""

SICK = [("ceph", "ceph-mds"), ("ceph", "ceph-osd")]
"""CephFS: ceph-fuse blocks without end while these are stopped, and completes once continued."""


def _config(tmp_path: Path) -> Config:
    return Config(storage=StorageConfig(keep=3, retry_backoff=0.01, hang_timeout=Duration(HANG)),
                  metrics=MetricsConfig(textfile_dir=str(tmp_path / "metrics")))  # fmt: skip


def _stalled_metric(tmp_path: Path) -> float:
    text = "".join(p.read_text() for p in (tmp_path / "metrics").glob("*.prom"))
    line = next(x for x in text.splitlines() if x.startswith("slurm_ckpt_durable_stalled{"))
    return float(line.split()[-1])


@pytest.mark.parametrize(("fs", "server"), SICK)
def test_save_without_scratch_fails_typed_within_the_bound(lab: Lab, tmp_path: Path, fs: str, server: str) -> None:
    run = lab.mount(fs, "a") / f"hung-noscratch-{os.getpid()}-{server}"
    ckpt = Checkpointer(run, config=_config(tmp_path), scratch=False)
    live = state(2)
    try:
        ckpt.save(state(1), step=1)
        with lab.hung(server, bound=90):
            t0 = time.monotonic()
            with pytest.raises(StorageHung) as hung:
                ckpt.save(live, step=2)
            took = time.monotonic() - t0
            assert HANG <= took < HANG + MARGIN
            err = hung.value
            assert isinstance(err, TimeoutError) and err.errno == errno.ETIMEDOUT
            assert err.filename == str(run) and "hang_timeout" in str(err) and "SLURM_CKPT_SCRATCH" in str(err)
            assert _stalled_metric(tmp_path) == 1
            # The trainer goes on, and changes the state the hung save was writing.
            live["model"]["w"].add_(1000.0)
            t0 = time.monotonic()
            with pytest.raises(StorageHung):  # the stuck call is not piled on: this one fails at once
                ckpt.save(state(3), step=3)
            assert time.monotonic() - t0 < HANG
        assert isinstance(ckpt.placement, Local)
        stuck = ckpt.placement.bound.abandoned
        if stuck is not None:
            stuck.join(120)
        assert _stalled_metric(tmp_path) == 0
        # Through the other mount: step 1 is the newest valid one; the given-up save committed
        # nothing written after it was given up, and left no temp dir.
        other = lab.mount(fs, "b") / run.name
        cand = find_latest([other], full=True)
        assert cand is not None and cand.step == 1
        assert not [p.name for p in other.iterdir() if p.name.startswith(".tmp-")]
        # The storage is back: the next save commits.
        ckpt.save(state(4), step=4)
        reader = Checkpointer(other, config=_config(tmp_path), scratch=False)
        check_state(reader.load_latest(), 4)
        reader.close()
    finally:
        ckpt.close()


@pytest.mark.parametrize(("fs", "server"), SICK)
def test_save_with_scratch_commits_there_and_drains_after(lab: Lab, tmp_path: Path, fs: str, server: str) -> None:
    run = lab.mount(fs, "a") / f"hung-scratch-{os.getpid()}-{server}"
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    ckpt = Checkpointer(run, config=_config(tmp_path), scratch=scratch)
    try:
        ckpt.save(state(1), step=1)
        assert ckpt.drain(60)
        with lab.hung(server, bound=90):
            t0 = time.monotonic()
            path = ckpt.save(state(2), step=2)
            assert time.monotonic() - t0 < MARGIN
            assert path.is_relative_to(scratch)
            # The copy to the durable tier hangs: waiting for it stops at the bound.
            t0 = time.monotonic()
            assert not ckpt.drain(timeout=HANG + 2 * MARGIN)
            assert time.monotonic() - t0 < HANG + MARGIN
            assert _stalled_metric(tmp_path) == 1
            assert ckpt.save(state(3), step=3).is_relative_to(scratch)
        tiers = ckpt.tiers
        assert tiers is not None
        drainer = tiers._drainer
        with drainer.cv:
            assert drainer.cv.wait_for(lambda: not drainer.stalled, 120)
        assert ckpt.drain(120)
        assert _stalled_metric(tmp_path) == 0
        reader = Checkpointer(lab.mount(fs, "b") / run.name, config=_config(tmp_path), scratch=False,
                              lock_timeout=None)  # fmt: skip
        check_state(reader.load_latest(), 3)
        reader.close()
    finally:
        ckpt.close()


def test_close_after_the_drain_returns_within_the_bound(lab: Lab, tmp_path: Path) -> None:
    """The drain is idle, then the MDS (which holds the run dir's lock) stops:
    close() gives up releasing that lock after the bound instead of hanging."""
    run = lab.mount("ceph", "a") / f"hung-close-{os.getpid()}"
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    ckpt = Checkpointer(run, config=_config(tmp_path), scratch=scratch)
    assert isinstance(ckpt.placement, Local)
    bound = ckpt.placement.bound
    try:
        ckpt.save(state(1), step=1)
        assert ckpt.drain(60)
        with lab.hung("ceph-mds", bound=90):
            t0 = time.monotonic()
            ckpt.close()
            assert time.monotonic() - t0 < HANG + MARGIN
    finally:
        ckpt.close()
    if bound.abandoned is not None:  # the release, once the MDS is back
        bound.abandoned.join(120)
    reader = Checkpointer(lab.mount("ceph", "b") / run.name, config=_config(tmp_path), scratch=False,
                          lock_timeout=60)  # fmt: skip
    check_state(reader.load_latest(), 1)
    reader.close()


_TRAINER = """
import os, sys, time
from slurm_ckpt import Checkpointer
from tests.faults.helpers import state
ckpt = Checkpointer()
ckpt.load_latest()
if os.environ.get("SLURM_RESTART_COUNT", "0") != "0":
    print("resumed", ckpt.loaded_step, ckpt.loaded_path, flush=True)
    ckpt.close()
    sys.exit(0)
ckpt.save(state(1, kib=4096), step=1)
assert ckpt.drain(60)
print("durable 1", flush=True)
step = 1
while True:
    step += 1
    if ckpt.maybe_save(lambda: state(step, kib=4096), step):
        print("committed", step, flush=True)
        break
    time.sleep(0.01)  # a training step
ckpt.close()
print("closed", flush=True)
"""


def _lines(proc: subprocess.Popen[str]) -> queue.Queue[tuple[float, str]]:
    """Every line the process writes (stdout and stderr), with the time it was read."""
    q: queue.Queue[tuple[float, str]] = queue.Queue()

    def pump(stream: object) -> None:
        for line in stream:  # type: ignore[attr-defined]
            q.put((time.monotonic(), line.rstrip("\n")))

    for stream in (proc.stdout, proc.stderr):
        threading.Thread(target=pump, args=(stream,), daemon=True).start()
    return q


def _until(q: queue.Queue[tuple[float, str]], want: str, timeout: float, seen: list[str]) -> tuple[float, str]:
    """The first line starting with ``want`` (the wrapper's events echo the command, prints and all)."""
    end = time.monotonic() + timeout
    while True:
        try:
            t, line = q.get(timeout=max(0.0, end - time.monotonic()))
        except queue.Empty:
            raise AssertionError(f"no {want!r} in {timeout:.0f}s; output so far:\n" + "\n".join(seen)) from None
        seen.append(line)
        if line.startswith(want):
            return t, line


@pytest.fixture
def wrapper_env(tmp_path: Path) -> Iterator[dict[str, str]]:
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SLURM_CKPT_"))}
    env.update(PYTHONPATH=str(Path(__file__).resolve().parents[2]), SLURM_CKPT_SCRATCH=str(scratch),
               SLURM_CKPT_STORAGE_HANG_TIMEOUT=str(HANG), SLURM_CKPT_CONFIG=str(tmp_path / "none.yaml"),
               SLURM_CKPT_WRAPPER_WAIT="120")  # fmt: skip
    (tmp_path / "none.yaml").write_text("{}\n")
    yield env


def test_emergency_save_commits_on_scratch_and_the_resumed_run_finds_it(
    lab: Lab, tmp_path: Path, wrapper_env: dict[str, str], record_property: object
) -> None:
    run = lab.mount("ceph", "a") / f"hung-wrapper-{os.getpid()}"
    env = {**wrapper_env, "SLURM_CKPT_DIR": str(run)}
    cli = str(Path(sys.executable).parent / "slurm-ckpt")
    proc = subprocess.Popen([cli, "run", "--local", "--", sys.executable, "-c",
                             _TRAINER], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    q, seen = _lines(proc), list[str]()
    try:
        _until(q, "durable 1", 120, seen)
        with lab.hung("ceph-osd", bound=90):
            t_sig = time.monotonic()
            os.kill(proc.pid, signal.SIGUSR1)
            t_commit, _ = _until(q, "slurm-ckpt run: event=committed", 60, seen)
            t_closed, _ = _until(q, "closed", HANG + 2 * MARGIN, seen)
            t_cont = time.monotonic()
        t_exit, _ = _until(q, "slurm-ckpt run: event=child-exit", 120, seen)
        t_resumed, resumed = _until(q, "resumed", 120, seen)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(60)
    timeline = {"commit_on_scratch": t_commit - t_sig, "close_returned": t_closed - t_sig,
                "servers_continued": t_cont - t_sig, "drained_and_exited": t_exit - t_sig,
                "resumed": t_resumed - t_sig}  # fmt: skip
    print("timeline (s after the signal):", {k: round(v, 2) for k, v in timeline.items()})
    record_property("timeline", timeline)  # type: ignore[operator]
    assert timeline["commit_on_scratch"] < MARGIN, seen
    assert timeline["close_returned"] < HANG + MARGIN, seen
    step = int(next(x for x in seen if x.startswith("committed")).split()[1])
    assert resumed.split()[1] == str(step), seen
    # The copy to the durable tier caught up once the servers were back.
    cand = find_latest([lab.mount("ceph", "b") / run.name], full=True)
    assert cand is not None and cand.step == step


def test_epilog_stage_out_on_a_hung_tier_ends_in_time_and_keeps_scratch(
    lab: Lab, scratch_base: Path, user: User  # noqa: F811 - fixtures
) -> None:
    root = lab.mount("ceph", "a") / f"hung-epilog-{os.getpid()}"
    root.mkdir(mode=0o755)
    durable = root / user.name / "job_141"
    owned_tree(root / user.name, user)
    owned_tree(durable, user)
    timeout = 20.0
    cfg = make_cfg(scratch_base, root, epilog_timeout=timeout)
    env = user.env("141")
    run_prolog(env, cfg)
    write_ckpt(scratch_base / "job_141" / "ckpt", 3, owner=user)
    result: list[StageResult | None] = []
    with lab.hung("ceph-osd", bound=120):
        t0 = time.monotonic()
        t = threading.Thread(target=lambda: result.append(run_epilog(env, cfg)), daemon=True)
        t.start()
        t.join(timeout + 2 * MARGIN)  # hang guard
        took = time.monotonic() - t0
        assert not t.is_alive(), "the epilog hung with the durable tier"
    print(f"epilog on a hung CephFS tier: {took:.1f}s (epilog_timeout {timeout:.0f}s): {result}")
    assert took < timeout + MARGIN
    res = result[0]
    assert isinstance(res, StageResult) and res.status == "timeout", res  # the child hung on the tier
    assert (scratch_base / "job_141" / "ckpt" / "step-000000003").is_dir()

"""``slurm-ckpt run --local`` end to end: real wrapper process, real children, real signals.

The child is this file run as a script (``python test_wrapper.py child …``): a
trainer that uses the real library, whose state is a deterministic running
value, so "resumed" and "finished with the right result" are checkable.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from slurm_ckpt.wrapper.events import parse_event
from slurm_ckpt.wrapper.proctree import descendants

ROOT = Path(__file__).resolve().parents[2]
CHILD = [sys.executable, __file__, "child"]


@dataclass
class Run:
    code: int
    events: list[dict[str, str]]
    stdout: str
    stderr: str

    def of(self, name: str) -> list[dict[str, str]]:
        return [e for e in self.events if e["event"] == name]


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "SCONTROL", "THP_MEM_ALLOC_ENABLE"))}  # fmt: skip
    env.update(SLURM_CKPT_DIR=str(tmp_path / "ckpt"), PYTHONPATH=str(ROOT), **extra)
    return env


def _wrapper_argv(*args: str) -> list[str]:
    return [sys.executable, "-c", "from slurm_ckpt.cli import main; main()", "run", *args]


class Live:
    """A running wrapper whose event lines are read as they come."""

    def __init__(self, argv: list[str], env: dict[str, str], preexec: Any = None) -> None:
        self.proc = subprocess.Popen(argv, env=env, text=True, preexec_fn=preexec,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
        self.err: list[str] = []
        self.out: list[str] = []
        self._readers = [threading.Thread(target=self._read, args=(f, buf), daemon=True)
                         for f, buf in ((self.proc.stderr, self.err), (self.proc.stdout, self.out))]  # fmt: skip
        for t in self._readers:
            t.start()

    @staticmethod
    def _read(stream: Any, buf: list[str]) -> None:
        for line in stream:
            buf.append(line)

    def wait_event(self, name: str, timeout: float = 30.0) -> dict[str, str]:
        def seen() -> dict[str, str] | None:
            return next((e for e in map(parse_event, list(self.err)) if e and e["event"] == name), None)

        return wait_for(seen, timeout, f"event {name}")  # type: ignore[no-any-return]

    def finish(self, timeout: float = 60) -> Run:
        try:
            self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            for t in self._readers:
                t.join(10)
        err = "".join(self.err)
        events = [e for e in map(parse_event, err.splitlines()) if e is not None]
        return Run(self.proc.returncode, events, "".join(self.out), err)


def start(tmp_path: Path, wrapper_args: list[str], child: list[str], **env: str) -> Live:
    return Live(_wrapper_argv(*wrapper_args, "--", *child), _env(tmp_path, **env))


def wrap(tmp_path: Path, wrapper_args: list[str], child_args: list[str], **env: str) -> Run:
    return start(tmp_path, wrapper_args, [*CHILD, *child_args], **env).finish()


def expected_acc(steps: int) -> int:
    acc = 1
    for step in range(1, steps + 1):
        acc = (acc * 31 + step) % 1_000_003
    return acc


def wait_for(cond: Any, timeout: float = 20.0, what: str = "condition") -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = cond()
        if got:
            return got
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def test_local_preempt_resume_finish(tmp_path: Path) -> None:
    out = tmp_path / "result"
    r = wrap(tmp_path, ["--local", "--preempt-after", "0.5"],
             ["--steps", "150", "--step-time", "0.01", "--every", "1000", "--out", str(out)])  # fmt: skip
    assert r.code == 0, r.stderr
    committed = r.of("committed")
    assert committed and committed[0]["run"] == "1"
    first = int(committed[0]["step"])
    assert 0 < first < 150  # interrupted mid-run
    assert [e["run"] for e in r.of("restart")] == ["2"]
    assert f"resumed from {first}" in r.stdout
    assert out.read_text() == str(expected_acc(150))  # the resumed run ends where an uninterrupted one does
    assert r.of("exit")[-1]["code"] == "0"


@pytest.mark.parametrize(("env", "want"), [
    ({}, "1"),  # engine.torch_huge_pages defaults to on
    ({"THP_MEM_ALLOC_ENABLE": "0"}, "0"),  # the user's own choice wins
    ({"SLURM_CKPT_ENGINE_TORCH_HUGE_PAGES": "false"}, "unset"),
])  # fmt: skip
def test_child_gets_torch_huge_pages_unless_told_otherwise(tmp_path: Path, env: dict[str, str],
                                                          want: str) -> None:  # fmt: skip
    show = "import os; print('THP=' + os.environ.get('THP_MEM_ALLOC_ENABLE', 'unset'))"
    r = start(tmp_path, ["--local"], [sys.executable, "-c", show], **env).finish()
    assert r.code == 0, r.stderr
    assert f"THP={want}" in r.stdout.splitlines()


def test_signal_before_the_child_listens_is_held_then_delivered(tmp_path: Path) -> None:
    # The request comes while the child is still "importing torch" (sleeping
    # with the signal ignored); it must survive and get the request once ready.
    r = wrap(tmp_path, ["--local", "--max-requeues", "0", "--preempt-after", "0.05"],
             ["--sleep-before", "1.0", "--steps", "100000", "--step-time", "0.001"])  # fmt: skip
    assert r.code == 0, r.stderr
    names = [e["event"] for e in r.events if e["run"] == "1"]
    assert names.index("forward") < names.index("ready")  # sent before anyone listened
    ready_at = names.index("ready")
    assert "forward" in names[ready_at:]  # re-sent to the trainer once it reported ready
    assert r.of("committed")[0]["run"] == "1"
    assert r.of("child-exit")[0]["code"] == "0"  # not killed by the signal's default action


def _usr1_pending() -> None:
    """In the forked child before exec: USR1 blocked and already sent, so it is pending
    when the wrapper starts, as one that comes during its start-up is."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    os.kill(os.getpid(), signal.SIGUSR1)


def test_a_signal_during_the_wrappers_start_up_is_a_checkpoint_request(tmp_path: Path) -> None:
    out = tmp_path / "result"
    child = [*CHILD, "--steps", "150", "--step-time", "0.01", "--every", "1000", "--out", str(out)]
    live = Live(_wrapper_argv("--local", "--", *child), _env(tmp_path), preexec=_usr1_pending)
    r = live.finish()
    assert r.code == 0, r.stderr
    signals = r.of("signal")
    assert [(e["run"], e["signal"], e["action"]) for e in signals] == [("1", "USR1", "request")]
    assert r.of("committed")[0]["run"] == "1" and [e["run"] for e in r.of("restart")] == ["2"]
    first = int(r.of("committed")[0]["step"])
    assert f"resumed from {first}" in r.stdout
    assert out.read_text() == str(expected_acc(150))


def test_crashed_child_exit_code_passes_through_without_requeue(tmp_path: Path) -> None:
    r = wrap(tmp_path, ["--local"], ["--steps", "50", "--every", "10", "--crash-at", "25", "--code", "7"])
    assert r.code == 7
    assert r.of("no-requeue")[0]["reason"] == "crashed"
    assert not r.of("restart")


def test_max_requeues_stops_the_second_time(tmp_path: Path) -> None:
    r = wrap(tmp_path, ["--local", "--max-requeues", "1", "--preempt-after", "0.3", "--preempt-after", "0.3"],
             ["--steps", "100000", "--step-time", "0.001"])  # fmt: skip
    assert r.code == 0, r.stderr
    assert len(r.of("restart")) == 1
    no = r.of("no-requeue")
    assert [n["reason"] for n in no] == ["max-requeues"]
    assert "limit" in no[0]["msg"]
    assert {e["run"] for e in r.of("committed")} == {"1", "2"}


def test_no_progress_guard(tmp_path: Path) -> None:
    # The child stops when asked but never saves: requeueing would loop forever.
    r = wrap(tmp_path, ["--local", "--preempt-after", "0.3"],
             ["--steps", "100000", "--step-time", "0.001", "--stop-without-saving"])  # fmt: skip
    assert r.code == 0
    assert [n["reason"] for n in r.of("no-requeue")] == ["no-progress"]
    assert not r.of("restart")


def test_second_signal_is_harmless(tmp_path: Path) -> None:
    live = start(tmp_path, ["--local", "--max-requeues", "0"],
                 [*CHILD, "--steps", "100000", "--step-time", "0.002", "--save-delay", "1.0"])  # fmt: skip
    try:
        live.wait_event("ready")
        os.kill(live.proc.pid, signal.SIGUSR1)
        live.wait_event("request")
        # The child is now in its (slow) emergency save: more signals arrive.
        os.kill(live.proc.pid, signal.SIGTERM)
        os.kill(live.proc.pid, signal.SIGUSR1)
    finally:
        r = live.finish()
    assert r.code == 0, r.stderr
    sigs = r.of("signal")
    assert sigs[0]["action"] == "request"
    assert len(r.of("request")) == 1
    assert {s["action"] for s in sigs[1:]} <= {"tighten-deadline", "ignored (a checkpoint is already requested)"}
    assert len(r.of("committed")) == 1
    assert [n["reason"] for n in r.of("no-requeue")] == ["max-requeues"]  # decided once


def test_deadline_ends_a_child_that_ignores_the_request(tmp_path: Path) -> None:
    t0 = time.monotonic()
    r = wrap(tmp_path, ["--local", "--preempt-after", "0.2"], ["--steps", "100000", "--step-time", "0.01",
             "--ignore-requests"], SLURM_CKPT_WRAPPER_WAIT="1")  # fmt: skip
    assert time.monotonic() - t0 < 20
    assert r.of("deadline")
    assert r.of("child-exit")[0]["killed"] == "1"
    assert r.code == 128 + signal.SIGKILL
    assert [n["reason"] for n in r.of("no-requeue")] == ["no-progress"]


def test_whole_tree_is_gone_even_a_daemonized_grandchild(tmp_path: Path) -> None:
    pidfile = tmp_path / "daemon.pid"
    r = wrap(tmp_path, ["--local"], ["--daemon", str(pidfile), "--steps", "1"])
    assert r.code == 0, r.stderr
    pid = int(pidfile.read_text())
    assert not Path(f"/proc/{pid}").exists(), "the daemonized grandchild outlived the wrapper"
    down = r.of("teardown")[0]
    assert int(down["terminated"]) + int(down["killed"]) >= 1


def test_sigint_counts_as_cancel(tmp_path: Path) -> None:
    live = start(tmp_path, ["--local"], [*CHILD, "--steps", "100000", "--step-time", "0.002"])
    try:
        live.wait_event("ready")
        os.kill(live.proc.pid, signal.SIGINT)
        live.wait_event("signal")
        os.kill(live.proc.pid, signal.SIGUSR1)
    finally:
        r = live.finish()
    assert r.of("signal")[0]["action"] == "cancel"
    assert [n["reason"] for n in r.of("no-requeue")] == ["cancelled"]
    assert not r.of("restart")


_PLAIN_CHILD = """
import os, signal, sys, time
from pathlib import Path
from slurm_ckpt.store import RunDir
from slurm_ckpt.store.codec import encode_state
from slurm_ckpt.store.writer import write_state
asked = []
signal.signal(signal.SIGUSR1, lambda *a: asked.append(1))  # its own handler, no slurm_ckpt Control
run = RunDir(os.environ["SLURM_CKPT_DIR"])
if os.environ.get("SLURM_RESTART_COUNT"):
    sys.exit(0)
for step in range(1, 100000):
    time.sleep(0.002)
    if asked:
        enc = encode_state({"step": step})
        run.commit(step, lambda tmp: write_state(tmp, enc))
        sys.exit(0)
"""


def test_a_child_without_the_library_gets_the_signal_and_its_checkpoint_counts(tmp_path: Path) -> None:
    r = start(tmp_path, ["--local", "--preempt-after", "0.5"], [sys.executable, "-c", _PLAIN_CHILD]).finish()
    assert r.code == 0, r.stderr
    assert r.of("forward") and not r.of("ready") and not r.of("committed")
    assert len(r.of("restart")) == 1  # progress found by scanning the run dir


@pytest.mark.slow
def test_dataloader_workers_survive_slurm_style_signals(tmp_path: Path) -> None:
    """Slurm signals every process of the step: USR1 then TERM to the trainer AND its workers."""
    live = start(tmp_path, ["--local", "--max-requeues", "0"],
                 [sys.executable, str(ROOT / "examples" / "train.py"), "--steps", "100000",
                  "--workers", "2", "--every", "1000000", "--step-time", "0.002"])  # fmt: skip
    try:
        live.wait_event("ready", timeout=60)
        # The trainer and its 2 DataLoader workers (forked once iteration starts).
        tree = wait_for(lambda: (lambda d: d if len(d) >= 3 else None)(descendants(live.proc.pid)),
                        timeout=60, what="trainer and 2 DataLoader workers")  # fmt: skip
        for sig in (signal.SIGCONT, signal.SIGUSR1, signal.SIGTERM):
            for pid in [live.proc.pid, *(p.pid for p in tree)]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
    finally:
        r = live.finish(timeout=120)
    assert len(tree) >= 3
    assert r.of("committed"), r.stderr
    assert r.of("child-exit")[0]["code"] == "0", r.stdout + r.stderr  # a dead worker crashes the trainer
    assert "killed by signal" not in r.stderr and "exited unexpectedly" not in r.stderr


# ---------------------------------------------------------------- the child


def _daemonize(pidfile: Path) -> None:
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            pidfile.write_text(str(os.getpid()))
            while True:
                time.sleep(1)
        os._exit(0)
    wait_for(pidfile.exists, what="daemon pid file")


def _child(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--every", type=int, default=1000)
    ap.add_argument("--step-time", type=float, default=0.0)
    ap.add_argument("--sleep-before", type=float, default=0.0)
    ap.add_argument("--save-delay", type=float, default=0.0)
    ap.add_argument("--crash-at", type=int, default=0)
    ap.add_argument("--code", type=int, default=1)
    ap.add_argument("--ignore-requests", action="store_true")
    ap.add_argument("--stop-without-saving", action="store_true")
    ap.add_argument("--daemon", type=Path)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)

    time.sleep(args.sleep_before)  # stands in for a slow `import torch`
    from slurm_ckpt import Checkpointer

    if args.daemon:
        _daemonize(args.daemon)
    ckpt = Checkpointer()
    state = ckpt.load_latest() or {"step": 0, "acc": 1}
    if ckpt.loaded_step is not None:
        print(f"resumed from {ckpt.loaded_step}", flush=True)
    acc = state["acc"]
    for step in range(state["step"] + 1, args.steps + 1):
        acc = (acc * 31 + step) % 1_000_003
        time.sleep(args.step_time)
        if step == args.crash_at:
            return args.code
        if args.ignore_requests:
            continue
        if args.stop_without_saving and ckpt.preempted:
            return 0
        if ckpt.preempted and args.save_delay:
            time.sleep(args.save_delay)  # a slow save, during which more signals arrive
        if ckpt.maybe_save({"step": step, "acc": acc}, step, every=args.every):
            return 0
    if args.out:
        args.out.write_text(str(acc))
    return 0


if __name__ == "__main__" and sys.argv[1:2] == ["child"]:
    sys.exit(_child(sys.argv[2:]))


@pytest.mark.root
def test_the_wrapped_command_runs_inside_the_jobs_io_cgroup(tmp_path: Path) -> None:
    """A real cgroup v1 blkio group, as the prolog makes it: the wrapper joins it
    before starting the child, so the trainer and its workers inherit the limits."""
    blkio = Path("/sys/fs/cgroup/blkio")
    if os.geteuid() != 0 or not (blkio / "cgroup.procs").exists():
        pytest.skip("needs root and a cgroup v1 blkio hierarchy")
    group = blkio / f"slurm-ckpt-test-{os.getpid()}"
    group.mkdir()
    try:
        env = dict(os.environ, SLURM_CKPT_IO_CGROUP=str(group), SLURM_CKPT_DIR=str(tmp_path / "ckpt"))
        env.pop("SLURM_JOB_ID", None)
        out = subprocess.run(
            [*_wrapper_argv("--local"), "--", "cat", "/proc/self/cgroup"],
            env=env, capture_output=True, text=True, timeout=60, cwd=ROOT,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        line = next(ln for ln in out.stdout.splitlines() if ":blkio:" in ln)
        assert line.endswith(f":blkio:/{group.name}"), out.stdout
    finally:
        with contextlib.suppress(FileNotFoundError):
            for pid in (group / "cgroup.procs").read_text().split():
                (blkio / "cgroup.procs").write_text(pid)
        group.rmdir()

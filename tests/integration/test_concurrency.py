"""Two writer processes on one run dir: the second fails naming the holder, or waits."""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_ckpt.store import find_latest

WRITER = r"""
import logging, os, sys, time
from slurm_ckpt import Checkpointer, LockHeld
# filelock logs each failed attempt at DEBUG: the test waits for that line to
# know this writer is blocked on the lock, instead of sleeping.
logging.basicConfig(level=logging.DEBUG, stream=sys.stdout, format="log %(name)s %(message)s")
run, step, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
ck = Checkpointer(run, lock_timeout=timeout)
print("ready", flush=True)
try:
    ck.save({"step": step, "pid": os.getpid()}, step=step)
except LockHeld as e:
    print("LOCKHELD", e, flush=True)
    sys.exit(5)
print("saved", time.time(), flush=True)
sys.stdin.readline()  # hold the lock until told to go
ck.close()
"""


class Writer:
    def __init__(self, run: Path, step: int, timeout: float) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(run), str(step), str(timeout)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        self._pump_thread = threading.Thread(target=self._pump, daemon=True)
        self._pump_thread.start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)

    def expect(self, needle: str, timeout: float = 60) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=min(0.5, max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                if not self._pump_thread.is_alive() and self.lines.empty():
                    break  # its output ended without the line
                continue
            self.seen.append(line)
            if needle in line:
                return line
        raise AssertionError(f"no {needle!r} from writer {self.proc.pid}; saw {self.seen[-20:]}")

    def release(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


@pytest.fixture
def writers() -> Iterator[list[Writer]]:
    started: list[Writer] = []
    yield started
    for w in started:
        w.stop()


def test_second_writer_is_refused_naming_the_holder(run_dir: Path, writers: list[Writer]) -> None:
    first = Writer(run_dir, 1, 0)
    writers.append(first)
    first.expect("saved")
    second = Writer(run_dir, 2, 0)
    writers.append(second)
    line = second.expect("LOCKHELD")
    assert second.proc.wait(timeout=60) == 5
    assert f"pid {first.proc.pid} on {socket.gethostname()}" in line
    assert str(run_dir) in line and "lock_timeout" in line
    cand = find_latest([run_dir])
    assert cand is not None and cand.step == 1


@pytest.mark.parametrize("how", ["exit", "kill -9"])
def test_waiting_writer_proceeds_when_the_holder_goes(
    run_dir: Path, writers: list[Writer], how: str
) -> None:
    first = Writer(run_dir, 1, 0)
    writers.append(first)
    first.expect("saved")
    second = Writer(run_dir, 2, 60)
    writers.append(second)
    second.expect("not acquired")  # blocked on the lock now
    assert not (run_dir / "step-000000002").exists()
    released = time.time()
    if how == "exit":
        first.release()
        assert first.proc.wait(timeout=60) == 0
    else:
        os.kill(first.proc.pid, signal.SIGKILL)
        first.proc.wait(timeout=60)
    saved_at = float(second.expect("saved").split()[1])
    assert saved_at >= released
    second.release()
    assert second.proc.wait(timeout=60) == 0
    cand = find_latest([run_dir])
    assert cand is not None and cand.step == 2

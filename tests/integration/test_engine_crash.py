"""kill -9 in the middle of a background write, for every snapshot mode.

A real trainer process commits step 1, then starts ``save_async`` of step 2 on
a filesystem made slow (FUSE, 20 ms per write into step 2's tensor file). When
that file is seen growing inside the temp dir, the test SIGKILLs either the
trainer (a node failure or OOM kill) or, in fork mode, the forked writer.

Then: resume gives step 1, complete and verified; no writer process is left
behind; a new writer takes the lock at once and commits.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from test_engine_fs import SLOW_TENSOR_WRITES, check, config, state  # the same directory

from slurm_ckpt import Checkpointer, SlurmCkptError
from slurm_ckpt.store import find_latest
from tests.faultfs import fixtures

pytestmark = pytest.mark.root

faultfs, fault_dir = fixtures.faultfs, fixtures.fault_dir

STEP2_SLOW = dict(SLOW_TENSOR_WRITES, path="*/.tmp-step-000000002-*/tensors-*")

TRAINER = """
import sys, time
sys.path.insert(0, {tests!r})
from test_engine_fs import config, state
from slurm_ckpt import Checkpointer
ck = Checkpointer({run!r}, config=config({snapshot!r}), distributed=False)
ck.save(state(1), step=1)
h = ck.save_async(state(2), step=2)
print("saving", flush=True)
h.wait()
print("committed", flush=True)
"""


def wait_for(cond: Any, what: str, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.005)  # polling interval, not a synchronisation
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def growing_tensor_file(run: Path) -> Path | None:
    for d in run.glob(".tmp-step-000000002-*"):
        f = d / "tensors-00000.safetensors"
        if f.exists() and f.stat().st_size > 0:
            return f
    return None


def children(pid: int) -> set[int]:
    out = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):  # a thread that just ended
            out |= {int(c) for c in (task / "children").read_text().split()}
    return out


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.parametrize("snapshot", ["overlap", "copy", "fork"])
def test_kill9_of_the_trainer_mid_write_resumes_from_the_previous_checkpoint(
    fault_dir: Path, faultfs: Any, snapshot: str
) -> None:
    code = TRAINER.format(tests=str(Path(__file__).parent), run=str(fault_dir), snapshot=snapshot)
    with faultfs.faults(STEP2_SLOW):
        proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout is not None and proc.stdout.readline() == "saving\n"
            wait_for(lambda: growing_tensor_file(fault_dir), "step 2's tensor file to grow")
            writers = children(proc.pid)
            assert len(writers) == (1 if snapshot == "fork" else 0)
            proc.kill()
        finally:
            proc.kill()
            proc.wait()
        # A forked writer whose parent died stops on its own (it checks between chunks).
        for pid in writers:
            wait_for(lambda pid=pid: not alive(pid), f"orphaned writer {pid} to exit")
    cand = find_latest([fault_dir])
    assert cand is not None and cand.step == 1
    check(cand.path, 1)
    with Checkpointer(fault_dir, config=config(), lock_timeout=0, distributed=False) as ck:
        ck.save(state(3), step=3)  # the lock is free at once: no orphan holds it
    assert not [n for n in os.listdir(fault_dir) if n.startswith(".tmp-")]
    check(fault_dir / "step-000000003", 3)


def test_kill9_of_the_forked_writer_fails_that_save_and_nothing_else(fault_dir: Path, faultfs: Any) -> None:
    with Checkpointer(fault_dir, config=config("fork"), distributed=False) as ck:
        ck.save(state(1), step=1)
        with faultfs.faults(STEP2_SLOW):
            before = children(os.getpid())
            h = ck.save_async(state(2), step=2)
            (writer,) = children(os.getpid()) - before
            wait_for(lambda: growing_tensor_file(fault_dir), "step 2's tensor file to grow")
            os.kill(writer, signal.SIGKILL)
            with pytest.raises(SlurmCkptError, match="died while writing"):
                h.wait()
        assert not alive(writer)
        assert not [n for n in os.listdir(fault_dir) if n.startswith(".tmp-")]
        ck.save(state(3), step=3)  # raised once, by wait(): saving goes on
    assert find_latest([fault_dir]).step == 3  # type: ignore[union-attr]
    check(fault_dir / "step-000000001", 1)

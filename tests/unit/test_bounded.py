"""``store/bounded.py``: a call that does not return is given up on, and commits nothing after.

The hang here is a write function waiting on an event; the real one (servers
stopped under a FUSE mount) is in ``tests/storage/test_storage_hung.py``.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from slurm_ckpt import Checkpointer
from slurm_ckpt.config import Config, Duration, EngineConfig, StorageConfig
from slurm_ckpt.errors import StorageError, StorageHung
from slurm_ckpt.store.bounded import Bound, progress, stall_watch
from slurm_ckpt.store.commit import commit
from slurm_ckpt.store.layout import list_steps
from slurm_ckpt.store.tensorfile import FileRecord


def test_result_and_error_pass_through(tmp_path: Path) -> None:
    b = Bound(tmp_path, 30)
    assert b.call(lambda: 7) == 7
    with pytest.raises(StorageError) as e:
        b.call(lambda: (_ for _ in ()).throw(StorageError(errno.EIO, "boom", tmp_path)))
    assert e.value.errno == errno.EIO


def test_hung_call_is_given_up_and_not_piled_on(tmp_path: Path) -> None:
    stalls: list[bool] = []
    b = Bound(tmp_path, 0.2, stalls.append)
    release = threading.Event()
    with pytest.raises(StorageHung) as e:
        b.call(release.wait)
    assert isinstance(e.value, TimeoutError) and e.value.filename == str(tmp_path)
    assert stalls == [True] and b.stalled
    with pytest.raises(StorageHung, match="still stuck"):
        b.call(lambda: 1)
    stuck = b.abandoned
    assert stuck is not None
    release.set()
    stuck.join(30)
    assert stalls == [True, False] and not b.stalled
    assert b.call(lambda: 2) == 2


def test_given_up_commit_leaves_nothing(tmp_path: Path) -> None:
    """The worker comes back after the caller went on: no checkpoint, no temp dir."""
    release = threading.Event()

    def write(into: Path) -> tuple[dict[str, FileRecord], dict[str, Any]]:
        release.wait()  # the hung write()
        (into / "data").write_bytes(b"written after the trainer went on")
        return {}, {}

    b = Bound(tmp_path, 0.2)
    with pytest.raises(StorageHung):
        b.call(lambda: commit(tmp_path, 5, write))
    stuck = b.abandoned
    assert stuck is not None
    release.set()
    stuck.join(30)
    assert list_steps(tmp_path) == []
    assert list(tmp_path.iterdir()) == []


def test_slow_storage_that_answers_is_not_hung(tmp_path: Path) -> None:
    """Each answer restarts the clock: a call longer than the bound, answering all the way, returns."""
    b = Bound(tmp_path, 1.0)

    def slow() -> int:
        for _ in range(30):  # 3 s in all, never 1 s without an answer
            time.sleep(0.1)
            progress()
        return 7

    assert b.call(slow) == 7 and not b.stalled


def test_a_checkpoint_slower_than_the_bound_commits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's writer threads and the commit's fsyncs report their answers to the bound."""
    real_pwritev, real_fsync = os.pwritev, os.fsync

    def slow_pwritev(fd: int, bufs: Any, off: int) -> int:
        time.sleep(0.25)  # storage that answers every call, slowly
        return real_pwritev(fd, bufs, off)

    def slow_fsync(fd: int) -> None:
        time.sleep(0.25)
        real_fsync(fd)

    ck = Checkpointer(tmp_path / "run", scratch=False, distributed=False,
                      config=Config(engine=EngineConfig(threads=1, chunk_size=1 << 20),
                                    storage=StorageConfig(hang_timeout=Duration(1))))  # fmt: skip
    state = {f"w{i}": torch.full((1 << 18,), float(i)) for i in range(8)}  # 8 MiB: 8 writes, 2 s or more
    monkeypatch.setattr(os, "pwritev", slow_pwritev)
    monkeypatch.setattr(os, "fsync", slow_fsync)
    started = time.monotonic()
    ck.save(state, 1)
    monkeypatch.undo()
    assert time.monotonic() - started > 2
    got = ck.load_latest()
    assert got is not None and all(torch.equal(got[k], v) for k, v in state.items())
    ck.close()


def test_a_drain_that_answers_is_not_stalled_and_one_that_does_not_is() -> None:
    stalls: list[bool] = []
    with stall_watch(1.0, stalls.append):
        for _ in range(30):
            time.sleep(0.1)
            progress()
    assert stalls == []
    events = {True: threading.Event(), False: threading.Event()}

    def on_stall(on: bool) -> None:
        stalls.append(on)
        events[on].set()

    with stall_watch(1.0, on_stall):
        assert events[True].wait(30)  # no answer: reported stalled
        progress()  # an answer: no longer stalled
        assert events[False].wait(30)
    assert stalls == [True, False]


def test_the_stalled_gauge_stays_up_while_either_source_is_stalled() -> None:
    """A given-up commit and a stalled drain feed one gauge: it falls when both are back."""
    from slurm_ckpt.placement.local import _Stalls

    out: list[bool] = []
    stalls = _Stalls(out.append)
    stalls(True)  # the drain
    stalls(True)  # a commit given up
    stalls(False)  # the commit returned; the drain still hangs
    assert out == [True]
    stalls(False)
    assert out == [True, False]

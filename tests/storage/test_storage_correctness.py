"""Checkpoints on real GlusterFS and CephFS, written through one mount and read through the other.

The two mounts are two FUSE clients with their own caches, as two nodes of a
cluster would have: what one commits must be what the other resumes from.
"""

from __future__ import annotations

import errno
import os
import random
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from slurm_ckpt import Checkpointer
from slurm_ckpt.config import Config, MetricsConfig, StorageConfig
from slurm_ckpt.errors import NoSpace, SlurmCkptError
from tests.faults.helpers import check_state, state
from tests.storage.lab import Lab

pytestmark = pytest.mark.root

_TRAINER = """
import sys
from slurm_ckpt import Checkpointer
from tests.faults.helpers import state
ckpt = Checkpointer(sys.argv[1], keep=2)
prev = ckpt.load_latest()
step = 0 if prev is None else prev["step"]
while True:
    step += 1
    ckpt.save(state(step, kib=2048), step=step)
    print(step, flush=True)
"""


def _config(tmp_path: Path, keep: int = 3) -> Config:
    return Config(storage=StorageConfig(keep=keep, retry_backoff=0.01),
                  metrics=MetricsConfig(textfile_dir=str(tmp_path / "metrics")))  # fmt: skip


def test_commit_through_one_mount_is_newest_through_the_other(netfs: tuple[Path, Path], tmp_path: Path) -> None:
    a, b = netfs
    writer = Checkpointer(a / "run", config=_config(tmp_path))
    try:
        for step in (1, 2, 3):
            writer.save(state(step), step=step)
            # At once: no wait, no retry between the commit and the other client's look.
            reader = Checkpointer(b / "run", config=_config(tmp_path))
            check_state(reader.load_latest(), step)
            assert reader.loaded_step == step
            reader.close()
    finally:
        writer.close()


def test_kill_9_while_saving_then_resume_through_the_other_mount(netfs: tuple[Path, Path], tmp_path: Path) -> None:
    a, b = netfs
    rng = random.Random(41)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    last = 0
    for _ in range(4):
        child = subprocess.Popen([sys.executable, "-c", _TRAINER, str(a / "run")], stdout=subprocess.PIPE,
                                 text=True, env=env)  # fmt: skip
        assert child.stdout is not None
        # Kill after a random number of commits, at a random moment within the next save.
        for _ in range(rng.randint(1, 3)):
            line = child.stdout.readline()
            assert line, "the trainer died before its first save"
            last = int(line)
        threading.Event().wait(rng.uniform(0, 0.3))
        child.send_signal(signal.SIGKILL)
        child.wait()
        reader = Checkpointer(b / "run", config=_config(tmp_path))
        loaded = reader.load_latest()
        reader.close()
        assert loaded is not None and loaded["step"] >= last
        check_state(loaded, loaded["step"], kib=2048)
        last = loaded["step"]
    # The kills left no committed-looking partial checkpoint behind.
    assert all(p.name.startswith(("step-", ".tmp-", ".lock", "TIER")) for p in (b / "run").iterdir())


def test_cephfs_quota_fails_the_save_typed_and_keeps_the_last(lab: Lab, tmp_path: Path) -> None:
    top = lab.mount("ceph", "a") / f"quota-save-{os.getpid()}"
    (top / "run").mkdir(parents=True)
    os.setxattr(top, "ceph.quota.max_bytes", str(24 << 20).encode())
    ckpt = Checkpointer(top / "run", config=_config(tmp_path, keep=3))
    try:
        ckpt.save(state(1, kib=4096), step=1)  # 4 MiB: fits
        with pytest.raises(NoSpace) as err:
            ckpt.save(state(2, kib=32768), step=2)  # 32 MiB: past the quota, even with step 1 gone
        assert err.value.errno == errno.EDQUOT
        assert "ceph.quota.max_bytes" in str(err.value)
        reader = Checkpointer(lab.mount("ceph", "b") / top.name / "run", config=_config(tmp_path))
        check_state(reader.load_latest(), 1, kib=4096)
        reader.close()
        assert not [p for p in (top / "run").iterdir() if p.name.startswith(".tmp-")]
    finally:
        ckpt.close()
        os.setxattr(top, "ceph.quota.max_bytes", b"0")


def test_retention_on_one_client_while_the_other_loads(netfs: tuple[Path, Path], tmp_path: Path) -> None:
    a, b = netfs
    writer = Checkpointer(a / "run", config=_config(tmp_path, keep=1))
    writer.save(state(1, kib=1024), step=1)
    stop = threading.Event()
    failed: list[BaseException] = []

    def save_loop() -> None:
        try:
            for step in range(2, 16):
                writer.save(state(step, kib=1024), step=step)
        except BaseException as e:
            failed.append(e)
        finally:
            stop.set()

    saver = threading.Thread(target=save_loop)
    saver.start()
    loads = errors = 0
    try:
        while not stop.is_set():
            reader = Checkpointer(b / "run", config=_config(tmp_path))
            try:
                loaded = reader.load_latest()
            except (SlurmCkptError, FileNotFoundError) as e:
                # The checkpoint went while it was read: a clean error, never a wrong state.
                errors += 1
                assert not isinstance(e, NoSpace), e
                continue
            finally:
                reader.close()
            loads += 1
            assert loaded is not None
            check_state(loaded, loaded["step"], kib=1024)
    finally:
        saver.join()
        writer.close()
    assert not failed, failed
    assert loads > 0, f"no load finished ({errors} clean errors)"

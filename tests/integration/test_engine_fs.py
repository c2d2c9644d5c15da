"""The engine on real filesystems: FUSE that refuses O_DIRECT writes, a 4 KiB-sector
disk, a full tmpfs, and the async policies (a request while one is in flight,
errors, interpreter exit) driven by a real slow filesystem, not by sleeps.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import mmap
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from slurm_ckpt import Checkpointer, StorageError
from slurm_ckpt.config import Config, EngineConfig, StorageConfig
from slurm_ckpt.engine import Engine
from slurm_ckpt.store import find_latest, verify_checkpoint
from slurm_ckpt.store.fsutil import preallocate
from tests import machine
from tests.faultfs import fixtures

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.root

# The shared fixtures, bound here so pytest finds them in this module.
faultfs, fault_dir, make_tmpfs = fixtures.faultfs, fixtures.fault_dir, fixtures.make_tmpfs

SLOW_TENSOR_WRITES = {"op": "write", "path": "*/tensors-*", "delay": 0.02, "count": 100}
"""The first 100 write calls into tensor files stall 20 ms each: a save stays in flight
for two seconds or more. Capped, because FUSE hands the fs 4 KiB writes: a stall on
every write would hold a 4 MiB save for 20 s."""


def config(snapshot: str = "auto", **engine: Any) -> Config:
    return Config(
        storage=StorageConfig(retries=0, keep=10),
        engine=dataclasses.replace(EngineConfig(snapshot=snapshot, chunk_size=1 << 20), **engine),
    )


def state(step: int, mib: int = 4) -> dict[str, Any]:
    n = mib * (1 << 18)
    return {"w": torch.arange(n, dtype=torch.float32) + step, "odd": torch.ones(1001) * step, "step": step}


def check(path: Path, step: int, mib: int = 4) -> None:
    """``path`` verifies in full and holds exactly ``state(step)``."""
    got = Engine().load(path, verify_checkpoint(path, full=True))
    want = state(step, mib)
    assert got["step"] == step
    assert torch.equal(got["w"], want["w"]) and torch.equal(got["odd"], want["odd"])


def test_fuse_refuses_direct_writes_and_the_engine_writes_buffered(fault_dir: Path) -> None:
    # First prove the premise on this very mount: O_DIRECT opens, but writes
    # fail; nor can it reserve space, so the engine writes without.
    probe = fault_dir / "probe"
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    try:
        assert preallocate(fd, 4096) is False
        with pytest.raises(OSError) as e:
            os.pwrite(fd, mmap.mmap(-1, 4096), 0)
        assert e.value.errno == errno.EINVAL
    finally:
        os.close(fd)
        probe.unlink()
    with Checkpointer(fault_dir / "run", config=config(), distributed=False) as ck:
        path = ck.save(state(1), step=1)
        h = ck.save_async(state(2), step=2)
        path2 = h.wait()
    check(path, 1)
    check(path2, 2)


@pytest.fixture
def sector4k(tmp_path: Path) -> Iterator[Path]:
    """An ext4 filesystem on a loop device with 4 KiB logical sectors, mounted."""
    machine.need(machine.loop_devices())
    img, mnt = tmp_path / "disk.img", tmp_path / "mnt"
    mnt.mkdir()
    with open(img, "wb") as f:
        f.truncate(64 << 20)
    dev = subprocess.run(["losetup", "--find", "--show", "--sector-size", "4096", str(img)],
                         check=True, capture_output=True, text=True).stdout.strip()  # fmt: skip
    try:
        subprocess.run(["mkfs.ext4", "-q", "-F", dev], check=True, capture_output=True)
        subprocess.run(["mount", dev, str(mnt)], check=True, capture_output=True)
        try:
            yield mnt
        finally:
            subprocess.run(["umount", str(mnt)], capture_output=True)
            if os.path.ismount(mnt):
                subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
    finally:
        subprocess.run(["losetup", "-d", dev], capture_output=True)


def test_a_4k_sector_disk_gets_aligned_direct_writes_and_a_buffered_tail(sector4k: Path) -> None:
    # The premise: this device refuses O_DIRECT I/O that is only 512-byte aligned.
    probe = sector4k / "probe"
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    try:
        with pytest.raises(OSError) as e:
            os.pwrite(fd, memoryview(mmap.mmap(-1, 4096))[:512], 0)
        assert e.value.errno == errno.EINVAL
    finally:
        os.close(fd)
    with Checkpointer(sector4k / "run", config=config(), distributed=False) as ck:
        path = ck.save(state(3), step=3)  # 4 MiB + 4004 bytes: the file ends mid-sector
        assert (path / "tensors-00000.safetensors").stat().st_size % 4096 != 0
        h = ck.save_async(state(4), step=4)
        path4 = h.wait()
    check(path, 3)
    check(path4, 4)


@pytest.mark.parametrize("snapshot", ["overlap", "copy", "fork"])
def test_a_full_disk_in_the_background_fails_the_save_everywhere_and_commits_nothing(
    make_tmpfs: Any, snapshot: str, caplog: pytest.LogCaptureFixture
) -> None:
    small = make_tmpfs("2M")
    caplog.set_level(logging.ERROR, logger="slurm_ckpt")
    ck = Checkpointer(small / "run", config=config(snapshot), distributed=False)
    try:
        h = ck.save_async(state(1), step=1)  # 4 MiB into 2 MiB
        with pytest.raises(StorageError) as e:
            h.wait()
        assert e.value.errno == errno.ENOSPC
        assert "background save of step 1 failed" in caplog.text
        assert sorted(os.listdir(small / "run")) == [".lock", ".lock.owner"]
        # Raised once, by wait(): the next save goes on.
        assert ck.save({"step": 3}, step=3).name == "step-000000003"
    finally:
        ck.close()


def test_a_request_while_a_save_is_in_flight_waits_for_it(fault_dir: Path, faultfs: Any) -> None:
    with faultfs.faults(SLOW_TENSOR_WRITES), Checkpointer(fault_dir, config=config(), distributed=False) as ck:
        h1 = ck.save_async(state(1), step=1)
        assert not h1.done()  # the slow filesystem keeps it in flight
        h2 = ck.save_async(state(2), step=2)
        # Policy: one save in flight per run dir; a new request first waits for
        # the one in flight to commit, so none is dropped or reordered.
        assert h1.done() and h1.wait().name == "step-000000001"
        assert h2.wait().name == "step-000000002"
    check(fault_dir / "step-000000001", 1)
    check(fault_dir / "step-000000002", 2)


SCRIPT = """
import os, sys, torch
sys.path.insert(0, {tests!r})
from test_engine_fs import config, state
from slurm_ckpt import Checkpointer
ck = Checkpointer({run!r}, config=config({snapshot!r}), distributed=False)
ck.save(state(1), step=1)
h = ck.save_async(state(2), step=2)
assert not h.done()
print("in flight", flush=True)
if {abandon!r}:
    os._exit(0)
"""


@pytest.mark.parametrize("snapshot", ["overlap", "copy", "fork"])
@pytest.mark.parametrize("abandon", [False, True])
def test_interpreter_exit_finishes_the_save_and_os_exit_abandons_it_cleanly(
    fault_dir: Path, faultfs: Any, snapshot: str, abandon: bool
) -> None:
    code = SCRIPT.format(tests=str(Path(__file__).parent), run=str(fault_dir), snapshot=snapshot, abandon=abandon)
    with faultfs.faults(dict(SLOW_TENSOR_WRITES, path="*/.tmp-step-000000002-*/tensors-*")):
        res = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "in flight" in res.stdout
    if abandon:
        # The process vanished mid-write: step 2 was never committed, step 1 is intact,
        # and the half-written temp dir is cleared by the next writer.
        cand = find_latest([fault_dir])
        assert cand is not None and cand.step == 1
        check(cand.path, 1)
        with Checkpointer(fault_dir, config=config(), lock_timeout=30, distributed=False) as ck:
            ck.save(state(3), step=3)
        assert not [n for n in os.listdir(fault_dir) if n.startswith(".tmp-")]
    else:
        # A normal exit waits for the save in flight: step 2 is committed.
        check(fault_dir / "step-000000002", 2)

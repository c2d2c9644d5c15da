"""Scratch -> durable tiers on real directories and real (tmpfs) filesystems."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from slurm_ckpt import Checkpointer, StorageError
from slurm_ckpt.cli import main
from slurm_ckpt.config import Config, Duration, StorageConfig
from slurm_ckpt.store import verify_checkpoint
from slurm_ckpt.store.layout import list_steps


@pytest.fixture
def dirs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """(scratch, durable); SLURM_CKPT_SCRATCH points at the scratch dir."""
    scratch, durable = tmp_path / "scratch", tmp_path / "durable"
    scratch.mkdir()
    monkeypatch.setenv("SLURM_CKPT_SCRATCH", str(scratch))
    return scratch, durable


def state(step: int) -> dict[str, object]:
    return {"w": torch.arange(4096, dtype=torch.float32) * step, "step": step}


def steps(run: Path) -> list[int]:
    return sorted(s for s, _ in list_steps(run))


def same(a: dict, b: dict) -> bool:
    return a["step"] == b["step"] and torch.equal(a["w"], b["w"])  # type: ignore[arg-type]


class LockHolder:
    """Another process holding a run dir's writer lock until released."""

    def __init__(self, run: Path) -> None:
        code = ("import sys; from pathlib import Path; from slurm_ckpt.store.lock import RunDirLock;"
                "l = RunDirLock(Path(sys.argv[1])); l.acquire(); print('held', flush=True);"
                "sys.stdin.readline()")  # fmt: skip
        run.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen([sys.executable, "-c", code, str(run)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)  # fmt: skip
        assert self.proc.stdout is not None and self.proc.stdout.readline() == "held\n"

    def release(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        self.proc.wait(timeout=60)


@pytest.fixture
def holders() -> Iterator[list[LockHolder]]:
    held: list[LockHolder] = []
    yield held
    for h in held:
        h.proc.kill()
        h.proc.wait()


def test_no_scratch_is_one_tier(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with Checkpointer(tmp_path / "run") as ck:
        assert ck.tiers is None and ck.search_dirs == [tmp_path / "run"]
        path = ck.save(state(1), step=1)
        assert path.parent == tmp_path / "run" and ck.is_durable(1) and ck.drain(0)
    for bad in (tmp_path / "absent", tmp_path / "run" / "step-000000001" / "state.json"):
        monkeypatch.setenv("SLURM_CKPT_SCRATCH", str(bad))
        with Checkpointer(tmp_path / "run2") as ck:
            assert ck.tiers is None
    assert not list(tmp_path.rglob("TIER.json"))


def test_save_commits_to_scratch_then_drains(dirs: tuple[Path, Path]) -> None:
    scratch, durable = dirs
    with Checkpointer(durable, keep=2) as ck:
        assert ck.search_dirs == [scratch / "ckpt", durable]
        tier = json.loads((scratch / "ckpt" / "TIER.json").read_text())
        assert tier == {"durable": str(durable), "keep": 2}
        path = ck.save(state(1), step=1)
        assert path == scratch / "ckpt" / "step-000000001"
        assert ck.drain(60) and ck.is_durable(1)
        copy = durable / "step-000000001"
        man = verify_checkpoint(copy, full=True)
        assert man.extra["copied_from"] == str(path)
        for s in (2, 3, 4):
            ck.save(state(s), step=s)
            # The drain copies only the newest checkpoint it finds: without waiting,
            # how many of 2, 3, 4 reach the durable tier depends on the machine's speed.
            assert ck.drain(60)
        ck.wait()
        assert steps(scratch / "ckpt") == [3, 4] and steps(durable) == [3, 4]  # keep=2 per tier
        assert not ck.is_durable(1), "removed by retention since"
    with Checkpointer(durable, scratch=False) as ck:  # the durable tier alone has everything
        assert same(ck.load_latest(), state(4)) and ck.loaded_path == durable / "step-000000004"


def test_tier_file_is_what_the_epilog_reads(dirs: tuple[Path, Path]) -> None:
    stageout = pytest.importorskip("slurm_ckpt.node.stageout")
    scratch, durable = dirs
    with Checkpointer(durable, keep=4):
        assert stageout.read_tier(scratch / "ckpt") == stageout.Tier(durable, 4)
    assert not [p for p in (scratch / "ckpt").iterdir() if p.name.endswith(".tmp")]


def test_newest_wins_while_a_copy_is_blocked(
    dirs: tuple[Path, Path], holders: list[LockHolder]
) -> None:
    """The durable dir is locked by another process, so the first copy waits on it.

    Meanwhile 2, 3, 4 are saved: scratch keeps the one being copied and the
    newest, never deletes either, and once unblocked only the newest is copied.
    When that copy ends, scratch is back to ``keep`` without another save.
    """
    scratch, durable = dirs
    holder = LockHolder(durable)
    holders.append(holder)
    with Checkpointer(durable, keep=1, lock_timeout=120) as ck:
        try:
            for s in (1, 2, 3, 4):
                ck.save(state(s), step=s)
            assert steps(scratch / "ckpt") == [1, 4]
            assert not ck.is_durable(4) and not ck.drain(timeout=0.2)
        finally:
            holder.release()  # else close() would wait for the blocked copy
        assert ck.drain(timeout=60)
        assert ck.is_durable(4) and not ck.is_durable(2) and not ck.is_durable(3)
        assert steps(durable) == [4] and steps(scratch / "ckpt") == [4]
        ck.save(state(5), step=5)
    assert steps(scratch / "ckpt") == [5] and steps(durable) == [5]


def test_the_trim_after_a_copy_spares_a_checkpoint_committed_since(
    dirs: tuple[Path, Path], holders: list[LockHolder]
) -> None:
    """A run resumed from an older step saves step 5 on scratch while step 10 is being
    copied. Between a save's commit and its hand-over to the drain, the trim that
    follows 10's copy must not take 5 for an old checkpoint beyond ``keep``."""
    scratch, durable = dirs
    holder = LockHolder(durable)
    holders.append(holder)
    with Checkpointer(durable, keep=1, lock_timeout=120) as ck:
        assert ck.tiers is not None
        try:
            ck.save(state(10), step=10)  # its copy waits for the durable dir's lock
            job = ck.engine.job(state(5))
            ck.tiers.fast.commit(5, job.write, nbytes=job.nbytes)  # committed, not handed over yet
        finally:
            holder.release()
        assert ck.drain(timeout=60) and ck.is_durable(10)
        assert steps(scratch / "ckpt") == [5, 10]


def test_a_copy_that_outlives_close_leaves_scratch_alone(
    dirs: tuple[Path, Path], holders: list[LockHolder]
) -> None:
    """close() stops waiting for a stalled copy and gives up scratch's lock; when
    the copy ends, it must not trim scratch, which then belongs to the stage-out
    (or to a next writer)."""
    scratch, durable = dirs
    holder = LockHolder(durable)
    holders.append(holder)
    # The copy of 1 waits for the durable dir's lock, and past hang_timeout is stalled.
    config = Config(storage=StorageConfig(hang_timeout=Duration(0.5)))
    ck = Checkpointer(durable, keep=1, lock_timeout=120, config=config)
    tiers = ck.tiers
    assert tiers is not None
    try:
        for s in (1, 2):
            ck.save(state(s), step=s)
        ck.close()
        assert tiers.copying
    finally:
        holder.release()
    drainer = tiers._drainer  # drain() returns at once while the copy is still marked stalled
    with drainer.cv:
        assert drainer.cv.wait_for(lambda: not drainer.busy, 60)
    assert steps(durable) == [2]
    assert steps(scratch / "ckpt") == [1, 2]


def test_close_waits_for_the_copy(dirs: tuple[Path, Path]) -> None:
    _, durable = dirs
    ck = Checkpointer(durable)
    handle = ck.save_async(state(7), step=7)
    ck.close()
    assert handle.wait().parent.name == "ckpt"
    verify_checkpoint(durable / "step-000000007", full=True)


def test_discovery_prefers_newest_valid_then_fast_tier(dirs: tuple[Path, Path]) -> None:
    scratch, durable = dirs
    fast = scratch / "ckpt"
    with Checkpointer(durable, scratch=False) as ck:
        ck.save(state(5), step=5)
        ck.save(state(7), step=7)
    with Checkpointer(fast, scratch=False) as ck:
        ck.save(state(5), step=5)
        ck.save(state(8), step=8)
    (fast / "step-000000008" / "MANIFEST.json").write_text("garbage")
    with Checkpointer(durable, keep=10) as ck:
        ck.drain(60)
        assert same(ck.load_latest(), state(7)) and ck.loaded_path == durable / "step-000000007"
        assert ck.latest() == durable / "step-000000007"
    (durable / "step-000000007" / "state.json").write_bytes(b"{}")
    with Checkpointer(durable, keep=10) as ck:
        assert ck.latest() == fast / "step-000000005", "equal steps: the fast tier first"
        assert same(ck.load_latest(), state(5)) and ck.loaded_path == fast / "step-000000005"
    res = CliRunner().invoke(main, ["resume", "--dir", str(durable)])
    assert res.exit_code == 0 and res.stdout.strip() == str(durable / "step-000000005")
    res = CliRunner().invoke(main, ["resume"], env={"SLURM_CKPT_DIR": str(durable)})
    assert res.exit_code == 0 and res.stdout.strip() == str(fast / "step-000000005")
    assert "step-000000008" in res.stderr and "step-000000007" in res.stderr
    ls = CliRunner().invoke(main, ["ls"], env={"SLURM_CKPT_DIR": str(durable)}).stdout
    assert f"# scratch tier: {fast}" in ls and f"# durable tier: {durable}" in ls


def test_scratch_only_checkpoint_from_an_earlier_run_is_copied(dirs: tuple[Path, Path]) -> None:
    scratch, durable = dirs
    with Checkpointer(durable, scratch=False) as ck:
        ck.save(state(1), step=1)
    with Checkpointer(scratch / "ckpt", scratch=False) as ck:
        ck.save(state(3), step=3)
    with Checkpointer(durable) as ck:
        assert ck.drain(60) and ck.is_durable(3)
    assert steps(durable) == [1, 3]


@pytest.mark.root
@pytest.mark.parametrize("fault", ["read-only", "full"])
def test_failing_durable_tier_keeps_scratch_and_surfaces(
    tmpfs: Callable[[str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fault: str
) -> None:
    """A real read-only remount, or a real full tmpfs, under the durable run dir."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setenv("SLURM_CKPT_SCRATCH", str(scratch))
    fs = tmpfs("128k")
    durable = fs / "run"
    durable.mkdir()
    big = {"w": torch.zeros(64 * 1024), "step": 0}  # 256 KiB: never fits in 128k
    if fault == "read-only":
        subprocess.run(["mount", "-o", "remount,ro", str(fs)], check=True)
    with Checkpointer(durable, keep=1) as ck:
        if fault == "full":
            ck.save(state(1), step=1)
            assert ck.drain(60) and ck.is_durable(1)
        ck.save(big, step=2)
        assert not ck.drain(60) and not ck.is_durable(2)
        assert (scratch / "ckpt" / "step-000000002").is_dir(), "the only copy stays on scratch"
        with pytest.raises(StorageError) as info:
            ck.save(state(3), step=3)  # storage.on_async_error: raise, before saving
        assert info.value.filename and str(durable) in info.value.filename
        assert steps(scratch / "ckpt") == [2]
        # Under a checkpoint-and-stop request the emergency save goes to scratch anyway.
        ck.save(big, step=3)
        assert not ck.drain(60)
        ck.control.request()
        path = ck.save(state(4), step=4)
        assert path == scratch / "ckpt" / "step-000000004"
        ck.drain(60)
        assert steps(scratch / "ckpt")[-1] == 4 and ck.is_durable(4) == (fault == "full")
    if fault == "read-only":
        subprocess.run(["mount", "-o", "remount,rw", str(fs)], check=True)
    with Checkpointer(durable, keep=1) as ck:  # storage is back: the next save drains
        ck.save(state(5), step=5)
        assert ck.drain(60) and ck.is_durable(5)
    assert steps(durable) == [5]

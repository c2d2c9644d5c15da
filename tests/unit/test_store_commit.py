"""The commit protocol's edges: failures, same-step replacement, temp dir hygiene."""

from __future__ import annotations

import ctypes
import errno
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from slurm_ckpt import Checkpointer
from slurm_ckpt.errors import StorageError
from slurm_ckpt.store import RunDir, find_latest, fsutil
from slurm_ckpt.store.codec import encode_state
from slurm_ckpt.store.commit import WriteFn, commit
from slurm_ckpt.store.load import load_state
from slurm_ckpt.store.manifest import MANIFEST
from slurm_ckpt.store.retention import FOREIGN_TMP_AGE, remove_stale_tmp
from slurm_ckpt.store.verify import verify_checkpoint
from slurm_ckpt.store.writer import write_state

HOST = socket.gethostname().replace("-", "_")


def dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


@pytest.fixture
def live_pid() -> Iterator[int]:
    p = subprocess.Popen(["sleep", "600"])
    yield p.pid
    p.kill()
    p.wait()


def tmp_name(step: int, pid: int, host: str = HOST, suffix: str = "") -> str:
    return f".tmp-step-{step:09d}-{host}-{pid}-beef{suffix}"


def save(run: Path, step: int, value: float, keep: int = 5) -> Path:
    with Checkpointer(run, keep=keep) as ck:
        return ck.save({"w": torch.full((4,), value), "v": value}, step=step)


def load(run: Path) -> tuple[int | None, object]:
    with Checkpointer(run) as ck:
        state = ck.load_latest()
        return ck.loaded_step, state


def test_failed_write_commits_nothing_and_leaves_no_temp(run_dir: Path) -> None:
    rd = RunDir(run_dir)

    def write(tmp: Path) -> tuple[dict, dict]:
        (tmp / "partial").write_bytes(b"x" * 100)
        raise OSError(5, "simulated EIO mid-write")

    with pytest.raises(OSError, match="simulated"):
        rd.commit(7, write)
    assert [n for n in os.listdir(run_dir) if n.startswith((".tmp-", "step-"))] == []
    rd.unlock()


def test_resaving_a_step_swaps_it_atomically(run_dir: Path) -> None:
    """The same step saved again after a resume: RENAME_EXCHANGE, old copy removed."""
    first = save(run_dir, 5, 1.0)
    ino = first.stat().st_ino
    second = save(run_dir, 5, 2.0)
    assert second == first and second.stat().st_ino != ino
    step, state = load(run_dir)
    assert step == 5 and state["v"] == 2.0  # type: ignore[index]
    assert [n for n in os.listdir(run_dir) if n.startswith(".tmp-")] == []


def test_rename_exchange_swaps_two_full_dirs(tmp_path: Path) -> None:
    old, new = tmp_path / "step-000000001", tmp_path / ".tmp-new"
    old.mkdir()
    (old / "f").write_text("old")
    new.mkdir()
    (new / "f").write_text("new")
    moved = fsutil.exchange_or_replace_dir(new, old)
    assert moved == new, "renameat2(RENAME_EXCHANGE) should be used on a local filesystem"
    assert (old / "f").read_text() == "new" and (new / "f").read_text() == "old"


def test_without_rename_exchange_old_copy_goes_aside_then_away(
    run_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NFS and some FUSE filesystems lack RENAME_EXCHANGE; that cannot be mounted
    here, so the libc entry point is removed to take the fallback path."""
    save(run_dir, 5, 1.0)
    monkeypatch.setattr(fsutil, "_renameat2", None)
    save(run_dir, 5, 2.0)
    assert load(run_dir)[1]["v"] == 2.0  # type: ignore[index]
    assert [n for n in os.listdir(run_dir) if n.startswith(".tmp-")] == []


def test_leftover_aside_copy_is_cleaned_when_replacement_landed(run_dir: Path) -> None:
    save(run_dir, 5, 2.0)
    aside = run_dir / tmp_name(5, dead_pid(), suffix=".old")
    os.rename(save(run_dir / "other", 5, 1.0), aside)
    save(run_dir, 6, 3.0)
    assert not aside.exists()
    assert load(run_dir)[0] == 6


def test_aside_copy_is_restored_when_replacement_never_landed(run_dir: Path) -> None:
    """Crash between the two renames of the fallback: step-N is missing, the old copy is aside."""
    committed = save(run_dir, 5, 1.0)
    aside = run_dir / tmp_name(5, dead_pid(), suffix=".old")
    os.rename(committed, aside)
    RunDir(run_dir).lock()  # the next writer's first act
    assert committed.is_dir() and not aside.exists()
    step, state = load(run_dir)
    assert step == 5 and state["v"] == 1.0  # type: ignore[index]


def test_stale_temp_dirs_removed_live_ones_kept(run_dir: Path, live_pid: int) -> None:
    run_dir.mkdir()
    dead = run_dir / tmp_name(3, dead_pid())
    live = run_dir / tmp_name(3, live_pid)
    foreign_young = run_dir / tmp_name(3, 1, host="othernode")
    foreign_old = run_dir / tmp_name(4, 1, host="othernode")
    for d in (dead, live, foreign_young, foreign_old):
        d.mkdir()
        (d / "data").write_bytes(b"x")
    past = time.time() - FOREIGN_TMP_AGE - 60
    os.utime(foreign_old, (past, past))
    save(run_dir, 10, 1.0)
    left = sorted(n for n in os.listdir(run_dir) if n.startswith(".tmp-"))
    assert left == sorted([live.name, foreign_young.name])


def test_own_pid_temp_dir_in_keep_set_survives(run_dir: Path) -> None:
    run_dir.mkdir()
    mine = run_dir / tmp_name(2, os.getpid())
    mine.mkdir()
    assert remove_stale_tmp(run_dir, keep={mine}) == []
    assert remove_stale_tmp(run_dir) == [mine]


def test_discovery_ignores_temp_and_aside_dirs(run_dir: Path) -> None:
    save(run_dir, 1, 1.0)
    os.rename(save(run_dir / "x", 9, 9.0), run_dir / tmp_name(9, dead_pid()))
    cand = find_latest([run_dir])
    assert cand is not None and cand.step == 1


def test_cleanup_spares_a_temp_dir_this_process_is_writing(run_dir: Path) -> None:
    """Another thread's cleanup (tier drain, full-disk pruning) runs mid-commit."""
    from slurm_ckpt.store.codec import encode_state
    from slurm_ckpt.store.commit import commit, in_flight
    from slurm_ckpt.store.writer import write_state

    run_dir.mkdir()
    seen: list[bool] = []

    def write(tmp: Path) -> tuple[dict, dict]:
        assert tmp in in_flight()
        remove_stale_tmp(run_dir)  # what a concurrent cleanup would do
        seen.append(tmp.is_dir())
        return write_state(tmp, encode_state({"x": 1}))

    commit(run_dir, 1, write)
    assert seen == [True] and in_flight() == frozenset()
    assert find_latest([run_dir]) is not None


def _write_value(value: int) -> WriteFn:
    return lambda tmp: write_state(tmp, encode_state({"v": value}))


def _value(path: Path) -> object:
    return load_state(path, verify_checkpoint(path))["v"]


def test_commit_under_a_name_keeps_a_target_already_there(tmp_path: Path) -> None:
    """A shard staged again (a retried drain, the epilog after the drain) keeps the first copy."""
    first = commit(tmp_path, 7, _write_value(1), name="rank-00003", if_exists="keep")
    again = commit(tmp_path, 7, _write_value(2), name="rank-00003", if_exists="keep")
    assert first == again == tmp_path / "rank-00003"
    assert _value(first) == 1
    assert sorted(os.listdir(tmp_path)) == ["rank-00003"]  # the second copy's temp dir is gone
    replaced = commit(tmp_path, 7, _write_value(3), name="rank-00003")
    assert _value(replaced) == 3 and sorted(os.listdir(tmp_path)) == ["rank-00003"]


@pytest.mark.parametrize("at_its_name", ["a link", "nothing"])
def test_a_temp_dir_renamed_away_mid_write_is_emptied_and_nothing_replaced(tmp_path: Path, at_its_name: str) -> None:
    """Another process (the user's other node) renames the temp dir away while it is written,
    maybe with a link at its name: the commit refuses before its rename, the step already
    there stays, the link's target is not touched, and the renamed dir is emptied through its fd."""
    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    run.mkdir()
    elsewhere.mkdir()
    (elsewhere / "theirs").write_text("not the commit's")
    old = commit(run, 5, _write_value(1))

    def write(into: Path) -> tuple[dict, dict]:
        out = _write_value(2)(into)
        tmp = next(run.glob(".tmp-step-*"))
        os.rename(tmp, run / "moved-away")
        if at_its_name == "a link":
            os.symlink(elsewhere, tmp)
        return out

    with pytest.raises(StorageError, match="renamed") as refused:
        commit(run, 5, write, on_dev=run.stat().st_dev)  # as the stage-out commits into a shared run dir
    assert refused.value.errno == errno.ESTALE
    assert not old.is_symlink() and _value(old) == 1
    assert os.listdir(run / "moved-away") == [] and os.listdir(elsewhere) == ["theirs"]


def test_commit_into_a_dir_holding_the_data_keeps_it_when_it_fails(tmp_path: Path) -> None:
    """An assembly commits the staging dir itself: a failure must not delete the staged data."""
    stage = tmp_path / ".shards-step-000000005-beefbeef"
    stage.mkdir()
    files, tensors = _write_value(5)(stage)
    (stage / MANIFEST).write_text("half a manifest, left by an assembler that died")

    def failing(_: Path) -> tuple[dict, dict]:
        raise OSError(errno.EIO, "simulated EIO")

    with pytest.raises(OSError, match="simulated"):
        commit(tmp_path, 5, failing, into=stage)
    assert stage.is_dir() and set(files) <= set(os.listdir(stage))
    assert find_latest([tmp_path]) is None
    path = commit(tmp_path, 5, lambda _: (files, tensors), into=stage)
    assert path == tmp_path / "step-000000005" and not stage.exists()
    assert _value(path) == 5


def test_preallocate_reserves_the_space_and_sets_the_length(tmp_path: Path) -> None:
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        assert fsutil.preallocate(fd, 8 << 20) is True
        st = os.fstat(fd)
    finally:
        os.close(fd)
    assert st.st_size == 8 << 20 and st.st_blocks * 512 >= 8 << 20


def test_preallocate_retries_a_call_a_signal_interrupted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Faked seam: no filesystem here answers fallocate with EINTR (tmpfs gives
    # up only on fatal signals now, ext4 never); NFS and FUSE can, and ctypes,
    # unlike os.*, does not retry. The checkpoint request arrives as a signal.
    real = fsutil._fallocate
    assert real is not None
    calls: list[int] = []

    def interrupted_twice(*args: int) -> int:
        calls.append(len(calls))
        if len(calls) <= 2:
            ctypes.set_errno(errno.EINTR)
            return -1
        return int(real(*args))

    monkeypatch.setattr(fsutil, "_fallocate", interrupted_twice)
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        assert fsutil.preallocate(fd, 1 << 20) is True
        assert os.fstat(fd).st_size == 1 << 20
    finally:
        os.close(fd)
    assert len(calls) == 3

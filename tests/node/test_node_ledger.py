"""The scratch ledger: reservations never exceed capacity minus headroom, even under races."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import pytest

from slurm_ckpt.node.ledger import Ledger

MiB = 2**20


def reserve(led: Ledger, job: str, size: int, policy: str = "shrink", min_size: int = MiB) -> int:
    return led.reserve(job, size, uid=1000, policy=policy, min_size=min_size).size


def test_grants_within_capacity_then_shrinks(tmp_path: Path) -> None:
    led = Ledger(tmp_path, capacity=100 * MiB, headroom=10 * MiB)
    assert reserve(led, "1", 60 * MiB) == 60 * MiB
    g = led.reserve("2", 50 * MiB, uid=1000, policy="shrink", min_size=MiB)
    assert g.size == 30 * MiB  # 100 - 10 headroom - 60 held
    assert g.warning and "asked for 50.0MiB" in g.warning and "30.0MiB" in g.warning
    assert reserve(led, "3", 5 * MiB) == 0  # nothing left
    assert set(led.entries()) == {"1", "2"}
    assert (tmp_path / "ledger.json").stat().st_mode & 0o777 == 0o600


def test_policy_none_and_min_size(tmp_path: Path) -> None:
    led = Ledger(tmp_path, capacity=100 * MiB)
    assert reserve(led, "1", 90 * MiB) == 90 * MiB
    g = led.reserve("2", 20 * MiB, uid=1, policy="none", min_size=MiB)
    assert g.size == 0 and g.warning and "no node-local scratch" in g.warning
    assert reserve(led, "3", 20 * MiB, min_size=11 * MiB) == 0  # 10 MiB left < min_size
    assert reserve(led, "4", 20 * MiB, min_size=10 * MiB) == 10 * MiB


def test_reserve_is_idempotent_and_release_frees(tmp_path: Path) -> None:
    led = Ledger(tmp_path, capacity=100 * MiB)
    assert reserve(led, "7", 70 * MiB) == 70 * MiB
    assert reserve(led, "7", 70 * MiB) == 70 * MiB  # a requeue on the same node keeps it
    assert led.release("7") == 70 * MiB
    assert led.release("7") == 0  # a second epilog
    assert reserve(led, "8", 100 * MiB) == 100 * MiB


def test_stale_entries_are_dropped_by_the_callback(tmp_path: Path) -> None:
    led = Ledger(tmp_path, capacity=100 * MiB)
    reserve(led, "1", 80 * MiB)
    g = led.reserve("2", 80 * MiB, uid=1, policy="shrink", min_size=MiB,
                    alive=lambda job, entry: job != "1")  # fmt: skip
    assert g.size == 80 * MiB and g.warning is None
    assert set(led.entries()) == {"2"}


def test_corrupt_ledger_is_set_aside(tmp_path: Path) -> None:
    (tmp_path / "ledger.json").write_text("{not json")
    led = Ledger(tmp_path, capacity=100 * MiB)
    assert reserve(led, "1", 10 * MiB) == 10 * MiB
    assert list(tmp_path.glob("ledger.json.corrupt-*"))


def _racer(path: str, job: str, start: float) -> None:
    led = Ledger(Path(path), capacity=100 * MiB)
    while time.time() < start:  # line up the processes so they really contend
        pass
    led.reserve(job, 30 * MiB, uid=1, policy="shrink", min_size=MiB)


def test_concurrent_prologs_never_overcommit(tmp_path: Path) -> None:
    start = time.time() + 0.5
    procs = [multiprocessing.get_context("fork").Process(target=_racer, args=(str(tmp_path), str(i), start))
             for i in range(8)]  # fmt: skip
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    entries = Ledger(tmp_path, capacity=100 * MiB).entries()
    sizes = sorted(int(e["size"]) for e in entries.values())
    assert sum(sizes) == 100 * MiB  # 3 x 30 MiB, then one shrunk to the last 10 MiB
    assert sizes == [10 * MiB, 30 * MiB, 30 * MiB, 30 * MiB]


def test_lock_timeout_is_reported(tmp_path: Path) -> None:
    import filelock

    from slurm_ckpt.errors import LockHeld

    held = filelock.FileLock(str(tmp_path / "ledger.lock"))
    with held, pytest.raises(LockHeld, match="ledger"):
        Ledger(tmp_path, capacity=MiB, lock_timeout=0.2).entries()


@pytest.mark.parametrize("name", ["ledger.lock", "ledger.json", ".ledger.json.{pid}"])
def test_no_ledger_file_is_followed_through_a_link(tmp_path: Path, name: str) -> None:
    """Every root-side ledger file is opened with O_NOFOLLOW relative to the state dir:
    a link planted at any of their names changes nothing outside it."""
    import os

    from slurm_ckpt.errors import StorageError

    victim = tmp_path.parent / f"{tmp_path.name}-victim"
    victim.write_text("precious")
    state = tmp_path / "state"
    state.mkdir(mode=0o711)
    link = state / name.format(pid=os.getpid())
    link.symlink_to(victim)
    led = Ledger(state, capacity=100 * MiB)
    if name == "ledger.lock":
        with pytest.raises(StorageError, match="ledger lock"):
            reserve(led, "1", MiB)
    else:
        assert reserve(led, "1", MiB) == MiB
        assert not os.path.islink(state / "ledger.json") and set(led.entries()) == {"1"}
    assert victim.read_text() == "precious"


def test_a_state_dir_others_can_write_is_refused(tmp_path: Path) -> None:
    from slurm_ckpt.errors import StorageError

    tmp_path.chmod(0o777)
    with pytest.raises(StorageError, match="writable by no one else"):
        Ledger(tmp_path, capacity=MiB).entries()

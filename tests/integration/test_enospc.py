"""A real full filesystem (a tiny tmpfs): the save fails cleanly and nothing is lost."""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from slurm_ckpt import Checkpointer, NoSpace, StorageError
from slurm_ckpt.store import find_latest, verify_checkpoint

pytestmark = pytest.mark.root

PAGE = 4096


def state(step: int, mib: float) -> dict[str, object]:
    n = int(mib * 2**20) // 4
    return {"w": torch.arange(n, dtype=torch.float32) + step, "step": step}


def used(fs: Path) -> int:
    st = os.statvfs(fs)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def leftovers(run: Path) -> list[str]:
    return [n for n in os.listdir(run) if n.startswith(".tmp-")]


def pages(n: int) -> int:
    return -(-n // PAGE) * PAGE


def fill_leaving(fs: Path, free: int) -> None:
    st = os.statvfs(fs)
    (fs / "filler").write_bytes(b"\0" * (st.f_bavail * st.f_frsize - free))


def check_clean_failure(run: Path, fs: Path, err: BaseException, before: int) -> None:
    assert isinstance(err, NoSpace) and isinstance(err, OSError)
    assert err.errno == errno.ENOSPC
    assert err.filename and str(run) in err.filename, err.filename
    assert "full" in err.hint and "storage.keep" in err.hint
    assert "No space left on device" in str(err) and err.filename in str(err)
    assert leftovers(run) == [], "partial temp data must be removed"
    assert used(fs) == before, "every byte of the failed save is given back"
    cand = find_latest([run], full=True)
    assert cand is not None and cand.step == 1
    verify_checkpoint(cand.path, full=True)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_save_too_big_for_the_disk(
    tmpfs: Callable[[str], Path], mode: str, figures: Callable[[str, str], Path]
) -> None:
    fs = tmpfs("4m")
    run = fs / "run"
    with Checkpointer(run, keep=1) as ck:
        ck.save(state(1, 1.5), step=1)
        before = used(fs)
        with pytest.raises(NoSpace) as info:
            if mode == "sync":
                ck.save(state(2, 3), step=2)
            else:
                ck.save_async(state(2, 3), step=2).wait()
        if mode == "async":
            # Whether the next call reports the error again is the on_async_error
            # policy's business, not this test's.
            with contextlib.suppress(NoSpace):
                ck.wait()
        check_clean_failure(run, fs, info.value, before)
        # The writer is not wedged: a save that fits still works.
        ck.save(state(3, 0.5), step=3)
    assert find_latest([run]).step == 3  # type: ignore[union-attr]
    figures(f"enospc-{mode}", f"{type(info.value).__name__}: {info.value}".replace(str(fs), "FS"))


def test_disk_full_at_the_manifest(tmpfs: Callable[[str], Path], tmp_path: Path) -> None:
    """Data files fit, the manifest written last does not: nothing is committed."""
    fs = tmpfs("8m")
    run = fs / "run"
    dry = tmp_path / "dry"
    # The same tensors for the dry run and the real save: the data file's header is
    # padded to where the tensor sits in its memory page, so another allocation
    # of the same tensor can make the file a page longer (this test failed so).
    second = state(2, 1)
    with Checkpointer(dry) as ck:
        sizes = {p.name: p.stat().st_size for p in ck.save(second, step=2).iterdir()}
    with Checkpointer(run, keep=1) as ck:
        ck.save(state(1, 1), step=1)
        fill_leaving(fs, sum(pages(n) for name, n in sizes.items() if name != "MANIFEST.json"))
        before = used(fs)
        with pytest.raises(StorageError) as info:
            ck.save(second, step=2)
        assert "MANIFEST.json" in str(info.value.filename)
        check_clean_failure(run, fs, info.value, before)


def test_a_data_file_too_big_for_the_disk_fails_before_any_of_it_is_written(
    tmpfs: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The engine reserves each data file's space before writing it, so on a full
    # scratch the save fails at once instead of after writing all that fits.
    fs = tmpfs("8m")
    run = fs / "run"
    written: list[int] = []
    real = os.pwritev

    def spy(fd: int, views: list[memoryview], off: int) -> int:
        written.append(sum(len(v) for v in views))
        return real(fd, views, off)

    with Checkpointer(run, keep=1) as ck:
        ck.save(state(1, 1), step=1)
        before = used(fs)
        monkeypatch.setattr(os, "pwritev", spy)
        with pytest.raises(NoSpace) as info:
            ck.save(state(2, 16), step=2)
        assert written == [], "no tensor bytes go out before the space is known to be there"
        check_clean_failure(run, fs, info.value, before)
        monkeypatch.undo()
        ck.save(state(3, 1), step=3)
        assert written == [] and find_latest([run]).step == 3  # type: ignore[union-attr]


@pytest.mark.parametrize("keep", [2, None], ids=["tier-file-with-keep", "older-tier-file"])
def test_the_epilog_stage_out_makes_room_with_the_jobs_keep(
    tmpfs: Callable[[str], Path], tmp_path: Path, keep: int | None
) -> None:
    """A full durable tier at the job's end: with the job's ``keep`` in TIER.json the
    epilog's stage-out prunes and applies retention as the job's drain would, so the
    newest checkpoint gets out; without it the stage-out fails and scratch is kept."""
    import json

    from slurm_ckpt.node.job import Job
    from slurm_ckpt.node.stageout import StageLimits, read_tier, stage_out
    from slurm_ckpt.store.layout import TIER_FILE
    from slurm_ckpt.store.tiers import write_tier_file

    durable = tmpfs("8m")
    with Checkpointer(durable, scratch=False, keep=10) as ck:
        for step in (10, 20):
            ck.save(state(step, 3), step)
    fast = tmp_path / "scratch" / "ckpt"
    with Checkpointer(fast, scratch=False) as ck:
        ck.save(state(30, 3), 30)
    write_tier_file(fast, durable, keep or 3)
    if keep is None:  # as a writer before TIER.json carried keep wrote it
        (fast / TIER_FILE).write_text(json.dumps({"durable": str(durable)}))
    tier = read_tier(fast)
    assert tier is not None and tier.durable == durable and tier.keep == keep

    job = Job.from_env({"SLURM_JOB_ID": "4243", "SLURM_JOB_UID": "0", "SLURM_JOB_GID": "0",
                        "SLURM_JOB_USER": "root"})  # fmt: skip
    res = stage_out(fast, None, job, timeout=60, limits=StageLimits((str(durable),), frozenset(), 2**40))
    steps = sorted(p.name for p in durable.glob("step-*"))
    if keep is None:
        assert res.status == "failed" and "No space left" in res.detail, res
        assert not res.scratch_disposable
        assert steps == ["step-000000010", "step-000000020"] and leftovers(durable) == []
    else:
        assert res.status == "staged" and res.step == 30, res
        assert steps == ["step-000000020", "step-000000030"]  # room made, then retention to keep=2
        verify_checkpoint(durable / "step-000000030", full=True)

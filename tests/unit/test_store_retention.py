"""Retention keeps the newest *valid* checkpoints and never deletes too early."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from slurm_ckpt import Checkpointer
from slurm_ckpt.store import find_latest, retention
from slurm_ckpt.store.layout import list_steps
from slurm_ckpt.store.retention import apply_retention, discard_checkpoint

DATA = "tensors-00000.safetensors"


def save_steps(run: Path, steps: list[int]) -> None:
    with Checkpointer(run, keep=100) as ck:
        for s in steps:
            ck.save({"w": torch.full((64,), float(s)), "step": s}, step=s)


def steps(run: Path) -> list[int]:
    return sorted(s for s, _ in list_steps(run))


def flip_data(d: Path) -> None:
    """Undetectable without reading every byte: a quick check passes it."""
    raw = bytearray((d / DATA).read_bytes())
    raw[-1] ^= 0xFF
    (d / DATA).write_bytes(bytes(raw))


def drop_manifest(d: Path) -> None:
    (d / "MANIFEST.json").unlink()


def truncate_data(d: Path) -> None:
    os.truncate(d / DATA, 10)


@pytest.mark.parametrize("damage", [flip_data, drop_manifest, truncate_data])
def test_keep1_resume_past_corrupt_newest_keeps_a_valid_one(
    run_dir: Path, damage: Callable[[Path], None]
) -> None:
    """100, 200, 300 saved; 300 damaged; the job resumes from 200 and saves 250 with keep=1."""
    save_steps(run_dir, [100, 200, 300])
    damage(run_dir / "step-000000300")
    with Checkpointer(run_dir, keep=1) as ck:
        state = ck.load_latest()
        assert ck.loaded_step == 200 and state["step"] == 200
        ck.save({"w": torch.full((64,), 250.0), "step": 250}, step=250)
    assert steps(run_dir) == [250, 300], "the damaged 300 is left for inspection, not counted"
    cand = find_latest([run_dir])
    assert cand is not None and cand.step == 250


@pytest.mark.parametrize("damage", [drop_manifest, truncate_data])
def test_keep1_standalone_never_deletes_newest_valid(
    run_dir: Path, damage: Callable[[Path], None]
) -> None:
    save_steps(run_dir, [1, 2, 3])
    damage(run_dir / "step-000000003")
    deleted = apply_retention(run_dir, 1)
    assert [p.name for p in deleted] == ["step-000000001"]
    assert steps(run_dir) == [2, 3]
    cand = find_latest([run_dir])
    assert cand is not None and cand.step == 2


def test_corrupt_ones_older_than_the_kept_are_deleted(run_dir: Path) -> None:
    save_steps(run_dir, [1, 2, 3, 4])
    drop_manifest(run_dir / "step-000000002")
    apply_retention(run_dir, 2)
    assert steps(run_dir) == [3, 4]


def test_protected_checkpoints_survive_and_count(run_dir: Path) -> None:
    save_steps(run_dir, [1, 2, 3, 4])
    apply_retention(run_dir, 1, protect=[run_dir / "step-000000002", run_dir / "step-000000004"])
    assert steps(run_dir) == [2, 4]


def test_checkpoints_committed_since_before_survive_and_count(run_dir: Path) -> None:
    """10 committed, then 5 and 7 (a run resumed from an older step): with ``before``
    between them, 5 and 7 are kept whatever their step, and 3 (older) is not."""
    import time

    save_steps(run_dir, [3, 10])
    since = time.time()
    save_steps(run_dir, [5, 7])
    deleted = apply_retention(run_dir, 2, protect=[run_dir / "step-000000010"], before=since)
    assert [p.name for p in deleted] == ["step-000000003"]
    assert steps(run_dir) == [5, 7, 10]
    apply_retention(run_dir, 2, protect=[run_dir / "step-000000010"])
    assert steps(run_dir) == [7, 10]


def test_checkpointer_keeps_k(run_dir: Path) -> None:
    with Checkpointer(run_dir, keep=2) as ck:
        for s in range(1, 6):
            ck.save({"step": s}, step=s)
            assert steps(run_dir) == list(range(max(1, s - 1), s + 1))


def test_failed_save_deletes_nothing(run_dir: Path) -> None:
    """Retention runs only after a commit: a save that fails leaves the old ones alone."""
    save_steps(run_dir, [1])
    with Checkpointer(run_dir, keep=1) as ck, pytest.raises(TypeError):
        ck.save({"w": torch.ones(2), "bad": object()}, step=2)
    assert steps(run_dir) == [1]


def test_discard_vanishes_whole_even_if_interrupted(
    run_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A crash during the delete (simulated at the tree removal) leaves no half-deleted step."""
    save_steps(run_dir, [1, 2])

    def crash(path: Path) -> None:
        raise KeyboardInterrupt("killed mid-delete")

    monkeypatch.setattr(retention, "remove_tree", crash)
    with pytest.raises(KeyboardInterrupt):
        discard_checkpoint(run_dir / "step-000000001")
    assert steps(run_dir) == [2]
    leftovers = [n for n in os.listdir(run_dir) if n.startswith(".tmp-step-000000001-")]
    assert len(leftovers) == 1
    monkeypatch.undo()
    retention.remove_stale_tmp(run_dir)  # what the next writer does first
    assert not (run_dir / leftovers[0]).exists()


def test_retention_after_a_save_deletes_in_the_background(run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """save() returns at its commit: the old step is gone from view at once, its files are
    deleted on the reaper thread (held here until the test lets it go), and wait() waits."""
    import threading

    gate, started = threading.Event(), threading.Event()
    real = retention.remove_tree

    def held(path: Path) -> None:
        started.set()
        assert gate.wait(30), "the test never released the reaper"
        real(path)

    monkeypatch.setattr(retention, "remove_tree", held)
    with Checkpointer(run_dir, keep=1) as ck:
        ck.save({"w": torch.ones(4), "step": 1}, step=1)
        ck.save({"w": torch.ones(4), "step": 2}, step=2)  # returns while the delete of 1 is held
        assert started.wait(30)
        assert steps(run_dir) == [2]
        trash = [n for n in os.listdir(run_dir) if n.startswith(".tmp-step-000000001-")]
        assert len(trash) == 1 and not retention.reaped(timeout=0)
        # The next writer's cleanup must not take the reaper's own temp dir for a leftover.
        assert retention.remove_stale_tmp(run_dir) == []
        gate.set()
        ck.wait()
        assert not (run_dir / trash[0]).exists() and retention.reaped(timeout=0)
        assert ck.load_latest()["step"] == 2


def test_a_delete_left_by_a_killed_trainer_is_finished_by_the_next_writer(run_dir: Path) -> None:
    import subprocess
    import sys

    save_steps(run_dir, [1, 2])
    # The child queues the delete of step 1 for its reaper and dies before the reaper runs.
    code = ("import os, sys; from pathlib import Path; from slurm_ckpt.store import retention; "
            "retention._reaper.submit = lambda trash: os._exit(9); "
            "retention.discard_checkpoint(Path(sys.argv[1]), later=True)")  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", code, str(run_dir / "step-000000001")], check=False)
    assert proc.returncode == 9
    assert steps(run_dir) == [2]
    assert [n for n in os.listdir(run_dir) if n.startswith(".tmp-step-000000001-")]
    with Checkpointer(run_dir, keep=1) as ck:
        ck.save({"step": 3}, step=3)
        ck.wait()
    assert steps(run_dir) == [3]
    assert not [n for n in os.listdir(run_dir) if n.startswith(".tmp-")]


@pytest.mark.parametrize("hang", [False, True])
def test_exit_finishes_queued_deletes_but_never_hangs_on_them(run_dir: Path, hang: bool) -> None:
    import subprocess
    import sys

    save_steps(run_dir, [1, 2])
    code = (
        "import sys, threading; from pathlib import Path; from slurm_ckpt.store import retention\n"
        "if sys.argv[2] == 'hang':\n"
        "    retention.EXIT_WAIT = 0.5\n"
        "    retention.remove_tree = lambda path: threading.Event().wait()  # a filesystem that never answers\n"
        "retention.discard_checkpoint(Path(sys.argv[1]), later=True)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(run_dir / "step-000000001"), "hang" if hang else "-"],
                          capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    trash = [n for n in os.listdir(run_dir) if n.startswith(".tmp-step-000000001-")]
    assert steps(run_dir) == [2]
    if hang:
        assert len(trash) == 1 and "still being deleted" in proc.stderr
    else:
        assert trash == [] and proc.stderr == ""

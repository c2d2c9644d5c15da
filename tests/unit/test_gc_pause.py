"""A save or a load of many small tensors runs no garbage collection (each one would
walk the trainer's live objects too), but the one pass over what it made once
the collector is back on. The collector is back on afterwards."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import torch

from slurm_ckpt import Checkpointer


def test_save_and_load_run_no_collection_and_leave_the_collector_on(tmp_path: Path) -> None:
    state = {"model": {f"p{i}": torch.full((4,), float(i)) for i in range(5000)}, "step": 1}
    ck = Checkpointer(tmp_path / "run", scratch=False, distributed=False)
    runs: list[int] = []

    def seen(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            runs.append(info["generation"])

    gc.callbacks.append(seen)
    try:
        ck.save(state, 1)
        saving, runs[:] = list(runs), []
        got = ck.load_latest()
        loading = list(runs)
    finally:
        gc.callbacks.remove(seen)
        ck.close()
    # Which generation that one pass collects depends on how many passes ran before
    # it, in this test or an earlier one in the process: count them, not their kind.
    assert len(saving) <= 1 and len(loading) <= 1, (saving, loading)
    assert gc.isenabled()
    assert got is not None and torch.equal(got["model"]["p4999"], state["model"]["p4999"])


def test_a_collector_turned_off_by_the_trainer_stays_off(tmp_path: Path) -> None:
    ck = Checkpointer(tmp_path / "run", scratch=False, distributed=False)
    gc.disable()
    try:
        ck.save({"w": torch.ones(3)}, 1)
        assert ck.load_latest() is not None
        assert not gc.isenabled()
    finally:
        gc.enable()
        ck.close()

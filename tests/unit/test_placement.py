"""``placement.choose``: which placement a process gets (one process here; the
multi-rank ones run with real torch.distributed in tests/integration/test_dist.py
and test_multinode_shards.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slurm_ckpt.config import StorageConfig
from slurm_ckpt.errors import ConfigError
from slurm_ckpt.placement import Local, choose
from slurm_ckpt.store import RunDir


def test_one_process_without_scratch_saves_to_its_run_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_CKPT_SCRATCH", str(tmp_path / "scratch"))  # named, but scratch=False wins
    (tmp_path / "scratch").mkdir()
    p = choose(RunDir(tmp_path / "run"), storage=StorageConfig(), keep=2, scratch=False)
    try:
        assert isinstance(p, Local) and p.tiers is None
        assert p.search_dirs == [tmp_path / "run"] and p.agree(True) and not p.agree(False)
    finally:
        p.close()
    assert not (tmp_path / "scratch" / "ckpt").exists()


def test_one_process_with_scratch_saves_there_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setenv("SLURM_CKPT_SCRATCH", str(scratch))
    p = choose(RunDir(tmp_path / "run"), storage=StorageConfig(), keep=2)
    try:
        assert p.tiers is not None
        assert p.search_dirs == [scratch / "ckpt", tmp_path / "run"]
        tier = json.loads((scratch / "ckpt" / "TIER.json").read_text())
        assert tier == {"durable": str(tmp_path / "run"), "keep": 2}
    finally:
        p.close()


def test_scratch_that_is_the_run_dir_is_one_tier(tmp_path: Path) -> None:
    run = tmp_path / "job" / "ckpt"
    run.mkdir(parents=True)
    p = choose(RunDir(run), storage=StorageConfig(), keep=2, scratch=tmp_path / "job")
    try:
        assert p.tiers is None and p.search_dirs == [run]
    finally:
        p.close()


def test_distributed_without_a_process_group_names_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"initialised torch\.distributed"):
        choose(RunDir(tmp_path / "run"), storage=StorageConfig(), keep=2, distributed=True)


def test_replica_ring_goes_by_node_and_skips_ranks_without_scratch() -> None:
    from slurm_ckpt.placement.replicas import ring

    three = [(True, "a"), (True, "b"), (True, "c")]
    assert ring(three, 1) == [(0, 1, 1), (1, 2, 1), (2, 0, 1)]
    assert ring(three, 5) == [(0, 1, 1), (0, 2, 2), (1, 2, 1), (1, 0, 2), (2, 0, 1), (2, 1, 2)]  # capped at nodes - 1
    assert ring(three, 0) == []
    # Two ranks per node: each slot replicates to the same slot of the next node, never to its own node.
    two_each = [(True, "a"), (True, "a"), (True, "b"), (True, "b")]
    assert ring(two_each, 1) == [(0, 2, 1), (1, 3, 1), (2, 0, 1), (3, 1, 1)]
    assert ring([(True, "a"), (True, "a")], 1) == []  # one node: no peer to hold a replica
    # A rank without scratch neither sends nor holds a replica.
    assert ring([(True, "a"), (False, "b"), (True, "c")], 1) == [(2, 0, 1)]

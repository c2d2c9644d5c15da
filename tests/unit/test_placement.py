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

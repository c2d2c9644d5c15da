"""Fixtures for the fault tests: one fault-injecting FUSE mount per session, real small disks."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from slurm_ckpt import Checkpointer
from slurm_ckpt.config import Config, MetricsConfig, StorageConfig
from tests.faultfs.fixtures import fault_dir, faultfs, make_loopfs, make_tmpfs  # noqa: F401

pytestmark = pytest.mark.root


@pytest.fixture
def make_ckpt(tmp_path: Path) -> Iterator[Callable[..., Checkpointer]]:
    """``make_ckpt(run_dir, keep=3, **storage)``: a Checkpointer with fast retries,
    its metrics textfile in ``tmp_path/metrics``; all closed at teardown."""
    made: list[Checkpointer] = []

    def make(run_dir: Path, keep: int = 3, **storage: Any) -> Checkpointer:
        storage.setdefault("retry_backoff", 0.01)
        cfg = Config(storage=StorageConfig(keep=keep, **storage),
                     metrics=MetricsConfig(textfile_dir=str(tmp_path / "metrics")))  # fmt: skip
        c = Checkpointer(run_dir, config=cfg)
        made.append(c)
        return c

    yield make
    for c in made:
        try:
            c.close()
        except Exception:  # a test's deliberate failure may resurface here; it was checked there
            c.run_dir.unlock()

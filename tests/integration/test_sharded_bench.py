"""``slurm-ckpt bench --sharded`` on a small FSDP2 state: every line measured, every load bit-exact.

Real processes (gloo over loopback), real FSDP2, real ``dcp.save``/``dcp.load``;
only the layers are small. No time is asserted.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.sharded import format_sharded, run_sharded_bench

pytestmark = pytest.mark.slow


def test_the_sharded_bench_measures_every_line_and_checks_each_load_against_dcp(tmp_path: Path) -> None:
    doc = run_sharded_bench(1_500_000, tmp_path, reps=1, width=256, reshard=(3, 1))
    assert doc["ok"] is True
    assert doc["info"]["nbytes"] == 2 * 3 * 256 * 256 * 4  # the size rounded up to whole layers (and moments)
    lines = doc["lines"]
    assert sorted(lines) == sorted([
        "save: slurm-ckpt Checkpointer.save", "save: dcp.save FileSystemWriter",
        *[k for k in lines if k.startswith("save: dcp.save FileSystemWriter, ")],
        "load 2 ranks: slurm-ckpt load_latest", "load 2 ranks: dcp.load FileSystemReader",
        "reshard 3 ranks: slurm-ckpt load_latest", "reshard 3 ranks: dcp.load FileSystemReader",
        "reshard 1 rank: slurm-ckpt load_latest", "reshard 1 rank: dcp.load FileSystemReader",
    ])  # fmt: skip
    assert all(len(v) == 1 and v[0] > 0 for v in lines.values())
    report = format_sharded(doc)
    assert "every load bit-exact (ours against dcp.load's, and at 2 ranks against the saved state): yes" in report
    assert report.count(" ours") == len(lines)
    assert list(tmp_path.iterdir()) == []  # its temp dir is removed

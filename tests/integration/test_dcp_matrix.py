"""The resharding matrix, as ``bench/reshard_matrix.py`` prints it, with a small model.

Save at 1, 2, 3 and 4 ranks, load at 1, 2, 3 and 4 (real FSDP2 over gloo, a
layer sharded on dim 1, the rest on dim 0, a replicated DTensor, AdamW's
moments): every tensor bit-exact on every rank, and the bytes each rank read
against the least it could read.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def test_every_save_size_loads_bit_exact_at_every_load_size(tmp_path: Path, figures: Callable[[str, str], Path]) -> None:
    out = tmp_path / "rows.json"
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "reshard_matrix.py"), "--width", "240", "--dir", str(tmp_path / "m"),
         "--json", str(out)],
        capture_output=True, text=True, timeout=1200, check=False, cwd=ROOT,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    figures("reshard-matrix", run.stdout)
    rows = json.loads(out.read_text())
    assert sorted({(r["save"], r["load"]) for r in rows}) == [(s, m) for s in (1, 2, 3, 4) for m in (1, 2, 3, 4)]
    assert len(rows) == 4 * (1 + 2 + 3 + 4)
    for r in rows:
        assert r["bad"] == [], r
        assert r["read"] >= r["needed"] > 0
        if r["save"] == r["load"] or r["load"] == 1:
            # The same layout, or one rank needing all: exactly its own bytes, nothing more.
            assert r["read"] == r["needed"], r

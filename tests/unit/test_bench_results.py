"""Each release's results table in the docs is the one its bench JSON makes; so is the
storage lab's table of filesystems."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.results import by_filesystem, results_table

ROOT = Path(__file__).resolve().parents[2]
RUNS = sorted((ROOT / "docs" / "results").glob("*.json"))


def _key(path: Path) -> tuple[int, ...]:
    return tuple(int(part) for part in path.stem.split("."))


def test_there_is_a_run_for_the_current_release() -> None:
    from slurm_ckpt import __version__

    assert any(run.stem == __version__ for run in RUNS), f"no docs/results/{__version__}.json"


@pytest.mark.parametrize("run", RUNS, ids=lambda p: p.stem)
def test_performance_page_holds_each_release_table(run: Path) -> None:
    table = results_table(json.loads(run.read_text()), run.stem)
    assert table in (ROOT / "docs" / "performance.md").read_text(), (
        f"docs/performance.md lacks the table of {run.name}: python -m bench.results {run}"
    )


def test_readme_holds_the_newest_table() -> None:
    newest = max(RUNS, key=_key)
    assert results_table(json.loads(newest.read_text()), newest.stem) in (ROOT / "README.md").read_text()


def test_storage_lab_page_holds_the_table_of_its_runs() -> None:
    runs = sorted((ROOT / "docs" / "results" / "storage-lab").glob("*.json"))
    assert runs, "no docs/results/storage-lab/*.json"
    table = by_filesystem({r.stem: json.loads(r.read_text()) for r in runs})
    assert table in (ROOT / "docs" / "storage-lab.md").read_text(), (
        "docs/storage-lab.md lacks the table: python -m bench.results --by-fs docs/results/storage-lab/*.json"
    )

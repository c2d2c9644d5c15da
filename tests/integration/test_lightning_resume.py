"""Lightning set-ups as users write them, stopped by the checkpoint signal and resumed: bit for bit.

Each cell trains a LightningModule with dropout, AdamW and a scheduler on a
shuffled ``StatefulDataLoader`` (``lightning_runs.py``), once uninterrupted
with Lightning alone and once with ``SlurmCkptIO`` and ``PreemptionCallback``,
where a real SIGUSR1 (what ``slurm-ckpt run`` forwards) arrives at a chosen
point, each stopped ``fit`` is followed by a fresh one resumed from
``io.resume_path()``, as after a requeue. The two must agree on every
training batch (epoch, batch index, data indices, loss and learning rate,
to the bit), on every validation batch, on the optimizer steps (each once),
on the final weights, optimizer and scheduler state, ``current_epoch`` and
``global_step``, and on the rows the CSV logger wrote, in one version
directory. ``stops`` pins where each stopped run checkpointed: the stop
waits for a state that resumes exactly (``docs/lightning.md``).

The cells run in this process (two DDP cells on two gloo ranks), a few
seconds each.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lightning.pytorch")
pytest.importorskip("torchdata")

from tests.integration.lightning_runs import Cell, diff, reference, stopped_and_resumed

# name -> (cell, the steps each stopped run checkpointed at)
CELLS: dict[str, tuple[Cell, list[int | None]]] = {
    # ModelCheckpoint set-ups (cause 1: a later save at the stop's step replaced its checkpoint)
    "default-checkpoint/max-epochs/epoch-scheduler/mid-epoch": (
        Cell(stops=(("train", 7), ("train", 17)), checkpoint="default", max_epochs=3, epoch_scheduler=True,
             logger=False), [7, 17]),
    "every-n-save-last/max-steps/mid-epoch": (
        Cell(stops=(("train", 6), ("train", 14)), checkpoint="every_last", max_steps=24, logger=False), [6, 14]),
    "every-n-save-last-link/max-steps/mid-epoch": (
        Cell(stops=(("train", 6), ("train", 14)), checkpoint="every_link", max_steps=24, logger=False), [6, 14]),
    "every-n-save-last/max-steps/on-a-save-step": (
        Cell(stops=(("train", 8), ("train", 16)), checkpoint="every_last", max_steps=24, logger=False), [8, 16]),
    "top-k-monitor/val-check-interval/mid-epoch": (
        Cell(stops=(("train", 7), ("train", 13)), checkpoint="top_k", max_steps=24, val_check_interval=5,
             logger=False), [7, 13]),
    "no-checkpointing/max-steps/mid-epoch": (
        Cell(stops=(("train", 5), ("train", 15)), max_steps=24, logger=False), [5, 15]),
    # Where the stop comes (causes 2 to 4)
    "no-validation/last-batch-of-epoch": (
        Cell(stops=(("train", 10), ("train", 20)), max_steps=24, logger=False, val=False), [11, 21]),
    "max-epochs/epoch-scheduler/last-batch-of-epoch": (
        Cell(stops=(("train", 10),), checkpoint="every_last", max_epochs=2, epoch_scheduler=True, logger=False),
        [11]),
    "val-check-interval/batch-before-validation": (
        Cell(stops=(("train", 5), ("train", 15)), max_steps=24, val_check_interval=5, logger=False), [6, 16]),
    "val-check-interval/during-validation": (
        Cell(stops=(("val", 1), ("val", 2)), max_steps=24, val_check_interval=5, logger=False), [6, 11]),
    # As Lightning's own loop tests: an interval that is a fraction of the epoch, and one
    # counted across epochs (check_val_every_n_epoch=None)
    "val-check-interval-half-epoch/max-epochs/batch-before-validation": (
        Cell(stops=(("train", 5), ("train", 14)), max_epochs=2, val_check_interval=0.5, logger=False), [6, 14]),
    "val-check-interval-across-epochs/batch-before-validation": (
        Cell(stops=(("train", 7), ("train", 13)), max_steps=24, val_check_interval=7, check_val_every_n_epoch=None,
             logger=False), [8, 13]),
    "during-sanity-check": (Cell(stops=(("sanity", 0),), max_steps=12, logger=False), [1]),
    "in-on-train-epoch-end": (Cell(stops=(("epoch_end", 0),), max_steps=24, logger=False), [11]),
    "accumulate-2/between-micro-batches": (
        Cell(stops=(("train", 5), ("train", 13)), max_steps=12, accumulate=2, logger=False, val=False), [3, 7]),
    "accumulate-2/every-n-save-last/val-check-interval/between-micro-batches": (
        Cell(stops=(("train", 3), ("train", 9)), checkpoint="every_last", max_steps=12, accumulate=2,
             val_check_interval=4, logger=False), [3, 6]),
    "last-step-of-the-run/no-checkpoint-needed": (
        Cell(stops=(("train", 12),), checkpoint="every_last", max_steps=12, logger=False), [None]),
    # Logs (cause 5)
    "csv-logger/mid-epoch": (Cell(stops=(("train", 5), ("train", 15)), max_steps=24), [5, 15]),
    # Lightning's default ModelCheckpoint keeps its files under the logger's version directory
    "csv-logger/default-checkpoint/max-epochs/mid-epoch": (
        Cell(stops=(("train", 4), ("train", 23)), checkpoint="default", max_epochs=3), [4, 23]),
    "tensorboard-logger/val-check-interval/during-validation": (
        Cell(stops=(("val", 1), ("train", 15)), max_steps=20, val_check_interval=5, tensorboard=True), [6, 16]),
    "csv-logger/top-k-monitor/max-epochs/during-validation": (
        Cell(stops=(("val", 2), ("train", 17)), checkpoint="top_k", max_epochs=3, epoch_scheduler=True,
             val_check_interval=5), [6, 17]),
    # min_epochs / min_steps: Lightning ignores should_stop until they are met
    "min-epochs/max-epochs/mid-epoch": (
        Cell(stops=(("train", 5), ("train", 14)), max_epochs=3, min_epochs=2, logger=False), [5, 14]),
    "min-steps/max-steps/mid-epoch": (
        Cell(stops=(("train", 5), ("train", 13)), max_steps=24, min_steps=20, logger=False), [5, 13]),
    # A time-based val_check_interval (a timedelta), on a clock that training alone moves
    "val-check-time/mid-epoch/batch-before-validation": (
        Cell(stops=(("train", 5), ("train", 14)), max_steps=24, val_check_seconds=7, logger=False), [5, 15]),
    # Logs: a step that is not a logging step (log_every_n_steps), epoch aggregates (on_epoch=True)
    "csv-logger/log-every-5-steps/mid-epoch": (
        Cell(stops=(("train", 7), ("train", 13)), max_steps=24, log_every_n_steps=5), [7, 13]),
    "csv-logger/epoch-metrics/max-epochs/mid-epoch": (
        Cell(stops=(("train", 4), ("train", 17)), max_epochs=3, epoch_metrics=True, log_every_n_steps=3),
        [4, 17]),
    "tensorboard-logger/epoch-metrics/val-check-interval/mid-epoch": (
        Cell(stops=(("train", 3), ("train", 12)), max_epochs=2, val_check_interval=5, epoch_metrics=True,
             tensorboard=True), [3, 12]),
    # As Lightning's own resume tests: validation every other epoch, a limited epoch, several
    # validation loaders, and an accumulation that does not divide the epoch
    "check-val-every-2-epochs/last-batch-of-epoch": (
        Cell(stops=(("train", 10), ("train", 20)), max_epochs=3, check_val_every_n_epoch=2, logger=False),
        [11, 21]),
    "limit-train-batches/last-batch-of-epoch": (
        Cell(stops=(("train", 7), ("train", 12)), max_epochs=3, limit_train_batches=7, logger=False), [8, 12]),
    "two-val-loaders/during-the-second": (
        Cell(stops=(("val", 3),), max_steps=16, val_check_interval=5, val_loaders=2, logger=False), [6]),
    "accumulate-3/epoch-not-a-multiple/last-batch-of-epoch": (
        Cell(stops=(("train", 10), ("train", 14)), max_epochs=2, accumulate=3, logger=False, val=False), [5, 6]),
    "plateau-scheduler-each-step/mid-epoch": (
        Cell(stops=(("train", 5), ("train", 13)), max_steps=20, plateau=True, logger=False), [5, 13]),
    "early-stopping/val-check-interval/mid-epoch": (
        Cell(stops=(("train", 7), ("train", 17)), max_epochs=4, val_check_interval=5, early_stopping=True,
             logger=False), [7, 17]),
    "reload-dataloaders-each-epoch/last-batch-of-epoch": (
        Cell(stops=(("train", 10), ("train", 15)), max_epochs=3, reload_dataloaders=1, logger=False), [11, 15]),
}


@pytest.fixture(autouse=True)
def _quiet() -> None:
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("name", list(CELLS))
def test_stopped_and_resumed_run_is_the_uninterrupted_run(tmp_path: Path, name: str) -> None:
    cell, stops = CELLS[name]
    if cell.tensorboard:
        pytest.importorskip("tensorboard")
    want = reference(cell, tmp_path / "ref")
    got = stopped_and_resumed(cell, tmp_path / "res")
    assert got.stopped_at == [*stops, None][: len(got.stopped_at)] and got.stopped_at[-1] is None, got.stopped_at
    assert [s for s in got.stopped_at if s is not None] == [s for s in stops if s is not None]
    assert diff(got, want) == []


def _ddp_cell(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    """One rank of a DDP cell: both runs on this rank; the signal reaches rank 1 only."""
    import os
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")  # started by the launcher, as srun starts tasks
    cell = DDP_CELLS[args["name"]][0]
    kw = {"accelerator": "cpu", "devices": world, "strategy": "ddp"}
    root = Path(args["out"])
    want = reference(cell, root / "ref", **kw)
    got = stopped_and_resumed(cell, root / "res", signal_here=rank == 1, **kw)
    if rank != 0:  # rank 0 alone logs; the others would read its files while it writes them
        got.rows = want.rows = []
        got.versions = want.versions = []
    return {"stopped_at": got.stopped_at, "problems": diff(got, want), "batches": len(got.record)}


DDP_CELLS: dict[str, tuple[Cell, list[int | None]]] = {
    "ddp/every-n-save-last/csv-logger/last-batch-of-epoch": (
        Cell(stops=(("train", 5), ("train", 10)), checkpoint="every_last", max_steps=14), [6, 11]),
    "ddp/accumulate-2/val-check-interval/during-validation": (
        Cell(stops=(("train", 3), ("val", 1)), max_steps=10, accumulate=2, val_check_interval=4, logger=False),
        [4, 7]),
    # Each rank seeded on its own (its own dropout): each resumes its own generators
    "ddp/rank-seeds/epoch-metrics/csv-logger/mid-epoch": (
        Cell(stops=(("train", 3),), max_steps=8, rank_seed=True, epoch_metrics=True), [3]),
}


@pytest.mark.parametrize("name", list(DDP_CELLS))
def test_ddp_ranks_stopped_and_resumed_are_the_uninterrupted_run(tmp_path: Path, name: str) -> None:
    from tests.integration.dist_ranks import launch

    got = launch(2, "tests.integration.test_lightning_resume:_ddp_cell", {"name": name, "out": str(tmp_path)},
                 tmp_path / "ranks", timeout=300)  # fmt: skip
    stops = DDP_CELLS[name][1]
    for rank, g in enumerate(got):
        assert g["stopped_at"] == [*stops, None], (rank, g["stopped_at"])
        assert g["problems"] == [], (rank, g["problems"])
        assert g["batches"] > 0

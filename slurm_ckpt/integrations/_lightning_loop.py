"""Where a Lightning fit loop may stop for a checkpoint, and how its logs continue.

Lightning's loops keep part of their state outside anything a checkpoint
holds, and a checkpoint saved at the end of a training batch resumes exactly
only when the uninterrupted run would do nothing but fetch the next batch of
the same epoch before the next ``training_step``:

* between the micro-batches of an accumulated optimizer step the gradients
  are in ``.grad``, which no checkpoint holds;
* after an epoch's last batch, the next epoch's ``iter(DataLoader)`` draws
  from torch's generator (the sampler's and the workers' seeds), as does a
  validation loop that is due, and a resumed run restores the generators only
  once it is back in a training batch: its draws would differ. Lightning also
  resumes a checkpoint taken before a due validation by skipping that
  validation.

So a requested stop waits for the first batch end after which none of these
is pending. These read Lightning's loop internals (2.5 to 2.6); the tests run
them against the installed Lightning.
"""

from __future__ import annotations

import contextlib
import csv
import logging
import os
from pathlib import Path
from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

__all__ = ["continue_logs", "finishes_now", "logger_versions", "not_whole", "skip_stop_validation"]

log = logging.getLogger("slurm_ckpt")


def not_whole(trainer: Trainer) -> str:
    """Why the state after this training batch cannot be checkpointed for a stop, or ""."""
    epoch_loop = trainer.fit_loop.epoch_loop
    if epoch_loop._should_accumulate():
        return "the optimizer step of the accumulated micro-batches"
    if epoch_loop._num_ready_batches_reached():
        return "the end of the epoch"
    fetcher = trainer.fit_loop._data_fetcher
    if fetcher is not None and epoch_loop._should_check_val_fx(fetcher):
        return "the validation due after this batch"
    return ""


def finishes_now(trainer: Trainer) -> bool:
    """True when ``fit`` ends after this batch anyway (``max_steps``, or the last epoch's end)."""
    fit_loop = trainer.fit_loop
    if fit_loop.max_steps >= 0 and trainer.global_step >= fit_loop.max_steps:
        return True
    max_epochs = fit_loop.max_epochs
    last_epoch = max_epochs is not None and max_epochs >= 0 and trainer.current_epoch + 1 >= max_epochs
    return last_epoch and fit_loop.epoch_loop._num_ready_batches_reached()


def skip_stop_validation(trainer: Trainer) -> None:
    """Keep ``trainer.should_stop`` from running a validation loop after this batch.

    Lightning validates when a callback sets ``should_stop`` (for early
    stopping); after a checkpoint for a stop it would run in the stopped job
    only, log its metrics, and cost time that the signal's lead time may not have.
    """
    trainer.fit_loop.epoch_loop._skip_next_val = True


def logger_versions(trainer: Trainer) -> list[Any]:
    """Each logger's version, for the checkpoint; None where a logger has none of its own."""
    return [lg.version if hasattr(lg, "_version") else None for lg in trainer.loggers]


def continue_logs(trainer: Trainer, versions: list[Any]) -> None:
    """Make the CSV and TensorBoard loggers of a resumed ``fit`` write into the version
    directories of the run that saved ``versions``, before ModelCheckpoint's setup puts
    its default dirpath under one.

    Both loggers pick the next free version at their first use, so a requeued job would
    start a new directory each time. Lightning opens each logger's experiment just
    before the callbacks' ``setup``: what it has made for the new version by then (the
    directory, TensorBoard's empty event file) is removed. CSVLogger deletes the metrics
    file of a version directory it opens: the rows logged so far are kept and appended to.
    """
    for lg, version in zip(trainer.loggers, versions, strict=False):
        if version is None or not isinstance(lg, (CSVLogger, TensorBoardLogger)) or lg._version == version:
            continue
        opened = lg._experiment
        new_dir = Path(lg.log_dir)
        # Only this process's empty start: a directory already holding logs is left alone.
        made = [p for p in new_dir.iterdir() if f".{os.getpid()}." in p.name] if opened is not None else []
        if opened is not None and len(made) != len(os.listdir(new_dir)):
            log.warning("%s has written to %s already: the resumed run logs there, not into version %s",
                        type(lg).__name__, new_dir, version)  # fmt: skip
            continue
        close = getattr(opened, "close", None)  # TensorBoard's SummaryWriter
        if close is not None:
            close()
        lg._experiment, lg._version = None, version
        if opened is not None:
            with contextlib.suppress(OSError):
                for p in made:
                    p.unlink()
                new_dir.rmdir()
        if trainer.is_global_zero and isinstance(lg, CSVLogger):
            _open_csv_keeping_rows(lg)


def _open_csv_keeping_rows(lg: Any) -> None:
    metrics = Path(lg.log_dir) / "metrics.csv"
    if not metrics.is_file():
        return
    kept = metrics.with_name(f".metrics.csv.resume-{os.getpid()}")
    os.replace(metrics, kept)
    try:
        writer = lg.experiment  # deletes the metrics file of an existing directory
    finally:
        os.replace(kept, metrics)
    with open(metrics, newline="") as f:
        header = next(csv.reader(f), [])
    # The writer rewrites the file with a new header when new keys appear: it must
    # know the keys already there, or it would drop their columns.
    writer.metrics_keys = sorted(k for k in header if k)

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
is pending. Other state lives in the trainer and no checkpoint of Lightning's
holds it: the partial sums of the epoch's ``on_epoch=True`` metrics, and the
clock of a time-based ``val_check_interval``; these carry them over a stop.
They read Lightning's loop internals (2.5 to 2.6); the tests run them against
the installed Lightning.
"""

from __future__ import annotations

import contextlib
import csv
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

__all__ = [
    "carry_epoch_sums",
    "continue_logs",
    "drop_epoch_sums",
    "epoch_sums",
    "finishes_now",
    "logger_versions",
    "not_whole",
    "set_val_clock",
    "stop_after_batch",
    "undo_stop",
    "val_clock",
]

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


def stop_after_batch(trainer: Trainer, checkpoint: Callable[[], None]) -> tuple[Any, Any]:
    """Call ``checkpoint`` once Lightning has finished this training batch, end ``fit``
    there, and make what the stopped job does after it leave no trace that the run not
    stopped would not leave. Returns what :func:`undo_stop` puts back when ``fit`` ends.

    * ``checkpoint`` runs where the run not stopped would fetch the next batch:
      after the batch's end hooks, Lightning still logs the batch and steps a
      ``ReduceLROnPlateau`` with ``interval="step"`` on the metrics the batch
      logged, and a checkpoint taken in ``on_train_batch_end`` would hold the
      scheduler before that step.
    * ``trainer.should_stop`` stops ``fit`` only once ``min_epochs`` and ``min_steps``
      are met; they are lifted for the rest of this ``fit``.
    * Lightning validates when ``should_stop`` is set (for early stopping): that
      validation would run in the stopped job only, log its metrics, and cost time
      that the signal's lead time may not have. It is skipped.
    * Lightning logs the batch's metrics when ``should_stop`` is set, whatever
      ``log_every_n_steps`` says, and the epoch's ``on_epoch=True`` aggregates when
      the loop ends: a partial epoch, which the resumed run logs again whole. This
      batch logs as the run not stopped logs it, and nothing after it does.
    """
    fit_loop, connector = trainer.fit_loop, trainer._logger_connector
    mins = (fit_loop.min_epochs, fit_loop.epoch_loop.min_steps)
    fit_loop.min_epochs, fit_loop.epoch_loop.min_steps = None, None
    fit_loop.epoch_loop._skip_next_val = True
    step_metrics = connector.update_train_step_metrics

    def update_train_step_metrics() -> None:
        del connector.update_train_step_metrics
        trainer.should_stop = False  # the decision of the run that goes on
        try:
            step_metrics()
        finally:
            trainer.should_stop = True
            connector.log_metrics = lambda *args, **kwargs: None  # type: ignore[method-assign]

    connector.update_train_step_metrics = update_train_step_metrics  # type: ignore[method-assign]
    loop = fit_loop.epoch_loop
    save_loggers = loop._save_loggers_on_train_batch_end

    def save_loggers_on_train_batch_end() -> None:  # the last thing of the batch
        del loop._save_loggers_on_train_batch_end
        checkpoint()
        save_loggers()

    loop._save_loggers_on_train_batch_end = save_loggers_on_train_batch_end  # type: ignore[method-assign]
    trainer.should_stop = True
    return mins


def undo_stop(trainer: Trainer, mins: tuple[Any, Any]) -> None:
    """Put back what :func:`stop_after_batch` changed, for a later ``fit`` or ``test`` of the trainer."""
    trainer.fit_loop.min_epochs, trainer.fit_loop.epoch_loop.min_steps = mins
    for name in ("update_train_step_metrics", "log_metrics"):
        trainer._logger_connector.__dict__.pop(name, None)
    trainer.fit_loop.epoch_loop.__dict__.pop("_save_loggers_on_train_batch_end", None)


def val_clock(trainer: Trainer) -> float | None:
    """Seconds of training since the last validation, where ``val_check_interval`` is a time."""
    if getattr(trainer, "_val_check_time_interval", None) is None:
        return None
    if trainer.validating:  # a save at the validation's end: its clock restarts now
        return 0.0
    return float(time.monotonic() - trainer._last_val_time)  # type: ignore[attr-defined]


def set_val_clock(trainer: Trainer, elapsed: float | None) -> None:
    """Start a resumed run's validation clock where :func:`val_clock` read it.

    Lightning starts the clock when ``fit`` starts, so a run resumed from a stop
    would validate ``val_check_interval`` after the requeue instead of after the
    training time that was left. Time spent stopped, saving and restarting is not
    counted: the clock counts the training the uninterrupted run does.
    """
    if elapsed is not None and getattr(trainer, "_val_check_time_interval", None) is not None:
        trainer._last_val_time = time.monotonic() - elapsed  # type: ignore[attr-defined]


def epoch_sums(trainer: Trainer) -> dict[str, Any]:
    """This rank's partial sums of the training epoch's ``on_epoch=True`` metrics, and
    the batches they count."""
    loop = trainer.fit_loop.epoch_loop
    sums = {}
    for key, metric in loop._results.items():
        if metric.is_tensor and metric.meta.on_epoch and not metric.has_reset:
            sums[key] = {"value": metric.value.clone()}
            if metric.meta.is_mean_reduction:
                sums[key]["cumulated_batch_size"] = metric.cumulated_batch_size.clone()
    return {"batches": loop.batch_progress.current.ready, "metrics": sums}


def carry_epoch_sums(trainer: Trainer, saved: dict[str, Any]) -> None:
    """Start the epoch's ``on_epoch=True`` metrics of a run resumed inside the epoch from
    the sums :func:`epoch_sums` saved, so the epoch's aggregates are the uninterrupted run's.

    Call before the first training batch's ``training_step``. Lightning makes each
    metric when it is first logged, so the sums go in when it is (before the value is
    added, in the order the uninterrupted run adds them). A run resumed at an epoch's
    start carries nothing.
    """
    loop = trainer.fit_loop.epoch_loop
    pending = dict(saved.get("metrics", {}))
    if not pending or loop.batch_progress.current.ready != saved.get("batches", -1) + 1:
        return
    results = loop._results
    update = results.update_metrics

    def update_metrics(key: str, value: Any, batch_size: int) -> None:
        sums = pending.pop(key, None)
        metric = results[key]
        if sums is not None and metric.is_tensor and metric.meta.on_epoch:
            for name, tensor in sums.items():
                setattr(metric, name, tensor.to(getattr(metric, name).device))
        if not pending:
            del results.update_metrics
        update(key, value, batch_size)

    results.update_metrics = update_metrics


def drop_epoch_sums(trainer: Trainer) -> None:
    """Forget sums :func:`carry_epoch_sums` still holds (metrics not logged again this epoch)."""
    trainer.fit_loop.epoch_loop._results.__dict__.pop("update_metrics", None)


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

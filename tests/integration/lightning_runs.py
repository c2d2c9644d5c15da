"""A Lightning training script as users write one, run whole or stopped and resumed.

:func:`run_cell` trains one configuration (a :class:`Cell`) twice in this
process: once uninterrupted with Lightning alone, and once with slurm-ckpt's
plugin and callback, where the checkpoint signal (SIGUSR1, as the wrapper
forwards it) is sent at chosen points and each stopped ``fit`` is followed by a
fresh one (new model, loader, trainer, generators seeded as at a process
start) resumed with ``ckpt_path=io.resume_path()``, as after a requeue. It
returns both runs' records for the test to compare bit for bit.
"""

from __future__ import annotations

import contextlib
import csv
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import Callback, EarlyStopping, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

from slurm_ckpt import Checkpointer
from slurm_ckpt.integrations.lightning import PreemptionCallback, SlurmCkptIO

N_TRAIN, N_VAL, BATCH = 40, 8, 4  # 10 training batches an epoch, 2 validation batches


@dataclass(frozen=True)
class Cell:
    """One Trainer set-up, and where the signal comes in each stopped run.

    A stop is ``(hook, n)``: ``("train", n)`` at the end of the n-th training
    (micro-)batch of the whole run; ``("val", n)`` at the n-th validation batch
    of the first validation loop after training started in that run;
    ``("sanity", 0)`` during the sanity check; ``("epoch_end", 0)`` in
    ``on_train_epoch_end``.
    """

    stops: tuple[tuple[str, int], ...]
    checkpoint: str = "none"  # default | every_last | every_link | top_k | none
    max_steps: int = -1
    max_epochs: int | None = None
    val_check_interval: int | float | None = None
    check_val_every_n_epoch: int | None = 1
    accumulate: int = 1
    epoch_scheduler: bool = False
    logger: bool = True
    tensorboard: bool = False  # TensorBoardLogger in place of CSVLogger
    val: bool = True
    min_epochs: int | None = None
    min_steps: int | None = None
    log_every_n_steps: int = 1
    epoch_metrics: bool = False  # the training loss also logged with on_epoch=True
    val_check_seconds: float | None = None  # a time-based val_check_interval, on a clock each batch moves 1 s
    limit_train_batches: int | None = None
    val_loaders: int = 1
    rank_seed: bool = False  # each rank seeds its generators with its own seed
    plateau: bool = False  # ReduceLROnPlateau each step on the training loss, in place of StepLR
    early_stopping: bool = False  # EarlyStopping on the validation loss
    reload_dataloaders: int = 0  # reload_dataloaders_every_n_epochs


class Clock:
    """A monotonic clock that only training moves: one second a training batch."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@contextlib.contextmanager
def _clock(cell: Cell) -> Iterator[Clock | None]:
    """Lightning's time-based validation reads ``time.monotonic``: a clock that makes it reproducible."""
    if cell.val_check_seconds is None:
        yield None
        return
    clock, real = Clock(), time.monotonic
    time.monotonic = clock
    try:
        yield clock
    finally:
        time.monotonic = real


class Indexed(Dataset[tuple[torch.Tensor, torch.Tensor, int]]):
    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 6, generator=g)
        self.y = self.x @ torch.randn(6, generator=g) + 0.1 * torch.randn(n, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[i], self.y[i], i


class Model(LightningModule):
    """An MLP with dropout, AdamW and a scheduler; logs its losses as users do."""

    def __init__(self, cell: Cell, record: list[Any], clock: Clock | None = None) -> None:
        super().__init__()
        self.cell = cell
        self.record = record
        self.clock = clock
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3),
                                       torch.nn.Linear(16, 1))  # fmt: skip

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, idx = batch
        loss = torch.nn.functional.mse_loss(self.net(x).squeeze(1), y)
        lr = self.trainer.optimizers[0].param_groups[0]["lr"]
        self.record.append(("batch", self.current_epoch, batch_idx, idx.tolist(), loss.item().hex(), float(lr).hex()))
        self.log("train_loss", loss, on_epoch=self.cell.epoch_metrics)
        if self.clock is not None:
            self.clock.now += 1.0
        return loss

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        x, y, _ = batch
        loss = torch.nn.functional.mse_loss(self.net(x).squeeze(1), y)
        if not self.trainer.sanity_checking:
            self.record.append(("val", self.global_step, dataloader_idx, batch_idx, loss.item().hex()))
        self.log("val_loss", loss)

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.record.append(("opt_step", self.global_step))

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        if self.cell.plateau:
            plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.7, patience=1)
            return {"optimizer": opt,
                    "lr_scheduler": {"scheduler": plateau, "interval": "step", "monitor": "train_loss"}}  # fmt: skip
        if self.cell.epoch_scheduler:
            sched: Any = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "epoch"}}
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.8)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class SignalAt(Callback):
    """Sends the checkpoint signal to this process at one point of the run."""

    def __init__(self, hook: str, n: int) -> None:
        self.hook, self.n = hook, n
        self.val_batches = 0
        self.fired = False

    def _fire(self, hook: str, at: bool = True) -> None:
        if hook == self.hook and at and not self.fired:
            self.fired = True
            os.kill(os.getpid(), signal.SIGUSR1)

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        self._fire("train", trainer.fit_loop.epoch_loop.total_batch_idx + 1 == self.n)

    def on_validation_batch_end(self, trainer: Trainer, *args: Any) -> None:
        if trainer.sanity_checking:
            self._fire("sanity")
            return
        self.val_batches += 1
        self._fire("val", self.val_batches == self.n)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._fire("epoch_end")


@dataclass
class Outcome:
    """What a run leaves: the per-batch record, the final state, what was logged."""

    record: list[Any] = field(default_factory=list)
    final: dict[str, Any] = field(default_factory=dict)
    stopped_at: list[int | None] = field(default_factory=list)
    rows: list[dict[str, str]] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)


def _loaders(cell: Cell) -> tuple[StatefulDataLoader[Any], Any]:
    data = Indexed(N_TRAIN, 1)
    if torch.distributed.is_initialized():
        # What docs/lightning.md asks for under DDP: with shuffle=True Lightning wraps
        # torchdata's sampler in one that draws each epoch's order from torch's generator.
        sampler = StatefulDistributedSampler(data, shuffle=True, seed=0)
        train = StatefulDataLoader(data, batch_size=BATCH, sampler=sampler)
    else:
        train = StatefulDataLoader(data, batch_size=BATCH, shuffle=True)
    val = [StatefulDataLoader(Indexed(N_VAL, 2 + i), batch_size=BATCH) for i in range(cell.val_loaders)]
    return train, val[0] if cell.val_loaders == 1 else val


def _checkpoint_callbacks(cell: Cell, root: Path) -> tuple[list[Callback], bool]:
    """The ModelCheckpoint of the set-up, and whether checkpointing is enabled."""
    if cell.checkpoint == "none":
        return [], False
    if cell.checkpoint == "default":  # Lightning adds its own ModelCheckpoint()
        return [], True
    if cell.checkpoint in ("every_last", "every_link"):
        last: Any = True if cell.checkpoint == "every_last" else "link"
        return [ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=4, save_last=last)], True
    if cell.checkpoint == "top_k":
        return [ModelCheckpoint(dirpath=root / "ckpt", monitor="val_loss", mode="min", save_top_k=2)], True
    raise ValueError(cell.checkpoint)


def _fit(cell: Cell, root: Path, record: list[Any], extra: list[Callback], plugins: list[Any],
         ckpt_path: str | None, **kw: Any) -> Trainer:  # fmt: skip
    rank = int(os.environ.get("LOCAL_RANK", "0")) if cell.rank_seed else 0
    seed_everything(rank, verbose=False)  # what the script does at each start
    with _clock(cell) as clock:
        return _fit_on(cell, root, Model(cell, record, clock), extra, plugins, ckpt_path, **kw)


def _fit_on(cell: Cell, root: Path, model: Model, extra: list[Callback], plugins: list[Any],
            ckpt_path: str | None, **kw: Any) -> Trainer:  # fmt: skip
    train, val = _loaders(cell)
    if cell.val_check_seconds is not None:
        kw["val_check_interval"] = timedelta(seconds=cell.val_check_seconds)
    if cell.limit_train_batches is not None:
        kw["limit_train_batches"] = cell.limit_train_batches
    if cell.early_stopping:
        extra = [*extra, EarlyStopping(monitor="val_loss", patience=3, min_delta=0.05)]
    mc, enabled = _checkpoint_callbacks(cell, root)
    logger: Any = False
    if cell.logger:
        logger = (TensorBoardLogger if cell.tensorboard else CSVLogger)(root / "logs", name="m")
    kw.setdefault("val_check_interval", cell.val_check_interval)
    trainer = Trainer(max_steps=cell.max_steps, max_epochs=cell.max_epochs, min_steps=cell.min_steps,
                      min_epochs=cell.min_epochs, check_val_every_n_epoch=cell.check_val_every_n_epoch,
                      accumulate_grad_batches=cell.accumulate, enable_checkpointing=enabled, logger=logger,
                      log_every_n_steps=cell.log_every_n_steps,
                      reload_dataloaders_every_n_epochs=cell.reload_dataloaders, enable_progress_bar=False, enable_model_summary=False,
                      default_root_dir=root, callbacks=[*extra, *mc], plugins=plugins, **kw)  # fmt: skip
    trainer.fit(model, train, val if cell.val else None, ckpt_path=ckpt_path)
    return trainer


def _final(trainer: Trainer) -> dict[str, Any]:
    module = trainer.lightning_module
    return {"weights": {k: v.detach().clone() for k, v in module.state_dict().items()},
            "optimizer": trainer.optimizers[0].state_dict(),
            "scheduler": trainer.lr_scheduler_configs[0].scheduler.state_dict(),
            "epoch": trainer.current_epoch, "global_step": trainer.global_step}  # fmt: skip


def _logged(root: Path) -> tuple[list[dict[str, str]], list[str]]:
    """The rows of every metrics file under ``root/logs``, in version order, and the versions."""
    base = root / "logs" / "m"
    versions = sorted(p.name for p in base.iterdir()) if base.is_dir() else []
    rows: list[dict[str, str]] = []
    for v in versions:
        f = base / v / "metrics.csv"
        if any((base / v).glob("events.out.tfevents.*")):
            rows += _scalars(base / v)
        elif f.exists():
            with open(f, newline="") as fh:
                rows += [{k: x for k, x in r.items() if x} for r in csv.DictReader(fh)]
    return rows, versions


def _scalars(log_dir: Path) -> list[dict[str, str]]:
    """What TensorBoard shows from a version directory (every event file in it): its scalars.

    The files are read one by one in the order they were made (their names end in a
    time and a counter, which sort as text only while the counters have one digit).
    """
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def made(p: Path) -> tuple[int, int]:
        parts = p.name.split(".")
        return int(parts[3]), int(parts[-1])

    by_tag: dict[str, list[dict[str, str]]] = {}
    for f in sorted(log_dir.glob("events.out.tfevents.*"), key=made):
        acc = EventAccumulator(str(f))
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            by_tag.setdefault(tag, []).extend(
                {"tag": tag, "step": str(e.step), "value": float(e.value).hex()} for e in acc.Scalars(tag))
    return [row for tag in sorted(by_tag) for row in by_tag[tag]]


def reference(cell: Cell, root: Path, **kw: Any) -> Outcome:
    """The run never stopped, with Lightning alone."""
    out = Outcome()
    trainer = _fit(cell, root, out.record, [], [], None, **kw)
    out.final = _final(trainer)
    out.rows, out.versions = _logged(root)
    return out


def stopped_and_resumed(cell: Cell, root: Path, *, signal_here: bool = True, **kw: Any) -> Outcome:
    """The run with slurm-ckpt, stopped at each of ``cell.stops`` in turn and resumed.

    ``signal_here``: whether this process sends itself the signals (with
    several ranks, one rank gets them, as Slurm signals each task on its own).
    """
    out = Outcome()
    for i in range(len(cell.stops) + 1):
        io = SlurmCkptIO(Checkpointer(root / "run", scratch=False, keep=20, distributed=False))
        preempt = PreemptionCallback()
        extra: list[Callback] = [preempt]
        if i < len(cell.stops) and signal_here:
            extra.insert(0, SignalAt(*cell.stops[i]))  # before the callback that looks for the request
        trainer = _fit(cell, root, out.record, extra, [io], io.resume_path(), **kw)
        io.ckpt.close()
        out.stopped_at.append(preempt.step if preempt.stopped else None)
        if not preempt.stopped:
            break
    out.final = _final(trainer)
    out.rows, out.versions = _logged(root)
    return out


def diff(got: Outcome, want: Outcome) -> list[str]:
    """How ``got`` differs from ``want``, bit for bit; empty when they are the same run."""
    problems = []
    if got.record != want.record:
        first = next((i for i, (a, b) in enumerate(zip(got.record, want.record, strict=False)) if a != b),
                     min(len(got.record), len(want.record)))  # fmt: skip
        problems.append(f"record differs from entry {first} of {len(want.record)} (got {len(got.record)}): "
                        f"got {got.record[first:first + 3]}, want {want.record[first:first + 3]}")  # fmt: skip
    for key in ("epoch", "global_step"):
        if got.final[key] != want.final[key]:
            problems.append(f"{key}: got {got.final[key]}, want {want.final[key]}")
    for key in ("weights", "optimizer", "scheduler"):
        if not _same(got.final[key], want.final[key]):
            problems.append(f"final {key} differ")
    if got.rows != want.rows:
        problems.append(f"logged rows differ: got {len(got.rows)}, want {len(want.rows)}; "
                        f"steps got {[r.get('step') for r in got.rows]}, want {[r.get('step') for r in want.rows]}")
    steps = [r[1] for r in got.record if r[0] == "opt_step"]
    if steps != list(range(want.final["global_step"])):
        problems.append(f"optimizer steps are not each step once: {steps}")
    if len(got.versions) != len(want.versions):
        problems.append(f"logger versions: got {got.versions}, want {want.versions}")
    return problems


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and bool(
            torch.equal(a.view(torch.uint8) if a.dim() else a, b.view(torch.uint8) if b.dim() else b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)

"""PyTorch Lightning: checkpoints through the Checkpointer, and a clean stop when preempted.

::

    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
    from slurm_ckpt.integrations.lightning import PreemptionCallback, SlurmCkptIO, plugins

    io = SlurmCkptIO()
    trainer = Trainer(plugins=plugins(io),             # SlurmCkptIO + SLURMEnvironment(auto_requeue=False)
                      callbacks=[PreemptionCallback(), ModelCheckpoint(every_n_train_steps=100)])
    trainer.fit(model, ckpt_path=io.resume_path())    # None on the first run: starts fresh

and in the batch script ``srun slurm-ckpt run -- python train.py``.

:class:`SlurmCkptIO` stores every checkpoint Lightning saves as a step of the
Checkpointer (commit protocol, checksums, tiers, optional background saves)
and leaves at the path Lightning asked for a small *pointer* file naming that
step, so ``ModelCheckpoint``'s file handling (``save_top_k``, ``save_last``,
``every_n_train_steps``, version suffixes, ``ckpt_path="last"`` or ``"best"``)
works as it does with Lightning's own files. A checkpoint's data lives as long
as retention keeps it (the newest ``storage.keep``): a pointer to a step that
retention removed fails to load with an error that says so. Weights-only
checkpoints (``save_weights_only=True``) are exports, not points to resume
from: they are written as Lightning's own torch files. Lightning's
``Model.load_from_checkpoint`` cannot read a pointer: :func:`load_from_checkpoint`
is the same call for one.

:class:`PreemptionCallback` turns ``ckpt.preempted`` (the wrapper's signal)
into a checkpoint at the next batch boundary, committed before ``fit`` stops,
and a clean stop; ``slurm-ckpt run`` then requeues the job. Lightning's own
SLURM requeue must be off (``SLURMEnvironment(auto_requeue=False)``; the
callback refuses to run with it on): its SIGUSR1 handler checkpoints inside the
signal handler and calls ``scontrol requeue`` itself.
"""

from __future__ import annotations

import inspect
import logging
from pathlib import Path
from typing import Any

from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn

from .._env import scratch_dir
from ..checkpointer import Checkpointer, SaveHandle
from ..config import load_config
from ..engine import Engine
from ..errors import ConfigError, ShardError
from ..loopstate import rng_state, set_rng_state
from ..store.manifest import MANIFEST
from ..store.tiers import read_dirs
from ._folder import error_text, gather_objects, raise_gathered
from ._lightning_loop import (
    carry_epoch_sums,
    continue_logs,
    drop_epoch_sums,
    epoch_sums,
    finishes_now,
    logger_versions,
    not_whole,
    set_val_clock,
    stop_after_batch,
    undo_stop,
    val_clock,
)
from ._steps import load_step, oldest_newest, read_pointer, resume_step, write_pointer

__all__ = ["PreemptionCallback", "SlurmCkptIO", "load_from_checkpoint", "plugins"]

log = logging.getLogger("slurm_ckpt")


class SlurmCkptIO(CheckpointIO):
    """A Lightning ``CheckpointIO`` that saves and loads through a :class:`Checkpointer`.

    ``ckpt``: the Checkpointer to use; by default one is made on first use
    with ``distributed=False`` (Lightning saves from global rank 0 only, the
    whole state). ``async_save``: write in the background
    (``Checkpointer.save_async``); the pointer file appears once the
    checkpoint is committed. ``trusted``: allow loading pickled values
    (a checkpoint saved with ``allow_pickle``, e.g. hyperparameters that are
    not plain values).
    """

    def __init__(self, ckpt: Checkpointer | None = None, *, async_save: bool = False,
                 trusted: bool = False) -> None:  # fmt: skip
        self._ckpt = ckpt
        self.async_save = async_save
        self.trusted = trusted
        self._pending: list[tuple[SaveHandle, Path]] = []
        self._resume: tuple[str, Any, int] | None = None
        """What resume_path found: the path it returned, the state, and its step."""
        self._torch = TorchCheckpointIO()
        self._stopped_at: int | None = None
        """The step of the checkpoint a stop committed; later saves of this fit name it."""

    @property
    def ckpt(self) -> Checkpointer:
        """The Checkpointer; made on first use, which also installs the signal flag."""
        if self._ckpt is None:
            self._ckpt = Checkpointer(distributed=False)
        return self._ckpt

    def resume_path(self) -> str | None:
        """What to pass as ``Trainer.fit(ckpt_path=...)``: the newest valid checkpoint, or None.

        The checkpoint is read here, once (verified as it is read, falling back
        to older ones past a damaged one), and handed to Lightning when ``fit``
        asks for this path. None, when there is nothing to resume from, makes
        ``fit`` start fresh: the same call works on the first run and on every
        requeued one.
        """
        state = self.ckpt.load_latest(trusted=self.trusted)
        step = self.ckpt.loaded_step
        if state is None or step is None:
            return None
        path = str(self.ckpt.loaded_path)
        self._resume = (path, state, step)
        log.info("resuming Lightning from step %s (%s)", step, path)
        return path

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any,
                        storage_options: Any | None = None) -> None:  # fmt: skip
        if storage_options is not None:
            raise TypeError(
                "SlurmCkptIO.save_checkpoint takes no storage_options; the Checkpointer's "
                f"configuration decides where and how it writes (got {storage_options!r})"
            )
        if "optimizer_states" not in checkpoint:
            # save_weights_only: an export, not a state to resume from; keeping it
            # out of the run dir keeps it from becoming the newest checkpoint.
            self._torch.save_checkpoint(checkpoint, path)
            return
        self._finish_pending()
        if self._stopped_at is not None:
            # After a stop Lightning goes on saving at the same global_step (ModelCheckpoint
            # at the epoch's end, on_train_end's save_last) states that are not the one to
            # resume from: the epoch counted as finished, an epoch scheduler stepped. The
            # checkpoint that resume picks stays the state at the stop, and Lightning's
            # file names that state; its weights are these.
            write_pointer(Path(path), self._stopped_at, self.ckpt.dir)
            return
        step = int(checkpoint["global_step"])
        if self.async_save:
            self._pending.append((self.ckpt.save_async(checkpoint, step), Path(path)))
        else:
            self.ckpt.save(checkpoint, step)
            write_pointer(Path(path), step, self.ckpt.dir)

    def load_checkpoint(self, path: Any, map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:  # fmt: skip
        self._finish_pending()
        if self._resume is not None and self._resume[0] == str(path):
            state: dict[str, Any] = self._resume[1]
            self._resume = None
            return state
        p = Path(path)
        step = _step_of_dir(p)
        if step is None:
            pointer = read_pointer(p)
            step = pointer.step if pointer is not None else None
        if step is None:  # a file Lightning wrote itself: read it as Lightning would
            return self._torch.load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        # A function (TorchCheckpointIO's default) has no counterpart here: tensors stay as saved.
        where = None if callable(map_location) else map_location
        loaded: dict[str, Any] = load_step(self.ckpt.search_dirs, self.ckpt.engine, step, trusted=self.trusted,
                                           map_location=where)  # fmt: skip
        return loaded

    def agree_resume(self) -> None:
        """Make every rank resume from the same step. Call on every rank once the
        process group is up and before ``fit`` restores (``PreemptionCallback.setup``
        does); nothing to do without a process group.

        Each rank's :meth:`resume_path` runs before ``fit`` starts
        ``torch.distributed``, so each picks on its own, and a rank may find a
        newer step than another (one on its node's scratch only). Ranks resumed
        from different steps train different numbers of steps, and the first to
        finish leaves the others waiting in a collective. They agree on the oldest
        of the newest steps they found, as every rank has that one or older ones
        unless retention removed it; a rank that found a newer one reads it
        instead. Every rank raises :class:`ShardError` when one cannot read it, or
        when one found no checkpoint while another found one.
        """
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return
        mine = self._resume[2] if self._resume is not None else None
        seen = gather_objects((mine, ", ".join(map(str, self.ckpt.search_dirs))))
        step, problem = oldest_newest([(f"rank {r}", s, where) for r, (s, where) in enumerate(seen)])
        if problem:  # the same on every rank, so every rank raises
            raise ShardError(f"resuming Lightning: {problem}")
        cause: BaseException | None = None
        error = ""
        if self._resume is not None and step is not None and mine != step:
            path, self._resume = self._resume[0], None  # one checkpoint in memory at a time
            try:
                self._resume = (path, resume_step(self.ckpt, step, mine, trusted=self.trusted), step)
            except BaseException as e:  # raised below on every rank, not only here (Ctrl-C too)
                cause, error = e, f"rank {dist.get_rank()}: {error_text(e)}"
        errors = [e for e in gather_objects(error) if e]
        raise_gathered(f"resuming Lightning from checkpoint {step}", errors, cause)

    def remove_checkpoint(self, path: Any) -> None:
        """Remove the pointer (or Lightning's own file); retention removes the data."""
        p = Path(path)
        if p.is_symlink() or p.is_file():
            p.unlink()

    def wait(self) -> None:
        """Wait for background saves to commit, and write their pointers."""
        self._finish_pending()

    def teardown(self) -> None:
        self._finish_pending()

    def _finish_pending(self) -> None:
        pending, self._pending = self._pending, []
        for handle, path in pending:
            handle.wait()
            write_pointer(path, handle.step, self.ckpt.dir)


def _step_of_dir(path: Path) -> int | None:
    """The step of a committed checkpoint directory (what ``resume_path`` returns)."""
    if not (path / MANIFEST).is_file():
        return None
    try:
        return int(path.name.removeprefix("step-"))
    except ValueError:
        return None


def load_from_checkpoint(cls: type[Any], checkpoint_path: str | Path, *, map_location: Any = None,
                         trusted: bool = False, **kwargs: Any) -> Any:  # fmt: skip
    """``cls.load_from_checkpoint(checkpoint_path, ...)`` for a file :class:`SlurmCkptIO` left.

    ``cls`` is a ``LightningModule`` (or ``LightningDataModule``) class. The
    files SlurmCkptIO leaves where Lightning asked (``best_model_path``,
    ``last.ckpt``) are pointers, and Lightning's own ``load_from_checkpoint``
    reads a path with ``torch.load``, which cannot read one. This reads the
    step the pointer names from the run dir it names (verified as it is read;
    ``SLURM_CKPT_DIR`` need not be set) and hands the state to
    ``cls.load_from_checkpoint``, so its hyperparameters, keyword overrides
    (``strict``, ``hparams_file``, ``__init__`` arguments), ``map_location``
    and the module's ``on_load_checkpoint`` work as for Lightning's files. On
    the way the state passes through ``torch.save`` into memory: for a moment
    the checkpoint is held twice. A file Lightning wrote itself (a weights-only
    export) goes to ``cls.load_from_checkpoint`` unchanged. ``trusted``: allow
    pickled values, as :class:`SlurmCkptIO`'s.
    """
    import io

    import torch

    pointer = read_pointer(Path(checkpoint_path)) if isinstance(checkpoint_path, (str, Path)) else None
    if pointer is None:
        return cls.load_from_checkpoint(checkpoint_path, map_location=map_location, **kwargs)
    # Lightning's default (and any function) maps devices that are missing here
    # to the CPU; it applies again to the copy below.
    where = map_location
    if where is None or callable(where):
        where = None if torch.cuda.is_available() else "cpu"
    # A save lands on node-local scratch first: the run dir may not have this step yet.
    dirs = read_dirs(pointer.run_dir, scratch_dir())
    state = load_step(dirs, Engine(load_config().engine), pointer.step, trusted=trusted, map_location=where)
    buf = io.BytesIO()
    torch.save(state, buf)
    del state
    buf.seek(0)
    # What was pickled here is what this process has just decoded: weights_only
    # would refuse the NumPy RNG states in it, and guards nothing. (Lightning
    # before 2.6 takes no weights_only: it would become a hyperparameter.)
    if "weights_only" in inspect.signature(cls.load_from_checkpoint).parameters:
        kwargs.setdefault("weights_only", False)
    return cls.load_from_checkpoint(buf, map_location=map_location, **kwargs)


def plugins(io: SlurmCkptIO | None = None) -> list[Any]:
    """``Trainer(plugins=...)`` for a job under ``slurm-ckpt run``.

    ``io`` (a :class:`SlurmCkptIO`, made if not given), and under Slurm
    ``SLURMEnvironment(auto_requeue=False)``, so that Lightning keeps its
    SLURM rank and node discovery but leaves signals and requeue to the wrapper.
    """
    out: list[Any] = [io if io is not None else SlurmCkptIO()]
    if SLURMEnvironment.detect():
        out.append(SLURMEnvironment(auto_requeue=False))
    return out


class PreemptionCallback(Callback):
    """On the wrapper's request, checkpoint at the next whole batch boundary and stop ``fit``.

    The checkpoint goes through the trainer's :class:`SlurmCkptIO` (required)
    and is committed before the callback returns; the stop is Lightning's own
    ``trainer.should_stop``, so ``fit`` returns normally and the script should
    then exit 0 (check :attr:`stopped`). With several ranks the request is
    agreed on first, so every rank stops at the same batch. ``filename``: the
    pointer written for it, in ``trainer.default_root_dir``.

    The stop comes at the end of the first training batch after the request
    where the state is whole: not between the micro-batches of an accumulated
    optimizer step, not at an epoch's end, not before a due validation (a
    request during validation, the sanity check or an epoch's end waits for
    the next training batch). When ``fit`` ends after the batch anyway, it
    ends as usual and no checkpoint is taken. After the stop, ``fit`` ends
    even before ``min_epochs``/``min_steps``, no validation runs, nothing more
    is logged (the batch logs as ``log_every_n_steps`` says, and the partial
    epoch's ``on_epoch`` aggregates are not logged), and what Lightning saves
    later in the same ``fit`` (``ModelCheckpoint`` at the epoch's end or
    ``on_train_end``) names the stop's checkpoint instead of replacing it:
    resume picks the state at the stop.

    Each checkpoint also holds, for every rank, what a resumed run needs to go
    on as the stopped one would have, restored just before the first batch
    after a resume: the partial sums of the epoch's ``on_epoch=True`` training
    metrics, the clock of a time-based ``val_check_interval``, and with
    ``rng=True`` (the default) the random number generators (Python, NumPy,
    torch, CUDA; see :func:`slurm_ckpt.rng_state`), after the DataLoader has
    drawn its seeds; at a stop's checkpoint that is where the stopped run would
    have drawn next, so dropout and other random ops continue each rank's
    stream. Lightning alone restores none of them. Every rank must call
    ``trainer.save_checkpoint`` (as Lightning requires): the ranks' states are
    gathered.

    ``loggers=True`` (the default) keeps the loggers' versions in the
    checkpoint, and a ``fit`` resumed from :meth:`SlurmCkptIO.resume_path`
    logs into the same version directories (``CSVLogger`` keeps the rows
    logged so far) rather than starting a new one at each requeue.
    """

    def __init__(self, filename: str = "preempted.ckpt", *, rng: bool = True, loggers: bool = True) -> None:
        self.filename = filename
        self.rng = rng
        self.loggers = loggers
        self.stopped = False
        self.step: int | None = None
        self._requested = False
        self._waiting_for = ""
        self._versions: list[Any] = []
        self._trainer: Trainer | None = None
        self._to_restore: dict[str, Any] | None = None
        self._undo: tuple[Any, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        trainer = self._trainer
        mine: dict[str, Any] = {"rng": rng_state()} if self.rng else {}
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            mine["epoch_sums"] = epoch_sums(trainer)
            mine["val_clock"] = val_clock(trainer)
        # Lightning calls this on every rank and writes rank 0's: each rank's own goes in.
        state: dict[str, Any] = {"ranks": gather_objects(mine)}
        if self.loggers:
            state["loggers"] = self._versions
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        ranks = state_dict.get("ranks")
        if ranks is None:  # saved by an older version: one rank's generators
            self._to_restore = {"rng": state_dict["rng"]} if "rng" in state_dict else None
            return
        import torch.distributed as dist

        on = dist.is_available() and dist.is_initialized()
        rank, world = (dist.get_rank(), dist.get_world_size()) if on else (0, 1)
        if len(ranks) != world:
            log.warning("the checkpoint was saved by %d ranks, this run has %d: the random generators, "
                        "epoch metrics and validation clock start afresh", len(ranks), world)  # fmt: skip
            self._to_restore = None
            return
        self._to_restore = dict(ranks[rank])

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any,
                             batch_idx: int) -> None:  # fmt: skip
        # Not in load_state_dict: Lightning restores callbacks before it builds the
        # DataLoader iterator, which draws its seeds from torch's generator; the
        # run that saved had drawn them before this point of the epoch.
        restore, self._to_restore = self._to_restore, None
        if restore is None:
            return
        if self.rng and "rng" in restore:
            set_rng_state(restore["rng"])
        if "epoch_sums" in restore:
            carry_epoch_sums(trainer, restore["epoch_sums"])
        set_val_clock(trainer, restore.get("val_clock"))

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        drop_epoch_sums(trainer)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self._undo is not None:
            undo_stop(trainer, self._undo)
            self._undo = None
        drop_epoch_sums(trainer)

    @staticmethod
    def _io(trainer: Trainer) -> SlurmCkptIO:
        io = trainer.strategy.checkpoint_io
        # AsyncCheckpointIO and other wrappers keep the real one inside.
        while not isinstance(io, SlurmCkptIO) and hasattr(io, "checkpoint_io"):
            io = io.checkpoint_io
        if not isinstance(io, SlurmCkptIO):
            raise ConfigError(
                "PreemptionCallback needs the trainer to save through SlurmCkptIO: pass "
                "Trainer(plugins=slurm_ckpt.integrations.lightning.plugins(...)); "
                f"its checkpoint_io is {type(io).__name__}"
            )
        return io

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        # Single-device strategies have no cluster_environment of their own;
        # the connector holds the one Lightning chose or was given.
        env = trainer._accelerator_connector.cluster_environment
        if isinstance(env, SLURMEnvironment) and env.auto_requeue:
            raise ConfigError(
                "Lightning's own SLURM requeue is on: its SIGUSR1 handler would checkpoint inside "
                "the signal handler and requeue the job itself, beside slurm-ckpt run. Pass "
                "Trainer(plugins=[SLURMEnvironment(auto_requeue=False), ...]), or "
                "plugins=slurm_ckpt.integrations.lightning.plugins(io)"
            )
        # Made now, before Lightning installs its signal handlers at the start of
        # fit: Lightning then chains SIGTERM to the Checkpointer's flag.
        io = self._io(trainer)
        _ = io.ckpt
        self._trainer = trainer
        if stage != "fit":
            return
        self.stopped, self.step, self._requested, self._waiting_for = False, None, False, ""
        io._stopped_at = None
        if trainer.world_size > 1:  # Lightning's group is up; it restores after this
            io.agree_resume()
        if self.loggers:
            # Before ModelCheckpoint's setup (Lightning runs checkpoint callbacks last),
            # which puts its default dirpath under the logger's version directory. The
            # path fit resumes from is not known yet: this is what resume_path read.
            if io._resume is not None:
                saved = io._resume[1].get("callbacks", {}).get(self.state_key, {})
                continue_logs(trainer, list(saved.get("loggers", [])))
            self._versions = logger_versions(trainer)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:  # fmt: skip
        if self.stopped or self._undo is not None:
            return
        io = self._io(trainer)
        # Every rank, every batch: the agreement is a collective.
        asked = trainer.strategy.reduce_boolean_decision(io.ckpt.preempted, all=False)
        self._requested = self._requested or asked
        if not self._requested or finishes_now(trainer):
            return
        pending = not_whole(trainer)  # the same on every rank: they count the same batches
        if pending:
            if pending != self._waiting_for:
                log.info("checkpoint requested at step %d: stopping after %s", trainer.global_step, pending)
                self._waiting_for = pending
            return

        def checkpoint() -> None:
            trainer.save_checkpoint(Path(trainer.default_root_dir) / self.filename)
            io.wait()  # committed (and reported to the wrapper) before fit returns
            self.stopped, self.step = True, trainer.global_step
            io._stopped_at = trainer.global_step
            log.info("checkpointed step %d on request; stopping", trainer.global_step)

        self._undo = stop_after_batch(trainer, checkpoint)

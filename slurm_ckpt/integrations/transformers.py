"""Hugging Face ``transformers.Trainer``: every checkpoint committed by the Checkpointer, resume from the newest valid.

::

    from slurm_ckpt.integrations.transformers import SlurmCkptCallback

    cb = SlurmCkptCallback()
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[cb])
    trainer.train(resume_from_checkpoint=cb.resume_path(args.output_dir))   # None: start fresh
    if cb.stopped:                                                         # preempted: exit 0
        sys.exit(0)

and in the batch script ``srun slurm-ckpt run -- python train.py``.

The Trainer writes ``checkpoint-N`` folders as usual (``save_steps``,
``save_total_limit``); it neither fsyncs them nor marks them complete, and
``resume_from_checkpoint=True`` takes the highest-numbered one, half-written or
not. After each save, :class:`SlurmCkptCallback` commits the folder's files,
byte for byte, as checkpoint ``N`` of the Checkpointer (commit protocol,
checksums, tiers). :meth:`SlurmCkptCallback.resume_path` writes the newest
checkpoint that verifies back out as a ``checkpoint-N`` folder and returns its
path for ``resume_from_checkpoint``; the Trainer then restores the model, the
optimizer, the scheduler, the scaler, its RNG states, its position in the
data and its log history from it as from its own. A resume that the Trainer
would feed from the start of a stream (an ``IterableDataset`` without
``__len__``, past its first pass) is refused (``docs/huggingface.md``).

On the wrapper's signal the callback asks the Trainer to save at the end of
the current step and to stop; the save is committed before ``train`` returns.
Because the Trainer's own folders are only a staging copy, ``output_dir`` may
sit on node-local disk when the job has one node.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from ..checkpointer import Checkpointer
from ..errors import ConfigError
from ._folder import folder_state, gather_objects, one_writer, resume_folder, together

__all__ = ["SlurmCkptCallback"]

log = logging.getLogger("slurm_ckpt")

RESUME_DIR = ".slurm-ckpt-resume"


def _world() -> int:
    """The number of processes: 1 without a process group."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _flagged(flag: bool, device: Any) -> list[int]:
    """The ranks whose ``flag`` is True: a gather on the training ``device`` (NCCL gathers CUDA tensors only)."""
    import torch
    import torch.distributed as dist

    if _world() == 1:
        return [0] if flag else []
    flags = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(_world())]
    dist.all_gather(flags, torch.tensor([int(flag)], device=device))
    return [rank for rank, f in enumerate(torch.cat(flags).tolist()) if f]


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _refuse_a_stream_restart(args: TrainingArguments, state: TrainerState, loader: Any) -> None:
    """Refuse a resume that the Trainer would feed from the start of the data stream.

    Over an ``IterableDataset`` without ``__len__`` the Trainer counts the whole
    run as one epoch and, resuming at step N, skips N batches of a fresh stream.
    Past the stream's first pass (``state.epoch`` >= 1: the Trainer saw it end)
    that skip runs off the end of the first pass and training starts the stream
    again from its first example, where the run that stopped was inside a later pass.
    """
    import torch
    from transformers.trainer_utils import has_length

    dataset = getattr(loader, "dataset", None)
    if state.global_step == 0 or args.ignore_data_skip or not isinstance(dataset, torch.utils.data.IterableDataset):
        return
    if has_length(loader) or (state.epoch or 0) < 1:
        return
    raise ConfigError(
        f"resuming the Trainer at step {state.global_step}, past the first pass over {type(dataset).__name__}, "
        "an IterableDataset without __len__: the Trainer would skip that many batches of a fresh stream and "
        "restart it from its first example. Give the dataset a __len__ (the number of examples one pass "
        "yields) so that the Trainer resumes at the right pass and position, or set "
        "TrainingArguments(ignore_data_skip=True) to restart the stream knowingly"
    )


class SlurmCkptCallback(TrainerCallback):
    """Commits each Trainer checkpoint through a :class:`Checkpointer`; stops on the wrapper's request.

    ``ckpt``: the Checkpointer; by default one made on first use with
    ``distributed=False`` (the world's main process commits the folder all
    processes wrote). ``stopped`` and ``step`` say whether, and at which
    step, a requested checkpoint ended training.
    """

    def __init__(self, ckpt: Checkpointer | None = None) -> None:
        self._ckpt = ckpt
        self.stopped = False
        self.step: int | None = None
        self._stopping = False

    @property
    def ckpt(self) -> Checkpointer:
        """The Checkpointer; made on first use, which also installs the signal flag."""
        if self._ckpt is None:
            self._ckpt = Checkpointer(distributed=False)
        return self._ckpt

    def resume_path(self, output_dir: str | Path) -> str | None:
        """What to pass as ``Trainer.train(resume_from_checkpoint=...)``: the newest valid checkpoint.

        Its files are written to ``<output_dir>/.slurm-ckpt-resume/node-<host>/checkpoint-N``
        (``rank-R`` without ``torch.distributed``; an earlier copy there is removed) and
        that path is returned; None when there is nothing
        to resume from, which makes ``train`` start fresh. Call it on every
        process, after the ``Trainer`` is made (which starts
        ``torch.distributed``): all resume from the same step, and one process a
        node writes it out, for all the node's processes to read (see
        ``_folder.resume_folder``).
        """
        one_writer(self.ckpt, "SlurmCkptCallback")
        found = resume_folder(self.ckpt, Path(output_dir) / RESUME_DIR)
        if found is None:
            return None
        step, dest = found
        log.info("resuming the Trainer from step %s (%s)", step, dest)
        return str(dest)

    def on_init_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:  # fmt: skip
        _ = self.ckpt  # the signal flag is listening from here on

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       train_dataloader: Any = None, **kwargs: Any) -> None:  # fmt: skip
        _refuse_a_stream_restart(args, state, train_dataloader)

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:  # fmt: skip
        # Agreed: ranks must stop at the same step.
        if not self._stopping and _flagged(self.ckpt.preempted, args.device):
            self._stopping = True
            control.should_save = True
            control.should_training_stop = True

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                **kwargs: Any) -> None:  # fmt: skip
        one_writer(self.ckpt, "SlurmCkptCallback")
        folder = Path(args.output_dir or "trainer_output") / f"checkpoint-{state.global_step}"
        _barrier()  # every process has written its part (its RNG file)
        collectives = functools.partial(_flagged, device=args.device), gather_objects
        with together(f"committing checkpoint {state.global_step}", *collectives):
            if state.is_world_process_zero:
                self.ckpt.save(folder_state(folder), step=state.global_step)
        if self._stopping:
            self.stopped, self.step = True, state.global_step
            log.info("checkpointed step %d on request; stopping", state.global_step)

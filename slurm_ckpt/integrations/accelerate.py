"""Hugging Face Accelerate: ``save_state`` and ``load_state`` that go through the Checkpointer.

::

    from slurm_ckpt import Checkpointer
    from slurm_ckpt.integrations.accelerate import load_state, preempted, save_state

    ckpt = Checkpointer(distributed=False)           # the main process commits
    step = load_state(accelerator, ckpt) or 0        # None on the first run
    for batch in loader:                             # (skip_first_batches or a stateful loader)
        ...
        step += 1
        stop = preempted(accelerator, ckpt)          # agreed by every process
        if stop or step % 500 == 0:
            save_state(accelerator, ckpt, step)
            if stop:
                break                                # exit 0: slurm-ckpt run requeues

The pair replaces ``accelerator.save_state(dir)`` / ``accelerator.load_state(dir)``.
Accelerate writes its folder as it always does (models, optimizers,
schedulers, the GradScaler, every process's RNG states, samplers, stateful
DataLoaders and ``register_for_checkpointing`` objects) into a staging dir;
its files are committed, byte for byte, as one checkpoint of the
Checkpointer (commit protocol, checksums, tiers), and the staging dir is
removed. ``load_state`` writes the newest checkpoint that verifies back out and
hands it to ``accelerator.load_state``: one process a node reads it and writes
it out for the node's processes, and all resume from the same step.

Staging: ``staging=`` if given, else ``$SLURM_CKPT_SCRATCH`` (the job's
node-local scratch), else the system temp dir. With processes on several
nodes, pass a ``staging`` dir that all of them see.
"""

from __future__ import annotations

import contextlib
import functools
import shutil
import tempfile
from pathlib import Path
from typing import Any

from accelerate import Accelerator

from .._env import job_id, scratch_dir
from ..checkpointer import Checkpointer
from ..errors import ConfigError
from ._folder import folder_state, one_writer, resume_folder, together

__all__ = ["load_state", "preempted", "save_state"]


def _staging(staging: str | Path | None, what: str) -> Path:
    base = Path(staging) if staging is not None else (scratch_dir() or Path(tempfile.gettempdir()))
    # The same name on every process: they all write into one folder.
    return base / f"slurm-ckpt-accelerate-{job_id() or 'local'}-{what}"


def save_state(accelerator: Accelerator, ckpt: Checkpointer, step: int, *,
               staging: str | Path | None = None, **save_kwargs: Any) -> Path | None:  # fmt: skip
    """``accelerator.save_state``, committed as checkpoint ``step`` of ``ckpt``. Call on every process.

    Returns the committed checkpoint's path on the main process (None on the
    others). ``save_kwargs`` go to ``accelerator.save_state``.
    """
    one_writer(ckpt, "save_state")
    if accelerator.project_configuration.automatic_checkpoint_naming:
        raise ConfigError(
            "save_state with ProjectConfiguration(automatic_checkpoint_naming=True): Accelerate would "
            "ignore the staging dir and keep its own checkpoints; the Checkpointer names and "
            "retains them (storage.keep), so turn automatic_checkpoint_naming off"
        )
    tmp = _staging(staging, f"save-{step}")
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    collectives = functools.partial(_flagged, accelerator), functools.partial(_told, accelerator)
    path = None
    try:
        with together(f"writing checkpoint {step}", *collectives):
            accelerator.save_state(str(tmp), **save_kwargs)
        with together(f"committing checkpoint {step}", *collectives):  # once every process's files are in
            if accelerator.is_main_process:
                path = ckpt.save(folder_state(tmp), step)
    finally:
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def load_state(accelerator: Accelerator, ckpt: Checkpointer, *,
               staging: str | Path | None = None, **load_kwargs: Any) -> int | None:  # fmt: skip
    """``accelerator.load_state`` from the newest valid checkpoint of ``ckpt``; its step, or None.

    None (nothing restored) when there is no checkpoint yet. Call on every
    process: all resume from the same step, and one process a node reads it
    and writes it out into the staging dir for the node's processes to load
    (see ``_folder.resume_folder``). ``load_kwargs`` go to ``accelerator.load_state``.
    """
    one_writer(ckpt, "load_state")
    root = _staging(staging, "load")
    found = resume_folder(ckpt, root)
    if found is None:
        return None
    step, folder = found
    try:
        with together(f"loading checkpoint {step}", functools.partial(_flagged, accelerator),
                      functools.partial(_told, accelerator)):  # fmt: skip
            accelerator.load_state(str(folder), **load_kwargs)  # then every process has read the node's copy
    finally:
        # After an error too: a copy of the whole checkpoint must not stay on the
        # node's scratch. Every process is done with it once together() has ended.
        shutil.rmtree(folder.parent, ignore_errors=True)
        with contextlib.suppress(OSError):  # another process's copy, or its removal, may be there
            root.rmdir()
    return step


def preempted(accelerator: Accelerator, ckpt: Checkpointer) -> bool:
    """``ckpt.preempted``, agreed: True on every process once any got the wrapper's signal.

    Slurm signals each process at a slightly different moment, and a process
    that went into ``save_state`` while another ran one more step would wait
    for it forever. Call on every process at every step: one small gather on
    the training device, which waits for the device as ``loss.item()`` does.
    """
    return bool(_flagged(accelerator, ckpt.preempted))


def _flagged(accelerator: Accelerator, flag: bool) -> list[int]:
    """The processes whose ``flag`` is True: a gather on the training device (NCCL gathers CUDA tensors only)."""
    import torch

    flags = accelerator.gather(torch.tensor([int(flag)], device=accelerator.device))
    return [rank for rank, f in enumerate(flags.tolist()) if f]


def _told(accelerator: Accelerator, text: str) -> list[str]:
    """Every process's ``text``, in rank order (an object gather, run only once a step has failed)."""
    from accelerate.utils import gather_object

    try:
        return list(gather_object([text]))
    except NotImplementedError:  # XLA has no object gather: each error stays in its process's log
        return ["see that process's log"] * accelerator.num_processes

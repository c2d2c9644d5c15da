"""A framework's checkpoint folder as a Checkpointer state, and back.

Hugging Face's Trainer and Accelerate write a checkpoint as a folder of files
in formats of their own (safetensors, torch pickles, JSON, per-rank RNG files),
which they alone know how to read back. Storing each file's bytes verbatim as
a ``uint8`` tensor keeps every one of them exactly, whatever the framework
version writes, and lets the Checkpointer do what the framework does not:
commit the set atomically and durably, checksum it, tier it, and find the
newest one that verifies. Nothing in the files is interpreted on either side,
so no pickle is loaded by slurm-ckpt.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
from collections.abc import Callable, Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import torch

from ..checkpointer import Checkpointer
from ..errors import CheckpointCorrupt, ConfigError, ShardError, UnsupportedValue
from ..placement import Local
from ..ranks import open_group
from ._steps import oldest_newest, resume_step

__all__ = ["error_text", "folder_state", "gather_objects", "one_writer", "raise_gathered", "resume_folder", "together",
           "write_folder"]

_FORMAT = "slurm-ckpt-folder"


def folder_state(path: Path) -> dict[str, Any]:
    """Every regular file under ``path`` as ``{"files": {relative path: bytes as uint8 tensor}}``."""
    files: dict[str, Any] = {}
    for p in sorted(path.rglob("*")):
        rel = p.relative_to(path).as_posix()
        if p.is_symlink():
            raise UnsupportedValue(
                f"{p} is a symlink; a checkpoint folder is stored file by file: "
                "save the file it points at instead"
            )
        if p.is_file():
            size = p.stat().st_size
            # Read into memory of its own: the file may be rewritten once this returns.
            files[rel] = torch.from_file(str(p), shared=False, size=size, dtype=torch.uint8)
    return {"format": _FORMAT, "files": files}


def write_folder(state: Any, path: Path) -> None:
    """Write the files of a :func:`folder_state` state under ``path`` (created, must not exist)."""
    if not isinstance(state, dict) or state.get("format") != _FORMAT:
        raise CheckpointCorrupt(
            f"this checkpoint does not hold a framework's checkpoint folder (format "
            f"{state.get('format') if isinstance(state, dict) else type(state).__name__!r}): "
            "it was saved by something else into the same run dir; give this job its own "
            "SLURM_CKPT_DIR"
        )
    path.mkdir(parents=True)
    for rel, data in state["files"].items():
        parts = PurePosixPath(rel).parts
        if not parts or PurePosixPath(rel).is_absolute() or ".." in parts:
            raise CheckpointCorrupt(f"checkpoint file name {rel!r} leaves the folder; refusing to write it")
        dest = path.joinpath(*parts)
        dest.parent.mkdir(parents=True, exist_ok=True)
        with open(dest, "wb") as f:
            # No fsync: this copy is read back at once and thrown away; the
            # checkpoint it came from is the durable one.
            f.write(memoryview(data.contiguous().numpy()))


def one_writer(ckpt: Checkpointer, what: str) -> None:
    """Refuse a Checkpointer whose saves are collective: the integrations commit the
    folder every process wrote from the main process alone, and a collective save
    there would wait for the other processes forever. Every process makes the same
    Checkpointer, so every process raises."""
    if not isinstance(ckpt.placement, Local):
        raise ConfigError(
            f"{what} commits the checkpoint from the main process alone, and this Checkpointer saves "
            "collectively (torch.distributed is initialised): make it with Checkpointer(distributed=False)"
        )


Flagged = Callable[[bool], list[int]]
"""A collective over every process: the ranks whose ``flag`` is True, in rank order."""
Told = Callable[[str], list[str]]
"""A collective over every process: each one's text, in rank order."""


@contextlib.contextmanager
def together(what: str, flagged: Flagged, told: Told) -> Iterator[None]:
    """Run a step of a save or a load that every process takes, and fail it on all when it fails on any.

    The process where the step failed raises its own error; the others raise
    :class:`ShardError` naming its rank and its error, so every process's log
    says why. Without this, a process whose part failed (the main one's
    commit, on a full disk) leaves the others waiting at the framework's next
    barrier until the collective timeout. Leaving the block is itself a
    barrier: no process goes on before every one has finished the step. The
    step must run no collective of its own: a process that fails before one
    would be in the flag gather while the others wait in that collective
    (FSDP's and DeepSpeed's ``save_state`` run some). The errors' texts are
    gathered only once a step has failed, so a step that succeeds costs one
    small gather.
    """
    try:
        yield
    except BaseException as e:  # Ctrl-C too: the others must not wait for this process
        flagged(True)
        told(error_text(e))
        raise
    failed = flagged(False)
    if failed:
        texts = told("")
        ranks: dict[str, list[int]] = {}  # a full disk fails every process alike: named once
        for r in failed:
            ranks.setdefault(texts[r], []).append(r)
        raise ShardError(f"{what} failed: " + "; ".join(
            f"rank{'s' * (len(rs) > 1)} {', '.join(map(str, rs))}: {text}" for text, rs in ranks.items()))


def gather_objects(obj: Any) -> list[Any]:
    """``obj`` of every process, in rank order, over the default process group (the
    framework's; with NCCL, on the CUDA device it set for this process), or ``[obj]``
    without one."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def error_text(e: BaseException) -> str:
    """An error for another process's message: its type and text, cut at 1000 characters."""
    try:
        text = f"{type(e).__name__}: {e}".removesuffix(": ")
    except Exception:  # a __str__ that fails must not keep this process from the others' gather
        text = type(e).__name__
    return text if len(text) <= 1000 else text[:999] + "\u2026"


def resume_folder(ckpt: Checkpointer, root: Path) -> tuple[int, Path] | None:
    """The newest valid checkpoint of ``ckpt`` written out as ``root/<node>/checkpoint-N``:
    its step and that path, or None when there is none. Call on every process.

    Under ``torch.distributed`` it is collective. One process a node (the
    lowest rank on it) reads the newest valid checkpoint it finds and writes it
    out, so a node of eight processes holds one copy in memory and on disk, not
    eight. Every process resumes from the oldest of the steps those found (a
    node may find a newer one, still on its scratch; it reads the older one
    instead), and an error on any process is raised on all of them. Without a
    process group each process writes its own copy, under ``root/rank-R``.
    """
    group = open_group()
    if group is None:
        whole = ckpt.load_latest()
        if whole is None or ckpt.loaded_step is None:
            return None
        return ckpt.loaded_step, _rewrite(whole, root / f"rank-{ckpt.rank}", ckpt.loaded_step)
    try:
        host = socket.gethostname()
        who = f"rank {group.rank} on {host}"
        writes = group.all_gather(host).index(host) == group.rank
        state: Any = None
        mine: int | None = None
        cause: BaseException | None = None  # this process's own error, chained to the one raised
        error = ""
        if writes:
            try:
                state = ckpt.load_latest()
                mine = ckpt.loaded_step if state is not None else None
            except BaseException as e:  # raised below on every process, not only here (Ctrl-C too)
                cause, error = e, f"{who}: {error_text(e)}"
        seen = group.all_gather((writes, who, mine, error, ", ".join(map(str, ckpt.search_dirs))))
        what = "finding the checkpoint to resume from"
        errors = [e for _, _, _, e, _ in seen if e]
        step, problem = None, ""
        if not errors:  # the same on every process: all go on, or none
            step, problem = oldest_newest([(w, s, where) for writer, w, s, _, where in seen if writer])
            errors = [problem] if problem else []
        dest = root / f"node-{host}" / f"checkpoint-{step}"
        if not errors:
            what = f"resuming from checkpoint {step}"
            if writes and step is not None:
                try:
                    if mine != step:
                        state = None  # one checkpoint in memory at a time
                        state = resume_step(ckpt, step, mine)
                    _rewrite(state, dest.parent, step)
                except BaseException as e:
                    cause, error = e, f"{who}: {error_text(e)}"
            del state
            errors = [e for e in group.all_gather(error) if e]
    finally:
        group.release()
    raise_gathered(what, errors, cause)
    return None if step is None else (step, dest)


def raise_gathered(what: str, errors: list[str], cause: BaseException | None) -> None:
    """Once every process has gathered the others' ``errors``: this process's own
    Ctrl-C (``cause``) as itself, else :class:`ShardError` naming every error."""
    if cause is not None and not isinstance(cause, Exception):
        raise cause  # Ctrl-C stays one here, now that the others know
    if errors:
        raise ShardError(f"{what} failed: {'; '.join(errors)}") from cause


def _rewrite(state: Any, parent: Path, step: int) -> Path:
    """``state``'s folder as ``parent/checkpoint-<step>``, replacing whatever ``parent`` held."""
    shutil.rmtree(parent, ignore_errors=True)
    dest = parent / f"checkpoint-{step}"
    write_folder(state, dest)
    return dest

"""Assembly: the last shard of a save in makes its staging dir the checkpoint ``step-N``."""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import time
from pathlib import Path
from typing import Any

import filelock

from ...errors import CheckpointCorrupt, LockHeld, storage_error
from ..commit import commit
from ..layout import step_dir
from ..manifest import Manifest
from ..retention import apply_retention
from ..tensorfile import FileRecord
from ..verify import find_latest
from .layout import ASSEMBLY_LOCK, assembler, prefixed, shard_name, staging_dir, staging_step
from .shard import LocalShard, read_shard

__all__ = ["AssemblyLock", "complete", "newest_durable_step", "prune_staging"]

log = logging.getLogger("slurm_ckpt")

_PER_SHARD = ("save_id", "shard", "staged_from")
"""A shard manifest's ``extra`` fields that describe that shard alone."""


class AssemblyLock:
    """``<durable>/.shards.lock``: one assembler at a time, across nodes.

    Not the run dir's writer lock: rank 0 holds that for its whole life, and
    the other ranks (and the epilogs) must be able to assemble meanwhile.
    """

    def __init__(self, durable: Path, timeout: float) -> None:
        self._lock = filelock.FileLock(
            str(durable / ASSEMBLY_LOCK), timeout=timeout, thread_local=False
        )
        self.path = durable / ASSEMBLY_LOCK

    def __enter__(self) -> None:
        try:
            self._lock.acquire()
        except filelock.Timeout:
            raise LockHeld(
                f"{self.path}: another assembler kept the shard lock; is a stage-out stuck?"
            ) from None
        except OSError as e:
            raise storage_error(e, "cannot take the shard assembly lock", self.path) from e

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


def _committed_save(final: Path) -> Manifest | None:
    try:
        return Manifest.read(final)
    except (CheckpointCorrupt, OSError):
        return None


def complete(durable: Path, step: int, save_id: str, world: int, *, keep: int | None = None,
             lock_timeout: float = 60.0, by: str = "", on_dev: int | None = None) -> Path | None:  # fmt: skip
    """Commit checkpoint ``step`` from its staged shards if all ``world`` are there.

    Returns the committed ``step-N`` (also when someone else committed this
    save before), or None while shards are missing. With ``keep``, retention
    runs on the durable run dir afterwards. ``by`` (drain, epilog) goes into
    the manifest's ``assembled_by``. ``on_dev``: see :func:`~slurm_ckpt.store.commit.commit`.
    """
    stage = staging_dir(durable, step, save_id)
    final = step_dir(durable, step)
    with AssemblyLock(durable, lock_timeout):
        done = _committed_save(final)
        if done is not None and done.extra.get("save_id") == save_id:
            return final  # assembled already: another node's drain or epilog came first
        if not stage.is_dir():
            return None
        shards: list[LocalShard] = []
        for rank in range(world):
            shard = read_shard(stage / shard_name(rank))
            if shard is None:
                return None
            if (shard.step, shard.save_id, shard.rank, shard.world) != (step, save_id, rank, world):
                raise CheckpointCorrupt(f"{shard.path}: shard of step {shard.step} save {shard.save_id} "
                                        f"rank {shard.rank}/{shard.world} in the staging dir of step "
                                        f"{step} save {save_id}", shard.path)  # fmt: skip
            shards.append(shard)
        when = max(s.manifest.time for s in shards)
        if done is not None and done.time > when:
            log.info("not assembling %s: %s holds a newer save of step %d", stage, final, step)
            prune_staging(durable, step)
            return None
        files, tensors, meta = _merged(save_id, world, shards, when, by)
        # Every shard is committed (fsynced, renamed) in the staging dir. Only now
        # may the manifest that makes the checkpoint whole be written, into it.
        commit(durable, step, lambda _: (files, tensors), into=stage, on_dev=on_dev, **meta)
        log.info("assembled %s from %d shards", final, world)
        prune_staging(durable, step)
        if keep is not None:
            apply_retention(durable, keep, protect=[final])
    return final


def _merged(save_id: str, world: int, shards: list[LocalShard], when: float,
            by: str) -> tuple[dict[str, FileRecord], dict[str, Any], dict[str, Any]]:  # fmt: skip
    """The whole checkpoint's file records, tensor index and manifest fields."""
    files: dict[str, FileRecord] = {}
    tensors: dict[str, Any] = {}
    where: dict[str, Any] = {}
    for s in shards:
        f, t = prefixed(s.rank, s.manifest.files, s.manifest.tensors)
        files.update(f)
        tensors.update(t)
        where[shard_name(s.rank)] = {
            "rank": s.rank, "host": s.manifest.host, "staged_from": s.manifest.extra.get("staged_from"),
            "files": len(s.manifest.files), "bytes": sum(r.size for r in s.manifest.files.values()),
        }  # fmt: skip
    first = shards[0].manifest
    # What the writer said about the whole save (its layout: ``is_chunked``) carries
    # over; what each shard says about itself went into ``where``.
    extra = {k: v for k, v in first.extra.items() if k not in _PER_SHARD}
    extra |= {"save_id": save_id, "shards": where, "assembled_at": time.time(),
              "assembled_by": assembler(by)}  # fmt: skip
    meta = {"time": when, "host": first.host, "job_id": first.job_id, "world_size": world,
            "nbytes": sum(s.manifest.nbytes for s in shards), "extra": extra}  # fmt: skip
    return files, tensors, meta


def prune_staging(durable: Path, upto: int) -> list[Path]:
    """Remove staging dirs of steps up to ``upto``: a committed step makes them obsolete."""
    removed = []
    try:
        names = os.listdir(durable)
    except FileNotFoundError:
        return []
    for name in names:
        step = staging_step(name)
        if step is not None and step <= upto:
            path = durable / name
            # Renamed away first, so a crash mid-delete leaves no half staging dir behind.
            trash = durable / f".shards-trash-{secrets.token_hex(6)}"
            try:
                os.rename(path, trash)
            except OSError:
                continue
            shutil.rmtree(trash, ignore_errors=True)
            removed.append(path)
    for name in names:
        if name.startswith(".shards-trash-"):
            shutil.rmtree(durable / name, ignore_errors=True)
    return removed


def newest_durable_step(durable: Path) -> int | None:
    """Step of the newest checkpoint committed in the durable run dir (quick check)."""
    cand = find_latest([durable], full=False)
    return cand.step if cand else None

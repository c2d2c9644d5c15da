"""Staging: a rank's shard committed into the durable run dir's staging dir."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from ...errors import CheckpointCorrupt, storage_error
from ..commit import WriteFn, commit
from ..fsutil import remove_tree
from ..retry import prune_for_space, pruned_once
from ..tensorfile import FileRecord
from ..transfer import ByteBudget, copy_files
from ..verify import plain_files, verify_checkpoint
from .assembly import AssemblyLock
from .layout import shard_name, staging_dir
from .shard import LocalShard

__all__ = ["stage_shard", "write_staged_shard"]

log = logging.getLogger("slurm_ckpt")


def write_staged_shard(durable: Path, step: int, save_id: str, rank: int, write: WriteFn,
                       **meta: Any) -> Path:  # fmt: skip
    """Commit a rank's shard straight into the durable staging dir (a rank without scratch).

    A shard staged there already (by an earlier attempt) is kept.
    """
    stage = staging_dir(durable, step, save_id)
    _mkdirs(stage)
    return commit(stage, step, write, name=shard_name(rank), if_exists="keep", **meta)


def stage_shard(shard: LocalShard, durable: Path, *, keep: int | None = None, lock_timeout: float = 60.0,
                on_dev: int | None = None, budget: ByteBudget | None = None) -> Path:  # fmt: skip
    """Copy a shard committed on scratch into the durable staging dir; return where it is.

    Every byte is checksummed as it is copied and compared with the shard's
    manifest, then the copy is read back in full before it is committed.
    Idempotent: a shard already staged is verified and kept.

    With ``keep``, a durable tier that is full (ENOSPC, EDQUOT) is pruned as the
    other tiers are (``prune_for_space``: ``keep - 1`` checkpoints stay, never
    fewer than the newest one) and the copy is tried once more. The pruning
    takes the assembly lock, under which retention after an assembly runs, so
    two ranks never prune at once.

    ``on_dev`` and ``budget``: see :func:`~slurm_ckpt.store.transfer.copy_checkpoint`.
    """
    stage = staging_dir(durable, shard.step, shard.save_id)
    dst = stage / shard_name(shard.rank)
    if dst.is_dir():
        try:
            verify_checkpoint(dst, full=True)
            return dst
        except CheckpointCorrupt as e:
            log.warning("staged shard %s is damaged (%s); staging it again", dst, e)
            remove_tree(dst)
    src, man = shard.path, shard.manifest
    if not plain_files(src, list(man.files)):
        raise CheckpointCorrupt(f"{src}: a file of the shard is not a regular file", src)

    def copy(tmp: Path) -> tuple[dict[str, FileRecord], dict[str, Any]]:
        return copy_files(src, tmp, man.files, read_back=True, budget=budget), man.tensors

    extra = dict(man.extra, staged_from=f"{man.host}:{src}")

    def stage_it() -> Path:
        _mkdirs(stage)
        return commit(stage, man.step, copy, name=dst.name, if_exists="keep", time=man.time,
                      host=man.host, job_id=man.job_id, world_size=man.world_size,
                      nbytes=man.nbytes, extra=extra, on_dev=on_dev)  # fmt: skip

    def prune() -> list[Path]:
        if keep is None:
            return []
        with AssemblyLock(durable, lock_timeout):
            return prune_for_space(durable, keep)

    return pruned_once(stage_it, prune, f"staging {dst}")


def _mkdirs(path: Path) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise storage_error(e, "cannot create shard staging dir", path) from e

"""Epilog stage-out of this node's shards of cross-node checkpoints.

A job whose ranks each had node-local scratch leaves ``<scratch>/ckpt/rank-K/``
dirs on every node (see :mod:`slurm_ckpt.store.shards`). The epilog of each node copies
this node's shards that are newer than the durable tier's newest checkpoint
into the durable staging dirs, and assembles a checkpoint when its shard was
the last one missing; the other nodes' epilogs then find it committed. It
runs in the stage-out child, with the job user's rights only.

Every shard newer than the durable tier is staged, not only the newest: if
another node's drain got its older shard out but died before the newer one,
this node's older shard is what completes the last whole checkpoint.

The peers' shards this node keeps as replicas (``<scratch>/ckpt/replicas/rank-K/``)
are staged the same way, after its own: when a node is lost before its
shards reached the durable tier, a replica on another node completes the save.

The durable tier's newest checkpoint is found with the same screens as
scratch (see :func:`.screen.newest_step`): the user writes both.
"""

from __future__ import annotations

import logging
import os
import socket
import stat
import time
from pathlib import Path

from ..errors import CheckpointCorrupt
from ..store import shards as sh
from ..store.manifest import Manifest
from .screen import newest_step, sparse_excess
from .stageresult import StageResult

__all__ = ["has_shards", "stage_shards"]

log = logging.getLogger("slurm_ckpt.node")


def _assembled_here(done: Path) -> bool:
    """Whether this process assembled ``done``: complete() also returns a save that another
    node's epilog assembled while this one was staging its shard."""
    try:
        return Manifest.read(done).extra.get("assembled_by") == sh.assembler("epilog")
    except (OSError, CheckpointCorrupt):
        return False


def _rank_dirs(scratch_ckpt: Path, *, replicas: bool = True) -> list[Path]:
    """This node's ``rank-K`` dirs, then (``replicas``) those of the peers' shards it keeps
    (``replicas/rank-K``): the epilog stages both alike."""
    try:
        names = sorted(os.listdir(scratch_ckpt))
    except OSError:
        return []
    out = []
    if replicas and sh.REPLICAS_DIR in names:
        try:
            if stat.S_ISDIR(os.lstat(scratch_ckpt / sh.REPLICAS_DIR).st_mode):
                out += _rank_dirs(scratch_ckpt / sh.REPLICAS_DIR, replicas=False)
        except OSError:
            pass
    for name in names:
        if sh.rank_of(name) is None:
            continue
        try:
            if stat.S_ISDIR(os.lstat(scratch_ckpt / name).st_mode):  # never a planted link
                out.append(scratch_ckpt / name)
        except OSError:
            continue
    # Own shards first: a replica of the same shard is only needed when they are gone.
    return sorted(out, key=lambda p: p.parent.name == sh.REPLICAS_DIR)


def has_shards(scratch_ckpt: Path) -> bool:
    """True if the job saved cross-node shards on this node."""
    return bool(_rank_dirs(scratch_ckpt))


def stage_shards(scratch_ckpt: Path, durable: Path, lock_timeout: float, *, keep: int | None = None,
                 sparse_bytes: int | None = None, on_dev: int | None = None) -> StageResult:  # fmt: skip
    """Stage every shard on this node that the durable tier still needs. Never raises.

    ``keep`` (the job's, from ``TIER.json``): make room on a full durable tier
    and apply retention after an assembly, as the job's own drain does.
    ``sparse_bytes``: a shard stored sparse that would be written out larger
    than this is not staged (see :func:`sparse_excess`), and the copies write no more than
    this in all. ``on_dev``: the durable filesystem, where every copy must land.
    """
    from ..store.transfer import ByteBudget

    budget = ByteBudget(sparse_bytes) if sparse_bytes is not None else None
    start = time.monotonic()
    try:
        newest = newest_step(durable)
    except OSError as e:
        return StageResult("failed", f"cannot read the durable run dir {durable}: {e}")
    staged: list[str] = []
    errors: list[str] = []
    committed: tuple[int, str] | None = None
    seen = 0
    for rank_dir in _rank_dirs(scratch_ckpt):
        try:
            shards = list(sh.local_shards(rank_dir))
        except OSError as e:
            errors.append(f"{rank_dir}: {e}")
            continue
        seen += len(shards)
        for i, shard in enumerate(shards):
            if newest is not None and shard.step <= newest:
                break  # older ones too: the durable tier has a newer whole checkpoint
            if i and _superseded(durable, shard.step):
                break  # another node's epilog completed a newer one meanwhile
            name = f"{sh.shard_name(shard.rank)} step {shard.step}"
            try:
                if sparse_bytes is not None and (why := sparse_excess(shard.path, shard.manifest, sparse_bytes)):
                    errors.append(why)
                    continue
                sh.stage_shard(shard, durable, keep=keep, lock_timeout=lock_timeout, on_dev=on_dev, budget=budget)
                done = sh.complete(
                    durable,
                    shard.step,
                    shard.save_id,
                    shard.world,
                    keep=keep,
                    lock_timeout=lock_timeout,
                    by="epilog",
                    on_dev=on_dev,
                )
            except CheckpointCorrupt as e:
                log.warning("not staging %s: %s", name, e)
                continue
            except OSError as e:
                if _superseded(durable, shard.step):
                    continue  # a newer checkpoint was committed meanwhile (and the staging dir pruned)
                errors.append(f"{name}: {e}")
                continue
            if done is not None:
                how = "(complete)" if _assembled_here(done) else "(completed by another node)"
                staged.append(f"{name} -> {done} {how}")
                if committed is None or shard.step > committed[0]:
                    committed = (shard.step, str(done))
                break  # this rank's older shards are superseded by a whole checkpoint
            else:
                staged.append(f"{name} staged, waiting for other nodes' shards")
    where = f"on {socket.gethostname()} in {time.monotonic() - start:.3f}s: "
    if errors:
        # Scratch must be kept: it may hold the only copy of a shard.
        return StageResult("failed", where + "; ".join(errors)[:2000])
    if staged:
        step, path = committed if committed else (None, None)
        return StageResult("staged", where + "; ".join(staged)[:2000], step, path)
    if seen:
        return StageResult("up-to-date", f"{durable} has step {newest}", newest)
    return StageResult("none", f"no valid shard in {scratch_ckpt}")


def _superseded(durable: Path, step: int) -> bool:
    try:
        newest = newest_step(durable)
    except OSError:
        return False
    return newest is not None and newest >= step

"""``LocalShard``: one rank's committed part of one save, and where shards are found."""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ...errors import CheckpointCorrupt
from ..layout import list_steps
from ..manifest import MANIFEST, Manifest
from ..verify import plain_files, verify_checkpoint
from .layout import is_save_id, rank_of, staging_step

__all__ = ["LocalShard", "local_shards", "read_shard", "staged_shards"]

log = logging.getLogger("slurm_ckpt")


@dataclass(frozen=True)
class LocalShard:
    """A committed shard: one rank's part of one save."""

    step: int
    save_id: str
    rank: int
    world: int
    path: Path
    manifest: Manifest


def _as_shard(path: Path, man: Manifest) -> LocalShard | None:
    info = man.extra.get("shard")
    sid = man.extra.get("save_id")
    if not isinstance(info, dict) or not is_save_id(sid):
        return None
    try:
        return LocalShard(man.step, sid, int(info["rank"]), int(info["world_size"]), path, man)
    except (KeyError, TypeError, ValueError):
        return None


def read_shard(path: Path, *, full: bool = False) -> LocalShard | None:
    """The shard committed at ``path``, or None if it is not one (or is corrupt)."""
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode) or not plain_files(path, [MANIFEST]):
            return None
    except FileNotFoundError:
        return None
    try:
        # Screen every file the manifest names before anything opens one.
        if not plain_files(path, list(Manifest.read(path).files)):
            return None
        return _as_shard(path, verify_checkpoint(path, full=full))
    except CheckpointCorrupt as e:
        log.info("skipping shard %s: %s", path, e)
        return None


def local_shards(rank_dir: Path) -> Iterator[LocalShard]:
    """Shards committed in one rank's fast-tier dir, newest first (quick check).

    OSError (EIO, EACCES) propagates: the shard might be good, so the caller
    must not treat it as absent.
    """
    for _, path in list_steps(rank_dir):
        shard = read_shard(path)
        if shard is not None:
            yield shard


def staged_shards(durable: Path, rank: int | None = None) -> Iterator[LocalShard]:
    """Shards waiting in the durable run dir's staging dirs (of ``rank``, or all)."""
    try:
        names = sorted(os.listdir(durable), reverse=True)
    except FileNotFoundError:
        return
    for name in names:
        if staging_step(name) is None:
            continue
        stage = durable / name
        try:
            subs = sorted(os.listdir(stage))
        except (FileNotFoundError, NotADirectoryError):
            continue
        for sub in subs:
            r = rank_of(sub)
            if r is None or (rank is not None and r != rank):
                continue
            shard = read_shard(stage / sub)
            if shard is not None:
                yield shard

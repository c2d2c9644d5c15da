"""Checkpoints whose shards start out on different nodes' scratch.

When every rank has its own node-local scratch, no directory is shared while
the checkpoint is written. Each rank commits its shard on its own node, then
the shards travel to the durable run dir one by one, and the checkpoint is
assembled there once the last one arrives::

    <scratch>/ckpt/rank-00001/step-000000120/   a rank's shard, committed on its node
                                                 (MANIFEST.json: its files, "save_id")
    <durable>/.shards-step-000000120-<save_id>/  staging: never read by discovery
        rank-00000/  MANIFEST.json  data…        each shard committed on its own
        rank-00001/  MANIFEST.json  data…
    <durable>/step-000000120/                    the staging dir, renamed once complete;
        MANIFEST.json                            lists rank-NNNNN/<file> of every rank
        rank-00000/ …  rank-00001/ …

``save_id`` (chosen by rank 0 for each collective save) keeps shards of two
saves of the same step (a run resumed from an older step saves it again) from
being mixed. Whoever stages the last shard of a set, a rank's background drain
or a node's epilog, writes the manifest and renames, under ``.shards.lock``;
anyone who comes later finds the step committed and does nothing. Until then
``step-N`` does not exist, so discovery can never return a checkpoint that
lacks a shard.

No torch and no collectives here: the root epilog (as the job's user) uses it too.
``layout`` names the dirs and maps a shard's records into the whole checkpoint's,
``shard`` reads committed shards, ``staging`` commits one into a staging dir,
and ``assembly`` commits the whole checkpoint.
"""

from __future__ import annotations

from .assembly import AssemblyLock, complete, newest_durable_step, prune_staging
from .layout import (
    ASSEMBLY_LOCK,
    REPLICAS_DIR,
    SHARD_PREFIX,
    STAGING_PREFIX,
    assembler,
    is_save_id,
    new_save_id,
    prefixed,
    rank_of,
    shard_extra,
    shard_manifest,
    shard_name,
    staging_dir,
    staging_step,
)
from .shard import LocalShard, local_shards, read_shard, staged_shards
from .staging import stage_shard, write_staged_shard

__all__ = [
    "ASSEMBLY_LOCK",
    "REPLICAS_DIR",
    "SHARD_PREFIX",
    "STAGING_PREFIX",
    "AssemblyLock",
    "LocalShard",
    "assembler",
    "complete",
    "is_save_id",
    "local_shards",
    "new_save_id",
    "newest_durable_step",
    "prefixed",
    "prune_staging",
    "rank_of",
    "read_shard",
    "shard_extra",
    "shard_manifest",
    "shard_name",
    "stage_shard",
    "staged_shards",
    "staging_dir",
    "staging_step",
    "write_staged_shard",
]

"""Names in a sharded checkpoint, and how a shard's records are named in the whole.

A sharded checkpoint holds one ``rank-NNNNN/`` dir per rank, and its manifest
names every file and tensor with that prefix; a shard's own manifest names
them without it. :func:`prefixed` and :func:`shard_manifest` go one way and
the other.
"""

from __future__ import annotations

import os
import re
import secrets
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeGuard

from ...errors import ConfigError
from ..manifest import Manifest
from ..tensorfile import FileRecord

__all__ = [
    "ASSEMBLY_LOCK",
    "REPLICAS_DIR",
    "SHARD_PREFIX",
    "STAGING_PREFIX",
    "assembler",
    "is_save_id",
    "new_save_id",
    "prefixed",
    "rank_of",
    "shard_extra",
    "shard_manifest",
    "shard_name",
    "staging_dir",
    "staging_step",
]

SHARD_PREFIX = "rank-"
REPLICAS_DIR = "replicas"
"""Under a node's ``<scratch>/ckpt``: one ``rank-NNNNN/`` dir per rank whose shards this node
keeps as peer replicas (``placement/replicas.py``)."""
STAGING_PREFIX = ".shards-step-"
ASSEMBLY_LOCK = ".shards.lock"
_SAVE_ID = r"[0-9a-f]{8,64}"
_RANK_RE = re.compile(r"^rank-(\d{5,})$")
_STAGING_RE = re.compile(rf"^\.shards-step-(\d{{9,}})-({_SAVE_ID})$")


def shard_name(rank: int) -> str:
    return f"{SHARD_PREFIX}{rank:05d}"


def rank_of(name: str) -> int | None:
    m = _RANK_RE.match(name)
    return int(m.group(1)) if m else None


def new_save_id() -> str:
    return secrets.token_hex(8)


def is_save_id(value: object) -> TypeGuard[str]:
    return isinstance(value, str) and re.fullmatch(_SAVE_ID, value) is not None


def staging_dir(durable: Path, step: int, save_id: str) -> Path:
    if not is_save_id(save_id):
        raise ValueError(f"bad save id {save_id!r}")
    return durable / f"{STAGING_PREFIX}{step:09d}-{save_id}"


def staging_step(name: str) -> int | None:
    """The step of a staging dir's name, or None if ``name`` is not one."""
    m = _STAGING_RE.match(name)
    return int(m.group(1)) if m else None


def shard_extra(rank: int, world: int, save_id: str, **more: Any) -> dict[str, Any]:
    """The manifest ``extra`` of one shard: who it is and which save it belongs to."""
    return {"save_id": save_id, "shard": {"rank": rank, "world_size": world, **more}}


def assembler(by: str) -> str:
    """How a manifest's ``assembled_by`` names this process (``by``: drain, epilog)."""
    return " ".join(filter(None, [socket.gethostname(), by, f"pid {os.getpid()}"]))


def _refile(entry: dict[str, Any], rename: Callable[[str], str]) -> dict[str, Any]:
    """A tensor index entry with every file name it holds passed through ``rename``.

    An entry names its file once (a whole tensor), per chunk (a chunked
    checkpoint, ``dcp/index.py``), or in its ``bytes`` record.
    """
    if "chunks" in entry:
        return {**entry, "chunks": [{**c, "file": rename(c["file"])} for c in entry["chunks"]]}
    if "bytes" in entry:
        return {**entry, "bytes": {**entry["bytes"], "file": rename(entry["bytes"]["file"])}}
    return {**entry, "file": rename(entry["file"])}


def prefixed(
    rank: int, files: dict[str, FileRecord], tensors: dict[str, Any]
) -> tuple[dict[str, FileRecord], dict[str, Any]]:
    """A shard's file and tensor records as the whole checkpoint's manifest names them."""
    prefix = shard_name(rank) + "/"
    return ({prefix + n: r for n, r in files.items()},
            {prefix + k: _refile(v, lambda f: prefix + f) for k, v in tensors.items()})  # fmt: skip


def shard_manifest(man: Manifest, rank: int) -> Manifest | None:
    """The part of ``man`` that belongs to ``rank``, with names relative to its shard dir.

    None when the checkpoint has no shards (it was written by one process).
    """
    shards = {name.split("/", 1)[0] for name in man.files if name.startswith(SHARD_PREFIX)}
    if not shards:
        return None
    prefix = shard_name(rank) + "/"
    if prefix[:-1] not in shards:
        raise ConfigError(
            f"checkpoint step {man.step} has {len(shards)} shards and no {prefix[:-1]}: "
            f"it was written by {len(shards)} ranks; resume it with the same number of ranks"
        )
    files = {n[len(prefix) :]: r for n, r in man.files.items() if n.startswith(prefix)}
    tensors = {k[len(prefix) :]: _refile(v, lambda f: f[len(prefix) :])
               for k, v in man.tensors.items() if k.startswith(prefix)}  # fmt: skip
    return Manifest(step=man.step, files=files, tensors=tensors, time=man.time, host=man.host,
                    job_id=man.job_id, world_size=man.world_size, nbytes=man.nbytes,
                    extra=man.extra)  # fmt: skip

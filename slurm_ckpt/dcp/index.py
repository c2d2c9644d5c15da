"""The manifest's index of a DCP-layout checkpoint, and DCP's ``Metadata`` built from it.

A checkpoint written through :class:`~slurm_ckpt.dcp.StorageWriter` is an
ordinary committed ``step-N`` dir: ``MANIFEST.json`` lists every file with its
size and crc32 (so ``slurm-ckpt ls``, ``verify``, ``resume`` and the tier drain
treat it like any other), and its ``extra`` says ``"layout": "dcp"``. The
tensor index maps each DCP key (the flattened name, ``model.0.weight``) to::

    {"dtype": "F32", "shape": [1024, 512],          # the global tensor
     "placements": ["Shard(dim=0)"], "mesh": [4],   # when it was a DTensor
     "chunks": [{"offsets": [0, 0], "sizes": [256, 512],
                 "file": "dcp-00000.safetensors", "at": 4160,
                 "block": 65536, "crc32": ["1c291ca3", ...]}, ...]}

    {"bytes": {"file": "dcp-00000.safetensors", "at": 123, "size": 52, "block": 65536, "crc32": ["..."]}}

A checkpoint saved by several ranks through ``Checkpointer.save`` keeps each
rank's files in its own ``rank-NNNNN/`` dir (``store/shards/``), and the
manifest names each rank's entries ``rank-NNNNN/<key>``, with that rank's
chunks and file names under the prefix. :func:`global_index` folds them back
into one entry per key, its chunks gathered from every rank.

``at`` is the chunk's byte offset in its file and ``crc32`` lists the crc32 of
each ``block`` bytes of it (the last block may be shorter). So a loader at any
world size can tell, from the manifest alone, which bytes of which files hold
the part of each tensor it needs, and verify every block it reads without
reading the rest of the file. Chunks are stored row-major and contiguous, in
safetensors files (a standard reader sees one entry per chunk).

A chunk's block is a 64th of it, rounded up to a power of two, and at least
64 KiB (:func:`block_size`): the manifest then holds at most 64 crcs a chunk
whatever the model's size, and a rank that needs part of a chunk reads at most
one block (1/64 of the chunk, or 64 KiB) more than it needs at each end of
each run of bytes it needs.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from ..errors import CheckpointCorrupt
from ..store.codec import decode_state, encode_state, st_dtype, torch_dtype
from ..store.manifest import CHUNKED, Manifest, is_chunked
from ..store.shards import rank_of

__all__ = [
    "LAYOUT",
    "Stored",
    "block_size",
    "chunk_key",
    "global_index",
    "index_entries",
    "is_dcp",
    "metadata_of",
    "planner_extra",
]

LAYOUT = CHUNKED
BLOCKS = 64
"""Crcs per chunk, at most."""
MIN_BLOCK = 64 << 10


def block_size(nbytes: int) -> int:
    """Bytes per verified block of a chunk of ``nbytes``: a power of two, at least
    ``MIN_BLOCK``, and large enough that the chunk has at most ``BLOCKS`` blocks."""
    block = MIN_BLOCK
    while block * BLOCKS < nbytes:
        block *= 2
    return block


@dataclass(frozen=True)
class Stored:
    """Where one chunk (or one DCP byte item) sits: file, byte offset, length, and the
    crc32 of each ``block`` bytes of it."""

    file: str
    at: int
    length: int
    block: int
    crcs: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {"file": self.file, "at": self.at, "block": self.block, "crc32": list(self.crcs)}


def is_dcp(man: Manifest) -> bool:
    """Whether ``man`` describes a checkpoint written in the DCP layout."""
    return is_chunked(man)


def global_index(man: Manifest) -> dict[str, dict[str, Any]]:
    """The manifest's tensor index with one entry per key, whoever wrote its chunks.

    In a checkpoint whose files lie in ``rank-NNNNN/`` dirs every key carries
    its rank's prefix; the entries of one key are merged (their chunks
    concatenated), and must agree on everything else.
    """
    if not any(rank_of(name.split("/", 1)[0]) is not None for name in man.files if "/" in name):
        return man.tensors
    out: dict[str, dict[str, Any]] = {}
    for key, entry in man.tensors.items():
        head, sep, fqn = key.partition("/")
        if not sep or rank_of(head) is None:
            raise CheckpointCorrupt(f"checkpoint step {man.step}: tensor key {key!r} names no rank's dir")
        have = out.get(fqn)
        if have is None:
            out[fqn] = dict(entry)
            continue
        if "chunks" not in entry or "chunks" not in have or any(
            have.get(f) != entry.get(f) for f in ("dtype", "shape", "placements", "mesh")
        ):
            raise CheckpointCorrupt(f"checkpoint step {man.step}: the ranks' entries of {fqn!r} disagree")
        have["chunks"] = [*have["chunks"], *entry["chunks"]]
    return out


def chunk_key(fqn: str, offsets: Any) -> str:
    """The safetensors key of one chunk: the DCP key, and ``@offsets`` when not at the origin."""
    offs = [int(o) for o in offsets or ()]
    return fqn if not any(offs) else f"{fqn}@{','.join(map(str, offs))}"


def planner_extra(planner_data: Any, version: str | None) -> dict[str, Any]:
    """The manifest's ``extra.dcp``: the planner's data as our JSON (never pickle)."""
    enc = encode_state(planner_data)
    if enc.tensors:
        raise ValueError("the save planner's planner_data holds tensors; slurm_ckpt.dcp cannot store them")
    # A JSON string, not nested JSON: the manifest is indented, and DCP's map of every key
    # to its path would take a dozen lines per key there.
    return {"version": version, "planner_data": json.dumps(enc.tree, separators=(",", ":"))}


def index_entries(
    metadata: Any, stored: dict[Any, Stored], layouts: dict[str, dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    """The manifest's tensor index from DCP's global ``Metadata`` and where each item went.

    ``stored`` maps each ``MetadataIndex`` (key and chunk offsets) to its :class:`Stored`;
    ``layouts`` adds ``placements`` and ``mesh`` for keys that were DTensors.
    """
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    out: dict[str, dict[str, Any]] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            where = stored[MetadataIndex(fqn)]
            out[fqn] = {"bytes": {**where.to_json(), "size": where.length}}
            continue
        chunks = []
        for ch in md.chunks:
            where = stored[MetadataIndex(fqn, ch.offsets)]
            chunks.append({"offsets": list(ch.offsets), "sizes": list(ch.sizes), **where.to_json()})
        out[fqn] = {"dtype": st_dtype(md.properties.dtype, fqn), "shape": list(md.size),
                    **layouts.get(fqn, {}), "chunks": chunks}  # fmt: skip
    return out


def metadata_of(man: Manifest, where: str) -> Any:
    """DCP's ``Metadata`` for a DCP-layout manifest.

    ``metadata.storage_data`` maps each ``MetadataIndex`` to its :class:`Stored`.
    Raises :class:`CheckpointCorrupt` naming ``where`` if the index is inconsistent.
    """
    import torch
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    try:
        dcp = man.extra["dcp"]
        sdm: dict[str, Any] = {}
        storage: dict[Any, Stored] = {}

        def stored(rec: dict[str, Any], length: int) -> Stored:
            crcs = tuple(str(c) for c in rec["crc32"])
            block = int(rec["block"])
            if block <= 0 or block % 16:
                raise ValueError(f"block size {block} is not a positive multiple of 16")
            if str(rec["file"]) not in man.files:
                raise ValueError(f"file {rec['file']!r} is not in the manifest")
            if len(crcs) != max(1, -(-length // block)):
                raise ValueError(f"{len(crcs)} block crcs for {length} bytes")
            at = int(rec["at"])
            if at < 0 or at + length > man.files[str(rec["file"])].size:
                raise ValueError(f"bytes {at}-{at + length} lie outside {rec['file']}")
            return Stored(str(rec["file"]), at, length, block, crcs)

        for fqn, entry in global_index(man).items():
            if "bytes" in entry:
                rec = entry["bytes"]
                sdm[fqn] = BytesStorageMetadata()
                storage[MetadataIndex(fqn)] = stored(rec, int(rec["size"]))
                continue
            dtype = torch_dtype(entry["dtype"])
            chunks = []
            for ch in entry["chunks"]:
                offsets, sizes = [int(o) for o in ch["offsets"]], [int(s) for s in ch["sizes"]]
                if len(offsets) != len(entry["shape"]) or len(sizes) != len(offsets):
                    raise ValueError(f"{fqn}: chunk of rank {len(sizes)} in a tensor of rank {len(entry['shape'])}")
                chunks.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)))
                storage[MetadataIndex(fqn, offsets)] = stored(ch, math.prod(sizes) * dtype.itemsize)
            sdm[fqn] = TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(entry["shape"]), chunks)
        planner_data = decode_state(json.loads(dcp["planner_data"]), _no_tensors, None)
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointCorrupt(f"{where}: invalid DCP index in the manifest: {e}", where) from None
    return Metadata(state_dict_metadata=sdm, planner_data=planner_data, storage_data=storage,
                    version=dcp.get("version"))  # fmt: skip


def _no_tensors(key: str) -> Any:
    raise ValueError(f"planner_data refers to a tensor ({key!r})")

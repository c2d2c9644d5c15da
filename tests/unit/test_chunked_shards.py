"""A chunked index (DTensor states) through the shard machinery: staged per rank, assembled, read back whole.

Real files and the real commit, staging and assembly functions. Each rank's
data file holds its chunk of one tensor ``w`` (4 x 2, sharded on dim 0).
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

import pytest
import torch

from slurm_ckpt.dcp.index import global_index, metadata_of
from slurm_ckpt.errors import CheckpointCorrupt
from slurm_ckpt.store.codec import TensorEntry
from slurm_ckpt.store.manifest import Manifest, is_chunked
from slurm_ckpt.store.shards import (
    complete,
    new_save_id,
    shard_extra,
    shard_manifest,
    write_staged_shard,
)
from slurm_ckpt.store.tensorfile import FileRecord, write_tensor_file

LAYOUT = {"layout": "dcp", "sharded": 1, "dcp": {"version": "1", "planner_data": "null"}}


def _write(rank: int, rows: int = 2) -> Any:
    def write(tmp: Path) -> tuple[dict[str, FileRecord], dict[str, Any]]:
        name = f"dcp-{rank:05d}.safetensors"
        t = torch.full((rows, 2), float(rank))
        rec = write_tensor_file(tmp / name, [TensorEntry(f"w@{2 * rank},0", t, "F32", [rows, 2])])
        data = t.numpy().tobytes()
        chunk = {"offsets": [2 * rank, 0], "sizes": [rows, 2], "file": name, "at": rec.size - len(data),
                 "block": 65536, "crc32": [f"{zlib.crc32(data):08x}"]}  # fmt: skip
        entry = {"dtype": "F32", "shape": [4, 2], "placements": ["Shard(dim=0)"], "mesh": [2], "chunks": [chunk]}
        return {name: rec}, {"w": entry}

    return write


def _assemble(durable: Path, *, rows1: int = 2, shape1: list[int] | None = None) -> Path:
    save_id = new_save_id()
    for rank in (0, 1):
        write = _write(rank, rows1 if rank else 2)
        if rank == 1 and shape1 is not None:
            inner = write

            def write(tmp: Path, inner: Any = inner) -> tuple[dict[str, FileRecord], dict[str, Any]]:
                files, index = inner(tmp)
                index["w"]["shape"] = shape1
                return files, index

        write_staged_shard(durable, 3, save_id, rank, write, world_size=2,
                           extra={**LAYOUT, **shard_extra(rank, 2, save_id)})  # fmt: skip
    done = complete(durable, 3, save_id, 2)
    assert done is not None
    return done


def test_an_assembled_chunked_checkpoint_stays_chunked_and_folds_back_into_global_entries(tmp_path: Path) -> None:
    path = _assemble(tmp_path / "run")
    man = Manifest.read(path)
    assert is_chunked(man) and man.extra["dcp"] == LAYOUT["dcp"] and "shard" not in man.extra
    assert sorted(man.tensors) == ["rank-00000/w", "rank-00001/w"]
    index = global_index(man)
    assert list(index) == ["w"] and index["w"]["shape"] == [4, 2]
    assert [(c["offsets"], c["file"]) for c in index["w"]["chunks"]] == [
        ([0, 0], "rank-00000/dcp-00000.safetensors"), ([2, 0], "rank-00001/dcp-00001.safetensors")]  # fmt: skip
    md = metadata_of(man, str(path))
    assert [list(c.offsets) for c in md.state_dict_metadata["w"].chunks] == [[0, 0], [2, 0]]
    # A rank's part, as the shard itself named it.
    part = shard_manifest(man, 1)
    assert part is not None and part.tensors["w"]["chunks"][0]["file"] == "dcp-00001.safetensors"


def test_ranks_whose_entries_disagree_make_the_checkpoint_corrupt(tmp_path: Path) -> None:
    path = _assemble(tmp_path / "run", shape1=[5, 2])
    with pytest.raises(CheckpointCorrupt, match="entries of 'w' disagree"):
        global_index(Manifest.read(path))
    with pytest.raises(CheckpointCorrupt, match="invalid DCP index"):
        metadata_of(Manifest.read(path), str(path))

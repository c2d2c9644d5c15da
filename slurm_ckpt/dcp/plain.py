"""Checkpoints that DCP did not write, as ``dcp.load`` sees them through :class:`StorageReader`.

Two kinds:

* a checkpoint of ``Checkpointer.save`` of plain tensors (one process): each
  tensor is one chunk at its offset in the safetensors file; a file holds no
  per-block crcs, so the reader verifies each file whole the first time it
  reads from it (``ranged.RangeReader``);
* a chunked checkpoint with a ``state.json`` (``Checkpointer.save`` or
  ``slurm_ckpt.sharded.save`` of DTensor states): its tensors are DCP's already.

In both, the plain values (a step, a scheduler's state, an optimizer's
``param_groups``) live in ``state.json``, not in DCP's pickles. They are
offered to DCP as byte items, keyed as DCP flattens a state (``optim.param_groups``),
holding ``torch.save`` of the decoded value; values pickled into ``objects.pkl``
(``allow_pickle``) only with ``trusted=True``.

A checkpoint of several ranks each saving its own plain state (``rank-NNNNN/``
dirs, not chunked) has no global tensors to offer: it is refused.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import pickle
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint._traverse import traverse_state_dict
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from ..errors import CheckpointCorrupt, ConfigError, UnsafeLoad, storage_error
from ..store.codec import contiguous_strides, decode_state, namespace, tensor_refs, torch_dtype
from ..store.fsutil import open_regular, read_small
from ..store.manifest import Manifest
from ..store.shards import SHARD_PREFIX, shard_name
from ..store.tensorfile import read_header
from ..store.writer import OBJECTS_FILE, STATE_FILE
from .index import Stored, block_size

__all__ = ["Refused", "Value", "plain_metadata", "state_values"]

_STATE_LIMIT = 1 << 30


Value = Callable[[], bytes]
"""The bytes of one byte item, made when DCP asks for it."""


def plain_metadata(ckpt: Path, man: Manifest, *, trusted: bool) -> tuple[Metadata, dict[str, Value]]:
    """DCP's ``Metadata`` of a ``Checkpointer.save`` checkpoint of plain tensors, and its values.

    ``metadata.storage_data`` maps each ``MetadataIndex`` to a :class:`Stored`
    without block crcs (the whole file is checked instead).
    """
    if any(name.startswith(SHARD_PREFIX) for name in man.files):
        raise ConfigError(
            f"{ckpt} was saved by {man.world_size} ranks, each its own plain state (rank-NNNNN dirs): "
            "there are no global tensors for dcp.load; resume it with Checkpointer.load_latest at the same world size"
        )
    where: dict[str, Stored] = {}
    for fname in sorted({str(e["file"]) for e in man.tensors.values()}):
        where.update(_file_entries(ckpt, man, fname))
    tree = json.loads(_verified(ckpt, man, STATE_FILE))
    views = {k: rec for k, rec in tensor_refs(tree).items() if rec is not None}
    placeholders: dict[int, str] = {}
    chunks: dict[str, Stored] = {}

    def placeholder(key: str) -> Any:
        if key in views:
            rec = views[key]
            shape, dtype = [int(d) for d in rec["shape"]], torch_dtype(rec["dtype"])
            # A view's key may be its storage's too: the view's chunk goes to ``chunks``.
            chunks[key] = _view_chunk(ckpt, key, rec, where.get(str(rec["of"])), shape, dtype)
        else:
            entry = man.tensors.get(key)
            if entry is None or key not in where:
                raise CheckpointCorrupt(f"{ckpt}: tensor {key!r} missing", ckpt)
            shape, dtype = [int(d) for d in entry["shape"]], torch_dtype(entry["dtype"])
            chunks[key] = where[key]
        t = torch.empty(shape, dtype=dtype, device="meta")
        placeholders[id(t)] = key
        return t

    flat, mapping = _flat(tree, placeholder)
    objects = _objects(ckpt, man, OBJECTS_FILE, trusted, lambda blob: pickle.loads(blob))
    sdm: dict[str, Any] = {}
    storage: dict[MetadataIndex, Stored] = {}
    values: dict[str, Value] = {}
    for fqn, obj in flat.items():
        key = placeholders.get(id(obj)) if isinstance(obj, torch.Tensor) else None
        if key is None:
            values[fqn] = _value(ckpt, fqn, obj, objects)
            sdm[fqn] = BytesStorageMetadata()
            continue
        shape = torch.Size(obj.shape)
        chunk = ChunkStorageMetadata(torch.Size([0] * len(shape)), shape)
        sdm[fqn] = TensorStorageMetadata(TensorProperties(dtype=obj.dtype), shape, [chunk])
        storage[MetadataIndex(fqn, chunk.offsets)] = chunks[key]
    return Metadata(state_dict_metadata=sdm, planner_data=mapping, storage_data=storage), values


def state_values(ckpt: Path, man: Manifest, *, trusted: bool) -> dict[str, Value]:
    """The plain values of a chunked checkpoint's ``state.json``, as DCP byte items (none without one).

    Where the ranks saved different values, rank 0's are offered.
    """
    name = next((n for n in (STATE_FILE, f"{shard_name(0)}/{STATE_FILE}") if n in man.files), None)
    if name is None:
        return {}
    doc = json.loads(_verified(ckpt, man, name))
    flat, _ = _flat(doc["trees"][0], _tensor_marker)
    # objects.pkl holds each rank's pickle (bytes): rank 0's is offered.
    objects = _objects(ckpt, man, name.replace(STATE_FILE, OBJECTS_FILE), trusted,
                       lambda blob: pickle.loads(pickle.loads(blob)[0]))  # fmt: skip
    return {fqn: _value(ckpt, fqn, v, objects) for fqn, v in flat.items() if v is not _TENSOR}


_TENSOR = torch.empty(0, device="meta")
"""Stands for every tensor of a chunked checkpoint's tree: DCP's index offers those."""


def _tensor_marker(key: str) -> Any:
    return _TENSOR


class Refused:
    """A value :func:`_value` cannot give DCP; calling it raises why."""

    def __init__(self, why: str) -> None:
        self.why = why

    def __call__(self) -> bytes:
        raise ConfigError(self.why)


class _Transposed:
    """Stands for a NumPy array in Fortran order, which :func:`_value` refuses: its bytes
    are its transpose's, so DCP would read a square one transposed without a word."""


class _Pickled:
    """Stands for object ``i`` of ``objects.pkl`` until a byte item needs it."""

    def __init__(self, i: int) -> None:
        self.i = i


_OBJREF = "$objref"


def _flat(tree: Any, load_tensor: Callable[[str], Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A state tree decoded (tensors by ``load_tensor``, pickled objects as :class:`_Pickled`
    without unpickling anything) and flattened as DCP flattens a state."""

    def prepare(t: Any) -> Any:
        if isinstance(t, list):
            return [prepare(v) for v in t]
        if isinstance(t, dict):
            if len(t) == 1 and "$np" in t:  # DCP offers numpy arrays as tensors
                return {"$t": t["$np"]}
            if len(t) == 1 and "$npT" in t:  # stored as its transpose: no chunk of its own shape
                return _Transposed()
            if len(t) == 1 and "$view" in t:  # a placeholder, like any tensor: see _view_chunk
                return {"$t": t["$view"]["key"]}
            if len(t) == 1 and "$pickle" in t:  # decoded as a plain dict, turned into a _Pickled below
                return {_OBJREF: t["$pickle"]}
            return {k: prepare(v) for k, v in t.items()}
        return t

    def mark(v: Any) -> Any:
        if isinstance(v, dict):
            if len(v) == 1 and _OBJREF in v:
                return _Pickled(int(v[_OBJREF]))
            return {k: mark(x) for k, x in v.items()}
        if isinstance(v, list):
            return [mark(x) for x in v]
        if type(v) is tuple:  # a torch.Size holds ints only, and stays a Size
            return tuple(mark(x) for x in v)
        if isinstance(v, argparse.Namespace):
            return namespace({k: mark(x) for k, x in vars(v).items()})
        return v

    state = mark(decode_state(prepare(tree), load_tensor, None))
    return _flatten(state if isinstance(state, dict) else {"": state})


class _Clash:
    """Stands for the values at two or more places that DCP's flattening gives one key
    (dict keys 1 and "1"; "a.b" beside a's "b"): no load through DCP can ask for one."""

    def __init__(self, paths: list[tuple[Any, ...]]) -> None:
        self.paths = paths


def _flatten(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``state`` flattened as DCP's ``flatten_state_dict`` flattens it, but where it
    would fail on a key that two places share: that key stands for a :class:`_Clash`,
    which a load through DCP that asks for it is refused, and the rest still load."""
    flat: dict[str, Any] = {}
    mapping: dict[str, Any] = {}

    def flat_copy(path: tuple[Any, ...], value: Any) -> None:
        fqn = ".".join(map(str, path))
        if fqn in flat:
            held = flat[fqn]
            flat[fqn] = _Clash([*held.paths, path] if isinstance(held, _Clash) else [mapping[fqn], path])
            return
        flat[fqn], mapping[fqn] = value, path

    traverse_state_dict(state, flat_copy)
    return flat, mapping


def _objects(ckpt: Path, man: Manifest, name: str, trusted: bool,
             unpickle: Callable[[bytes], list[Any]]) -> Callable[[], list[Any]]:  # fmt: skip
    """The objects of ``objects.pkl``, unpickled at the first call, and only when ``trusted``."""
    got: list[list[Any]] = []

    def objects() -> list[Any]:
        if not trusted:
            raise UnsafeLoad(f"{ckpt} holds pickled objects, which can run code when loaded; pass "
                             "StorageReader(..., trusted=True) only if you trust who wrote it")  # fmt: skip
        if not got:
            got.append(unpickle(_verified(ckpt, man, name)))  # trusted=True: the caller vouched for it
        return got[0]

    return objects


def _value(ckpt: Path, fqn: str, value: Any, objects: Callable[[], list[Any]]) -> Value:
    """The bytes DCP's planner unpickles one value from (``torch.save``), made when asked for.

    A value holding tensors (or NumPy arrays, stored as tensors) is :class:`Refused`: the
    reader refuses a load that asks for it before reading anything, and a load that does
    not (``slurm_ckpt.sharded``'s, which decodes the state itself) is not disturbed by it.
    """
    if isinstance(value, _Clash):
        # DCP's paths hold str() of each key: 1 and "1" are one place to print.
        places = " and ".join(dict.fromkeys("state" + "".join(f"[{k!r}]" for k in p) for p in value.paths))
        return Refused(f"{ckpt}: DCP's name {fqn!r} stands for {len(value.paths)} places of the saved state "
                       f"({places}: dict keys that print alike, as 1 and '1', or a key with a dot beside nested "
                       "ones), which no load through DCP can tell apart; load it with Checkpointer.load_latest")  # fmt: skip
    if _holds(value, _Transposed):
        return Refused(f"{ckpt}: {fqn!r} is or holds a NumPy array in Fortran order, stored as its transpose, "
                       "which DCP cannot read as the array; load this checkpoint with Checkpointer.load_latest")  # fmt: skip
    if _holds(value, torch.Tensor):
        # DCP keeps a tuple (or a list of lists) holding tensors as one pickled value.
        return Refused(f"{ckpt}: {fqn!r} is a value holding tensors or arrays, which DCP would load as one "
                       "pickle; load this checkpoint with Checkpointer.load_latest")  # fmt: skip

    def saved() -> bytes:
        v = _unmark(value, objects) if _holds(value, _Pickled) else value
        buf = io.BytesIO()
        torch.save(v, buf)
        return buf.getvalue()

    return saved


def _holds(value: Any, kind: type) -> bool:
    """Whether ``value`` is, or holds, a ``kind`` (sets hold plain values only: see the codec)."""
    if isinstance(value, kind):
        return True
    if isinstance(value, argparse.Namespace):
        value = vars(value)
    if isinstance(value, dict):
        return any(_holds(v, kind) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds(v, kind) for v in value)
    return False


def _unmark(value: Any, objects: Callable[[], list[Any]]) -> Any:
    if isinstance(value, _Pickled):
        return objects()[value.i]
    if isinstance(value, dict):
        return {k: _unmark(v, objects) for k, v in value.items()}
    if isinstance(value, list):
        return [_unmark(v, objects) for v in value]
    if isinstance(value, tuple):
        return tuple(_unmark(v, objects) for v in value)
    if isinstance(value, argparse.Namespace):
        return namespace({k: _unmark(v, objects) for k, v in vars(value).items()})
    return value


def _file_entries(ckpt: Path, man: Manifest, fname: str) -> dict[str, Stored]:
    """Where each tensor of data file ``fname`` lies in it, from its safetensors header."""
    rec = man.files.get(fname)
    if rec is None:
        raise CheckpointCorrupt(f"{ckpt}: tensor file {fname} not in manifest", ckpt / fname)
    path = ckpt / fname
    try:
        with os.fdopen(open_regular(path), "rb", buffering=0) as f:
            raw, header = read_header(f, path, rec.size)
    except OSError as e:
        raise storage_error(e, "cannot read data file", path) from e
    out = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        begin, end = (int(x) for x in info["data_offsets"])
        if math.prod(int(d) for d in info["shape"]) * torch_dtype(info["dtype"]).itemsize != end - begin:
            raise CheckpointCorrupt(f"{path}: entry {key!r} holds {end - begin} bytes, not its shape's", path)
        out[key] = Stored(fname, len(raw) + begin, end - begin, block_size(end - begin), ())
    return out


def _view_chunk(ckpt: Path, key: str, rec: dict[str, Any], base: Stored | None, shape: list[int],
                dtype: torch.dtype) -> Stored:  # fmt: skip
    """Where a ``$view`` tensor's bytes lie: one run inside its storage's entry.

    DCP reads a chunk as one run of bytes, so only a view laid out contiguously,
    whose values are its bytes, is offered; any other (a transpose, a strided
    slice, a lazy conjugate) is refused, naming the loader that rebuilds it.
    """
    if base is None:
        raise CheckpointCorrupt(f"{ckpt}: storage {rec['of']!r} of tensor {key!r} missing", ckpt)
    numel = math.prod(shape)
    want = contiguous_strides(shape)
    if numel and any(n != 1 and int(s) != w for n, s, w in zip(shape, rec["stride"], want, strict=True)):
        raise ConfigError(f"{ckpt}: tensor {key!r} was saved as a non-contiguous view, which dcp.load cannot "
                          "read as one chunk; load this checkpoint with Checkpointer.load_latest")  # fmt: skip
    if rec.get("conj") or rec.get("neg"):
        raise ConfigError(f"{ckpt}: tensor {key!r} was saved with torch's lazy conjugate or negative bit, whose "
                          "values dcp.load cannot rebuild from its bytes; load this checkpoint with "
                          "Checkpointer.load_latest")  # fmt: skip
    at, length = int(rec["offset"]) * dtype.itemsize, numel * dtype.itemsize
    if at + length > base.length:
        raise CheckpointCorrupt(f"{ckpt}: tensor {key!r} lies outside its storage {rec['of']!r}", ckpt)
    return Stored(base.file, base.at + at, length, block_size(length), ())


def _verified(ckpt: Path, man: Manifest, name: str) -> bytes:
    path = ckpt / name
    rec = man.files.get(name)
    if rec is None:
        raise CheckpointCorrupt(f"{ckpt}: {name} not in manifest", path)
    try:
        data = read_small(path, _STATE_LIMIT)
    except OSError as e:
        raise storage_error(e, "cannot read", path) from e
    if len(data) != rec.size or f"{zlib.crc32(data):08x}" != rec.checksum:
        raise CheckpointCorrupt(f"{path}: checksum mismatch", path)
    return data

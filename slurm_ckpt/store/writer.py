"""Turn an encoded state into checkpoint files, and back.

This is the plain sequential reference path; ``slurm_ckpt.engine`` supplies the
parallel one. Both produce the same files, so either can read what the other wrote.
"""

from __future__ import annotations

import json
import pickle
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ..errors import CheckpointCorrupt, ConfigError, UnsafeLoad, storage_error
from .codec import EncodedState, decode_state, plan_into, refuse_meta
from .fsutil import write_file_durably
from .manifest import Manifest
from .tensorfile import FileRecord, read_tensors, write_tensor_file
from .verify import crc_file

__all__ = [
    "OBJECTS_FILE",
    "STATE_FILE",
    "ReadFn",
    "load_state",
    "refuse_meta",
    "small_files",
    "tensor_file_name",
    "tensor_index",
    "write_small_files",
    "write_state",
]

STATE_FILE = "state.json"
OBJECTS_FILE = "objects.pkl"

ReadFn = Callable[..., dict[str, Any]]
"""``read(path, expected: FileRecord, *, into) -> {key: tensor}`` in host memory, verifying the checksum.

``into`` maps keys to tensors the reader may fill in place (and return);
``load_state`` copies the values into any it did not."""


def tensor_file_name(index: int) -> str:
    return f"tensors-{index:05d}.safetensors"


def small_files(enc: EncodedState) -> dict[str, bytes]:
    """The bytes of state.json (and objects.pkl when pickling was allowed).

    Serialized at once, so an async save captures them before the trainer
    can change the objects they come from.
    """
    blobs = {STATE_FILE: json.dumps(enc.tree, separators=(",", ":"), allow_nan=False).encode()}
    if enc.objects:
        blobs[OBJECTS_FILE] = pickle.dumps(enc.objects, protocol=pickle.HIGHEST_PROTOCOL)
    return blobs


def write_small_files(tmp: Path, enc: EncodedState | dict[str, bytes]) -> dict[str, FileRecord]:
    """state.json (and objects.pkl when pickling was allowed), fsynced."""
    blobs = small_files(enc) if isinstance(enc, EncodedState) else enc
    out = {}
    for name, data in blobs.items():
        write_file_durably(tmp / name, data)
        out[name] = FileRecord(len(data), f"{zlib.crc32(data):08x}")
    return out


def tensor_index(enc: EncodedState, name: str) -> dict[str, Any]:
    """The manifest's tensor index: key -> file, dtype, shape."""
    return {t.key: {"file": name, "dtype": t.dtype, "shape": t.shape} for t in enc.tensors}


def write_state(tmp: Path, enc: EncodedState) -> tuple[dict[str, FileRecord], dict[str, Any]]:
    """Write all files of ``enc`` into ``tmp``; every file is fsynced before return."""
    name = tensor_file_name(0)
    files = write_small_files(tmp, enc)
    if enc.tensors:
        files[name] = write_tensor_file(tmp / name, enc.tensors)
    return files, tensor_index(enc, name)


def load_state(
    ckpt: Path,
    man: Manifest,
    *,
    map_location: Any = None,
    trusted: bool = False,
    read: ReadFn = read_tensors,
    into: Any = None,
) -> Any:
    """Read a committed checkpoint, verifying every checksum as the bytes arrive.

    ``read`` reads one data file (``slurm_ckpt.engine`` passes its parallel reader).
    Without ``map_location`` a tensor saved on a device goes back to it, as with
    ``torch.load``; a device puts every tensor there, a dict ``{saved: device}``
    moves those saved on the devices it names. ``into``: a state shaped like the saved one; its tensors get
    the saved values (cast to its dtype) and the returned state holds them. A tensor
    of ``into`` that the checkpoint lacks, whose shape differs, or on the meta device,
    is a ``ValueError`` before anything is read.
    """
    if man.extra.get("layout") == "dcp":
        # Its tensor index holds global shapes and chunks, not whole tensors by file.
        raise ConfigError(
            f"{ckpt} is a sharded checkpoint written through slurm_ckpt.dcp: load it with "
            "slurm_ckpt.sharded.load(run_dir, into=...) or dcp.load with slurm_ckpt.dcp.StorageReader"
        )
    for small in (STATE_FILE, OBJECTS_FILE):
        rec = man.files.get(small)
        if rec is not None and crc_file(ckpt / small) != rec.checksum:
            raise CheckpointCorrupt(f"{ckpt / small}: checksum mismatch", ckpt / small)
    try:
        tree = json.loads((ckpt / STATE_FILE).read_bytes())
    except OSError as e:
        raise storage_error(e, "cannot read state", ckpt / STATE_FILE) from e
    targets, whole, copied, shared = plan_into(ckpt, tree, into, man.tensors)
    place = placement(map_location)
    by_file: dict[str, list[str]] = {}
    for key, info in man.tensors.items():
        by_file.setdefault(info["file"], []).append(key)
    tensors: dict[str, Any] = {}
    for fname, keys in by_file.items():
        if fname not in man.files:
            raise CheckpointCorrupt(f"{ckpt}: tensor file {fname} not in manifest", ckpt / fname)
        here = set(keys)
        # Views, and targets that share memory (copied in into's order), are filled when decoded.
        mine = {k: t for k, t in targets.items() if k in whole and k in here and k not in shared}
        tensors.update(read(ckpt / fname, man.files[fname], into=mine))  # to host memory: decode places them

    def load_tensor(key: str) -> Any:
        try:
            return tensors[key]
        except KeyError:
            raise CheckpointCorrupt(f"{ckpt}: tensor {key!r} missing", ckpt) from None

    if OBJECTS_FILE in man.files and not trusted:
        raise UnsafeLoad(
            f"{ckpt} holds pickled objects, which can run code when loaded; "
            "pass trusted=True only if you trust who wrote it"
        )
    return decode_state(tree, load_tensor, lambda: (ckpt / OBJECTS_FILE).read_bytes(), trusted=trusted,
                        place=place, into=targets, copied=copied, shared=shared)  # fmt: skip


def placement(map_location: Any) -> Callable[[str], str]:
    """Where a tensor saved on a device goes, as ``torch.load``'s ``map_location`` says:
    back there (None), onto one device, or as a dict from saved device to device; not
    its hooks on each storage, a function."""
    if map_location is None:
        return lambda saved: saved
    if isinstance(map_location, Mapping):
        remap = {str(k): str(v) for k, v in map_location.items()}
        return lambda saved: remap.get(saved, saved)
    if callable(map_location):
        raise ValueError(
            "map_location as a function (torch.load's hook on each storage) is not supported: pass a "
            "device (map_location='cpu'), or a dict from saved device to device ({'cuda:0': 'cuda:1'})"
        )
    device = str(map_location)
    return lambda saved: device

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
from typing import Any, NamedTuple

from ..errors import CheckpointCorrupt, ConfigError, UnsafeLoad, storage_error
from .codec import (
    EncodedState,
    decode_state,
    encode_state,
    match_into,
    overlapping,
    tensor_refs,
    torch_dtype_name,
    transposed,
)
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
    targets, whole, copied, shared = _into_targets(ckpt, man, tree, into)
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


def refuse_meta(ckpt: Path, key: str, t: Any) -> None:
    """A tensor on the meta device has no memory: copying into it does nothing, and
    a load into it would hand it back unchanged."""
    if t.is_meta:
        raise ValueError(
            f"cannot load {key!r} of {ckpt} into a tensor on the meta device, which has no memory: "
            "load without into= and pass the result to model.load_state_dict(..., assign=True), "
            "or materialize the model first (model.to_empty(device='cpu'))"
        )


class _Into(NamedTuple):
    """What a load ``into=`` fills, by the saved tensors' keys."""

    targets: dict[str, Any]
    """``into``'s tensors, in ``into``'s order."""
    whole: set[str]
    """Those stored whole and of the saved dtype: a reader may fill them in place."""
    copied: dict[str, Any]
    """The arrays that get their targets' values (``EncodedState.copied``)."""
    shared: set[str]
    """Those copied in last, in ``into``'s order: their memory overlaps another's."""


def _into_targets(ckpt: Path, man: Manifest, tree: Any, into: Any) -> _Into:
    """The targets of ``into``, each checked against the saved tensor at its place."""
    if into is None:
        return _Into({}, set(), {}, set())
    matched = encode_state(into, allow_pickle=True, prepare=lambda t: t, stored=False)
    targets, copied = match_into(ckpt, tree, matched.tree, matched.leaves, matched.copied)
    flipped: set[str] = set()
    saved = tensor_refs(tree, flipped)
    for key in flipped & targets.keys():
        # A NumPy array saved in Fortran order is stored as its transpose: the target
        # (in its own shape, whatever its order) is filled through its transpose.
        targets[key] = transposed(targets[key])
    whole = set()
    for key, t in targets.items():
        refuse_meta(ckpt, key, t)
        view = saved[key]
        info = view if view is not None else man.tensors.get(key, {})
        shape = list(info.get("shape", []))
        if list(t.shape) != shape:
            raise ValueError(
                f"cannot load {key!r} of {ckpt} into the tensor given for it: the checkpoint holds "
                f"{torch_dtype_name(info.get('dtype'))} {shape}, the tensor is {t.dtype} {list(t.shape)}; "
                "pass a state shaped like the saved one, or load without into="
            )
        # Of another dtype (a model cast since the save), it is copied into, and so
        # cast, once read, as load_state_dict and DCP cast.
        if view is None and torch_dtype_name(info.get("dtype")) == str(t.dtype):
            whole.add(key)
    # A view tied in into as it was when saved (a model's tied head, in its embedding's
    # memory) gets its values with its base's, in whatever order: it does not keep the
    # base from being read in place.
    tied = {key: rec["of"] for key, rec in saved.items()
            if rec is not None and key in targets and _tied_as_saved(targets[key], rec, targets, whole)}  # fmt: skip
    shared = overlapping({k: t for k, t in targets.items() if k not in tied})
    shared |= {key for key, base in tied.items() if base in shared}
    return _Into(targets, whole, copied, shared)


def _tied_as_saved(t: Any, rec: dict[str, Any], targets: dict[str, Any], whole: set[str]) -> bool:
    """Whether target ``t`` of a ``$view`` record lies in its base's target just where
    the view lay in its base: as memory, the same tensor as the base's read gives it."""
    base = targets.get(rec["of"])
    if base is None or rec["of"] == rec["key"] or rec["of"] not in whole or rec.get("conj") or rec.get("neg"):
        return False
    if not base.is_contiguous() or any(x.is_conj() or x.is_neg() for x in (t, base)):
        return False  # its memory is not laid out as the saved storage's bytes
    return (t.dtype == base.dtype and torch_dtype_name(rec["dtype"]) == str(t.dtype) and t.device == base.device
            and list(t.stride()) == rec["stride"]
            and t.data_ptr() == base.data_ptr() + rec["offset"] * t.element_size())  # fmt: skip

"""Loading one committed checkpoint: the one place a load is planned and carried out.

A resume goes ``Checkpointer.load_latest`` -> its placement, which picks the
checkpoint and falls back to older ones (``placement/``) -> :class:`Loader`,
which loads the one it is handed:

1. the small files (``state.json``, ``objects.pkl``), each read once and checked
   against the manifest's crc32;
2. ``into=`` resolved once into a plan before any data is read
   (``codec/into.py``: each target matched by place and checked against the
   manifest, overlaps found);
3. each data file read by the reader it is given (the engine's parallel one,
   ``engine/reader.py``, or the sequential ``tensorfile.read_tensors``), which is
   handed only the targets it may fill in place;
4. the tree decoded (``codec/decode.py``), which copies into the others.

A chunked checkpoint (DTensor states) goes to the loader given for those
(``sharded/loader.py``). As ``commit`` takes the engine's writer, a load takes
its reader: the store stays free of the engine.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ..errors import CheckpointCorrupt, ConfigError, UnsafeLoad, storage_error
from .codec import decode_state, gc_paused, plan_into
from .crc import crc32
from .fsutil import read_small
from .layout import OBJECTS_FILE, STATE_FILE
from .manifest import Manifest, is_chunked
from .tensorfile import read_tensors

__all__ = ["Loader", "ReadFn", "device_map", "load_state", "pickled_parts", "unsafe"]

ReadFn = Callable[..., dict[str, Any]]
"""``read(path, expected: FileRecord, *, into) -> {key: tensor}`` in host memory, verifying the checksum.

``into`` maps keys to tensors the reader may fill in place (and return), none
overlapping another; the decoder copies the values into any it did not."""

Chunked = Callable[..., Any]
"""``load(ckpt, man, *, into, trusted, device)``: a chunked checkpoint's state."""


class Loader:
    """Loads the checkpoint a placement hands it (a ``placement.Load``), with
    ``read`` for each data file and ``chunked`` for DTensor states; see the
    module's docstring. ``mmap``: ``read`` maps the files (no ``into=`` then).

    ``seconds`` and ``nbytes`` describe the last load that returned.
    """

    def __init__(
        self,
        read: ReadFn = read_tensors,
        *,
        mmap: bool = False,
        map_location: Any = None,
        trusted: bool = False,
        into: Any = None,
        chunked: Chunked | None = None,
    ) -> None:
        if into is not None and mmap:
            raise ValueError("into= and mmap=True do not mix: mmap maps the file, into= reads into your tensors")
        device_map(map_location)  # a function is refused before anything is read
        self.read, self.chunked = read, chunked
        self.map_location, self.trusted, self.into = map_location, trusted, into
        self.seconds, self.nbytes = 0.0, 0

    def __call__(self, ckpt: Path, man: Manifest) -> Any:
        t0 = time.monotonic()
        if self.chunked is not None and is_chunked(man):  # every rank its parts, at any world size
            if isinstance(self.map_location, Mapping):  # its chunks keep no device to map from
                raise ValueError(f"{ckpt} holds sharded (DTensor) states, which load onto one device: pass "
                                 "map_location as a device (map_location='cuda:0'), or into=")  # fmt: skip
            state = self.chunked(ckpt, man, into=self.into, trusted=self.trusted, device=self.map_location)
        else:
            state = load_state(ckpt, man, map_location=self.map_location, trusted=self.trusted, read=self.read,
                               into=self.into)  # fmt: skip
        self.seconds, self.nbytes = time.monotonic() - t0, int(man.nbytes or sum(r.size for r in man.files.values()))
        return state


def pickled_parts(man: Manifest) -> list[str]:
    """The files of a checkpoint, any rank's shard included, that hold pickled objects."""
    return sorted(n for n in man.files if n.rpartition("/")[2] == OBJECTS_FILE)


def unsafe(where: Path | str) -> UnsafeLoad:
    """The refusal of a load without ``trusted=True`` of ``where``, which holds pickled objects."""
    return UnsafeLoad(f"{where} holds pickled objects, which can run code when loaded; "
                      "pass trusted=True only if you trust who wrote it")  # fmt: skip


def load_state(
    ckpt: Path,
    man: Manifest,
    *,
    map_location: Any = None,
    trusted: bool = False,
    read: ReadFn = read_tensors,
    into: Any = None,
) -> Any:
    """Read a committed checkpoint of plain tensors, verifying every checksum as the bytes arrive.

    ``read`` reads one data file (the sequential reference reader by default).
    Without ``map_location`` a tensor saved on a device goes back to it, as with
    ``torch.load``; a device puts every tensor there, a dict ``{saved: device}``
    moves those saved on the devices it names. ``into``: a state shaped like the
    saved one; its tensors get the saved values (cast to its dtype) and the
    returned state holds them. A tensor of ``into`` that the checkpoint lacks,
    whose shape differs, or on the meta device, is a ``ValueError`` before
    anything is read.
    """
    if man.extra.get("layout") == "dcp":
        # Its tensor index holds global shapes and chunks, not whole tensors by file.
        raise ConfigError(
            f"{ckpt} is a sharded checkpoint written through slurm_ckpt.dcp: load it with "
            "slurm_ckpt.sharded.load(run_dir, into=...) or dcp.load with slurm_ckpt.dcp.StorageReader"
        )
    try:
        tree = json.loads(_small_file(ckpt, man, STATE_FILE))
    except ValueError as e:  # its crc32 matched: written so, not damaged since
        raise CheckpointCorrupt(f"{ckpt / STATE_FILE}: not valid JSON ({e})", ckpt / STATE_FILE) from None
    objects = _small_file(ckpt, man, OBJECTS_FILE) if OBJECTS_FILE in man.files else None
    if objects is not None and not trusted:
        raise unsafe(ckpt)
    import torch

    # gc paused: thousands of small objects are built. no_grad: into= may hold
    # parameters, which need grad, and are copied into as load_state_dict does.
    with gc_paused(), torch.no_grad():
        return _load(ckpt, man, tree, objects, map_location, trusted, read, into)


def _load(ckpt: Path, man: Manifest, tree: Any, objects: bytes | None, map_location: Any, trusted: bool,
          read: ReadFn, into: Any) -> Any:  # fmt: skip
    plan = plan_into(ckpt, tree, into, man.tensors)
    place = device_map(map_location)
    # Read in place: targets stored whole, of the saved dtype, overlapping no other.
    # Views, and targets that share memory (copied in into's order), are filled when decoded.
    fill = {k: t for k, t in plan.targets.items() if k in plan.whole and k not in plan.shared}
    by_file: dict[str, set[str]] = {}
    for key, info in man.tensors.items():
        by_file.setdefault(info["file"], set()).add(key)
    tensors = _Tensors(ckpt)
    for fname, keys in by_file.items():
        if fname not in man.files:
            raise CheckpointCorrupt(f"{ckpt}: tensor file {fname} not in manifest", ckpt / fname)
        mine = {k: t for k, t in fill.items() if k in keys}
        tensors.update(read(ckpt / fname, man.files[fname], into=mine))  # to host memory: decode places them
    return decode_state(tree, tensors.__getitem__, None if objects is None else lambda: objects, trusted=trusted,
                        place=place, into=plan.targets, copied=plan.copied, shared=plan.shared)  # fmt: skip


class _Tensors(dict[str, Any]):
    """The tensors read, by key; one the tree names but no file held is damage."""

    def __init__(self, ckpt: Path) -> None:
        super().__init__()
        self.ckpt = ckpt

    def __missing__(self, key: str) -> Any:
        raise CheckpointCorrupt(f"{self.ckpt}: tensor {key!r} missing", self.ckpt)


def _small_file(ckpt: Path, man: Manifest, name: str) -> bytes:
    """A small file's bytes, read once and checked against the manifest's crc32."""
    rec, path = man.files.get(name), ckpt / name
    if rec is None:
        raise CheckpointCorrupt(f"{path}: not in the manifest", path)
    try:
        data = read_small(path, rec.size)
    except CheckpointCorrupt:
        raise
    except OSError as e:
        raise storage_error(e, "cannot read state", path) from e
    if f"{crc32(data):08x}" != rec.checksum:
        raise CheckpointCorrupt(f"{path}: checksum mismatch", path)
    return data


def device_map(map_location: Any) -> Callable[[str], str]:
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

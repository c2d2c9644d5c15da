"""Turn an encoded state into checkpoint files.

This is the plain sequential reference path; ``slurm_ckpt.engine`` supplies the
parallel one. Both produce the same files, so either can read what the other
wrote; loading them back is ``load.py``'s.
"""

from __future__ import annotations

import json
import pickle
import zlib
from pathlib import Path
from typing import Any

from .codec import EncodedState, refuse_meta
from .fsutil import write_file_durably
from .layout import OBJECTS_FILE, STATE_FILE
from .tensorfile import FileRecord, write_tensor_file

__all__ = [
    "OBJECTS_FILE",
    "STATE_FILE",
    "refuse_meta",
    "small_files",
    "tensor_file_name",
    "tensor_index",
    "write_small_files",
    "write_state",
]

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


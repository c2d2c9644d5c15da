"""A framework's checkpoint folder as a Checkpointer state, and back.

Hugging Face's Trainer and Accelerate write a checkpoint as a folder of files
in formats of their own (safetensors, torch pickles, JSON, per-rank RNG files),
which they alone know how to read back. Storing each file's bytes verbatim as
a ``uint8`` tensor keeps every one of them exactly, whatever the framework
version writes, and lets the Checkpointer do what the framework does not:
commit the set atomically and durably, checksum it, tier it, and find the
newest one that verifies. Nothing in the files is interpreted on either side,
so no pickle is loaded by slurm-ckpt.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath
from typing import Any

import torch

from ..errors import CheckpointCorrupt, UnsupportedValue

__all__ = ["folder_state", "write_folder"]

_FORMAT = "slurm-ckpt-folder"


def folder_state(path: Path) -> dict[str, Any]:
    """Every regular file under ``path`` as ``{"files": {relative path: bytes as uint8 tensor}}``."""
    files: dict[str, Any] = {}
    for p in sorted(path.rglob("*")):
        rel = p.relative_to(path).as_posix()
        if p.is_symlink():
            raise UnsupportedValue(
                f"{p} is a symlink; a checkpoint folder is stored file by file: "
                "save the file it points at instead"
            )
        if p.is_file():
            size = p.stat().st_size
            # Read into memory of its own: the file may be rewritten once this returns.
            files[rel] = torch.from_file(str(p), shared=False, size=size, dtype=torch.uint8)
    return {"format": _FORMAT, "files": files}


def write_folder(state: Any, path: Path) -> None:
    """Write the files of a :func:`folder_state` state under ``path`` (created, must not exist)."""
    if not isinstance(state, dict) or state.get("format") != _FORMAT:
        raise CheckpointCorrupt(
            f"this checkpoint does not hold a framework's checkpoint folder (format "
            f"{state.get('format') if isinstance(state, dict) else type(state).__name__!r}): "
            "it was saved by something else into the same run dir; give this job its own "
            "SLURM_CKPT_DIR"
        )
    path.mkdir(parents=True)
    for rel, data in state["files"].items():
        parts = PurePosixPath(rel).parts
        if not parts or PurePosixPath(rel).is_absolute() or ".." in parts:
            raise CheckpointCorrupt(f"checkpoint file name {rel!r} leaves the folder; refusing to write it")
        dest = path.joinpath(*parts)
        dest.parent.mkdir(parents=True, exist_ok=True)
        with open(dest, "wb") as f:
            # No fsync: this copy is read back at once and thrown away; the
            # checkpoint it came from is the durable one.
            f.write(memoryview(data.contiguous().numpy()))

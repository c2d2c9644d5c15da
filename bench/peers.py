"""The peers the benchmark measures ours against: torch.save, DCP, safetensors."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .disk import fsync_path
from .state import flatten

__all__ = ["dcp_load", "dcp_save", "st_load", "st_save", "torch_save"]


def torch_save(state: Any, path: Path) -> None:
    import torch

    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def st_save(flat: dict[str, Any], path: Path) -> None:
    from safetensors.torch import save_file

    save_file(flat, str(path))
    fsync_path(path)


def st_load(path: Path) -> Any:
    import torch
    from safetensors.torch import load_file

    out = load_file(str(path))
    # load_file may map the file and read nothing yet; a resume needs the bytes,
    # so each page is touched (as ours and torch.load read everything).
    for t in out.values():
        if t.numel():
            t.reshape(-1).view(torch.uint8)[:: 4096].sum()
    return out


def dcp_save(state: dict[str, Any], path: Path, threads: int) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path), thread_count=threads), no_dist=True)


def dcp_load(like: dict[str, Any], path: Path, *, into: bool = False) -> Any:
    import torch
    import torch.distributed.checkpoint as dcp

    # DCP loads into tensors the caller allocates: into ``like``'s own, or into
    # new ones, whose allocation is then part of the load.
    target = {k: {n: t if into else torch.empty_like(t) for n, t in flatten(v).items()} for k, v in like.items()}
    dcp.load(target, storage_reader=dcp.FileSystemReader(str(path)), no_dist=True)
    return target

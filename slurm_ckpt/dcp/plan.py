"""One rank's data file of the chunked layout, planned from DCP's write items.

Both writers of the chunked layout plan their file here:
:class:`~slurm_ckpt.dcp.StorageWriter` (``write_data``, under ``dcp.save``)
and the DTensor path of ``Checkpointer.save`` (``slurm_ckpt.sharded.job``).
From the items DCP's planner gave this rank, :func:`plan_file_of` makes one
entry per chunk under its key (``index.chunk_key``) and lays the file out:
over the tensors' own memory (``engine.layout.plan_file``), or over a copy in
the engine's staging buffer. :func:`~slurm_ckpt.dcp.chunks.write_chunks`
then writes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..store.codec import TensorEntry, is_dtensor, resolved, st_dtype
from .index import chunk_key

if TYPE_CHECKING:
    from torch.distributed.checkpoint.planner import SavePlanner, WriteItem

    from ..engine.layout import FileImage
    from ..engine.staging import Staging

__all__ = ["FilePlan", "data_file_name", "dtensor_layout", "plan_file_of"]


def data_file_name(rank: int) -> str:
    """The name of rank ``rank``'s data file in a checkpoint of the chunked layout."""
    return f"dcp-{rank:05d}.safetensors"


@dataclass
class FilePlan:
    """One rank's data file, laid out: write ``image`` with ``write_chunks(..., entries, ...)``."""

    entries: list[TensorEntry]
    """One per chunk, in file order."""
    items: list[WriteItem]
    """The DCP write item of each entry: ``items[i]`` is ``entries[i]``'s."""
    image: FileImage
    mode: str
    """``"copy"`` when ``image`` is a copy in the staging buffer, else ``"sync"`` (the tensors' own memory)."""


def plan_file_of(items: list[WriteItem], planner: SavePlanner, *, staging: Staging | None = None,
                 copy: bool = False) -> FilePlan:  # fmt: skip
    """Lay out the data file of this rank's ``items``, resolved through ``planner``.

    Without ``staging`` every chunk goes to CPU memory and the file is laid out
    over it. With ``staging`` the file is a copy in the staging buffer when
    ``copy`` is set or a chunk is on a GPU (CPU chunks are made contiguous
    first only when there is no copy), else laid out over the chunks' memory.
    """
    import torch
    from torch.distributed.checkpoint.planner import WriteItemType

    from ..engine.layout import plan_file
    from ..engine.staging import is_cuda

    entries: list[TensorEntry] = []
    by_key: dict[str, WriteItem] = {}
    keys: set[str] = {"__metadata__"}
    for item in items:
        fqn = item.index.fqn
        data: Any = planner.resolve_data(item)
        if item.type == WriteItemType.BYTE_IO:
            raw = bytearray(data.getbuffer())
            t = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        else:
            t = data.detach()
            if staging is None or not (copy or is_cuda(t)):
                t = t.to("cpu").contiguous()  # copies only what is not CPU and contiguous yet
            t = resolved(t)
        key = chunk_key(fqn, item.index.offset)
        while key in keys:  # never for DCP's own keys; kept so that no two entries share one
            key += "'"
        keys.add(key)
        entries.append(TensorEntry(key, t, st_dtype(t.dtype, fqn, scalar=t.dim() == 0), list(t.shape)))
        by_key[key] = item
    if staging is not None and (copy or any(is_cuda(e.tensor) for e in entries)):
        # A copy now: the checkpoint holds the state as it was at this call.
        image, entries = staging.stage(entries)
        mode = "copy"
    else:
        image = plan_file(entries)  # puts entries in file order
        mode = "sync"
    return FilePlan(entries, [by_key[e.key] for e in entries], image, mode)


def dtensor_layout(value: Any) -> dict[str, Any] | None:
    """A DTensor's ``placements`` and ``mesh`` shape, as the index keeps them; None for any other value."""
    if not is_dtensor(value):
        return None
    return {"placements": [repr(p) for p in value.placements], "mesh": list(value.device_mesh.shape)}

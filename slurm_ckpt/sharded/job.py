"""``ShardJob``: one rank's part of a ``Checkpointer`` save of a state holding DTensors.

The Checkpointer makes one where it would make the engine's job, and hands its
``write`` to its placement's ``commit``, exactly as for any other state: so a
DTensor state gets the same commit protocol, retries, tiers (scratch first, the
background drain) and cross-node scratch (``placement/``) as every checkpoint.
What differs is what each rank writes:

1. :func:`make_job` (collective, on the placement's rank group) gathers the
   ranks' plain values and tensor digests (``parts.prepare``), and asks
   DCP's planner which chunks each rank writes: every rank its own shards
   of each DTensor, and a chunk that several ranks hold (a replicated
   DTensor, a plain tensor equal on every rank) by one of them only, as DCP
   itself decides (``create_global_plan``, run by every rank on the
   gathered local plans, the same on each);
2. ``write(dir)`` writes those chunks into one safetensors-layout file,
   ``dcp-<rank>.safetensors``, with the engine's parallel ``O_DIRECT`` writer
   (``dcp/chunks.py``: the crc32 of every block), and rank 0 also writes
   ``state.json``; it returns the chunks' index, which the placement merges
   into the manifest (``rank-NNNNN/`` prefixed when several ranks save).

The checkpoint is *chunked* (``store.manifest.is_chunked``): any number of
ranks loads it, each reading its parts of every rank's files.

``background=True`` (``save_async``) copies this rank's chunks into the
engine's staging buffer before the job is returned (the ``copy`` snapshot
mode, whatever ``engine.snapshot`` says): the checkpoint then holds the state
as it was when ``save_async`` returned, whatever training does next.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError
from ..store.codec import TensorEntry, is_dtensor, st_dtype
from ..store.tensorfile import FileRecord
from ..store.writer import write_small_files
from .parts import Ranks, prepare

if TYPE_CHECKING:
    from ..engine import Engine
    from ..ranks import RankGroup

__all__ = ["ShardJob", "make_job"]


class ShardJob:
    """The ``write`` of one rank's part of a chunked checkpoint (see the module docstring).

    Offers what the Checkpointer uses of the engine's ``SaveJob``: ``write``,
    ``nbytes``, ``captured``, ``mode``, ``close``; and ``extra``, the manifest
    fields that make the checkpoint chunked.
    """

    def __init__(self, rank: int, entries: list[TensorEntry], chunks: list[dict[str, Any]], image: Any,
                 small: dict[str, bytes], extra: dict[str, Any], engine: Engine, mode: str) -> None:  # fmt: skip
        from ..dcp.plan import data_file_name

        self.name = data_file_name(rank)
        self.entries = entries
        """In file order; ``chunks[i]`` describes ``entries[i]``."""
        self.chunks = chunks
        self.image: Any = image
        self.small = small
        self.extra = extra
        self.mode = mode
        self.nbytes = sum(e.nbytes for e in entries)
        self._engine = engine
        self.captured = threading.Event()
        self.captured.set()  # in place (a synchronous save) or copied already

    def write(self, tmp: Path) -> tuple[dict[str, FileRecord], dict[str, Any]]:
        """Write this rank's files into ``tmp`` (fsynced); return them and their chunks' index.

        Callable again into a fresh dir (a retried commit).
        """
        from ..dcp.chunks import write_chunks

        files = write_small_files(tmp, self.small) if self.small else {}
        index: dict[str, Any] = {}
        if not self.entries:
            return files, index
        assert self.image is not None, "job already closed"
        record, stored = write_chunks(tmp / self.name, self.name, self.image, self.entries, self._engine.cfg,
                                      what="Checkpointer.save")  # fmt: skip
        files[self.name] = record
        for chunk, where in zip(self.chunks, stored, strict=True):
            entry = index.setdefault(chunk["fqn"], {k: v for k, v in chunk.items() if k not in ("fqn", "chunk")})
            entry.setdefault("chunks", []).append({**chunk["chunk"], **where.to_json()})
        return files, index

    def close(self) -> None:
        """Let go of the tensors (or of the staging buffer, which the next save reuses)."""
        self.image = None
        self.entries = []
        self.captured.set()


def make_job(state: Any, *, group: RankGroup | None, engine: Engine, allow_pickle: bool,
             background: bool) -> ShardJob:  # fmt: skip
    """Plan this rank's part of a save of ``state``; collective over ``group`` (None: this process alone)."""
    import warnings

    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION

    from ..dcp.index import LAYOUT, planner_extra
    from ..dcp.plan import plan_file_of

    ranks = Ranks(group.pg, alone=False) if group is not None else Ranks(alone=True)
    prep = prepare(state, ranks, allow_pickle=allow_pickle)
    if group is None:
        _check_alone(prep.flat)
    planner = DefaultSavePlanner(flatten_state_dict=False)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        planner.set_up_planner(prep.flat, is_coordinator=ranks.rank == 0)
        plans = ranks.all_gather(planner.create_local_plan())
        # Every rank runs DCP's global planning on the same plans, so each knows
        # which chunks it writes (a chunk several ranks hold goes to one of them).
        global_plans, metadata = planner.create_global_plan(plans)
        mine = planner.finish_plan(global_plans[ranks.rank])
    # The same file plan as dcp.save's writer: one entry per chunk, over the tensors'
    # own memory (a synchronous save of CPU tensors), else over a staged copy.
    plan = plan_file_of(mine.items, planner, staging=engine.staging, copy=background)
    chunks = [_chunk_entry(item.index.fqn, prep.flat[item.index.fqn], item.tensor_data) for item in plan.items]
    extra = {"layout": LAYOUT, "sharded": 1, "dcp": planner_extra(metadata.planner_data, CURRENT_DCP_VERSION)}
    small = prep.files if ranks.rank == 0 else {}
    return ShardJob(ranks.rank, plan.entries, chunks, plan.image, small, extra, engine, plan.mode)


def _chunk_entry(fqn: str, value: Any, td: Any) -> dict[str, Any]:
    """The index fields of one chunk: its key, the global tensor's dtype and shape (and
    placements and mesh for a DTensor), and where the chunk sits in it."""
    from ..dcp.plan import dtensor_layout

    assert td is not None and td.chunk is not None, f"{fqn}: DCP planned a write without a chunk"
    out: dict[str, Any] = {"fqn": fqn, "dtype": st_dtype(td.properties.dtype, fqn), "shape": list(td.size)}
    out |= dtensor_layout(value) or {}
    out["chunk"] = {"offsets": list(td.chunk.offsets), "sizes": list(td.chunk.sizes)}
    return out


def _check_alone(flat: dict[str, Any]) -> None:
    """A process saving on its own cannot save a DTensor spread over other ranks."""
    for key, t in flat.items():
        if is_dtensor(t) and t.device_mesh.size() > 1:
            raise ConfigError(
                f"{key!r} is a DTensor over {t.device_mesh.size()} ranks, and this Checkpointer saves this "
                "process's state alone (distributed=False, or no torch.distributed group): every rank of its "
                "mesh must save it together; create the Checkpointer after init_process_group(), without "
                "distributed=False"
            )

"""Loading one chunked checkpoint at this world size: every rank its parts, through DCP's planner.

A chunked checkpoint (``store.manifest.is_chunked``) comes from one of three writers:

* ``Checkpointer.save`` of a state holding DTensors (``job.py``), by one rank
  or several (then each rank's files lie in its ``rank-NNNNN/`` dir);
* :func:`slurm_ckpt.sharded.save`;
* ``dcp.save`` with :class:`slurm_ckpt.dcp.StorageWriter`: no ``state.json``;
  the structure comes from DCP's own map of each key to its path
  (``planner_data``), and its non-tensor values are DCP's pickles, loaded
  with ``torch.load(weights_only=True)`` unless the caller trusts the writer.

All come back the same way (see ``slurm_ckpt/sharded/__init__.py``): tensors
found at the same place in ``into`` are filled in place, resharded to them;
the others come back whole, as CPU tensors of their global shape.

:func:`load_one` is collective, and safe to call from inside a placement's
resume: the ranks agree that every one of them can load before DCP's own
collectives start, and either all load or all get an error.
"""

from __future__ import annotations

import io
import json
import logging
import pickle
import warnings
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config import Config
from ..errors import CheckpointCorrupt, ConfigError, StorageError, UnsafeLoad, storage_error
from ..store.codec import decode_state, match_into, torch_dtype
from ..store.fsutil import read_small
from ..store.manifest import Manifest, is_chunked
from ..store.shards import shard_name
from ..store.writer import OBJECTS_FILE, STATE_FILE, refuse_meta
from .parts import PER_RANK, Ranks, Split, refs, split

if TYPE_CHECKING:
    from ..ranks import RankGroup

__all__ = ["Loaded", "load_checkpoint", "load_one"]

log = logging.getLogger("slurm_ckpt")

_STATE_LIMIT = 1 << 30


@dataclass(frozen=True)
class Loaded:
    """What :func:`slurm_ckpt.sharded.load` returns."""

    state: Any
    step: int
    path: Path
    bytes_read: int = 0
    """Bytes this rank read from the checkpoint's data files."""
    bytes_needed: int = 0
    """The least this rank could have read: the bytes of its parts of the tensors it loaded."""
    reads: dict[str, tuple[int, int]] = field(default_factory=dict)
    """(bytes read, bytes needed) by the checkpoint's tensor key."""


@dataclass
class _Plan:
    """What this rank loads from one checkpoint."""

    man: Manifest
    targets: dict[str, Any]
    """DCP key -> the tensor its bytes go into (the ``into=`` one, or a fresh one)."""
    build: Callable[[], Any]
    """Makes the state once the targets are filled."""


def load_one(ckpt: Path, man: Manifest | None, into: Split | None, ranks: Ranks, *, trusted: bool,
             config: Config | None, device: Any = None) -> tuple[Loaded | None, str]:  # fmt: skip
    """(loaded, "") or (None, why ``ckpt`` must be skipped); raises what an older checkpoint would not fix.

    ``into``: ``parts.split(into, stored=False)``, the tensors to load into.
    ``device``: where the tensors that are not in ``into`` are made (default CPU).
    Every rank calls it for the same checkpoint.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    from ..dcp import StorageReader

    mine: Exception | None = None
    try:
        plan: _Plan | None = _plan(ckpt, man, into, ranks.rank, trusted, device)
        status: tuple[str, str] = ("ok", "")
    except (CheckpointCorrupt, StorageError) as e:
        plan, status = None, ("corrupt", f"rank {ranks.rank}: {e}")
    except Exception as e:  # bad into=, pickles, a dtype of a newer torch, or a bug: no rank may skip the gather
        plan, status, mine = None, ("fatal", f"rank {ranks.rank}: {type(e).__name__}: {e}"), e
    # Every rank must know before the collective load whether all can go on.
    statuses = ranks.all_gather(status)
    fatal = [why for kind, why in statuses if kind == "fatal"]
    if mine is not None:
        raise mine
    if fatal:
        raise ConfigError("another rank cannot load this checkpoint: " + "; ".join(fatal))
    bad = [why for kind, why in statuses if kind == "corrupt"]
    if bad:
        return None, "; ".join(bad)
    assert plan is not None
    reader = StorageReader(ckpt, config=config)
    reader.by_stored_key = True
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(plan.targets, storage_reader=reader, process_group=ranks.group, no_dist=ranks.dist is None,
                     planner=DefaultLoadPlanner(flatten_state_dict=False))  # fmt: skip
    except CheckpointException as e:
        errors = [f[0] if isinstance(f, tuple) else f for f in e.failures.values()]
        if errors and all(isinstance(x, (CheckpointCorrupt, StorageError)) for x in errors):
            return None, "; ".join(f"rank {r}: {x}" for r, x in zip(e.failures, errors, strict=True))
        raise
    state = plan.build()
    return Loaded(state, plan.man.step, ckpt, reader.bytes_read, reader.bytes_needed, reader.reads), ""


def load_checkpoint(ckpt: Path, man: Manifest, *, into: Any, group: RankGroup | None, trusted: bool,
                    device: Any = None, config: Config | None = None) -> Any:  # fmt: skip
    """The state of chunked checkpoint ``ckpt`` for ``Checkpointer.load_latest``.

    Collective over ``group`` (a placement's ranks; None: this process alone).
    Raises :class:`CheckpointCorrupt` on every rank when any rank found damage.
    """
    ranks = Ranks(group.pg) if group is not None else Ranks(alone=True)
    targets = split(into, allow_pickle=True, stored=False) if into is not None else None
    got, why = load_one(ckpt, man, targets, ranks, trusted=trusted, config=config, device=device)
    if got is None:
        raise CheckpointCorrupt(f"{ckpt}: {why}", ckpt)
    return got.state


def _plan(ckpt: Path, man: Manifest | None, into: Split | None, rank: int, trusted: bool,
          device: Any) -> _Plan:  # fmt: skip
    from ..dcp.index import global_index
    from ..store import verify_checkpoint

    if man is None:
        man = verify_checkpoint(ckpt, full=False)
    if not is_chunked(man):
        raise ConfigError(f"{ckpt} holds no DTensor state (it was written by Checkpointer.save of plain "
                          "tensors): load it with Checkpointer.load_latest")  # fmt: skip
    index = global_index(man)
    state_file = _small_file(man, STATE_FILE)
    if state_file is None:
        return _plan_dcp(ckpt, man, index, into.tensors if into else {}, trusted, device)
    doc = json.loads(_verified(ckpt, man, state_file))
    saved_world, trees = int(doc["world_size"]), doc["trees"]
    per_rank = set(doc["per_rank"])
    src = rank if rank < saved_world else 0
    if rank >= saved_world and (per_rank or len(trees) > 1):
        log.warning(
            "%s was saved by %d ranks; rank %d gets rank 0's per-rank values (%s)",
            ckpt, saved_world, rank, ", ".join(sorted(per_rank)[:3]) or "plain values",
        )  # fmt: skip
    tree = trees[src] if len(trees) > 1 else trees[0]
    wanted = list(dict.fromkeys(refs(tree)))
    given, copied = match_into(ckpt, tree, into.tree, into.tensors, into.copied) if into else ({}, {})
    _refuse_one_for_two(ckpt, given)
    targets: dict[str, Any] = {}
    stored_key: dict[str, str] = {}
    for k in wanted:
        key = stored_key[k] = f"{k}{PER_RANK}{src}" if k in per_rank else k
        entry = index.get(key)
        if entry is None or "chunks" not in entry:
            raise CheckpointCorrupt(f"{ckpt}: tensor {key!r} missing from the manifest", ckpt)
        targets[key] = _target(ckpt, k, entry, given, device)
    objects_blob = None
    objects_file = _small_file(man, OBJECTS_FILE)
    if objects_file is not None:
        if not trusted:
            raise UnsafeLoad(f"{ckpt} holds pickled objects, which can run code when loaded; "
                             "pass trusted=True only if you trust who wrote it")  # fmt: skip
        per = pickle.loads(_verified(ckpt, man, objects_file))  # trusted=True: the caller vouched for it
        mine: bytes = per[src] if len(per) > 1 else per[0]

        def objects_blob() -> bytes:
            return mine

    def build() -> Any:
        return decode_state(tree, lambda k: targets[stored_key[k]], objects_blob, trusted=trusted, copied=copied)

    return _Plan(man, targets, build)


def _plan_dcp(ckpt: Path, man: Manifest, index: dict[str, Any], into: dict[str, Any], trusted: bool,
              device: Any) -> _Plan:  # fmt: skip
    """A checkpoint written by ``dcp.save``: its structure from DCP's map of keys to paths."""
    from torch.distributed.checkpoint._nested_dict import unflatten_state_dict

    from ..dcp.index import metadata_of
    from ..dcp.ranged import RangeReader

    md = metadata_of(man, str(ckpt))
    tensors = [k for k, e in index.items() if "chunks" in e]
    _check_into(ckpt, into, tensors)
    targets = {k: _target(ckpt, k, index[k], into, device) for k in tensors}
    values: dict[str, Any] = {}
    with RangeReader(ckpt, man.files) as rr:
        for fqn, where in md.storage_data.items():
            if "bytes" in index.get(fqn.fqn, {}):
                values[fqn.fqn] = _unpickle(ckpt, fqn.fqn, rr.read_bytes(where), trusted)
    mapping = md.planner_data if isinstance(md.planner_data, dict) else {}

    def build() -> Any:
        flat = {**targets, **values}
        return unflatten_state_dict(flat, mapping) if mapping else flat

    return _Plan(man, targets, build)


def _unpickle(ckpt: Path, fqn: str, data: bytes, trusted: bool) -> Any:
    """A value ``dcp.save`` pickled (``torch.save``); only plain types unless ``trusted``."""
    import torch

    try:
        # trusted=True: the caller vouched for who wrote it; else only what weights_only allows.
        return torch.load(io.BytesIO(data), weights_only=not trusted)
    except pickle.UnpicklingError as e:
        raise UnsafeLoad(f"{ckpt}: value {fqn!r}, pickled by dcp.save, holds types that torch.load("
                         f"weights_only=True) refuses ({str(e).splitlines()[0]}); pass trusted=True only if "
                         "you trust who wrote it") from None  # fmt: skip


def _refuse_one_for_two(ckpt: Path, into: dict[str, Any]) -> None:
    """One tensor given for two saved apart: DCP's load would fill it in an order of its own."""
    seen: dict[int, str] = {}
    for key, t in into.items():
        if seen.setdefault(id(t), key) != key:
            raise ValueError(
                f"into= gives one tensor for both {seen[id(t)]!r} and {key!r}, which {ckpt} holds apart: "
                "load without into= and pass the result to set_state_dict() or load_state_dict()"
            )


def _check_into(ckpt: Path, into: dict[str, Any], wanted: list[str]) -> None:
    extra = sorted(set(into) - set(wanted))
    if extra:
        raise ValueError(
            f"into= holds {len(extra)} tensor(s) that {ckpt} does not, e.g. {extra[0]!r}: pass a state "
            "shaped like the saved one (saved as {'model': msd, 'optim': osd}, load with into={'model': msd, 'optim': osd})"
        )


def _target(ckpt: Path, key: str, entry: dict[str, Any], into: dict[str, Any], device: Any) -> Any:
    """The tensor that key ``key``'s bytes go into: ``into``'s, or a fresh one of the global shape."""
    import torch

    shape = [int(d) for d in entry["shape"]]
    t = into.get(key)
    if t is None:
        return torch.empty(shape, dtype=torch_dtype(entry["dtype"]), device=device)
    refuse_meta(ckpt, key, t)
    if list(t.shape) != shape:
        raise ValueError(f"cannot load {key!r} of {ckpt} into the tensor given for it: the checkpoint holds "
                         f"shape {shape}, the tensor is {list(t.shape)}; pass a matching state or load without into=")  # fmt: skip
    return t


def _small_file(man: Manifest, name: str) -> str | None:
    """Where ``state.json`` or ``objects.pkl`` is: at the top, or in rank 0's dir (rank 0 writes them)."""
    for where in (name, f"{shard_name(0)}/{name}"):
        if where in man.files:
            return where
    return None


def _verified(ckpt: Path, man: Manifest, name: str) -> bytes:
    path = ckpt / name
    try:
        data = read_small(path, _STATE_LIMIT)
    except OSError as e:
        raise storage_error(e, "cannot read", path) from e
    if f"{zlib.crc32(data):08x}" != man.files[name].checksum or len(data) != man.files[name].size:
        raise CheckpointCorrupt(f"{path}: checksum mismatch", path)
    return data

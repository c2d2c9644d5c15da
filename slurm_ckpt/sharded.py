"""Sharded states: DTensors, plain tensors and plain values in one checkpoint, loadable at any world size.

A state here is what ``Checkpointer.save`` takes (nested dicts, lists and
tuples of tensors and plain values) where tensors may be ``DTensor`` s, as
``get_state_dict`` returns them for an FSDP2 model and its optimizer::

    from slurm_ckpt import sharded
    msd, osd = get_state_dict(model, opt)
    sharded.save({"model": msd, "optim": osd, "step": step}, run_dir, step)     # every rank

    msd, osd = get_state_dict(model, opt)           # at the new world size
    got = sharded.load(run_dir, into={"model": msd, "optim": osd})
    set_state_dict(model, opt, model_state_dict=got.state["model"], optim_state_dict=got.state["optim"])

Every rank calls both (they are collective). The tensors go through DCP with
:class:`slurm_ckpt.dcp.StorageWriter`: each rank writes only its own shards,
and one checkpoint is committed for all. What is saved, and what comes back:

* a **DTensor** is one global tensor; a load reshards it to whatever the
  ``into=`` tensor at the same place is (any mesh, any placement), each rank
  reading only the blocks that hold its part;
* a **plain tensor** that is the same on every rank (a replicated buffer, an
  optimizer's ``step``) is stored once; one that differs between ranks (an
  RNG state) is stored per rank, and each rank gets its own back;
* **everything else** goes to ``state.json`` through the codec (never pickle,
  unless ``allow_pickle``), once if it is the same on every rank, else per rank.

A load at another world size gives a rank that did not exist at save time
rank 0's per-rank values, and says so in a warning: there is no right answer
for them (an RNG state of a rank that did not exist), and most trainers
reseed or recompute them.

Without ``into=``, a load returns every tensor whole (a plain CPU tensor of
the global shape), on every rank: the state as one process would have it,
for evaluation, export, or a world of one. With ``into=``, tensors found at
the same place in ``into`` are filled in place (what ``set_state_dict``
expects), others come back whole, and values come from the checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import warnings
import zlib
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .config import Config
from .errors import CheckpointCorrupt, ConfigError, StorageError, UnsafeLoad, storage_error
from .store import iter_valid, note_skip, verify_checkpoint
from .store.codec import decode_state, encode_state, is_dtensor, path_parts, torch_dtype
from .store.fsutil import read_small
from .store.layout import step_dir
from .store.manifest import MANIFEST, Manifest
from .store.verify import Skipped
from .store.writer import OBJECTS_FILE, STATE_FILE

__all__ = ["Loaded", "load", "save", "save_async"]

log = logging.getLogger("slurm_ckpt")

_PER_RANK = "#rank"
"""Suffix of a per-rank plain tensor's key: ``rng#rank3``."""
_STATE_LIMIT = 1 << 30


@dataclass(frozen=True)
class Loaded:
    """What :func:`load` returns."""

    state: Any
    step: int
    path: Path
    bytes_read: int = 0
    """Bytes this rank read from the checkpoint's data files."""
    bytes_needed: int = 0
    """The least this rank could have read: the bytes of its parts of the tensors it loaded."""
    reads: dict[str, tuple[int, int]] = field(default_factory=dict)
    """(bytes read, bytes needed) by the checkpoint's tensor key."""


# ------------------------------------------------------------------ ranks


class _Ranks:
    """This process's rank in ``group`` (or the default group), and object collectives on it."""

    def __init__(self, group: Any) -> None:
        import torch.distributed as dist

        self.dist = dist if dist.is_available() and dist.is_initialized() else None
        self.group = group
        self.rank = self.dist.get_rank(group) if self.dist else 0
        self.world = self.dist.get_world_size(group) if self.dist else 1

    def all_gather(self, obj: Any) -> list[Any]:
        if self.dist is None or self.world == 1:
            return [obj]
        out: list[Any] = [None] * self.world
        self.dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast(self, obj: Any) -> Any:
        if self.dist is None or self.world == 1:
            return obj
        box = [obj]
        self.dist.broadcast_object_list(box, group=self.group, group_src=0)
        return box[0]


# ------------------------------------------------------------------ the state's parts


@dataclass
class _Split:
    tree: Any
    tensors: dict[str, Any]
    """DCP key (the flattened name, as DCP's own ``model.0.weight``) -> tensor or DTensor."""
    objects: list[Any]


def _split(state: Any, *, allow_pickle: bool = False) -> _Split:
    """The state's values as a JSON tree whose tensors are ``{"$t": key}`` references.

    The same tensor object at two places (tied weights) is one key.
    """
    tensors: dict[str, Any] = {}
    by_id: dict[int, str] = {}

    def refer(t: Any, path: str) -> str:
        if id(t) in by_id:
            return by_id[id(t)]
        # The suffix marks per-rank copies, so a key of the state may not end in it.
        key = (".".join(path_parts(path)) or ".").replace(_PER_RANK, _PER_RANK + "'")
        while key in tensors:
            key += "'"
        tensors[key] = t
        by_id[id(t)] = key
        return key

    enc = encode_state(state, allow_pickle=allow_pickle, refer=refer)
    return _Split(enc.tree, tensors, enc.objects)


def _refs(tree: Any) -> Iterator[str]:
    """The tensor keys a tree refers to."""
    if isinstance(tree, list):
        for v in tree:
            yield from _refs(v)
    elif isinstance(tree, dict):
        if len(tree) == 1:
            ((tag, val),) = tree.items()
            if tag in ("$t", "$np"):
                yield val
                return
        for v in tree.values():
            yield from _refs(v)


def _digest(t: Any) -> tuple[str, tuple[int, ...], str]:
    """What says whether two ranks' plain tensors are the same value."""
    from .store.tensorfile import tensor_bytes

    if is_dtensor(t):  # its data pointer is the wrapper's (0): there are no bytes to compare
        raise TypeError("a DTensor is one global tensor, not a value of each rank")

    c = t.detach().to("cpu").contiguous()
    return str(c.dtype), tuple(c.shape), f"{zlib.crc32(tensor_bytes(c)):08x}"


def _one_or_each(values: list[Any]) -> list[Any]:
    """``[v]`` when every rank has the same ``v``, else one per rank."""
    return values[:1] if all(v == values[0] for v in values) else values


# ------------------------------------------------------------------ save


def _prepare(state: Any, run_dir: str | os.PathLike[str], step: int, *, allow_pickle: bool, keep: int | None,
             config: Config | None, process_group: Any, lock_timeout: float | None) -> tuple[dict[str, Any], Any, _Ranks]:  # fmt: skip
    """DCP's flat state and our writer for one save; a collective (digests and trees are gathered)."""
    from .dcp import StorageWriter

    ranks = _Ranks(process_group)
    split = _split(state, allow_pickle=allow_pickle)
    plain = {k: _digest(t) for k, t in split.tensors.items() if not is_dtensor(t)}
    tree = json.dumps(split.tree, separators=(",", ":"), allow_nan=False)
    objects = pickle.dumps(split.objects, protocol=pickle.HIGHEST_PROTOCOL) if split.objects else b""
    gathered = ranks.all_gather((plain, tree, objects))
    # A plain tensor is stored once when every rank holds the same value, else per rank.
    per_rank = sorted({k for p, _, _ in gathered for k in p if any(q.get(k) != p[k] for q, _, _ in gathered)})
    flat = {(f"{k}{_PER_RANK}{ranks.rank}" if k in per_rank else k): t for k, t in split.tensors.items()}
    trees = _one_or_each([t for _, t, _ in gathered])
    doc = {"world_size": ranks.world, "per_rank": per_rank, "trees": [json.loads(t) for t in trees]}
    files = {STATE_FILE: json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()}
    blobs = _one_or_each([o for _, _, o in gathered])
    if any(blobs):
        # Each rank's own pickle, kept as bytes: a load unpickles only the one it uses.
        files[OBJECTS_FILE] = pickle.dumps(blobs, protocol=pickle.HIGHEST_PROTOCOL)
    writer = StorageWriter(run_dir, step=step, keep=keep, config=config, lock_timeout=lock_timeout,
                           files=files if ranks.rank == 0 else None, extra={"sharded": 1})  # fmt: skip
    return flat, writer, ranks


def save(
    state: Any,
    run_dir: str | os.PathLike[str],
    step: int,
    *,
    allow_pickle: bool = False,
    keep: int | None = None,
    config: Config | None = None,
    process_group: Any = None,
    lock_timeout: float | None = 0,
) -> Path:
    """Save ``state`` as checkpoint ``step`` of ``run_dir``; every rank calls it, and
    each writes only its own shards. Returns once the checkpoint is committed.

    ``process_group``: the group of the ranks that save (default: the default
    group; a gloo group of their own keeps these collectives apart from NCCL's).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    flat, writer, _ = _prepare(state, run_dir, step, allow_pickle=allow_pickle, keep=keep, config=config,
                               process_group=process_group, lock_timeout=lock_timeout)  # fmt: skip
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(flat, storage_writer=writer, process_group=process_group,
                 planner=DefaultSavePlanner(flatten_state_dict=False))  # fmt: skip
    return step_dir(Path(run_dir).absolute(), step)


def save_async(
    state: Any,
    run_dir: str | os.PathLike[str],
    step: int,
    *,
    allow_pickle: bool = False,
    keep: int | None = None,
    config: Config | None = None,
    process_group: Any = None,
    lock_timeout: float | None = 0,
) -> Future[Path]:
    """:func:`save` in the background (``dcp.async_save``): returns once the state is
    copied; the future's result is the committed checkpoint's path.

    Give it a process group that training does not use: its collectives run on a thread.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    flat, writer, _ = _prepare(state, run_dir, step, allow_pickle=allow_pickle, keep=keep, config=config,
                               process_group=process_group, lock_timeout=lock_timeout)  # fmt: skip
    where = step_dir(Path(run_dir).absolute(), step)
    out: Future[Path] = Future()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        inner = dcp.async_save(flat, storage_writer=writer, process_group=process_group,
                               planner=DefaultSavePlanner(flatten_state_dict=False))  # fmt: skip
    upload = inner.upload_completion if hasattr(inner, "upload_completion") else inner

    def done(f: Any) -> None:
        err = f.exception()
        if err is None:
            out.set_result(where)
        else:
            out.set_exception(err)

    upload.add_done_callback(done)
    return out


# ------------------------------------------------------------------ load


def load(
    path: str | os.PathLike[str],
    *,
    into: Any = None,
    process_group: Any = None,
    trusted: bool = False,
    search: Sequence[str | os.PathLike[str]] = (),
    config: Config | None = None,
    skipped: list[Skipped] | None = None,
) -> Loaded | None:
    """Load the newest checkpoint every rank can read from run dir ``path`` (or the
    checkpoint ``path`` names), at this world size; None if there is none.

    Collective. ``into``: a state shaped like the saved one whose tensors are
    filled in place (see the module's docstring). A checkpoint with a damaged
    block on any rank is skipped by all ranks together, and the next older one
    loaded (into the same tensors). ``search``: more run dirs (a scratch tier).
    """
    ranks = _Ranks(process_group)
    root = Path(path).absolute()
    from .dcp.writer import parse_checkpoint_id

    exact = parse_checkpoint_id(root)
    if exact is not None and not (root / MANIFEST).exists() and step_dir(*exact).is_dir():
        root = step_dir(*exact)
    one = (root / MANIFEST).exists()
    cands = None
    if ranks.rank == 0:
        cands = iter([root]) if one else (c.path for c in iter_valid([*map(Path, search), root], full=False, skipped=skipped))
    into_keys = _split(into, allow_pickle=True).tensors if into is not None else {}
    while True:
        where = ranks.broadcast(str(next(cands, None) or "") if cands is not None else None)
        if not where:
            return None
        ckpt = Path(where)
        got, why = _load_one(ckpt, into_keys, ranks, trusted, config, process_group)
        if got is not None:
            return got
        note_skip(ckpt, why, skipped)
        if one:
            raise CheckpointCorrupt(f"{ckpt}: {why}", ckpt)


def _load_one(ckpt: Path, into: dict[str, Any], ranks: _Ranks, trusted: bool, config: Config | None,
              process_group: Any) -> tuple[Loaded | None, str]:  # fmt: skip
    """(loaded, "") or (None, why it must be skipped); raises what an older checkpoint would not fix."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    from .dcp import StorageReader

    mine: Exception | None = None
    try:
        plan = _plan(ckpt, into, ranks.rank, trusted)
        status: tuple[str, str] = ("ok", "")
    except (CheckpointCorrupt, StorageError) as e:
        plan, status = None, ("corrupt", f"rank {ranks.rank}: {e}")
    except (ConfigError, ValueError, UnsafeLoad) as e:
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
    man, targets, refs, tree, objects_blob = plan
    reader = StorageReader(ckpt, config=config)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(targets, storage_reader=reader, process_group=process_group,
                     planner=DefaultLoadPlanner(flatten_state_dict=False))  # fmt: skip
    except CheckpointException as e:
        errors = [f[0] if isinstance(f, tuple) else f for f in e.failures.values()]
        if errors and all(isinstance(x, (CheckpointCorrupt, StorageError)) for x in errors):
            return None, "; ".join(f"rank {r}: {x}" for r, x in zip(e.failures, errors, strict=True))
        raise
    def load_tensor(key: str) -> Any:
        return targets[refs[key]]

    state = decode_state(tree, load_tensor, objects_blob, trusted=trusted)
    return Loaded(state, man.step, ckpt, reader.bytes_read, reader.bytes_needed, reader.reads), ""


def _plan(ckpt: Path, into: dict[str, Any], rank: int,
          trusted: bool) -> tuple[Manifest, dict[str, Any], dict[str, str], Any, Any]:  # fmt: skip
    """What this rank loads from ``ckpt``: (manifest, DCP targets by stored key, the stored key
    of each key its tree refers to, its tree, its objects)."""
    import torch

    from .dcp.index import is_dcp

    man = verify_checkpoint(ckpt, full=False)
    if not is_dcp(man):
        raise ConfigError(f"{ckpt} was written by Checkpointer.save, not slurm_ckpt.sharded.save: "
                          "load it with Checkpointer.load_latest")  # fmt: skip
    if STATE_FILE not in man.files:
        raise ConfigError(f"{ckpt} was written by dcp.save, not slurm_ckpt.sharded.save: load it with "
                          "dcp.load and slurm_ckpt.dcp.StorageReader")  # fmt: skip
    doc = json.loads(_verified(ckpt, man, STATE_FILE))
    saved_world, trees = int(doc["world_size"]), doc["trees"]
    per_rank = set(doc["per_rank"])
    src = rank if rank < saved_world else 0
    if rank >= saved_world and (per_rank or len(trees) > 1):
        log.warning(
            "%s was saved by %d ranks; rank %d gets rank 0's per-rank values (%s)",
            ckpt, saved_world, rank, ", ".join(sorted(per_rank)[:3]) or "plain values",
        )  # fmt: skip
    tree = trees[src] if len(trees) > 1 else trees[0]
    wanted = list(dict.fromkeys(_refs(tree)))
    extra = sorted(set(into) - set(wanted))
    if extra:
        raise ValueError(
            f"into= holds {len(extra)} tensor(s) that {ckpt} does not, e.g. {extra[0]!r}: pass a state "
            "shaped like the saved one (saved as {'model': msd, 'optim': osd}, load with into={'model': msd, 'optim': osd})"
        )
    targets: dict[str, Any] = {}
    refs: dict[str, str] = {}
    for k in wanted:
        key = refs[k] = f"{k}{_PER_RANK}{src}" if k in per_rank else k
        entry = man.tensors.get(key)
        if entry is None or "chunks" not in entry:
            raise CheckpointCorrupt(f"{ckpt}: tensor {key!r} missing from the manifest", ckpt)
        shape = [int(d) for d in entry["shape"]]
        t = into.get(k)
        if t is None:
            t = torch.empty(shape, dtype=torch_dtype(entry["dtype"]))
        elif list(t.shape) != shape:
            raise ValueError(f"cannot load {k!r} of {ckpt} into the tensor given for it: the checkpoint holds "
                             f"shape {shape}, the tensor is {list(t.shape)}; pass a matching state or load without into=")  # fmt: skip
        targets[key] = t
    objects_blob = None
    if OBJECTS_FILE in man.files:
        if not trusted:
            raise UnsafeLoad(f"{ckpt} holds pickled objects, which can run code when loaded; "
                             "pass trusted=True only if you trust who wrote it")  # fmt: skip
        per = pickle.loads(_verified(ckpt, man, OBJECTS_FILE))  # trusted=True: the caller vouched for it
        mine: bytes = per[src] if len(per) > 1 else per[0]

        def objects_blob() -> bytes:
            return mine

    return man, targets, refs, tree, objects_blob


def _verified(ckpt: Path, man: Manifest, name: str) -> bytes:
    path = ckpt / name
    try:
        data = read_small(path, _STATE_LIMIT)
    except OSError as e:
        raise storage_error(e, "cannot read", path) from e
    if f"{zlib.crc32(data):08x}" != man.files[name].checksum or len(data) != man.files[name].size:
        raise CheckpointCorrupt(f"{path}: checksum mismatch", path)
    return data

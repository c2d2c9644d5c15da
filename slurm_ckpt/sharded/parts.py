"""A sharded state's parts: its tensors by key, its plain values, and which of them each rank owns.

What one save stores (:func:`prepare`, a collective):

* ``flat``: every tensor by its DCP key, the flattened path (``model.0.weight``):
  DTensors as they are (DCP's planner splits them into chunks), a plain
  tensor that is the same on every rank once, one that differs once per rank
  under ``<key>#rank<N>``;
* ``files``: ``state.json`` (the state's JSON trees, whose tensors are
  ``{"$t": key}`` references, once if every rank's tree is the same, else one
  per rank) and, only with ``allow_pickle``, ``objects.pkl``. Rank 0 writes them.
"""

from __future__ import annotations

import json
import pickle
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..store.codec import array_tensor, copied_into, encode_state, into_tree, is_dtensor, path_parts
from ..store.writer import OBJECTS_FILE, STATE_FILE

__all__ = ["PER_RANK", "Prepared", "Ranks", "Split", "holds_dtensor", "prepare", "refs", "split"]

PER_RANK = "#rank"
"""Suffix of a per-rank plain tensor's key: ``rng#rank3``."""


class Ranks:
    """This process's rank in ``group`` (or the default group), and object collectives on it.

    ``alone``: act as a world of one whatever ``torch.distributed`` says (a
    Checkpointer whose ranks save on their own).
    """

    def __init__(self, group: Any = None, *, alone: bool = False) -> None:
        import torch.distributed as dist

        up = not alone and dist.is_available() and dist.is_initialized()
        self.dist = dist if up else None
        self.group = group
        self.alone = alone
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


@dataclass
class Split:
    tree: Any
    tensors: dict[str, Any]
    """DCP key (the flattened name, as DCP's own ``model.0.weight``) -> tensor or DTensor."""
    objects: list[Any]
    copied: dict[str, Any]
    """Split to be matched: the arrays loaded through copies, by key (``IntoTree.copied``)."""


def split(state: Any, *, allow_pickle: bool = False, stored: bool = True) -> Split:
    """The state's values as a JSON tree whose tensors are ``{"$t": key}`` references.

    The same tensor object at two places (tied weights) is one key. ``stored``: false
    for ``into=``, split to be matched (:func:`~slurm_ckpt.store.codec.into_tree`), not stored.
    """
    tensors: dict[str, Any] = {}
    copied: dict[str, Any] = {}
    by_id: dict[int, str] = {}

    def refer(t: Any, path: str) -> str:
        if id(t) in by_id:
            return by_id[id(t)]
        # The suffix marks per-rank copies, so a key of the state may not end in it.
        key = (".".join(path_parts(path)) or ".").replace(PER_RANK, PER_RANK + "'")
        while key in tensors:
            key += "'"
        tensors[key] = _as_tensor(t, into=not stored)
        if not stored and tensors[key] is not t and copied_into(t, tensors[key]):
            copied[key] = t
        by_id[id(t)] = key
        return key

    if not stored:
        return Split(into_tree(state, refer=refer).tree, tensors, [], copied)
    enc = encode_state(state, allow_pickle=allow_pickle, refer=refer)
    return Split(enc.tree, tensors, enc.objects, copied)


def _as_tensor(t: Any, into: bool = False) -> Any:
    """A NumPy array (NumPy's RNG state) as a tensor: it is stored as a chunk like any
    plain tensor, in C order, and the tree's ``$np`` gives it back as an array.
    ``into``: the tensor to load it into, over the array's own memory wherever torch
    can view that (see ``array_tensor``)."""
    return array_tensor(t, into) if type(t).__module__ == "numpy" else t


def holds_dtensor(state: Any) -> bool:
    """Whether ``state`` (nested dicts, lists, tuples) holds a DTensor anywhere."""
    import sys

    if "torch.distributed.tensor" not in sys.modules:  # nothing made one: no need to look
        return False
    todo = [state]
    while todo:
        obj = todo.pop()
        if isinstance(obj, dict):
            todo.extend(obj.values())
        elif isinstance(obj, (list, tuple)):
            todo.extend(obj)
        elif is_dtensor(obj):
            return True
    return False


def refs(tree: Any) -> Iterator[str]:
    """The tensor keys a tree refers to."""
    if isinstance(tree, list):
        for v in tree:
            yield from refs(v)
    elif isinstance(tree, dict):
        if len(tree) == 1:
            ((tag, val),) = tree.items()
            if tag in ("$t", "$np"):
                yield val
                return
        for v in tree.values():
            yield from refs(v)


def _digest(t: Any) -> tuple[str, tuple[int, ...], str]:
    """What says whether two ranks' plain tensors are the same value."""
    from ..store.tensorfile import tensor_bytes

    if is_dtensor(t):  # its data pointer is the wrapper's (0): there are no bytes to compare
        raise TypeError("a DTensor is one global tensor, not a value of each rank")

    c = t.detach().to("cpu").contiguous()
    return str(c.dtype), tuple(c.shape), f"{zlib.crc32(tensor_bytes(c)):08x}"


def _one_or_each(values: list[Any]) -> list[Any]:
    """``[v]`` when every rank has the same ``v``, else one per rank."""
    return values[:1] if all(v == values[0] for v in values) else values


@dataclass
class Prepared:
    """What one rank contributes to one save (see the module docstring)."""

    flat: dict[str, Any]
    files: dict[str, bytes]
    ranks: Ranks


def prepare(state: Any, ranks: Ranks, *, allow_pickle: bool) -> Prepared:
    """The flat state and the small files of one save; a collective (digests and trees are gathered)."""
    parts = split(state, allow_pickle=allow_pickle)
    plain = {k: _digest(t) for k, t in parts.tensors.items() if not is_dtensor(t)}
    tree = json.dumps(parts.tree, separators=(",", ":"), allow_nan=False)
    objects = pickle.dumps(parts.objects, protocol=pickle.HIGHEST_PROTOCOL) if parts.objects else b""
    gathered = ranks.all_gather((plain, tree, objects))
    # A plain tensor is stored once when every rank holds the same value, else per rank.
    per_rank = sorted({k for p, _, _ in gathered for k in p if any(q.get(k) != p[k] for q, _, _ in gathered)})
    flat = {(f"{k}{PER_RANK}{ranks.rank}" if k in per_rank else k): t for k, t in parts.tensors.items()}
    trees = _one_or_each([t for _, t, _ in gathered])
    doc = {"world_size": ranks.world, "per_rank": per_rank, "trees": [json.loads(t) for t in trees]}
    files = {STATE_FILE: json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()}
    blobs = _one_or_each([o for _, _, o in gathered])
    if any(blobs):
        # Each rank's own pickle, kept as bytes: a load unpickles only the one it uses.
        files[OBJECTS_FILE] = pickle.dumps(blobs, protocol=pickle.HIGHEST_PROTOCOL)
    return Prepared(flat, files, ranks)

"""Loading ``into=`` a caller's state: its tensors matched by place to the saved ones, and checked.

``into_tree`` walks ``into=`` to the shape of a saved tree (tensors and arrays as
references, containers as the encoder nests them); ``match_into`` pairs them by
place; ``plan_into`` checks each pair (shape, meta device) and says which
targets a reader may fill in place and which overlap in memory (``overlapping``).
"""

from __future__ import annotations

import json
import sys
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any, NamedTuple

from .encode import encode_state
from .tags import (
    _MAX_JSON_INT_BITS,
    _escape,
    _package,
    _tensor_dtype,
    array_tensor,
    copied_into,
    is_dtensor,
    torch_dtype_name,
    transposed,
)

_PLAIN = (bool, int, float, complex, str, bytes, bytearray, set, PurePath)
"""Values that are never a tensor's place (a ``torch.Size`` is a tuple, not a container)."""

__all__ = ["IntoPlan", "IntoTree", "into_tree", "match_into", "overlapping", "plan_into", "refuse_meta", "tensor_refs"]


@dataclass
class IntoTree:
    """``into=`` as a tree to match by place against a saved one."""

    tree: Any
    tensors: dict[str, Any] = field(default_factory=dict)
    """Its tensors (a NumPy array's: over its memory, or a copy) by its own keys."""
    copied: dict[str, Any] = field(default_factory=dict)
    """The writable arrays whose memory no tensor can view (negative strides, a field
    of a record array), by key: their ``tensors`` are over copies, whose loaded
    values :func:`~slurm_ckpt.store.codec.decode_state` copies back."""


def into_tree(into: Any, refer: Callable[[Any, str], str] | None = None) -> IntoTree:
    """``into``'s tensors and arrays as ``{"$t": key}`` and ``{"$np": key}``, nested in
    lists and dicts as the encoder nests them (a dict whose keys are not all plain
    strings as ``$items`` pairs, its keys as the encoder writes them), so that
    :func:`match_into` finds each at its place. Other values are None, or
    ``{"$pickle": 0}`` where they are objects no tensor can stand for.

    ``refer(tensor, path)``, when given, takes every tensor and array (DTensors
    too) and returns its key: the sharded loader keys them by DCP's names.
    """
    torch: Any = sys.modules.get("torch")
    np: Any = sys.modules.get("numpy")
    tensor_type = getattr(torch, "Tensor", ())
    lazy = torch.nn.parameter.UninitializedTensorMixin if torch else ()
    out = IntoTree(None)
    memo: dict[int, dict[str, str]] = {}

    def ref(obj: Any, path: str, tag: str) -> dict[str, str]:
        if id(obj) in memo:  # one object at two places: one key, as saved ties are
            return memo[id(obj)]
        if refer is not None:
            key = refer(obj, path)
        else:
            key = path or "/"
            while key in out.tensors:
                key += "'"
            t = obj if tag == "$t" else array_tensor(obj, into=True)
            out.tensors[key] = t
            if tag == "$np" and copied_into(obj, t):
                out.copied[key] = obj
        memo[id(obj)] = {tag: key}
        return memo[id(obj)]

    def walk(obj: Any, path: str) -> Any:
        if isinstance(obj, tensor_type):
            if isinstance(obj, lazy):
                # It has no memory yet, and torch raises at any look at its storage.
                raise ValueError(
                    f"into= holds an uninitialized parameter or buffer of a lazy module (nn.LazyLinear, say) at "
                    f"{path or '/'}, which has no memory to load into: load without into= and pass the module's "
                    "part of the result to its load_state_dict(), which initializes it"
                )
            if refer is None and (obj.layout != torch.strided or obj.is_nested or is_dtensor(obj)):
                raise ValueError(f"into= holds at {path or '/'} a tensor of layout {obj.layout} (or a DTensor), "
                                 "which cannot be loaded into as a plain tensor: load without into=")  # fmt: skip
            return ref(obj, path, "$t")
        if isinstance(obj, dict):
            if all(type(k) is str and not k.startswith("$") for k in obj):
                return {k: walk(v, f"{path}/{_escape(k)}") for k, v in obj.items()}
            return {"$items": [[_key(k), walk(v, f"{path}/{_escape(str(k))}")] for k, v in obj.items()]}
        if isinstance(obj, list) or type(obj) is tuple:
            return [walk(v, f"{path}/{i}") for i, v in enumerate(obj)]
        if _package(obj) == "argparse" and type(obj).__qualname__ == "Namespace":
            return walk(dict(vars(obj)), path)
        if np is not None and isinstance(obj, np.ndarray):
            if type(obj) is not np.ndarray or not _tensor_dtype(obj.dtype):
                return {"$pickle": 0}  # a masked array, strings, big-endian: no tensor to read into
            return ref(obj, path, "$np")
        if obj is None or isinstance(obj, _PLAIN) or (np is not None and isinstance(obj, np.generic)) or (
                torch is not None and isinstance(obj, (torch.dtype, torch.device, torch.Size))):  # fmt: skip
            return None  # a plain value: nothing to load into
        return {"$pickle": 0}

    try:
        out.tree = walk(into, "")
    except RecursionError:
        raise ValueError("into= is nested deeper than Python's recursion limit, or holds itself: "
                         "pass a state shaped like the saved one") from None  # fmt: skip
    return out


def _key(k: Any) -> Any:
    """A dict key as the encoder writes it, so that :func:`match_into` pairs it with the saved one."""
    if isinstance(k, str):
        return str.__str__(k)  # a str Enum's member is stored as its str
    if isinstance(k, int) and not isinstance(k, bool) and k.bit_length() <= _MAX_JSON_INT_BITS:
        return int(k)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # what a save would say of it, not of a load
        return encode_state(k, allow_pickle=True).tree


def tensor_refs(tree: Any, flipped: set[str] | None = None) -> dict[str, dict[str, Any] | None]:
    """Every tensor object a tree refers to, by key: its ``$view`` record, or
    None for one stored whole (``$t``, ``$np``, ``$npT``: the data file's header
    says its dtype and shape). ``flipped`` gets the keys of the ``$npT`` ones."""
    out: dict[str, dict[str, Any] | None] = {}

    def walk(obj: Any) -> None:
        if isinstance(obj, list):
            for v in obj:
                walk(v)
        elif isinstance(obj, dict):
            if len(obj) == 1:
                (tag, val), = obj.items()
                if tag in ("$t", "$np", "$npT"):
                    out[val] = None
                    if tag == "$npT" and flipped is not None:
                        flipped.add(val)
                    return
                if tag == "$view":
                    out[val["key"]] = val
                    return
            for v in obj.values():
                walk(v)

    walk(tree)
    return out


def _ref_key(node: Any) -> str | None:
    """The key of the tensor or array a tree node refers to; None if it is none."""
    if type(node) is not dict or len(node) != 1:
        return None
    key = node.get("$t") or node.get("$np") or node.get("$npT")  # the first: the common one
    if key is None and type(view := node.get("$view")) is dict:
        key = view.get("key")
    return key if type(key) is str else None


def _children(node: Any) -> dict[Any, Any] | None:
    """A container's children by place: a list's and a tuple's by index, a dict's by
    its key as encoded (so that 1 and "1" are two places), of any kind of dict."""
    if isinstance(node, list):
        return dict(enumerate(node))
    if not isinstance(node, dict):
        return None
    if len(node) == 1:
        (tag, val), = node.items()
        bodies = {"$odict": 0, "$defaultdict": 1}
        if tag in bodies and isinstance(val, list) and len(val) == 2:
            return _children(val[bodies[tag]])
        if tag in ("$counter", "$namespace", "$tuple"):
            return _children(val)
        if tag == "$items" and isinstance(val, list):
            # A str key as in a plain dict; any other as its JSON, apart from every str.
            return {k if isinstance(k, str) else ("$", json.dumps(k, sort_keys=True)): v
                    for k, v in (kv for kv in val if isinstance(kv, list) and len(kv) == 2)}  # fmt: skip
        if tag.startswith("$"):
            return None  # a leaf: a number, bytes, a pickle
    return node


def match_into(where: Any, saved: Any, into: Any, tensors: Mapping[str, Any],
               copied: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:  # fmt: skip
    """``into``'s tensors and the arrays that get their values, by the key of the saved
    tensor at the same place in ``saved`` (checkpoint ``where``'s tree), in ``into``'s
    order. ``into``: the tree of ``into=`` (:func:`into_tree`), whose ``tensors``
    and ``copied`` are by its own keys.

    Matched by place, not by a key made of the path: keys that print alike (1 and
    "1") still pair right in another order, and one tensor given at two places gets
    both saved ones, copied in in turn. A tensor at a place where the checkpoint has
    none, or two given where one was saved, is a ``ValueError`` naming it.
    """
    targets: dict[str, Any] = {}
    given: dict[str, str] = {}
    places: dict[str, Any] = {}  # where each saved tensor was first given, for messages
    # A place is (key, its container's place): made into text only for a message.
    todo: list[tuple[Any, Any, Any]] = [(saved, into, None)]
    while todo:
        s, i, place = todo.pop()
        mine = _ref_key(i)
        if mine is None:
            children = _children(i)
            if children:
                theirs = _children(s) or {}
                todo.extend([(theirs.get(k), v, (k, place)) for k, v in reversed(children.items())])
            elif isinstance(i, dict) and "$pickle" in i and _ref_key(s) is not None:
                # A value no tensor can hold (a big-endian array): nothing to load into.
                raise ValueError(
                    f"into= holds at {_place(place)} a value that cannot be loaded into, where {where} holds a "
                    "tensor or array: pass a tensor (or a native-order NumPy array) there, or load without into="
                )
            continue
        key = _ref_key(s)
        if key is None:
            # It would keep its old values without a word, and a trainer that relies
            # on into= would train on from them.
            raise ValueError(
                f"into= holds a tensor at {_place(place)} where {where} holds none: pass a state shaped like the "
                "saved one (saved as {'model': model.state_dict(), ...}, load with into={'model': "
                "model.state_dict()})"
            )
        if mine in copied and not (isinstance(s, dict) and ("$np" in s or "$npT" in s)):
            # Its values would reach it from a saved array only: here they would stay in its copy.
            raise ValueError(
                f"into= holds at {_place(place)} a NumPy array that torch cannot view (negative strides, a "
                f"field of a record array), where {where} holds a tensor: pass a tensor there, or a copy "
                "(np.ascontiguousarray(a)) that you copy back"
            )
        if given.setdefault(key, mine) != mine and not _same_tensor(tensors[given[key]], tensors[mine]):
            # Which one would get the values, and which the returned state would hold?
            raise ValueError(
                f"{where} holds one tensor at both {_place(places[key])} and {_place(place)} (one object at both "
                "places when saved, as tied weights are), and into= gives two there: tie them as they were, or "
                "load without into= and pass the result to load_state_dict()"
            )
        places.setdefault(key, place)
        targets[key] = tensors[given[key]]
    return targets, {key: copied[mine] for key, mine in given.items() if mine in copied}


def _place(place: Any) -> str:
    """A place in ``into`` as Python subscripts it (``into['model']['w']``): a dict's
    key or a list's index as Python writes it, a key of another kind as stored (its JSON)."""
    out = []
    while place is not None:
        key, place = place
        out.append(key[1] if isinstance(key, tuple) else repr(key))
    return "into" + "".join(f"[{k}]" for k in reversed(out))


def _same_tensor(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` show the same values from the same memory (a tied weight's
    two ``detach()``es): one filled is the other filled."""
    if is_dtensor(a) or is_dtensor(b):
        if not (is_dtensor(a) and is_dtensor(b) and a.placements == b.placements and a.device_mesh == b.device_mesh
                and a.shape == b.shape and a.stride() == b.stride()):  # fmt: skip
            return False
        a, b = a.to_local(), b.to_local()
    if not a.numel():  # no memory to tell them apart by
        return a is b
    return bool(a.dtype == b.dtype and a.device == b.device and a.shape == b.shape and a.stride() == b.stride()
                and a.data_ptr() == b.data_ptr() and a.is_conj() == b.is_conj() and a.is_neg() == b.is_neg())  # fmt: skip


def overlapping(targets: Mapping[str, Any]) -> set[str]:
    """The keys of targets whose memory overlaps another target's (tied weights given
    separately, views of one buffer): reads straight into them would race, and
    copies into them must go in order, the last one's values staying."""
    spans = []
    for key, t in targets.items():
        if not (n := t.nbytes):
            continue
        lo = t.data_ptr()
        if not t.is_contiguous():  # from its lowest element to its highest: all the bytes it can touch
            steps = [(d - 1) * s for d, s in zip(t.shape, t.stride(), strict=True)]
            size = t.element_size()
            lo, n = lo + sum(min(0, x) for x in steps) * size, (sum(abs(x) for x in steps) + 1) * size
        spans.append(("" if t.is_cpu else str(t.device), lo, lo + n, key))
    spans.sort()
    out: set[str] = set()
    device, reach, last = "", -1, ""
    for on, lo, hi, key in spans:
        if on != device:
            device, reach = on, -1
        if lo < reach:
            out.update((key, last))
        if hi > reach:
            reach, last = hi, key
    return out


def refuse_meta(ckpt: Any, key: str, t: Any) -> None:
    """A tensor on the meta device has no memory: copying into it does nothing, and
    a load into it would hand it back unchanged."""
    if t.is_meta:
        raise ValueError(
            f"cannot load {key!r} of {ckpt} into a tensor on the meta device, which has no memory: "
            "load without into= and pass the result to model.load_state_dict(..., assign=True), "
            "or materialize the model first (model.to_empty(device='cpu'))"
        )


class IntoPlan(NamedTuple):
    """What a load ``into=`` fills, by the saved tensors' keys."""

    targets: dict[str, Any]
    """``into``'s tensors, in ``into``'s order."""
    whole: set[str]
    """Those stored whole and of the saved dtype: a reader may fill them in place."""
    copied: dict[str, Any]
    """The arrays that get their targets' values (``IntoTree.copied``)."""
    shared: set[str]
    """Those copied in last, in ``into``'s order: their memory overlaps another's."""


def plan_into(ckpt: Any, tree: Any, into: Any, index: Mapping[str, Any]) -> IntoPlan:
    """The targets of ``into`` in checkpoint ``ckpt`` (its ``tree`` and its manifest's tensor
    ``index``), each checked against the saved tensor at its place."""
    if into is None:
        return IntoPlan({}, set(), {}, set())
    given = into_tree(into)
    targets, copied = match_into(ckpt, tree, given.tree, given.tensors, given.copied)
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
        info = view if view is not None else index.get(key, {})
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
    return IntoPlan(targets, whole, copied, shared)


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

"""(JSON tree, data-file entries) -> state: the decoder, which rebuilds what ``torch.load`` gives."""

from __future__ import annotations

import base64
import binascii
import contextlib
import pickle
import re
from collections import Counter, OrderedDict, defaultdict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from ...errors import CheckpointCorrupt, UnsafeLoad
from .into import overlapping
from .tags import (
    _FACTORY_BY_NAME,
    _NP_SCALAR_KINDS,
    _newer_dtype,
    _torch,
    namespace,
    resolved,
    torch_dtype,
)

__all__ = ["decode_state"]

_T = TypeVar("_T")


def decode_state(
    tree: Any,
    load_tensor: Callable[[str], Any],
    objects_blob: Callable[[], bytes] | None,
    *,
    trusted: bool = False,
    place: Callable[[str], str] | None = None,
    into: Mapping[str, Any] | None = None,
    copied: Mapping[str, Any] | None = None,
    shared: set[str] | None = None,
) -> Any:
    """Rebuild a state from its JSON tree; ``load_tensor(key)`` returns a data-file entry.

    ``place(saved device)``: the device a tensor saved there goes to (a
    ``map_location``); None leaves every tensor where it was read. Numpy
    arrays stay in host memory. ``into``: tensors by key to copy the loaded
    values into and return instead (those the reader already filled in place
    come back as they are). Where ``into``'s tensors overlap in memory, they are
    copied into last, in ``into``'s order, as ``load_state_dict`` copies: where
    they overlap, the last one's values stay (``shared``: their keys, where the
    caller knows them already). ``copied``: NumPy arrays by key
    (``EncodedState.copied``) that get the values their targets in ``into`` were
    loaded with, and are returned in their place.
    """
    tensors: dict[str, Any] = {}
    views: dict[str, Any] = {}
    arrays: dict[tuple[str, bool], Any] = {}
    moved: dict[tuple[str, str], Any] = {}
    objects: list[Any] | None = None
    targets = into or {}
    copies = copied or {}
    if shared is None:
        shared = overlapping(targets)
    last: dict[str, Any] = {}  # what the shared targets get, copied in at the end
    late: dict[str, Any] = {}  # the targets of copied arrays among them, as the arrays are shaped

    def tensor(key: str) -> Any:
        if key not in tensors:
            tensors[key] = load_tensor(key)
        return tensors[key]

    def filled(key: str, t: Any) -> Any:
        target = targets.get(key)
        if target is None or target is t:
            return t
        if key in shared:  # its source is fresh memory, or a target's that no shared one overlaps
            last[key] = t
            return target
        return target.copy_(t)

    def view(rec: dict[str, Any]) -> Any:
        key = rec["key"]
        if key not in views:
            views[key] = filled(key, _rebuild(rec, storage_of(rec)))
        return views[key]

    def storage_of(rec: dict[str, Any]) -> Any:
        base = tensor(rec["of"])
        # An into= tensor copied into holds the saved values, but not laid out as the
        # storage's bytes when it is strided or has a lazy bit: views take a copy.
        if not base.is_contiguous() or base.is_conj() or base.is_neg():
            base = resolved(base).contiguous()
        return placed(rec["of"], base, rec.get("device", "cpu"), rec["key"])

    def placed(entry: str, base: Any, saved: str, key: str) -> Any:
        """Data-file entry ``entry`` (``base``) on the device a tensor saved on ``saved`` goes to."""
        # A tensor copied into an into= tensor stays where it is read: the copy moves it.
        if place is None or key in targets:
            return base
        device = place(saved)
        if str(base.device) == device:
            return base
        if (entry, device) not in moved:
            moved[entry, device] = _to_device(base, device, key, saved)
        return moved[entry, device]

    def array(key: str, flip: bool) -> Any:
        if (key, flip) not in arrays:
            a = filled(key, tensor(key)).numpy()
            a = a.T if flip else a
            if key in copies:  # the caller's array, which no tensor could view: given the values
                if key in shared:
                    late[key] = a  # once its target is copied into, at the end
                else:
                    copies[key][...] = a
                a = copies[key]
            arrays[key, flip] = a
        return arrays[key, flip]

    def dec(obj: Any) -> Any:
        nonlocal objects
        if isinstance(obj, list):
            return [dec(v) for v in obj]
        if not isinstance(obj, dict):
            return obj
        if len(obj) == 1:
            (tag, val), = obj.items()
            if tag == "$t":  # saved on the CPU
                return filled(val, placed(val, tensor(_of(str, tag, val)), "cpu", val))
            if tag == "$view":
                return view(_view_record(val))
            if tag in ("$np", "$npT"):
                return array(_of(str, tag, val), tag == "$npT")
            if tag == "$tuple":
                return tuple(dec(v) for v in _of(list, tag, val))
            if tag == "$set":
                try:
                    return {dec(v) for v in _of(list, tag, val)}
                except TypeError:  # an element that cannot be in a set
                    raise CheckpointCorrupt(f"state.json: a bad set {val!r:.80}") from None
            if tag == "$npscalar":
                return _np_scalar(val)
            if tag == "$complex":
                if not (isinstance(val, list) and len(val) == 2):
                    raise CheckpointCorrupt(f"state.json: a bad complex number {val!r:.80}")
                return complex(_number(val[0]), _number(val[1]))
            if tag == "$items":
                pairs = _of(list, tag, val)
                if not all(isinstance(kv, list) and len(kv) == 2 for kv in pairs):
                    raise CheckpointCorrupt(f"state.json: a bad items {val!r:.80}")
                try:
                    return {_hashable(dec(k)): dec(v) for k, v in pairs}
                except TypeError:  # a key that cannot be a dict key
                    raise CheckpointCorrupt(f"state.json: a bad items {val!r:.80}") from None
            if tag in ("$counter", "$defaultdict"):
                return _dict_of_kind(tag, val, dec)
            if tag == "$namespace":
                return _namespace(dec(val))
            if tag == "$odict":
                if len(pair := _of(list, tag, val)) != 2:
                    raise CheckpointCorrupt(f"state.json: a bad odict {val!r:.80}")
                body, meta = (dec(v) for v in pair)
                if not isinstance(body, dict):
                    raise CheckpointCorrupt(f"state.json: a bad odict {val!r:.80}")
                od = OrderedDict(body)
                if meta is not None:
                    od._metadata = meta  # type: ignore[attr-defined]
                return od
            if tag in _LEAVES:
                return _leaf(tag, val)
            if tag == "$pickle":
                if not trusted:
                    raise UnsafeLoad(
                        "this checkpoint holds pickled objects, which can run code when "
                        "loaded; pass trusted=True only if you trust who wrote it"
                    )
                if objects is None:
                    assert objects_blob is not None
                    objects = pickle.loads(objects_blob())  # opt-in, documented as trusted-only
                return objects[val]
        return {k: dec(v) for k, v in obj.items()}

    out = dec(tree)
    for key in (k for k in targets if k in last):
        targets[key].copy_(last[key])
        if key in late:
            copies[key][...] = late[key]
    return out


def _rebuild(rec: dict[str, Any], base: Any) -> Any:
    """The tensor ``rec`` describes, on the storage of ``base`` (a data-file entry).

    Built as ``torch.load`` builds tensors (an empty tensor ``set_`` to the
    storage), so it is no view of ``base`` and has no ``_base``. A record torch
    refuses (outside its storage, a grad on ints) is damage.
    """
    try:
        return _rebuilt(rec, base)
    except (KeyError, RuntimeError) as e:
        raise CheckpointCorrupt(f"state.json: a bad view {rec!r:.80}: {e}") from None


def _rebuilt(rec: dict[str, Any], base: Any) -> Any:
    import torch

    dtype = torch_dtype(rec["dtype"])
    storage = base.untyped_storage()
    offset = int(rec["offset"])
    start = base.storage_offset() * base.element_size()  # an entry inside a mapped file
    if start:
        if start % dtype.itemsize:
            storage, start = base.clone().untyped_storage(), 0
        offset += start // dtype.itemsize
    shape, stride = rec["shape"], rec["stride"]
    # set_ would grow a resizable storage to fit, with bytes that were never saved.
    last = offset + sum((n - 1) * st for n, st in zip(shape, stride, strict=True)) if all(shape) else -1
    if (last + 1) * dtype.itemsize > storage.nbytes():
        raise RuntimeError("it lies outside its storage")
    t = torch.empty(0, dtype=dtype, device=storage.device).set_(storage, offset, shape, stride)
    # Set on the tensor itself, as torch.load does: conj() would make a view with a _base.
    if rec.get("conj"):
        torch._C._set_conj(t, True)
    if rec.get("neg"):
        torch._C._set_neg(t, True)
    if rec.get("parameter"):
        return torch.nn.Parameter(t, requires_grad=bool(rec.get("requires_grad")))
    if rec.get("requires_grad"):
        t.requires_grad_()
    return t


def _to_device(t: Any, device: str, key: str, saved: str) -> Any:
    try:
        return t.to(device)
    except (RuntimeError, AssertionError) as e:
        where = f"saved on {device}" if saved == device else f"saved on {saved}, to go to {device}"
        raise ValueError(
            f"tensor {key!r} was {where}, which this process cannot use ({e}); pass map_location "
            "(e.g. map_location='cpu') to load the checkpoint onto a device it has"
        ) from None


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, list) else key


def _dict_of_kind(tag: str, val: Any, dec: Callable[[Any], Any]) -> Any:
    """The ``Counter`` or ``defaultdict`` a ``$counter`` or ``$defaultdict`` tag holds."""
    if tag == "$counter":
        name, body = None, val
    elif isinstance(val, list) and len(val) == 2 and (val[0] is None or isinstance(val[0], str)):
        name, body = val
    else:
        name = body = None
    items = dec(body)
    if not isinstance(items, dict) or name not in _FACTORY_BY_NAME:
        raise CheckpointCorrupt(f"state.json: a bad {tag[1:]} {val!r:.80}")
    return Counter(items) if tag == "$counter" else defaultdict(_FACTORY_BY_NAME[name], items)


def _of(kind: type[_T], tag: str, val: Any) -> _T:
    """``val``, the value of ``tag``, if it is a ``kind``; damage otherwise."""
    if not isinstance(val, kind):
        raise CheckpointCorrupt(f"state.json: a bad {tag[1:]} {val!r:.80}")
    return val


def _str(val: Any) -> str:
    if not isinstance(val, str):
        raise TypeError("not a string")
    return val


def _one_of(val: Any, allowed: tuple[str, ...]) -> str:
    if val not in allowed:
        raise ValueError("not one of the values written")
    return str(val)


def _int64s(val: Any, least: int = -(2**63)) -> list[int]:
    """A list of ints (not bools) of at least ``least`` that fit in int64: a ``torch.Size``
    (negative entries too), or with ``least=0`` a shape or strides."""
    if not isinstance(val, list) or not all(type(d) is int and least <= d < 2**63 for d in val):
        raise ValueError("not a list of int64s")
    return val


_VIEW_FIELDS = {"key": str, "of": str, "dtype": str, "shape": list, "stride": list, "offset": int}


def _view_record(rec: Any) -> dict[str, Any]:
    """A ``$view`` record with every field it needs, of its type (``_rebuild`` checks the rest)."""
    try:
        ok = (isinstance(rec, dict) and all(type(rec.get(k)) is t for k, t in _VIEW_FIELDS.items())
              and len(_int64s(rec["stride"], 0)) == len(_int64s(rec["shape"], 0)) and rec["offset"] >= 0)  # fmt: skip
    except ValueError:
        ok = False
    if not ok:
        raise CheckpointCorrupt(f"state.json: a bad view {rec!r:.80}")
    return rec


def _dtype(name: Any) -> Any:
    torch = _torch()
    # From the module's own names: getattr would import a lazy submodule a name happens to match.
    name = _str(name)
    dtype = vars(torch).get(name)
    if dtype is None and re.fullmatch(r"[a-z][a-z0-9_]*", name):
        # A dtype of a newer torch than this one (state.json's checksum held, so the
        # writer put it there): not damage, which would pass over the checkpoint.
        raise _newer_dtype(f"the dtype torch.{name}")
    if not isinstance(dtype, torch.dtype):
        raise ValueError("not a torch dtype")
    return dtype


_LEAVES: dict[str, Callable[[Any], Any]] = {
    "$bytes": lambda v: base64.b64decode(_str(v), validate=True),
    "$bytearray": lambda v: bytearray(base64.b64decode(_str(v), validate=True)),
    "$float": lambda v: float(_one_of(v, ("nan", "inf", "-inf"))),
    "$int": lambda v: int(_str(v), 16),
    "$dtype": _dtype,
    "$device": lambda v: _torch().device(_str(v)),
    "$size": lambda v: _torch().Size(_int64s(v)),
    "$path": lambda v: Path(_str(v)),
}
"""The tags whose value is a plain JSON value, with what each decodes to."""


def _leaf(tag: str, val: Any) -> Any:
    """The value of a ``_LEAVES`` tag; a malformed one is damage, never a value built from it."""
    try:
        return _LEAVES[tag](val)
    except (TypeError, ValueError, RuntimeError, binascii.Error):
        raise CheckpointCorrupt(f"state.json: a bad {tag[1:]} {val!r:.80}") from None



def _namespace(attrs: Any) -> Any:
    """The ``argparse.Namespace`` a ``$namespace`` tag holds."""
    if not isinstance(attrs, dict):
        raise CheckpointCorrupt(f"state.json: a bad namespace {attrs!r:.80}")
    return namespace(attrs)


def _np_scalar(val: Any) -> Any:
    """The numpy scalar a ``$npscalar`` tag holds (``CheckpointCorrupt`` if it is malformed)."""
    import numpy as np

    try:
        dtype_str, value = val
        dtype = np.dtype(dtype_str) if isinstance(dtype_str, str) else None
    except (TypeError, ValueError):
        dtype = None
    if dtype is None or dtype.kind not in _NP_SCALAR_KINDS:
        raise CheckpointCorrupt(f"state.json: a bad numpy scalar {val!r:.80}")
    if isinstance(value, dict) and isinstance(raw := value.get("$bytes"), str) and len(value) == 1:
        data = base64.b64decode(raw)
        if len(data) == dtype.itemsize:
            return np.frombuffer(data, dtype=dtype)[0]
    elif dtype.kind in "biuf" and type(value) in (bool, int, float):
        with contextlib.suppress(OverflowError):
            x = dtype.type(value)
            if x == value:
                return x
    raise CheckpointCorrupt(f"state.json: a numpy {dtype_str} scalar that is not one: {value!r:.80}")


def _number(v: Any) -> float:
    """A part of a ``$complex``: a JSON number or a ``$float`` (``CheckpointCorrupt`` otherwise)."""
    if type(v) in (int, float):
        return float(v)
    if isinstance(v, dict) and set(v) == {"$float"} and v["$float"] in ("nan", "inf", "-inf"):
        return float(v["$float"])
    raise CheckpointCorrupt(f"state.json: a complex number with a part that is not a number: {v!r:.80}")

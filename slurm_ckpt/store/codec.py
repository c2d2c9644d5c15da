"""State <-> (JSON tree, tensors): the safe encoding of a checkpoint's contents.

A state is nested dicts, lists and tuples of tensors and plain values. Tensor
bytes leave the tree and go to safetensors-layout data files, one entry per
storage; everything else becomes JSON in ``state.json``. JSON values that JSON
cannot say natively are tagged objects with a single ``$``-key:

=================  ==========================================================
``{"$t": key}``     a tensor stored whole under ``key`` in a data file: a CPU
                    tensor that was all of its own storage, contiguous
``{"$view": {}}``   any other tensor: a view of the storage stored under
                    ``of``, placed as torch places it (``dtype``, ``shape``,
                    ``stride``, ``offset`` in elements), with ``device``,
                    ``requires_grad``, ``parameter``, ``conj`` and ``neg``
                    (the lazy conjugate and negative bits) when they are set;
                    ``key`` names the tensor object
``{"$np": key}``    a numpy array, stored whole as a tensor
``{"$npT": key}``   a numpy array in Fortran order (the transpose of one, say), as
                    pickle keeps it: stored whole as its transpose, in C order
``{"$npscalar":     a numpy scalar (``np.float32(0.5)``), as its dtype
[dtype, v]}``       (``"<f4"``) and its value: a JSON number where that gives
                    back the same bits, else ``{"$bytes": ...}`` of its bytes
``{"$tuple": []}``  a tuple
``{"$size": []}``   a ``torch.Size``
``{"$complex":      a complex number
[re, im]}``
``{"$items": []}``  a dict whose keys are not all plain strings (e.g. the int
                    keys of an optimizer state_dict), as ``[key, value]`` pairs
``{"$odict": []}``  an ``OrderedDict`` (a model's state_dict), as ``[dict, metadata]``:
                    the dict as above, and its ``_metadata`` (the module versions
                    ``load_state_dict`` passes on) or null
``{"$counter": d}`` a ``Counter``, its dict as above
``{"$namespace":    an ``argparse.Namespace``, its attributes as a dict as above
d}``
``{"$path": s}``    a ``pathlib.Path`` (of this system's flavour)
``{"$defaultdict":  a ``defaultdict`` whose ``default_factory`` is a builtin type
[factory, d]}``     (``"list"``) or None; one of another factory is stored as a
                    plain dict, as are other dict subclasses (an ``OrderedDict``
                    subclass as an ``OrderedDict``), with a warning
``{"$bytes": b64}`` bytes; ``{"$bytearray": b64}`` a bytearray
``{"$set": []}``    a set
``{"$device": s}``  a ``torch.device``
``{"$float": s}``   ``nan``, ``inf`` or ``-inf``
``{"$int": hex}``   an int too big for a JSON number (Python refuses to print
                    ints over 4300 digits in decimal; hex has no such limit)
``{"$dtype": s}``   a ``torch.dtype``
``{"$pickle": i}``  object ``i`` of ``objects.pkl`` (opt-in, trusted input only)
=================  ==========================================================

Storages and tensor objects keep the relations ``torch.save`` keeps, so a load
gives what ``torch.load`` gives: each storage is stored once and whole, and
comes back as one storage of its own that every tensor saved on it views again
(tied weights, views of one buffer), at the same offsets and strides; the same
tensor object at several places comes back as one object. A storage is stored
as the tensor that covers all of it when there is one (so ``safe_open`` shows
that tensor), else as its bytes, 1-D.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import functools
import json
import math
import pickle
import re
import sys
import warnings
from collections import Counter, OrderedDict, defaultdict, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from ..errors import CheckpointCorrupt, UnsafeLoad, UnsupportedValue

_T = TypeVar("_T")

__all__ = [
    "EncodedState",
    "TensorEntry",
    "array_tensor",
    "copied_into",
    "decode_state",
    "encode_state",
    "is_dtensor",
    "match_into",
    "namespace",
    "overlapping",
    "path_parts",
    "resolved",
    "st_dtype",
    "tensor_refs",
    "torch_dtype",
    "torch_dtype_name",
    "transposed",
]

# safetensors' dtype names. The float8 ones: FP8 training's on NVIDIA GPUs (torch
# >= 2.1), on AMD's (FNUZ, torch >= 2.2), and the MX formats' scales (E8M0, torch
# >= 2.7). C128 is ours: safetensors has no complex128. torch's float4_e2m1fn_x2 is
# left out: safetensors' F4 counts 4-bit values where torch's dtype counts pairs of
# them, so its shape in the header would not be the tensor's.
_DTYPES = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16",
    "I32": "int32", "U32": "uint32", "I64": "int64", "U64": "uint64",
    "F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
    "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2FNUZ": "float8_e5m2fnuz", "F8_E8M0": "float8_e8m0fnu",
    "C64": "complex64", "C128": "complex128",
}  # fmt: skip
_TORCH_TO_ST = {v: k for k, v in _DTYPES.items()}
_MAX_JSON_INT_BITS = 10_000
"""About 3000 decimal digits, safely under Python's 4300-digit str() limit."""


def torch_dtype(name: str) -> Any:
    """The torch dtype for a safetensors dtype name (``KeyError`` for one not known here).

    ``ImportError`` where this torch lacks it: an older torch than the one that
    saved, not a damaged checkpoint, so no reader may take it for one and pass
    over the checkpoint for an older step (readers turn the other errors of a
    bad header into :class:`CheckpointCorrupt`).
    """
    import torch

    dtype = getattr(torch, _DTYPES[name], None)
    if dtype is None:
        raise _newer_dtype(f"{name} tensors (torch.{_DTYPES[name]})")
    return dtype


def _newer_dtype(what: str) -> ImportError:
    """The error for ``what``, a dtype this torch lacks: a newer torch saved it."""
    import torch

    return ImportError(f"this checkpoint holds {what}, which torch {torch.__version__} lacks: upgrade torch to load it")


def torch_dtype_name(name: Any) -> str:
    """``torch.float32`` for ``F32``, for messages; an unknown name as it is."""
    return f"torch.{_DTYPES[name]}" if name in _DTYPES else str(name)


@functools.cache
def _st_name(dtype: Any) -> str | None:
    return _TORCH_TO_ST.get(str(dtype).removeprefix("torch."))


def st_dtype(dtype: Any, where: str = "", *, scalar: bool = False) -> str:
    """The safetensors dtype name for a torch dtype; :class:`UnsupportedValue` if it has
    none, its message starting with ``where`` (the tensor's place in the state).
    ``scalar``: the tensor is 0-dim, which views as bytes only once it has a dimension."""
    st = _st_name(dtype)
    if st is None:
        name = str(dtype).removeprefix("torch.")
        if name.startswith(("qint", "quint")):
            # Not the bytes' view, as for the others: .view() of a quantized tensor kills the process.
            quantization = ("its quantization (t.q_scale() and t.q_zero_point(), or t.q_per_channel_scales(), "
                            "t.q_per_channel_zero_points() and t.q_per_channel_axis())")  # fmt: skip
            if name in ("quint4x2", "quint2x4"):  # int_repr() packs these; their few values dequantize exactly
                fix = (f"store t.dequantize() and {quantization}, and quantize it again with those after "
                       "loading, which gives back the same integers")  # fmt: skip
            else:  # not dequantize(): float32 cannot hold every qint32
                fix = (f"store t.int_repr() and {quantization}, and rebuild it after loading with "
                       "torch._make_per_tensor_quantized_tensor (or _make_per_channel_quantized_tensor)")  # fmt: skip
        elif scalar and dtype.itemsize > 1:
            fix = (f"store a copy of its bytes, t.reshape(1).view(torch.uint8), and view them back "
                   f"with .view(torch.{name}).reshape(()) after loading, or cast it")  # fmt: skip
        else:
            fix = (f"store a copy of its bytes, t.contiguous().view(torch.uint8), and view them back "
                   f"with .view(torch.{name}) after loading, or cast it")  # fmt: skip
        raise UnsupportedValue(f"{where + ': ' if where else ''}tensor dtype {name} cannot be stored: {fix}")
    return st


def contiguous_strides(shape: list[int]) -> list[int]:
    """The strides torch gives a new contiguous tensor of ``shape``."""
    out = [0] * len(shape)
    step = 1
    for i in range(len(shape) - 1, -1, -1):
        out[i] = step
        step *= max(shape[i], 1)
    return out


@dataclass
class TensorEntry:
    """One entry of a data file (a tensor, or a storage's bytes). ``tensor`` is CPU and contiguous."""

    key: str
    tensor: Any
    dtype: str
    shape: list[int]

    @functools.cached_property
    def nbytes(self) -> int:
        # Cached: the layout asks each tensor for it several times, each
        # time through two torch accessors.
        return int(self.tensor.numel() * self.tensor.element_size())


@dataclass
class EncodedState:
    tree: Any
    tensors: list[TensorEntry] = field(default_factory=list)
    objects: list[Any] = field(default_factory=list)
    leaves: dict[str, Any] = field(default_factory=dict)
    """Every tensor object of the state by its key (views included), as given."""
    copied: dict[str, Any] = field(default_factory=dict)
    """Encoded to be matched: the writable NumPy arrays whose memory no tensor can
    view (negative strides, a field of a record array), by key; their ``leaves``
    are tensors over copies, whose loaded values :func:`decode_state` copies back."""

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def _escape(part: str) -> str:
    return part.replace("%", "%25").replace("/", "%2F")


def path_parts(path: str) -> list[str]:
    """The keys and indices of a value's ``path`` in the state (``/model/0.weight`` -> model, 0.weight)."""
    return [p.replace("%2F", "/").replace("%25", "%") for p in path.split("/")[1:]]


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (without importing torch.distributed)."""
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(t, mod.DTensor)


@dataclass(slots=True)
class _Leaf:
    """A tensor object of the state and the tag object that stands for it in the tree."""

    key: str
    tensor: Any
    ref: dict[str, Any]
    nbytes: int
    """Of the tensor's storage."""


def _is_whole(t: Any, nbytes: int) -> bool:
    """Whether ``t`` is all of its storage, in order: its bytes are the storage's bytes."""
    if t.storage_offset() or t.nbytes != nbytes or not t.is_contiguous():
        return False
    # is_contiguous() ignores the strides of dims of size 0 and 1; torch.load does not.
    shape = t.shape
    return (1 not in shape and 0 not in shape) or list(t.stride()) == contiguous_strides(list(shape))


def _plain(t: Any) -> bool:
    """A tensor ``{"$t": key}`` says all about: a plain CPU tensor that needs no grad,
    whose values are its bytes (no lazy conjugate or negative bit)."""
    return type(t) is _torch().Tensor and not t.requires_grad and t.is_cpu and not t.is_conj() and not t.is_neg()


def resolved(t: Any) -> Any:
    """``t`` with its lazy conjugate and negative bits applied to its data (a copy
    only where one is set): for writers that store a tensor's values as bytes
    with no record of the bits (DCP's chunks)."""
    return t.resolve_conj().resolve_neg()


def _bytes_as_stored(t: Any) -> Any:
    """``t`` without its lazy conjugate and negative bits: a view over the same
    bytes, so that a copy of it (a staging copy) copies the bytes, not the values
    the bits make of them. The ``$view`` record keeps the bits."""
    if t.is_conj():
        t = t.conj()  # clears the bit of a conjugate view: no data is touched
    if t.is_neg():
        t = _torch()._neg_view(t)
    return t


def encode_state(
    state: Any,
    *,
    allow_pickle: bool = False,
    prepare: Callable[[Any], Any] | None = None,
    refer: Callable[[Any, str], str] | None = None,
    stored: bool = True,
) -> EncodedState:
    """Split ``state`` into a JSON tree and a list of data-file entries.

    ``stored``: false where a state is encoded to be matched (an ``into=``
    target), not stored: then no warning says which subclasses (of dict, list,
    str, int, float) were stored as plain values, tensors on the meta device
    and of dtypes that cannot be stored are taken, and no data-file entries are
    made (the result's ``leaves`` are what such a caller needs).

    ``prepare`` maps each entry's tensor to the CPU contiguous tensor that will
    be written (the engine passes its staging copy here); by default tensors are
    moved to the CPU and made contiguous, copying only when needed.

    ``refer(tensor, path)``, when given, takes every tensor (DTensors and numpy
    arrays too) instead of the entry list, and returns the key the tree refers
    to it by: the sharded path (``slurm_ckpt.sharded``) stores them itself.
    """
    out = EncodedState(tree=None)
    plain: list[str] = []  # what was stored as a plain value, by path (a dict subclass as a dict)
    torch_mod = sys.modules.get("torch")  # no tensor without it
    tensor_type, strided = getattr(torch_mod, "Tensor", None), getattr(torch_mod, "strided", None)
    lazy = torch_mod.nn.parameter.UninitializedTensorMixin if torch_mod else ()  # a lazy module's, not yet run
    memo: dict[int, dict[str, Any]] = {}  # id(tensor or array) -> its tag object
    refs = [0]  # tensor, array and pickle references made so far (a set may hold none)
    attributed: set[int] = set()  # id(tensor) of those with Python attributes, said once
    storages: dict[int, list[_Leaf]] = {}  # storage -> the tensors on it, in order
    # safetensors reserves "__metadata__" for its own header entry.
    keys: set[str] = {"__metadata__"}

    def new_key(path: str) -> str:
        key = path.lstrip("/") or "."
        while key in keys:
            key += "'"
        keys.add(key)
        return key

    def entry(key: str, t: Any) -> None:
        data = prepare(t) if prepare else t.detach().to("cpu").contiguous()
        out.tensors.append(TensorEntry(key, data, st_dtype(t.dtype), list(t.shape)))

    def tensor_ref(t: Any, path: str) -> dict[str, Any]:
        refs[0] += 1
        if isinstance(t, lazy):
            # A lazy module's parameter before its first forward: no shape and no
            # memory yet, and torch raises at any look at its storage, without
            # saying where in the state it is.
            if stored:
                raise UnsupportedValue(
                    f"{path or '/'}: an uninitialized parameter or buffer of a lazy module (nn.LazyLinear, say) has "
                    "no data to save: run one forward pass (a dummy batch) before the first save"
                )
            raise ValueError(
                f"into= holds an uninitialized parameter or buffer of a lazy module (nn.LazyLinear, say) at {path or '/'}, "
                "which has no memory to load into: load without into= and pass the module's part of the "
                "result to its load_state_dict(), which initializes it"
            )
        if stored and t.is_meta:
            # No memory behind it: its bytes would be read from address 0. torch.save
            # keeps only its shape, so a resume would train on from weights never saved.
            raise UnsupportedValue(
                f"{path or '/'}: a tensor on the meta device has no data to save: materialize "
                "the module first (module.to_empty(device=...), then initialize it), or leave "
                "the tensor out of the state"
            )
        if t.is_nested:
            raise UnsupportedValue(f"{path or '/'}: a nested tensor cannot be stored; "
                                   "store its components (list(t.unbind()))")  # fmt: skip
        if stored and t.__dict__ and id(t) not in attributed:
            # torch.save pickles them; a tag has no room for values that may need a pickle.
            # Private ones are frameworks' marks (torch.compile marks optimizer states).
            attributed.add(id(t))
            names = ", ".join(sorted(n for n in map(str, t.__dict__) if not n.startswith("_")))
            if names:
                plain.append(f"{path or '/'}: a {type(t).__name__} without its Python attributes ({names})")
        if refer is not None:
            return {"$t": refer(t, path)}
        if type(t) is not tensor_type and is_dtensor(t):
            # Its storage is a wrapper with no data of its own, and its local shard
            # alone would be saved as if it were the whole tensor.
            raise UnsupportedValue(
                f"{path or '/'}: a DTensor (FSDP2, tensor parallel) cannot be saved as a plain "
                "tensor: save sharded states with slurm_ckpt.sharded.save, or with dcp.save and "
                "storage_writer=slurm_ckpt.dcp.StorageWriter(run_dir, step=N)"
            )
        ref = memo.get(id(t))
        if ref is None:
            if stored:
                st_dtype(t.dtype, path or "/", scalar=t.dim() == 0)  # an unstorable dtype fails here, naming it and where
            ref = memo[id(t)] = {}
            storage = t.untyped_storage()
            leaf = _Leaf(new_key(path), t, ref, int(storage.nbytes()))
            out.leaves[leaf.key] = t
            if not stored:  # to be matched by place (match_into): no entry, no view record
                ref["$t"] = leaf.key
            # One group per storage, as torch.save keys them (the storage object,
            # not its address: two storages over one buffer are saved twice).
            storages.setdefault(storage._cdata, []).append(leaf)
        return ref

    def array_ref(a: Any, path: str) -> dict[str, Any]:
        refs[0] += 1
        if refer is not None:  # DCP's chunks: in C order, the one order DCP reads a tensor's bytes in
            return {"$np": refer(a, path)}
        # Arrays are stored whole, each on its own, as pickle stores them: in C
        # order, but for one in Fortran order (and not also in C order), which
        # pickle keeps so, and which is stored as its transpose, in C order. An
        # into= target is taken in its own shape: the loader turns it to the saved one.
        fortran = stored and a.flags.f_contiguous and not a.flags.c_contiguous
        tag, whole = ("$npT", a.T) if fortran else ("$np", a)
        ref = memo.get(id(a))
        if ref is None:
            key = new_key(path)
            t = array_tensor(whole, into=not stored)
            out.leaves[key] = t
            if not stored and copied_into(a, t):
                out.copied[key] = a
            entry(key, t)
            ref = memo[id(a)] = {tag: key}
        return ref

    def enc(obj: Any, path: str, key: bool = False) -> Any:
        if type(obj) is tensor_type and obj.layout is strided:  # the common leaf, first
            return tensor_ref(obj, path)
        if obj is None or isinstance(obj, (bool, str)):
            if type(obj) is str or type(obj) is bool or obj is None:
                return obj
            if _package(obj) != "numpy":  # np.str_ is a str to every reader: said in docs/loading.md
                plain.append(_plain_note(obj, path))  # a str Enum's member, say
            return str.__str__(obj)
        if isinstance(obj, int):
            if type(obj) is not int:
                plain.append(_plain_note(obj, path))  # an IntEnum's or IntFlag's member, say
            return int(obj) if obj.bit_length() <= _MAX_JSON_INT_BITS else {"$int": hex(obj)}
        if type(obj) is float:  # np.float64 is a float too: it is kept below
            if math.isfinite(obj):
                return obj
            return {"$float": repr(obj)}
        tname = _package(obj)
        if tname == "torch":
            import torch

            if isinstance(obj, torch.Tensor):
                if obj.layout != torch.strided and not obj.is_nested:
                    raise UnsupportedValue(f"{path or '/'}: a tensor of layout {obj.layout} cannot be "
                                           f"stored; store {_layout_part(obj.layout)}")  # fmt: skip
                return tensor_ref(obj, path)
            if isinstance(obj, torch.dtype):
                return {"$dtype": str(obj).removeprefix("torch.")}
            if isinstance(obj, torch.device):
                return {"$device": str(obj)}
            if isinstance(obj, torch.Size):
                return {"$size": [int(d) for d in obj]}
        if tname == "numpy":
            import numpy as np

            if type(obj) is np.ndarray and _tensor_dtype(obj.dtype):
                # Not a subclass (a masked array): stored as a plain array, it would lose its mask.
                return array_ref(obj, path)
            if isinstance(obj, np.generic) and obj.dtype.kind in _NP_SCALAR_KINDS:
                # Kept a numpy scalar, not turned into a Python one: arithmetic
                # on an np.float32 rounds to float32, on a float to float64, so
                # a resumed loop would drift from the one that saved.
                return {"$npscalar": [obj.dtype.str, _np_scalar_value(obj)]}
        if isinstance(obj, float):  # a subclass: numpy's are kept above
            plain.append(_plain_note(obj, path))
            return enc(float(obj), path)
        if isinstance(obj, complex):
            return {"$complex": [enc(obj.real, path), enc(obj.imag, path)]}
        if isinstance(obj, dict):
            # type(k) is str: a key of a str subclass (a str Enum's member) goes through
            # enc with the other keys, which stores it as a str and says so.
            if all(type(k) is str and not k.startswith("$") for k in obj):
                body: Any = {k: enc(v, f"{path}/{_escape(k)}") for k, v in obj.items()}
            else:
                body = {"$items": [[enc(k, f"{path}/$key", key=True), enc(v, f"{path}/{_escape(str(k))}")]
                                   for k, v in obj.items()]}  # fmt: skip
            if type(obj) is Counter:
                return {"$counter": body}
            if type(obj) is defaultdict and _factory_kept(obj.default_factory):
                return {"$defaultdict": [_FACTORIES[obj.default_factory], body]}
            if type(obj) not in (dict, OrderedDict):
                plain.append(_plain_note(obj, path))
            if isinstance(obj, OrderedDict):
                meta = getattr(obj, "_metadata", None)
                return {"$odict": [body, None if meta is None else enc(meta, f"{path}/$metadata")]}
            return body
        if isinstance(obj, list):
            if type(obj) is not list:
                plain.append(_plain_note(obj, path))
            return [enc(v, f"{path}/{i}") for i, v in enumerate(obj)]
        if isinstance(obj, tuple) and type(obj) is tuple:
            return {"$tuple": [enc(v, f"{path}/{i}") for i, v in enumerate(obj)]}
        if type(obj) is _PATH:
            return {"$path": str(obj)}  # a Path given on a command line, as "args" often hold one
        if tname == "argparse" and type(obj).__qualname__ == "Namespace":
            # The parsed command line many training scripts save as "args": its
            # attributes, as a dict, and no code to run to rebuild it.
            return {"$namespace": enc(dict(vars(obj)), path)}
        if isinstance(obj, (bytes, bytearray)):
            tag = "$bytearray" if type(obj) is bytearray else "$bytes"
            return {tag: base64.b64encode(bytes(obj)).decode("ascii")}
        if type(obj) is set:
            before = refs[0]
            items = [enc(v, f"{path}/{i}") for i, v in enumerate(obj)]
            if refs[0] != before:
                # A tensor hashes by identity: which saved one a loaded one stands for
                # (for into=, for DCP) would depend on the set's order in each process.
                raise UnsupportedValue(f"{path or '/'}: a set holding a tensor or a pickled object; "
                                       "store a list instead")  # fmt: skip
            return {"$set": items}
        if allow_pickle:
            refs[0] += 1
            out.objects.append(obj)
            return {"$pickle": len(out.objects) - 1}
        if key:  # say which, and a fix that is hashable
            where, fix = f"{path.removesuffix('/$key') or '/'}, the key {obj!r:.60}", _key_instead(obj)
        else:
            where, fix = path or "/", _instead(obj)
        raise UnsupportedValue(f"{where}: cannot store {_what(obj)} safely; "
                               f"{fix}, or pass allow_pickle=True (trusted input only)")

    try:
        out.tree = enc(state, "")
    except RecursionError:  # torch.save keeps a cycle; the tree cannot hold one
        raise UnsupportedValue(_too_deep(state)) from None
    for group in storages.values() if stored else ():
        _store(group, entry)
    if plain and stored:
        more = f" (and {len(plain) - 3} more)" if len(plain) > 3 else ""
        warnings.warn(f"stored as plain ones, these load as such: {'; '.join(plain[:3])}{more}", UserWarning,
                      stacklevel=3)  # fmt: skip
    return out


def _store(group: list[_Leaf], entry: Callable[[str, Any], None]) -> None:
    """Write one storage's entry and fill in the tags of the tensors on it."""
    first, nbytes = group[0].tensor, group[0].nbytes
    if len(group) == 1 and _plain(first) and _is_whole(first, nbytes):
        group[0].ref["$t"] = group[0].key  # the common case: a tensor with its own storage
        entry(group[0].key, first)
        return
    # Stored as the tensor that covers the whole storage, if one does, else as
    # the storage's bytes, in the dtype of the tensors on it if they agree.
    whole = next((leaf for leaf in group if _is_whole(leaf.tensor, nbytes)), None)
    if whole is not None:
        base, data = whole.key, _bytes_as_stored(whole.tensor.detach())
    else:
        import torch

        base = group[0].key
        dtypes = {leaf.tensor.dtype for leaf in group}
        size = first.element_size()
        if len(dtypes) == 1 and nbytes % size == 0:
            # A view op, so the entry shares the tensors' version counter (overlap's guard reads it).
            data = _bytes_as_stored(first.detach()).as_strided((nbytes // size,), (1,), 0)
        else:
            data = torch.empty(0, dtype=torch.uint8, device=first.device).set_(
                first.untyped_storage(), 0, (nbytes,), (1,))  # fmt: skip
    entry(base, data)
    for leaf in group:
        t = leaf.tensor
        if leaf is whole and _plain(t):
            leaf.ref["$t"] = leaf.key
            continue
        view: dict[str, Any] = {"key": leaf.key, "of": base, "dtype": st_dtype(t.dtype), "shape": list(t.shape),
                                "stride": list(t.stride()), "offset": int(t.storage_offset())}  # fmt: skip
        if not t.is_cpu:
            view["device"] = str(t.device)
        if t.requires_grad:
            view["requires_grad"] = True
        if isinstance(t, _torch().nn.Parameter):
            view["parameter"] = True
        if t.is_conj():
            view["conj"] = True
        if t.is_neg():
            view["neg"] = True
        leaf.ref["$view"] = view


_FACTORIES: dict[Any, str | None] = {None: None, list: "list", dict: "dict", set: "set", int: "int",
                                     float: "float", str: "str", tuple: "tuple", bool: "bool"}  # fmt: skip
"""The ``default_factory`` of a ``defaultdict`` that ``$defaultdict`` keeps, by name."""
_FACTORY_BY_NAME = {name: f for f, name in _FACTORIES.items()}


def _factory_kept(factory: Any) -> bool:
    return factory is None or (isinstance(factory, type) and factory in _FACTORIES)


def _too_deep(state: Any) -> str:
    """Why :func:`encode_state` ran out of stack: the first container found inside itself."""
    on_path: dict[int, str] = {}  # the containers being walked, by id: their paths
    walk: list[tuple[Any, str, bool]] = [(state, "", False)]
    while walk:
        obj, path, leaving = walk.pop()
        if leaving:
            del on_path[id(obj)]
            continue
        if isinstance(obj, dict):
            inside = [(v, f"{path}/{_escape(str(k))}") for k, v in obj.items()]
            if isinstance(obj, OrderedDict) and getattr(obj, "_metadata", None) is not None:
                inside.append((obj._metadata, f"{path}/$metadata"))  # type: ignore[attr-defined]
        elif isinstance(obj, (list, tuple)):
            inside = [(v, f"{path}/{i}") for i, v in enumerate(obj)]
        elif _package(obj) == "argparse" and type(obj).__qualname__ == "Namespace":
            inside = [(v, f"{path}/{_escape(k)}") for k, v in vars(obj).items()]
        else:
            continue
        if id(obj) in on_path:
            return (f"{path}: the {type(obj).__name__} at {on_path[id(obj)] or '/'} again, inside itself; a state "
                    "holding a cycle cannot be stored: break the cycle, or save the values it leads to")  # fmt: skip
        on_path[id(obj)] = path
        walk.append((obj, path, True))
        walk.extend(reversed([(v, p, False) for v, p in inside]))
    return "the state is nested deeper than Python's recursion limit; flatten it"


def _package(obj: Any) -> str:
    """The top-level package of ``obj``'s type: ``"numpy"`` for ``np.float32``."""
    return type(obj).__module__.split(".")[0]


def _plain_note(obj: Any, path: str) -> str:
    """What :func:`encode_state` says of a dict, list, str, int or float subclass it stores as a plain one."""
    base = next(b.__name__ for b in (OrderedDict, dict, list, str, int, float) if isinstance(obj, b))
    if isinstance(obj, defaultdict):
        return f"{path or '/'}: a defaultdict of {obj.default_factory!r}, not a builtin type, as a dict"
    return f"{path or '/'}: {_a(type(obj).__qualname__)} as {_a(base)}"


def _instead(obj: Any) -> str:
    """What to store in place of ``obj``, a value with no safe form: the fix its refusal names."""
    try:
        usual = _usual_part(obj)
    except Exception:  # a property, __getattr__ or metaclass may raise anything: no hint then
        usual = None
    return usual or "convert it to tensors and plain values"


def _key_instead(obj: Any) -> str:
    """What to key a dict by in place of ``obj``, a key with no safe form: a fix that
    gives something hashable, as a key must be (set(), asdict(), state_dict() do not)."""
    import dataclasses
    import datetime
    import enum

    if isinstance(obj, frozenset):  # not sorted(k): it raises for a mix of types
        return "key it by tuple(sorted(k, key=repr)) instead"
    if dataclasses.is_dataclass(obj):
        return "key it by dataclasses.astuple(k) instead"
    if isinstance(obj, tuple):  # a named tuple
        return "key it by tuple(k) instead"
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(obj, numpy.dtype):
        if obj.subdtype is None and obj.names is not None:  # its .descr is a list, of lists where fields nest
            return ("key it by str(k.descr) instead, and rebuild it with "
                    "np.lib.format.descr_to_dtype(ast.literal_eval(key)) after loading")  # fmt: skip
        if obj.subdtype is None:
            return _instead(obj)  # its .str
        if obj.base.names is None:  # a subarray of a plain dtype; one of records gets the advice below
            return "key it by (k.base.str, k.shape) instead, and rebuild it with np.dtype(key) after loading"
    if _torch_kind(obj) or isinstance(obj, (enum.Enum, datetime.date, datetime.time, datetime.timedelta)):
        return _instead(obj)  # a str or a number: str() of it, .value, isoformat(), total_seconds()
    return "key it by a str, an int or a tuple of them instead"


def _what(obj: Any) -> str:
    """``obj``'s kind, as a refusal names it: its type, or a NumPy array's dtype."""
    if _package(obj) == "numpy":
        import numpy as np

        if type(obj) is np.ndarray:
            return f"a NumPy array of dtype {obj.dtype}"
        if isinstance(obj, np.dtype):
            return "a NumPy dtype"
    return _a(type(obj).__qualname__)


def _array_part(a: Any) -> str:
    """What to store of a NumPy array whose dtype no tensor has."""
    kind = a.dtype.kind
    if a.dtype.names is not None:
        return "store each field (a['name']) as an array of its own"
    if kind in "mM":  # datetimes and timedeltas: numbers in a unit
        return "store a.view('int64') and str(a.dtype), and view it back with .view(dtype) after loading"
    if kind in "biufc" and not a.dtype.isnative:
        return "store it in native byte order, a.astype(a.dtype.newbyteorder('='))"
    if kind in "biufc":  # a width no tensor has: long double. A copy: a 0-dim or strided one views as no bytes
        return (f"store its bytes, np.ascontiguousarray(a).reshape(-1).view(np.uint8), and a.shape, and view "
                f"them back with .view(np.dtype('{a.dtype.str}')).reshape(shape) after loading, or cast it")  # fmt: skip
    if kind in "USV":  # np.array() of the list alone picks the longest item's width; [] has no shape
        return ("store a.tolist(), str(a.dtype) and a.shape, and rebuild it with "
                "np.array(values, dtype=dtype).reshape(shape) after loading")  # fmt: skip
    return "store a.tolist()"  # objects


def _usual_part(obj: Any) -> str | None:
    """The usual thing to store of an object like ``obj``, where there is one."""
    import dataclasses
    import datetime
    import enum
    import random
    import types

    def has(*names: str) -> bool:
        return all(callable(getattr(obj, n, None)) for n in names)

    if _torch_kind(obj):
        return "store str() of it and rebuild it with getattr(torch, s.removeprefix('torch.')) after loading"
    if _package(obj) == "numpy":
        import numpy as np

        if type(obj) is np.ndarray:
            return _array_part(obj)
        if isinstance(obj, np.dtype):
            if obj.subdtype is not None:  # its .str and .descr ('|V24') have neither its base nor its shape
                return ("store np.lib.format.dtype_to_descr(d.base) and d.shape, and rebuild it with "
                        "np.dtype((np.lib.format.descr_to_dtype(descr), shape)) after loading")  # fmt: skip
            if obj.names is not None:  # its .str ('|V12') has no fields; np.dtype(descr) makes fields of padding
                return "store its .descr and rebuild it with np.lib.format.descr_to_dtype() after loading"
            return "store its .str and rebuild it with np.dtype() after loading"
    if isinstance(obj, (type, types.ModuleType, random.SystemRandom)):  # no state of their own to store
        return None
    if has("state_dict", "load_state_dict"):  # a module, optimizer, scheduler, GradScaler
        return "store its state_dict() and restore it with load_state_dict()"
    if has("get_state", "set_state"):  # a torch.Generator, NumPy's RandomState
        return "store its get_state() and restore it with set_state()"
    if has("getstate", "setstate"):  # a random.Random
        return "store its getstate() and restore it with setstate()"
    if _package(obj) == "numpy" and type(obj).__name__ == "Generator":  # np.random.default_rng()
        return "store its bit_generator.state and restore it by assigning that"
    if dataclasses.is_dataclass(obj):
        return "store dataclasses.asdict() of it"
    if isinstance(obj, tuple) and has("_asdict"):  # a named tuple
        return "store its _asdict() or tuple() of it"
    if isinstance(obj, enum.Enum):
        return "store its .value or .name"
    if isinstance(obj, (datetime.date, datetime.time)):
        return "store its isoformat()"
    if isinstance(obj, datetime.timedelta):
        return "store its total_seconds()"
    if isinstance(obj, frozenset):
        return "store set() of it"
    if isinstance(obj, deque):
        return "store list() of it"
    return None


def _torch_kind(obj: Any) -> bool:
    """Whether ``obj`` is a torch layout, memory format or qscheme (``torch.strided``)."""
    return _package(obj) == "torch" and type(obj).__name__ in ("layout", "memory_format", "qscheme")


def _layout_part(layout: Any) -> str:
    """What to store of a tensor not strided: dense, or for a sparse one (smaller) the parts it is rebuilt from."""
    import torch

    if layout == torch.sparse_coo:
        parts = ("the indices() and values() of t.coalesce(), and t.shape; rebuild it with "
                 "torch.sparse_coo_tensor(indices, values, shape)")  # fmt: skip
    elif layout in (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc):
        # torch.sparse_compressed_tensor takes every one of them
        compressed, plain = ("crow", "col") if layout in (torch.sparse_csr, torch.sparse_bsr) else ("ccol", "row")
        parts = (f"t.{compressed}_indices(), t.{plain}_indices(), t.values() and t.shape; rebuild it with "
                 f"torch.sparse_compressed_tensor({compressed}_indices, {plain}_indices, values, shape, "
                 f"layout={layout})")  # fmt: skip
    else:  # mkldnn's: no smaller parts
        return "t.to_dense()"
    return f"t.to_dense(), or, smaller, {parts}"


_VOWEL_READ_AS_CONSONANT = re.compile(r"one|uni(?![mn])|use|usu|eu(?!ler)", re.IGNORECASE)
"""Starts of words read with a consonant first: One..., Union, User...; not Uninitialized..., Euler..."""


def _a(noun: str) -> str:
    """``noun`` with its indefinite article: "an IntervalStrategy", "a dict", "a UserDict", and
    for a name read letter by letter, by the first letter's name: "an SGD", "a UUID"."""
    if noun[:2].isupper():
        return f"{'an' if noun[0] in 'AEFHILMNORSX' else 'a'} {noun}"
    vowel = noun[:1].lower() in "aeiou" and not _VOWEL_READ_AS_CONSONANT.match(noun)
    return f"{'an' if vowel else 'a'} {noun}"


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


def namespace(attrs: Mapping[Any, Any]) -> Any:
    """An ``argparse.Namespace`` with ``attrs`` set as pickle sets them: into its
    ``__dict__``, whatever their names."""
    import argparse

    ns = argparse.Namespace()
    ns.__dict__.update(attrs)
    return ns


def _namespace(attrs: Any) -> Any:
    """The ``argparse.Namespace`` a ``$namespace`` tag holds."""
    if not isinstance(attrs, dict):
        raise CheckpointCorrupt(f"state.json: a bad namespace {attrs!r:.80}")
    return namespace(attrs)


def _tensor_dtype(dtype: Any) -> bool:
    """Whether a tensor can hold an array of ``dtype``: numbers and bools of at most 64 bits
    a part, in this machine's byte order (not strings, datetimes, ``longdouble``, objects)."""
    size = dtype.itemsize // 2 if dtype.kind == "c" else dtype.itemsize
    return dtype.isnative and dtype.kind in "biufc" and size <= 8


def transposed(t: Any) -> Any:
    """``t`` with its dimensions in reverse order, a view: the tensor a NumPy array in
    Fortran order is stored as (``$npT``), or, of that, one in the array's own shape."""
    return t.permute(*reversed(range(t.dim())))


def array_tensor(a: Any, into: bool = False) -> Any:
    """A tensor over a NumPy array's memory, to store it: of its shape (0-d too), and
    over a copy where the array is not C-contiguous or not writable (a load ``into=``
    writes through it). ``into``: the tensor to load into the array, over its own
    memory in any order where torch can view that (writable, no negative strides)."""
    import torch

    # torch takes only strides in whole elements, where NumPy calls a field of a record
    # array of one record (stride: the record's size) contiguous.
    whole = all(s % a.itemsize == 0 for s in a.strides)  # only numeric dtypes reach here: itemsize > 0
    # NumPy calls an array C-contiguous whatever the strides of its dims of size 1, negative too.
    viewable = whole and a.flags.writeable and all(s >= 0 for s in a.strides)
    if not (viewable and (into or a.flags.c_contiguous)):
        a = a.copy(order="C")
    return torch.from_numpy(a)


def copied_into(a: Any, t: Any) -> bool:
    """Whether ``t``, ``array_tensor(a, into=True)``, is over a copy of ``a`` that ``a``
    (writable) must get the loaded values of: torch views no negative strides, and
    no strides that are not whole elements (a field of a record array)."""
    return bool(a.flags.writeable and not sys.modules["numpy"].may_share_memory(t.numpy(), a))


_PATH = type(Path())  # this system's concrete Path: PosixPath on Linux

_NP_SCALAR_KINDS = "biufcmM"
"""Numpy scalars stored as ``$npscalar``: bools, numbers, datetimes and timedeltas."""


def _np_scalar_value(x: Any) -> Any:
    """``x``'s value in ``state.json``: a JSON number if reading it back gives the same bits."""
    if x.dtype.kind in "biuf":  # not complex, and datetimes' numbers need their unit
        v = x.item()
        plain = type(v) in (bool, int) or (type(v) is float and math.isfinite(v))
        if plain and x.dtype.type(v).tobytes() == x.tobytes():
            return v
    return {"$bytes": base64.b64encode(x.tobytes()).decode("ascii")}


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


def _torch() -> Any:
    import torch

    return torch


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
    order. ``into``: the tree of ``into=`` encoded with ``stored=False``, whose
    ``tensors`` and ``copied`` are by its own keys.

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

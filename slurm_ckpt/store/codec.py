"""State <-> (JSON tree, tensors): the safe encoding of a checkpoint's contents.

A state is nested dicts, lists and tuples of tensors and plain values. Tensors
leave the tree and go to safetensors-layout data files; everything else becomes
JSON in ``state.json``. JSON values that JSON cannot say natively are tagged
objects with a single ``$``-key:

=================  ==========================================================
``{"$t": key}``     a tensor stored under ``key`` in a data file
``{"$np": key}``    a numpy array, stored as a tensor
``{"$tuple": []}``  a tuple
``{"$items": []}``  a dict whose keys are not all plain strings (e.g. the int
                    keys of an optimizer state_dict), as ``[key, value]`` pairs
``{"$bytes": b64}`` bytes
``{"$float": s}``   ``nan``, ``inf`` or ``-inf``
``{"$int": hex}``   an int too big for a JSON number (Python refuses to print
                    ints over 4300 digits in decimal; hex has no such limit)
``{"$dtype": s}``   a ``torch.dtype``
``{"$pickle": i}``  object ``i`` of ``objects.pkl`` (opt-in, trusted input only)
=================  ==========================================================

Tensors that are the same view of the same storage (tied weights) are stored
once and come back as one tensor object, so ties survive a round trip.
"""

from __future__ import annotations

import base64
import functools
import math
import pickle
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import UnsafeLoad, UnsupportedValue

__all__ = ["EncodedState", "TensorEntry", "decode_state", "encode_state", "is_dtensor", "path_parts", "torch_dtype"]

# safetensors' dtype names; F8 types exist in torch >= 2.1.
_DTYPES = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16",
    "I32": "int32", "U32": "uint32", "I64": "int64", "U64": "uint64",
    "F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
    "C64": "complex64", "C128": "complex128",
}  # fmt: skip
_TORCH_TO_ST = {v: k for k, v in _DTYPES.items()}
_MAX_JSON_INT_BITS = 10_000
"""About 3000 decimal digits, safely under Python's 4300-digit str() limit."""


def torch_dtype(name: str) -> Any:
    """The torch dtype for a safetensors dtype name."""
    import torch

    return getattr(torch, _DTYPES[name])


def st_dtype(dtype: Any) -> str:
    name = str(dtype).removeprefix("torch.")
    try:
        return _TORCH_TO_ST[name]
    except KeyError:
        raise UnsupportedValue(f"tensor dtype {name} cannot be stored; cast it first") from None


@dataclass
class TensorEntry:
    """A tensor leaving the tree. ``tensor`` is CPU and contiguous."""

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
    import sys

    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(t, mod.DTensor)


def encode_state(
    state: Any,
    *,
    allow_pickle: bool = False,
    prepare: Callable[[Any], Any] | None = None,
    refer: Callable[[Any, str], str] | None = None,
) -> EncodedState:
    """Split ``state`` into a JSON tree and a list of tensors.

    ``prepare`` maps each tensor to the CPU contiguous tensor that will be
    written (the engine passes its staging copy here); by default tensors are
    moved to the CPU and made contiguous, copying only when needed.

    ``refer(tensor, path)``, when given, takes every tensor (DTensors and numpy
    arrays too) instead of the tensor list, and returns the key the tree refers
    to it by: the sharded path (``slurm_ckpt.sharded``) stores them itself.
    """
    out = EncodedState(tree=None)
    seen: dict[tuple[Any, ...], str] = {}
    # safetensors reserves "__metadata__" for its own header entry.
    keys: set[str] = {"__metadata__"}

    def tensor_ref(t: Any, path: str, tag: str) -> dict[str, str]:
        if refer is not None:
            return {tag: refer(t, path)}
        if is_dtensor(t):
            # Its storage is a wrapper with no data of its own, and its local shard
            # alone would be saved as if it were the whole tensor.
            raise UnsupportedValue(
                f"{path or '/'}: a DTensor (FSDP2, tensor parallel) cannot be saved as a plain "
                "tensor: save sharded states with slurm_ckpt.sharded.save, or with dcp.save and "
                "storage_writer=slurm_ckpt.dcp.StorageWriter(run_dir, step=N)"
            )
        ident = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
                 tuple(t.stride()), t.dtype, str(t.device))  # fmt: skip
        if t.numel() and ident in seen:
            return {tag: seen[ident]}
        key = path.lstrip("/") or "."
        while key in keys:
            key += "'"
        keys.add(key)
        if t.numel():
            seen[ident] = key
        dtype = st_dtype(t.dtype)
        data = prepare(t) if prepare else t.detach().to("cpu").contiguous()
        out.tensors.append(TensorEntry(key, data, dtype, list(t.shape)))
        return {tag: key}

    def enc(obj: Any, path: str) -> Any:
        if obj is None or isinstance(obj, (bool, str)):
            return obj
        if isinstance(obj, int):
            return int(obj) if obj.bit_length() <= _MAX_JSON_INT_BITS else {"$int": hex(obj)}
        if isinstance(obj, float):
            if math.isfinite(obj):
                return obj
            return {"$float": repr(obj)}
        tname = type(obj).__module__.split(".")[0]
        if tname == "torch":
            import torch

            if isinstance(obj, torch.Tensor):
                if obj.is_sparse or obj.layout != torch.strided:
                    raise UnsupportedValue(f"{path}: sparse tensors are not supported; call .to_dense()")
                return tensor_ref(obj, path, "$t")
            if isinstance(obj, torch.dtype):
                return {"$dtype": str(obj).removeprefix("torch.")}
            if isinstance(obj, torch.Size):
                return {"$tuple": [int(d) for d in obj]}
        if tname == "numpy":
            import numpy as np

            if isinstance(obj, np.ndarray) and obj.dtype != object:
                import torch

                return tensor_ref(torch.from_numpy(np.ascontiguousarray(obj)), path, "$np")
            if isinstance(obj, np.generic):
                return enc(obj.item(), path)
        if isinstance(obj, dict):
            if all(isinstance(k, str) and not k.startswith("$") for k in obj):
                return {k: enc(v, f"{path}/{_escape(k)}") for k, v in obj.items()}
            return {"$items": [[enc(k, f"{path}/$key"), enc(v, f"{path}/{_escape(str(k))}")]
                               for k, v in obj.items()]}  # fmt: skip
        if isinstance(obj, list):
            return [enc(v, f"{path}/{i}") for i, v in enumerate(obj)]
        if isinstance(obj, tuple) and type(obj) is tuple:
            return {"$tuple": [enc(v, f"{path}/{i}") for i, v in enumerate(obj)]}
        if isinstance(obj, (bytes, bytearray)):
            return {"$bytes": base64.b64encode(bytes(obj)).decode("ascii")}
        if allow_pickle:
            out.objects.append(obj)
            return {"$pickle": len(out.objects) - 1}
        raise UnsupportedValue(
            f"{path or '/'}: cannot store a {type(obj).__qualname__} safely; convert it to "
            "tensors and plain values, or pass allow_pickle=True (trusted input only)"
        )

    out.tree = enc(state, "")
    return out


def decode_state(
    tree: Any,
    load_tensor: Callable[[str], Any],
    objects_blob: Callable[[], bytes] | None,
    *,
    trusted: bool = False,
) -> Any:
    """Rebuild a state from its JSON tree; ``load_tensor(key)`` returns a tensor."""
    tensors: dict[str, Any] = {}
    objects: list[Any] | None = None

    def tensor(key: str) -> Any:
        if key not in tensors:
            tensors[key] = load_tensor(key)
        return tensors[key]

    def dec(obj: Any) -> Any:
        nonlocal objects
        if isinstance(obj, list):
            return [dec(v) for v in obj]
        if not isinstance(obj, dict):
            return obj
        if len(obj) == 1:
            (tag, val), = obj.items()
            if tag == "$t":
                return tensor(val)
            if tag == "$np":
                return tensor(val).numpy()
            if tag == "$tuple":
                return tuple(dec(v) for v in val)
            if tag == "$items":
                return {_hashable(dec(k)): dec(v) for k, v in val}
            if tag == "$bytes":
                return base64.b64decode(val)
            if tag == "$float":
                return float(val)
            if tag == "$int":
                return int(val, 16)
            if tag == "$dtype":
                import torch

                return getattr(torch, val)
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

    return dec(tree)


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, list) else key

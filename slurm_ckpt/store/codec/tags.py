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

import contextlib
import functools
import gc
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...errors import UnsupportedValue

__all__ = [
    "EncodedState",
    "TensorEntry",
    "array_tensor",
    "contiguous_strides",
    "copied_into",
    "gc_paused",
    "is_dtensor",
    "namespace",
    "path_parts",
    "resolved",
    "st_dtype",
    "torch_dtype",
    "torch_dtype_name",
    "transposed",
]


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause Python's cyclic GC while a state's many small objects are built
    (encoded or decoded).

    A training process tracks hundreds of thousands of objects (torch alone),
    so full collections triggered by the allocations of encoding thousands of
    tensors can cost more than the encoding itself, and each walks every
    object. Nothing built here is cyclic garbage, so nothing is lost by waiting.
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


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
            fix = "store t.int_repr() and its quantization parameters"
        elif scalar and dtype.itemsize > 1:
            fix = (f"store a copy of its bytes, t.reshape(1).view(torch.uint8), and view them back "
                   f"with .view(torch.{name}).reshape(()) after loading")  # fmt: skip
        else:
            fix = (f"store a copy of its bytes, t.contiguous().view(torch.uint8), and view them back "
                   f"with .view(torch.{name}) after loading")  # fmt: skip
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
    _nbytes: int = field(default=-1, repr=False, compare=False)

    @property
    def nbytes(self) -> int:
        # Cached: the layout asks each tensor for it several times, each time
        # through two torch accessors. Not a cached_property, which takes a lock
        # on each first look (Python < 3.12): 10,000 small tensors, 10,000 locks.
        if self._nbytes < 0:
            self._nbytes = int(self.tensor.numel() * self.tensor.element_size())
        return self._nbytes


@dataclass
class EncodedState:
    tree: Any
    tensors: list[TensorEntry] = field(default_factory=list)
    objects: list[Any] = field(default_factory=list)
    leaves: dict[str, Any] = field(default_factory=dict)
    """Every tensor object of the state by its key (views included), as given."""

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def _escape(part: str) -> str:
    if "%" not in part and "/" not in part:  # nearly every key: no new string to make
        return part
    return part.replace("%", "%25").replace("/", "%2F")


def path_parts(path: str) -> list[str]:
    """The keys and indices of a value's ``path`` in the state (``/model/0.weight`` -> model, 0.weight)."""
    return [p.replace("%2F", "/").replace("%25", "%") for p in path.split("/")[1:]]


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (without importing torch.distributed)."""
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(t, mod.DTensor)


def resolved(t: Any) -> Any:
    """``t`` with its lazy conjugate and negative bits applied to its data (a copy
    only where one is set): for writers that store a tensor's values as bytes
    with no record of the bits (DCP's chunks)."""
    return t.resolve_conj().resolve_neg()


_FACTORIES: dict[Any, str | None] = {None: None, list: "list", dict: "dict", set: "set", int: "int",
                                     float: "float", str: "str", tuple: "tuple", bool: "bool"}  # fmt: skip
"""The ``default_factory`` of a ``defaultdict`` that ``$defaultdict`` keeps, by name."""
_FACTORY_BY_NAME = {name: f for f, name in _FACTORIES.items()}


def _factory_kept(factory: Any) -> bool:
    return factory is None or (isinstance(factory, type) and factory in _FACTORIES)


def _package(obj: Any) -> str:
    """The top-level package of ``obj``'s type: ``"numpy"`` for ``np.float32``."""
    return type(obj).__module__.split(".")[0]


def namespace(attrs: Mapping[Any, Any]) -> Any:
    """An ``argparse.Namespace`` with ``attrs`` set as pickle sets them: into its
    ``__dict__``, whatever their names."""
    import argparse

    ns = argparse.Namespace()
    ns.__dict__.update(attrs)
    return ns


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


def _torch() -> Any:
    import torch

    return torch


"""State -> (JSON tree, data-file entries): the encoder (the tags are in :mod:`.tags`)."""

from __future__ import annotations

import base64
import math
import sys
import warnings
from collections import Counter, OrderedDict, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ...errors import UnsupportedValue
from .tags import (
    _FACTORIES,
    _MAX_JSON_INT_BITS,
    _NP_SCALAR_KINDS,
    _PATH,
    EncodedState,
    TensorEntry,
    _escape,
    _factory_kept,
    _package,
    _st_name,
    _tensor_dtype,
    _torch,
    array_tensor,
    contiguous_strides,
    is_dtensor,
    st_dtype,
)

__all__ = ["encode_state"]


@dataclass(slots=True)
class _Leaf:
    """A tensor object of the state and the tag object that stands for it in the tree."""

    key: str
    tensor: Any
    ref: dict[str, Any]
    nbytes: int
    """Of the tensor's storage."""
    dtype: str
    """Its safetensors name."""


def _is_whole(t: Any, nbytes: int) -> bool:
    """Whether ``t`` is all of its storage, in order: its bytes are the storage's bytes."""
    if t.storage_offset() or t.nbytes != nbytes or not t.is_contiguous():
        return False
    # is_contiguous() ignores the strides of dims of size 0 and 1; torch.load does not.
    shape = t.shape
    return (1 not in shape and 0 not in shape) or list(t.stride()) == contiguous_strides(list(shape))


def _plain(t: Any, tensor_type: Any) -> bool:
    """A tensor ``{"$t": key}`` says all about: a plain CPU tensor that needs no grad,
    whose values are its bytes (no lazy conjugate or negative bit)."""
    return type(t) is tensor_type and not t.requires_grad and t.is_cpu and not t.is_conj() and not t.is_neg()


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
) -> EncodedState:
    """Split ``state`` into a JSON tree and a list of data-file entries.

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

    def entry(key: str, t: Any, dtype: str) -> None:
        data = prepare(t) if prepare else t.detach().to("cpu").contiguous()
        out.tensors.append(TensorEntry(key, data, dtype, list(t.shape)))

    def tensor_ref(t: Any, path: str) -> dict[str, Any]:
        refs[0] += 1
        exact = type(t) is tensor_type  # the common case, which no lazy module's or DTensor is
        if not exact and isinstance(t, lazy):
            # A lazy module's parameter before its first forward: no shape and no
            # memory yet, and torch raises at any look at its storage, without
            # saying where in the state it is.
            raise UnsupportedValue(
                f"{path or '/'}: an uninitialized parameter or buffer of a lazy module (nn.LazyLinear, say) has "
                "no data to save: run one forward pass (a dummy batch) before the first save"
            )
        if t.is_meta:
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
        if t.__dict__ and id(t) not in attributed:
            # torch.save pickles them; a tag has no room for values that may need a pickle.
            # Private ones are frameworks' marks (torch.compile marks optimizer states).
            attributed.add(id(t))
            names = ", ".join(sorted(n for n in map(str, t.__dict__) if not n.startswith("_")))
            if names:
                plain.append(f"{path or '/'}: a {type(t).__name__} without its Python attributes ({names})")
        if refer is not None:
            return {"$t": refer(t, path)}
        if not exact and is_dtensor(t):
            # Its storage is a wrapper with no data of its own, and its local shard
            # alone would be saved as if it were the whole tensor.
            raise UnsupportedValue(
                f"{path or '/'}: a DTensor (FSDP2, tensor parallel) cannot be saved as a plain "
                "tensor: save sharded states with slurm_ckpt.sharded.save, or with dcp.save and "
                "storage_writer=slurm_ckpt.dcp.StorageWriter(run_dir, step=N)"
            )
        ref = memo.get(id(t))
        if ref is None:
            # An unstorable dtype fails here, naming it and where.
            dtype = _st_name(t.dtype) or st_dtype(t.dtype, path or "/", scalar=t.dim() == 0)
            ref = memo[id(t)] = {}
            storage = t.untyped_storage()
            key = new_key(path)
            out.leaves[key] = t
            leaf = _Leaf(key, t, ref, storage.nbytes(), dtype)
            # One group per storage, as torch.save keys them (the storage object,
            # not its address: two storages over one buffer are saved twice).
            group = storages.get(cdata := storage._cdata)
            if group is None:
                storages[cdata] = [leaf]
            else:
                group.append(leaf)
        return ref

    def array_ref(a: Any, path: str) -> dict[str, Any]:
        refs[0] += 1
        if refer is not None:  # DCP's chunks: in C order, the one order DCP reads a tensor's bytes in
            return {"$np": refer(a, path)}
        # Arrays are stored whole, each on its own, as pickle stores them: in C
        # order, but for one in Fortran order (and not also in C order), which
        # pickle keeps so, and which is stored as its transpose, in C order.
        fortran = a.flags.f_contiguous and not a.flags.c_contiguous
        tag, whole = ("$npT", a.T) if fortran else ("$np", a)
        ref = memo.get(id(a))
        if ref is None:
            key = new_key(path)
            t = array_tensor(whole)
            out.leaves[key] = t
            entry(key, t, st_dtype(t.dtype))
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
                                           "stored; store t.to_dense()")  # fmt: skip
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
        raise UnsupportedValue(_refusal(obj, path, key))

    try:
        out.tree = enc(state, "")
    except RecursionError:  # torch.save keeps a cycle; the tree cannot hold one
        raise UnsupportedValue(_too_deep(state)) from None
    for group in storages.values():
        _store(group, entry, tensor_type)
    if plain:
        more = f" (and {len(plain) - 3} more)" if len(plain) > 3 else ""
        warnings.warn(f"stored as plain ones, these load as such: {'; '.join(plain[:3])}{more}", UserWarning,
                      stacklevel=3)  # fmt: skip
    return out


def _store(group: list[_Leaf], entry: Callable[[str, Any, str], None], tensor_type: Any) -> None:
    """Write one storage's entry and fill in the tags of the tensors on it."""
    first, nbytes = group[0].tensor, group[0].nbytes
    if len(group) == 1 and _plain(first, tensor_type) and _is_whole(first, nbytes):
        group[0].ref["$t"] = group[0].key  # the common case: a tensor with its own storage
        entry(group[0].key, first, group[0].dtype)
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
    entry(base, data, st_dtype(data.dtype))
    for leaf in group:
        t = leaf.tensor
        if leaf is whole and _plain(t, tensor_type):
            leaf.ref["$t"] = leaf.key
            continue
        view: dict[str, Any] = {"key": leaf.key, "of": base, "dtype": leaf.dtype, "shape": list(t.shape),
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


def _plain_note(obj: Any, path: str) -> str:
    """What :func:`encode_state` says of a dict, list, str, int or float subclass it stores as a plain one."""
    base = next(b.__name__ for b in (OrderedDict, dict, list, str, int, float) if isinstance(obj, b))
    if isinstance(obj, defaultdict):
        return f"{path or '/'}: a defaultdict of {obj.default_factory!r}, not a builtin type, as a dict"
    return f"{path or '/'}: {_a(type(obj).__qualname__)} as {_a(base)}"


def _refusal(obj: Any, path: str, key: bool) -> str:
    """The one sentence refusing ``obj``, a value with no safe form at ``path``: where, what, one fix.

    The fix is specific only for what trainers hold by mistake (a module or an
    optimizer in place of its ``state_dict()``); the docs' table of refusals says
    what to store of the rest.
    """
    if key:  # a dict key: which one, and a fix that is hashable
        where, fix = f"{path.removesuffix('/$key') or '/'}, the key {obj!r:.60}", "key it by a str, an int or a tuple of them instead"
    else:
        where, fix = path or "/", "convert it to tensors and plain values (the loading docs' table of refusals says how)"
        try:
            stateful = not isinstance(obj, type) and all(
                callable(getattr(obj, n, None)) for n in ("state_dict", "load_state_dict"))  # fmt: skip
        except Exception:  # a __getattr__ or a metaclass may raise anything: the general fix then
            stateful = False
        if stateful:  # a module, optimizer, scheduler, GradScaler
            fix = "store its state_dict() and restore it with load_state_dict()"
    return f"{where}: cannot store {_what(obj)} safely; {fix}, or pass allow_pickle=True (trusted input only)"


def _what(obj: Any) -> str:
    """``obj``'s type as a refusal names it; a NumPy array's by its dtype."""
    if _package(obj) == "numpy" and type(obj).__name__ == "ndarray":
        return f"a NumPy array of dtype {obj.dtype}"
    return _a(type(obj).__qualname__)


def _a(noun: str) -> str:
    return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"


def _np_scalar_value(x: Any) -> Any:
    """``x``'s value in ``state.json``: a JSON number if reading it back gives the same bits."""
    if x.dtype.kind in "biuf":  # not complex, and datetimes' numbers need their unit
        v = x.item()
        plain = type(v) in (bool, int) or (type(v) is float and math.isfinite(v))
        if plain and x.dtype.type(v).tobytes() == x.tobytes():
            return v
    return {"$bytes": base64.b64encode(x.tobytes()).decode("ascii")}


"""Round trip of states through a real checkpoint: bit-exact tensors, plain values, ties, pickle opt-in."""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import enum
import functools
import io
import json
import math
import random
import re
import struct
import subprocess
import sys
import tempfile
import warnings
from collections import Counter, OrderedDict, defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slurm_ckpt import CheckpointCorrupt, Checkpointer, UnsafeLoad, UnsupportedValue
from slurm_ckpt.store.codec import decode_state, encode_state

DTYPES = [
    torch.float32,
    torch.float64,
    torch.bfloat16,
    torch.float16,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
    torch.complex128,
    # Those of later torch releases, where this one has them.
    *(getattr(torch, name) for name in ("uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2",
                                        "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
      if hasattr(torch, name)),
]  # fmt: skip
FP8 = ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")


def raw(t: torch.Tensor) -> bytes:
    flat = torch.empty(t.numel(), dtype=t.dtype).copy_(t.detach().reshape(-1))
    return flat.view(torch.uint8).numpy().tobytes()


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    """Any dtype; 0-dim, empty, contiguous, transposed, sliced or broadcast views.

    Float data is random bytes, so NaN payloads, -0.0 and subnormals are covered.
    """
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(st.lists(st.integers(0, 5), min_size=0, max_size=3))
    view = draw(st.sampled_from(["plain", "transpose", "slice", "expand"]))
    if view == "transpose":
        shape = [*shape, 3, 2][: max(2, len(shape))]
    if view == "slice":
        shape = [*shape[:-1], (shape[-1] if shape else 0) * 2 + 1]
    numel = math.prod(shape)
    size = numel * torch.empty((), dtype=dtype).element_size()
    data = bytearray(draw(st.binary(min_size=size, max_size=size)))
    if dtype is torch.bool:
        data = bytearray(b & 1 for b in data)
    base = torch.frombuffer(data, dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8)
    t = base.view(dtype).reshape(shape).clone()
    if view == "transpose":
        t = t.transpose(0, 1)
    elif view == "slice":
        t = t[..., ::2]
    elif view == "expand":
        t = t.unsqueeze(0).expand(2, *t.shape)
    return t


floats = st.floats(allow_nan=True, allow_infinity=True)
NP_SCALARS = ["?", "i1", "u1", "i2", "u2", "i4", "u4", "i8", "u8", "f2", "f4", "f8", "g", "c8", "c16", "M8[s]",
              "m8[ms]"]  # fmt: skip


@st.composite
def np_scalars(draw: st.DrawFn) -> Any:
    """A numpy scalar of any stored kind, from random bytes (NaN payloads, -0.0, NaT)."""
    dtype = np.dtype(draw(st.sampled_from(NP_SCALARS)))
    data = draw(st.binary(min_size=dtype.itemsize, max_size=dtype.itemsize))
    if dtype.kind == "b":
        data = bytes(b & 1 for b in data)
    if dtype == np.longdouble:  # x87's 80 bits in 16: the 6 bytes of padding are not kept
        data = data[:10] + bytes(dtype.itemsize - 10)
    return np.frombuffer(data, dtype=dtype)[0]


np_ints = st.integers(-(2**63), 2**63 - 1).map(np.int64) | st.integers(0, 255).map(np.uint8)
ints = st.integers() | st.integers(min_value=2**63, max_value=2**300) | st.just(-(2**80))
keys_str = st.text(max_size=8) | st.sampled_from(
    ["$t", "$items", "a/b", "%2F", "__metadata__", "."]
)


@st.composite
def states(draw: st.DrawFn) -> Any:
    pool = draw(st.lists(tensors(), min_size=1, max_size=6))
    leaf = st.none() | st.booleans() | ints | floats | st.text(max_size=10) | st.binary(max_size=10)
    leaf = leaf | np_scalars() | st.complex_numbers() | st.lists(st.integers(0, 9), max_size=3).map(torch.Size)
    leaf = leaf | st.sampled_from(pool)  # drawing the same object twice makes a tie
    tree = st.recursive(
        leaf,
        lambda kids: (
            st.lists(kids, max_size=4)
            | st.lists(kids, max_size=3).map(tuple)
            | st.dictionaries(keys_str, kids, max_size=4)
            | st.dictionaries(st.integers(-3, 10**20) | keys_str, kids, max_size=4)
            | st.dictionaries(np_ints | st.lists(np_ints, max_size=2).map(tuple), kids, max_size=3)
        ),
        max_leaves=12,
    )
    return draw(tree)


def leaves(obj: Any) -> Iterator[Any]:
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from leaves(k)
            yield from leaves(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from leaves(v)
    else:
        yield obj


def assert_same(a: Any, b: Any, where: str = "/") -> None:
    assert type(a) is type(b), f"{where}: {type(a)} became {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert raw(a) == raw(b), f"{where}: tensor bytes differ"
    elif isinstance(a, np.generic):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), f"{where}: {a!r} became {b!r}"
    elif isinstance(a, complex):
        assert_same(a.real, b.real, f"{where}real/")
        assert_same(a.imag, b.imag, f"{where}imag/")
    elif isinstance(a, float):
        assert struct.pack("<d", a) == struct.pack("<d", b) or (math.isnan(a) and math.isnan(b)), (
            where
        )
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{where}: keys {list(a)} became {list(b)}"
        assert_same(list(a), list(b), f"{where}keys/")  # their types too: np.int64(3) == 3
        for k in a:
            assert_same(a[k], b[k], f"{where}{k!r}/")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}{i}/")
    else:
        assert a == b, f"{where}: {a!r} became {b!r}"


def round_trip(state: Any, *, async_: bool = False, **load: Any) -> Any:
    with tempfile.TemporaryDirectory() as d:
        with Checkpointer(Path(d), keep=1) as ck:
            if async_:
                ck.save_async(state, step=1).wait()
            else:
                ck.save(state, step=1)
        with Checkpointer(Path(d)) as ck:
            out = ck.load_latest(**load)
            assert ck.loaded_step == 1
            return out


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(states())
def test_round_trip_is_exact_and_keeps_ties(state: Any) -> None:
    out = round_trip(state)
    assert_same(state, out)
    before, after = list(leaves(state)), list(leaves(out))
    for i, x in enumerate(before):
        for j in range(i):
            if isinstance(x, torch.Tensor) and x is before[j] and x.numel():
                assert after[i] is after[j], "tied tensors came back as two tensors"


@given(states())
def test_async_round_trip_is_exact(state: Any) -> None:
    assert_same(state, round_trip(state, async_=True))


def test_every_dtype_and_shape_kind_explicitly() -> None:
    """The cases the property test might draw rarely, pinned."""
    w = torch.randn(4, 3)
    state = {
        "tied": {"a": w, "b": w},
        "zero_dim": {str(dt): torch.ones((), dtype=dt) for dt in DTYPES},
        "empty": torch.empty(0, 3, dtype=torch.bfloat16),
        "transposed": torch.arange(12, dtype=torch.float16).reshape(3, 4).t(),
        "sliced": torch.arange(20, dtype=torch.int64)[3:17:3],
        "nan_inf": [float("nan"), float("inf"), float("-inf"), -0.0],
        "big": 10**5000,
        "opt": {"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": [{"params": [0]}]},
        "tuple_key": {(1, "a"): 2},
        "bytes": b"\x00\xff",
        "dtype": torch.bfloat16,
        "size": torch.Size([2, 3]),
        "complex": [1 + 2j, complex(float("nan"), -0.0)],
        "np": [
            np.float32(0.1), np.float16(-0.0), np.float32("nan"), np.uint64(2**64 - 1), np.bool_(True),
            np.longdouble(1) / 3, np.complex64(1 - 2j), np.datetime64("2026-12-02T10:00"),
            np.timedelta64("NaT"), np.float64(0.1),
        ],
        "__metadata__": torch.ones(2),
    }
    out = round_trip(state)
    assert out["tied"]["a"] is out["tied"]["b"]
    assert out["big"] == 10**5000
    assert out["dtype"] is torch.bfloat16
    assert_same({k: v for k, v in state.items() if k != "dtype"}, {k: v for k, v in out.items() if k != "dtype"})


class Config(dict):  # as attribute-access dicts are written
    def __getattr__(self, key: str) -> Any:
        return self[key]


def test_counters_and_defaultdicts_keep_their_type_other_subclasses_warn() -> None:
    metrics: defaultdict[str, list[float]] = defaultdict(list, loss=[0.5])
    state = {"seen": Counter("aab"), "metrics": metrics, "nested": defaultdict(dict, {1: {"a": Counter()}}),
             "none": defaultdict(None, a=1)}  # fmt: skip
    out = round_trip(state)
    assert_same(state, out)
    assert out["metrics"].default_factory is list and out["metrics"]["new"] == []  # goes on as it did
    assert out["seen"]["c"] == 0 and out["none"].default_factory is None
    class Zero:  # a callable instance, not hashable: a factory no tag names
        __hash__ = None  # type: ignore[assignment]

        def __call__(self) -> int:
            return 0

    odd = {"cfg": Config(lr=0.1), "counts": defaultdict(Zero(), a=1), "rows": type("Rows", (list,), {})([1]),
           "out": type("Output", (OrderedDict,), {})(x=1)}  # fmt: skip
    with pytest.warns(UserWarning) as seen:
        out = round_trip(odd)
    (one,) = seen  # one warning a save, naming each
    assert str(one.message).startswith("stored as plain ones, these load as such: /cfg: a Config as a dict; "
                                       "/counts: a defaultdict of <")  # fmt: skip
    assert str(one.message).endswith("not a builtin type, as a dict; /rows: a Rows as a list (and 1 more)")
    assert out == {"cfg": {"lr": 0.1}, "counts": {"a": 1}, "rows": [1], "out": {"x": 1}}
    assert type(out["cfg"]) is dict and type(out["out"]) is OrderedDict


def test_a_tensor_s_python_attributes_are_named_in_the_warning_not_dropped_silently(tmp_path: Path) -> None:
    # torch.save pickles a tensor's __dict__ (Megatron marks parameters this way).
    p = torch.nn.Parameter(torch.ones(2))
    p.tensor_model_parallel = True  # type: ignore[attr-defined]
    p._mark = 2  # type: ignore[attr-defined]
    t = torch.zeros(3)
    t.note = {"a": 1}  # type: ignore[attr-defined]
    compiled = torch.zeros(2)  # torch.compile marks an optimizer's states so: not the trainer's values
    compiled._dynamo_static_input_type = "unguarded"  # type: ignore[attr-defined]
    with pytest.warns(UserWarning) as seen:
        out = round_trip({"p": p, "tied": p, "t": t, "plain": torch.ones(1), "exp_avg": compiled})
    (one,) = seen
    assert str(one.message) == ("stored as plain ones, these load as such: /p: a Parameter without its Python "
                                "attributes (tensor_model_parallel); /t: a Tensor without its Python attributes (note)")
    assert out["p"] is out["tied"] and type(out["p"]) is torch.nn.Parameter and torch.equal(out["t"], t)
    with Checkpointer(tmp_path) as ck, warnings.catch_warnings():
        warnings.simplefilter("error")
        ck.save({"t": torch.zeros(3)}, step=1)
        ck.load_latest(into={"t": t})  # a target's attributes are its own: nothing to say


def test_an_argparse_namespace_and_paths_keep_their_types() -> None:
    # As the timm, DeiT, MAE and torchvision reference scripts save it: checkpoint["args"] = args.
    args = argparse.Namespace(model="vit_small", lr=5e-4, epochs=300, betas=(0.9, 0.999), resume="", clip=None,
                              sched=argparse.Namespace(name="cosine", warmup=5), eps=np.float32(1e-8),
                              output_dir=Path("runs/vit"), data=Path("/datasets/imagenet"))  # fmt: skip
    state = {"args": args, "epoch": 3, "w": torch.ones(2)}
    out = round_trip(state)
    assert type(out["args"]) is argparse.Namespace and out["args"] == args
    assert type(out["args"].betas) is tuple and type(out["args"].eps) is np.float32
    assert type(out["args"].sched) is argparse.Namespace and out["args"].sched.warmup == 5
    assert type(out["args"].output_dir) is type(Path()) and out["args"].data == Path("/datasets/imagenet")
    with pytest.raises(UnsupportedValue, match=r"/args/data: cannot store an object"):  # its values as anywhere
        round_trip({"args": argparse.Namespace(data=object())})
    odd = argparse.Namespace(**{"$x": 1, "not an identifier": 2})
    odd.__dict__[3] = "an int name, as pickle would keep it"
    assert vars(round_trip({"args": odd})["args"]) == vars(odd)


def test_sets_devices_and_bytearrays_keep_their_types_as_torch_load_s_do() -> None:
    # What torch.load(weights_only=True) keeps of these, and a resumed loop may rely on:
    # a set's membership, a bytearray's mutability, a torch.device to move tensors to.
    state = {"seen": {3, "a", (1, 2)}, "device": torch.device("cpu"), "gpu": torch.device("cuda", 1),
             "buf": bytearray(b"\x00\xff"), "empty": set(), "dtypes": {torch.bfloat16, ("f32", torch.float32)},
             "shapes": {torch.Size([2, 3])}, "view_shape": torch.Size([-1, 768])}  # fmt: skip
    out = round_trip(state)
    assert_same(state, out)
    assert out["seen"] == {3, "a", (1, 2)} and out["gpu"] == torch.device("cuda:1")
    out["buf"].extend(b"x")  # still a bytearray
    for odd in (torch.ones(2), (1, torch.ones(1))):  # hashed by identity
        with pytest.raises(UnsupportedValue, match=r"/s: a set holding a tensor or a pickled object; store a list"):
            round_trip({"s": {odd}})
    with pytest.raises(UnsupportedValue, match=r"/s/0: cannot store an Opaque safely"):
        round_trip({"s": {Opaque(1)}})


def test_numpy_arrays_keep_their_shape_and_a_masked_one_is_not_stored_as_a_plain_one(tmp_path: Path) -> None:
    state = {"scalar": np.array(7.0), "strided": np.arange(12.0).reshape(3, 4)[:, ::2]}
    out = round_trip(state)
    assert out["scalar"].shape == () and out["scalar"] == 7.0  # not (1,)
    assert np.array_equal(out["strided"], state["strided"])
    masked = np.ma.masked_array([1.0, 2.0], mask=[False, True])
    with pytest.raises(UnsupportedValue, match=r"/m: cannot store a MaskedArray safely"):  # not without its mask
        round_trip({"m": masked})
    with Checkpointer(tmp_path, allow_pickle=True) as ck:
        ck.save({"m": masked}, step=1)
        assert ck.load_latest(trusted=True)["m"].mask.tolist() == [False, True]
    # Arrays no tensor can hold: refused naming where, or pickled whole when allowed.
    odd = {"be": np.arange(3, dtype=">f4"), "names": np.array(["ab", "c"]), "when": np.array(["2026-12-02"], "M8[s]"),
           "long": np.zeros(2, dtype=np.longdouble)}  # fmt: skip
    for key, a in odd.items():
        with pytest.raises(UnsupportedValue, match=rf"/{key}: cannot store a NumPy array of dtype {re.escape(str(a.dtype))} "
                                                   r"safely; .*allow_pickle=True"):  # fmt: skip
            round_trip({key: a})
    with Checkpointer(tmp_path, allow_pickle=True) as ck:
        ck.save(odd, step=2)
        got = ck.load_latest(trusted=True)
    assert all(np.array_equal(got[k], a) and got[k].dtype == a.dtype for k, a in odd.items())


def layout(a: np.ndarray) -> tuple[Any, ...]:
    return a.dtype, a.shape, a.strides, a.flags.c_contiguous, a.flags.f_contiguous, a.tobytes(order="A")


def test_numpy_arrays_keep_their_order_as_torch_load_gives_them(tmp_path: Path) -> None:
    # Pickle keeps an array in Fortran order (a transposed one, say) so, and copies
    # any other one in C order: torch.load gives each back with those strides.
    w = np.arange(12.0).reshape(3, 4)
    fortran = np.asfortranarray(np.arange(24, dtype=np.int32).reshape(2, 3, 4))
    frozen = w.T.copy(order="F")
    frozen.flags.writeable = False
    state = {"c": w, "t": w.T, "f": fortran, "frozen": frozen, "strided": w[:, ::2], "strided_t": w.T[::2],
             "row": np.arange(3.0)[None, :], "same": [fortran, fortran]}  # fmt: skip
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    want = torch.load(buf, weights_only=False)
    assert want["t"].flags.f_contiguous and not want["t"].flags.c_contiguous  # what the test is about
    for got in (round_trip(state), round_trip(state, async_=True)):
        for key in ("c", "t", "f", "frozen", "strided", "strided_t", "row"):
            assert layout(got[key]) == layout(want[key]), key
        assert got["same"][0] is got["same"][1] and layout(got["same"][0]) == layout(fortran)
    with Checkpointer(tmp_path, keep=1) as ck:
        ck.save(state, step=1)
        # into= arrays in any order, whichever order was saved: read into their memory.
        into = {"t": np.zeros((4, 3), order="F"), "f": np.zeros((2, 3, 4), np.int32), "c": np.zeros((3, 4), order="F"),
                "strided": np.zeros((3, 4))[:, ::2]}  # fmt: skip
        got = ck.load_latest(into=into)
        # Negative strides, which torch cannot view: loaded through a copy, then copied in.
        reversed_row = np.zeros((1, 6))[:, ::-2]
        assert ck.load_latest(into={"row": reversed_row})["row"] is reversed_row
        assert np.array_equal(reversed_row, state["row"])
    for key, target in into.items():
        assert np.array_equal(target, state[key]) and np.shares_memory(got[key], target), key
    assert layout(got["t"]) == layout(want["t"])


def test_into_a_read_only_array_leaves_its_memory_alone(tmp_path: Path) -> None:
    with Checkpointer(tmp_path, keep=1) as ck:
        ck.save({"a": np.array([1, 2], dtype=np.uint16)}, step=1)
        src = bytes([9, 0, 9, 0])
        got = ck.load_latest(into={"a": np.frombuffer(src, dtype=np.uint16)})
    assert got["a"].tolist() == [1, 2] and src == bytes([9, 0, 9, 0])


def test_a_load_into_a_state_with_a_dict_subclass_says_nothing(tmp_path: Path) -> None:
    with Checkpointer(tmp_path, keep=1) as ck, pytest.warns(UserWarning, match="/cfg: a Config as a dict"):
        ck.save({"w": torch.ones(2), "cfg": Config(lr=0.1)}, step=1)
    with Checkpointer(tmp_path) as ck, warnings.catch_warnings():
        warnings.simplefilter("error")  # into= is encoded to be matched, and stores nothing
        got = ck.load_latest(into={"w": torch.zeros(2), "cfg": Config(lr=0.1)})
    assert torch.equal(got["w"], torch.ones(2)) and got["cfg"] == {"lr": 0.1}


def test_a_numpy_scalar_resumes_the_arithmetic_it_was_saved_in() -> None:
    # A loss average kept in float32, as np.mean of a float32 array gives it: read
    # back as a Python float, the next updates would round to float64 instead.
    def ema(avg: Any, steps: range) -> Any:
        for i in steps:
            avg = avg * 0.9 + 0.1 / (i + 1)
        return avg

    saved = ema(np.float32(1.0), range(5))
    assert type(saved) is np.float32
    resumed = ema(round_trip({"avg": saved})["avg"], range(5, 10))
    assert type(resumed) is np.float32 and resumed.tobytes() == ema(np.float32(1.0), range(10)).tobytes()


def test_numpy_scalars_keep_readable_values_in_state_json(tmp_path: Path) -> None:
    with Checkpointer(tmp_path, keep=1) as ck:
        ck.save({"a": np.float32(0.5), "b": np.int64(-3), "c": np.float32("inf")}, step=1)
    tree = json.loads((tmp_path / "step-000000001" / "state.json").read_text())
    assert tree["a"] == {"$npscalar": ["<f4", 0.5]} and tree["b"] == {"$npscalar": ["<i8", -3]}
    assert tree["c"] == {"$npscalar": ["<f4", {"$bytes": "AACAfw=="}]}


@pytest.mark.parametrize("tag", [
    {"$npscalar": ["<f4", [1, 2, 3]]}, {"$npscalar": ["<f8", None]}, {"$npscalar": ["?", "False"]},
    {"$npscalar": ["?", 2]}, {"$npscalar": ["<i1", 1000]}, {"$npscalar": ["<i4", 1.5]},
    {"$npscalar": ["<m8[s]", 5]}, {"$npscalar": ["<f4", {"x": 1}]}, {"$npscalar": ["<f4", {"$bytes": "AAA="}]},
    {"$npscalar": ["<f4"]}, {"$npscalar": [{"a": 1}, 1]}, {"$npscalar": ["O", 1]}, {"$npscalar": ["nonsense", 1]},
    {"$complex": [{"$complex": [1, 2]}, 3]}, {"$complex": ["1", 2]}, {"$complex": [1]},
    {"$defaultdict": ["os.system", {}]}, {"$defaultdict": [{}]}, {"$defaultdict": ["list", [1]]}, {"$counter": [1, 1]},
    {"$namespace": [1]}, {"$namespace": None}, {"$path": ["/a"]},
    {"$set": [[1]]}, {"$set": 1}, {"$device": "gpu:x"}, {"$bytearray": "%%"}, {"$bytes": 5}, {"$dtype": "load"},
    {"$float": "abc"}, {"$float": "1e5"}, {"$int": 5}, {"$size": [1.5]}, {"$size": [2**70]},
    {"$size": [True]}, {"$size": {}}, {"$tuple": 5}, {"$items": [[{"a": 1}, 2]]}, {"$odict": [1]},
    {"$odict": [[1, 2], None]}, {"$namespace": [["a", 1]]}, {"$t": [1]}, {"$np": {}},
    {"$view": {}}, {"$view": {"key": "v", "of": "w", "dtype": "F32", "shape": [2], "stride": [1, 1], "offset": 0}},
    {"$view": {"key": "v", "of": "w", "dtype": "F32", "shape": [2], "stride": [1], "offset": -1}},
    {"$view": {"key": "v", "of": "w", "dtype": "F32", "shape": [2], "stride": [-1], "offset": 1}},
    {"$view": {"key": "v", "of": "w", "dtype": "F32", "shape": [2], "stride": [1], "offset": 1}},
    {"$view": {"key": "v", "of": "w", "dtype": "F32", "shape": [9], "stride": [1], "offset": 0}},
    {"$view": {"key": "v", "of": "w", "dtype": "X9", "shape": [1], "stride": [1], "offset": 0}},
    {"$view": {"key": "v", "of": "w", "dtype": "I32", "shape": [1], "stride": [1], "offset": 0, "requires_grad": True}},
])  # fmt: skip
def test_a_malformed_tag_is_a_corrupt_checkpoint(tag: dict[str, Any]) -> None:
    # state.json is checksummed, so only a writer set on it gets here; its load must
    # fail as damage (skipped for an older checkpoint), never build something else.
    with pytest.raises(CheckpointCorrupt, match=r"state\.json"):
        decode_state({"x": tag}, lambda key: torch.zeros(2), None)  # every entry: 2 floats


class Opaque:
    def __init__(self, x: int) -> None:
        self.x = x


def test_arbitrary_objects_need_allow_pickle(tmp_path: Path) -> None:
    with Checkpointer(tmp_path) as ck, pytest.raises(UnsupportedValue, match="allow_pickle"):
        ck.save({"obj": Opaque(1)}, step=1)
    assert not list(tmp_path.glob("step-*")), "a refused save must not commit anything"


@pytest.mark.skipif(not all(hasattr(torch, n) for n in FP8), reason="needs torch >= 2.7")
def test_fp8_states_of_nvidia_and_amd_gpus_and_mx_scales_come_back_as_torch_load_gives_them(tmp_path: Path) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(0)
    bits = torch.randint(0, 256, (6, 8), dtype=torch.uint8, generator=gen)
    state = {name: bits.clone().view(getattr(torch, name)) for name in FP8}
    state["rows"] = state["float8_e5m2fnuz"][2:4]  # a view of one of them
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    ref = torch.load(buf)
    with Checkpointer(tmp_path) as ck:
        path = ck.save(state, step=1)
        got = ck.load_latest(mmap=True)
        assert_same(ref, got)
        assert_same(ref, ck.load_latest())
        into = {k: torch.zeros_like(v) for k, v in state.items() if k != "rows"}
        got = ck.load_latest(into={**into, "rows": into["float8_e5m2fnuz"][2:4]})
        assert_same(ref, got)
        assert all(got[k] is into[k] for k in into)
    # The data file reads wherever safetensors reads its own files of these dtypes.
    readable = []
    for name in FP8:
        own = tmp_path / f"{name}.safetensors"
        try:
            save_file({"t": state[name]}, str(own))
            with safe_open(str(own), framework="pt") as f:
                f.get_tensor("t")
        except Exception:  # an older safetensors, which does not know this dtype
            continue
        readable.append(name)
    with safe_open(str(path / "tensors-00000.safetensors"), framework="pt") as f:
        for name in readable:
            assert f.get_tensor(name).dtype is state[name].dtype
            assert torch.equal(f.get_tensor(name).view(torch.uint8), bits)
    assert "float8_e4m3fn" in readable  # so the check above ran for one dtype at least


@pytest.mark.skipif(not hasattr(torch, "float8_e4m3fnuz"), reason="needs torch >= 2.2")
@pytest.mark.parametrize("holds", ["tensor", "dtype"])
def test_a_checkpoint_with_a_dtype_this_torch_lacks_is_not_passed_over_as_damaged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, holds: str
) -> None:
    # An older torch than the one that saved: the load must fail saying so, not skip
    # the checkpoint as corrupt and resume from an older one, or from nothing.
    fp8 = torch.zeros(4, dtype=torch.uint8).view(torch.float8_e4m3fnuz)
    with Checkpointer(tmp_path, keep=2) as ck:
        ck.save({"w": torch.ones(4)}, step=1)
        ck.save({"w": fp8} if holds == "tensor" else {"cfg": {"dtype": torch.float8_e4m3fnuz}}, step=2)
        monkeypatch.delattr(torch, "float8_e4m3fnuz")
        for load in (ck.load_latest, functools.partial(ck.load_latest, mmap=True)):
            with pytest.raises(ImportError, match=r"(F8_E4M3FNUZ|torch\.float8_e4m3fnuz)\b.*upgrade torch"):
                load()


def test_a_dtype_with_no_safetensors_name_is_refused_naming_where_and_a_bit_exact_way(tmp_path: Path) -> None:
    if not hasattr(torch, "float4_e2m1fn_x2"):
        pytest.skip("needs torch >= 2.8")
    packed = torch.arange(8, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)  # two FP4 values a byte
    with Checkpointer(tmp_path) as ck:
        with pytest.raises(UnsupportedValue, match=r"^/model/w: tensor dtype float4_e2m1fn_x2 .*t\.contiguous\(\)\.view\(torch\.uint8\)"):
            ck.save({"model": {"w": packed}}, step=1)
        assert not list(tmp_path.glob("step-*"))
        ck.save({"model": {"w": packed.contiguous().view(torch.uint8)}}, step=1)  # what the message says
        back = ck.load_latest()["model"]["w"].view(torch.float4_e2m1fn_x2)
        model_w = torch.zeros(8, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
        ck.load_latest(into={"model": {"w": model_w.view(torch.uint8)}})  # into= the model's, through the same view
    assert back.dtype is packed.dtype and torch.equal(back.view(torch.uint8), packed.view(torch.uint8))
    assert torch.equal(model_w.view(torch.uint8), packed.view(torch.uint8))


_BYTES_ONLY = [name for name in ("complex32", "bits16", "bits8", "float4_e2m1fn_x2") if hasattr(torch, name)]


@pytest.mark.parametrize("name", _BYTES_ONLY)
@pytest.mark.parametrize("shape", [(), (3,), (2, 2)])
def test_following_the_bytes_advice_gives_back_every_bit_at_any_rank(name: str, shape: tuple[int, ...]) -> None:
    # A 0-dim tensor of a dtype wider than a byte does not view as bytes as it is.
    dtype = getattr(torch, name)
    t = torch.arange(math.prod(shape) * dtype.itemsize, dtype=torch.uint8).view(dtype).reshape(shape)
    with pytest.raises(UnsupportedValue) as refused:
        encode_state({"t": t})
    store, back = re.search(r"store a copy of its bytes, (t\.[^,]+), and view them back with (\S+) after", str(refused.value)).groups()
    assert back.startswith(f".view(torch.{name})"), str(refused.value)
    stored = eval(store, {"t": t, "torch": torch})  # the message's own expression
    loaded = eval(f"b{back}", {"b": round_trip({"t": stored})["t"], "torch": torch})
    assert loaded.dtype is dtype and tuple(loaded.shape) == shape
    assert torch.equal(loaded.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))




@dataclasses.dataclass
class TrainConfig:
    lr: float = 0.1


class _Lazy:
    def __getattr__(self, name: str) -> Any:
        raise KeyError(name)  # a config that looks names up: not an AttributeError


def one_sentence(msg: str) -> bool:
    return re.search(r"[.!?]\s+[A-Z]", msg) is None


def _rare_values() -> dict[str, tuple[Any, str]]:
    """Values with no safe form and no advice of their own (docs/loading.md's table has
    it): each, and the type its refusal names."""
    return {
        "masked_array": (np.ma.masked_array([1.0, 2.0], mask=[False, True]), "MaskedArray"),
        "big_endian_array": (np.arange(3, dtype=">f4"), "dtype >f4"),
        "string_array": (np.array(["ab", "c"]), "dtype <U2"),
        "datetime_array": (np.array(["2026-12-02"], "M8[D]"), "dtype datetime64[D]"),
        "record_array": (np.zeros(2, dtype=[("x", "<f4"), ("n", "<i8")]), "dtype [('x'"),
        "long_double_array": (np.zeros(2, dtype=np.longdouble), f"dtype {np.dtype(np.longdouble)}"),
        "object_array": (np.array([1, "a"], dtype=object), "dtype object"),
        "numpy_dtype": (np.dtype([("a", "<i4")]), "dtype"),
        "numpy_void_scalar": (np.zeros(1, dtype=[("x", "i4")])[0], "void"),
        "torch_generator": (torch.Generator().manual_seed(1), "Generator"),
        "numpy_random_state": (np.random.RandomState(1), "RandomState"),
        "numpy_generator": (np.random.default_rng(1), "Generator"),
        "python_random": (random.Random(1), "Random"),
        "dataclass": (TrainConfig(), "TrainConfig"),
        "named_tuple": (collections.namedtuple("Point", "x y")(1, 2), "Point"),
        "enum": (enum.Enum("Strategy", "STEPS").STEPS, "Strategy"),
        "datetime": (datetime.datetime(2026, 12, 3, 9, 30), "datetime"),
        "frozenset": (frozenset({1}), "frozenset"),
        "deque": (collections.deque([1, 2], maxlen=10), "deque"),
        "torch_layout": (torch.sparse_coo, "layout"),
        "memory_format": (torch.channels_last, "memory_format"),
        "a_class": (torch.nn.Linear, "type"),
        "a_module": (random, "module"),
        "object_of_your_own": (Opaque(1), "Opaque"),
        "raising_getattr": (_Lazy(), "_Lazy"),
    }


@pytest.mark.parametrize("key", list(_rare_values()))
def test_a_rare_value_is_refused_naming_its_path_and_type_and_pickles_when_allowed(key: str) -> None:
    value, named = _rare_values()[key]
    with pytest.raises(UnsupportedValue) as refused:
        encode_state({"state": {key: value}})
    msg = str(refused.value)
    assert msg.startswith(f"/state/{key}: ") and named in msg and one_sentence(msg), msg
    assert "allow_pickle=True" in msg, msg
    assert len(encode_state({"state": {key: value}}, allow_pickle=True).objects) == 1  # the escape hatch


def _rare_tensors() -> dict[str, tuple[Any, str]]:
    """Tensors with no plain storage or no stored dtype: each, and the layout or dtype its refusal names."""
    dense = torch.eye(4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # CSC, the block layouts and quantize_per_* warn in some torch releases
        out = {
            "sparse_coo": (dense.to_sparse(), "torch.sparse_coo"),
            "sparse_csr": (dense.to_sparse_csr(), "torch.sparse_csr"),
            "sparse_bsr": (dense.to_sparse_bsr((2, 2)), "torch.sparse_bsr"),
            "nested": (torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), "nested"),
            "quint8": (torch.quantize_per_tensor(torch.randn(6), 0.05, 3, torch.quint8), "quint8"),
            "qint8_per_channel": (torch.quantize_per_channel(torch.randn(2, 3), torch.tensor([0.1, 0.2]),
                                                             torch.tensor([0, 1]), 0, torch.qint8), "qint8"),
            "quint4x2": (torch.quantize_per_tensor(torch.rand(6), 0.07, 1, torch.quint4x2), "quint4x2"),
        }  # fmt: skip
        if torch.backends.mkldnn.is_available():
            out["mkldnn"] = (dense.to_mkldnn(), "torch._mkldnn")
    return out


@pytest.mark.parametrize("key", list(_rare_tensors()))
def test_a_rare_tensor_is_refused_naming_its_path_and_layout_or_dtype(key: str) -> None:
    t, named = _rare_tensors()[key]
    with pytest.raises(UnsupportedValue) as refused:
        encode_state({"model": {key: t}}, allow_pickle=True)  # tensors are never pickled
    msg = str(refused.value)
    assert msg.startswith(f"/model/{key}: ") and named in msg and one_sentence(msg), msg
    # The bytes' view that other dtypes with no stored form are told of kills the process for these.
    if named.startswith(("qint", "quint")):
        assert ".view(" not in msg, msg


# What trainers hold by mistake, and the one fix their refusal names.
_KEPT_ADVICE = {
    "module": (lambda: torch.nn.Linear(2, 2), "Linear", "state_dict()"),
    "optimizer": (lambda: torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1), "SGD", "state_dict()"),
    "scaler": (lambda: torch.amp.GradScaler("cpu"), "GradScaler", "state_dict()"),
    "meta": (lambda: torch.empty(3, device="meta"), "meta device", "to_empty("),
    "lazy": (lambda: torch.nn.LazyLinear(3).weight, "lazy module", "forward pass"),
    **({"complex32": (lambda: torch.ones(2, dtype=torch.complex32), "complex32", "view(torch.uint8)")}
       if hasattr(torch, "complex32") else {}),
}  # fmt: skip


@pytest.mark.parametrize("key", _KEPT_ADVICE)
def test_a_value_trainers_hold_by_mistake_is_refused_naming_its_path_type_and_fix(key: str) -> None:
    make, named, fix = _KEPT_ADVICE[key]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # lazy modules are "experimental"
        value = make()
    with pytest.raises(UnsupportedValue) as refused:
        encode_state({"state": {key: value}})
    msg = str(refused.value)
    assert msg.startswith(f"/state/{key}: ") and named in msg and fix in msg and one_sentence(msg), msg


@dataclasses.dataclass(frozen=True)
class RunKey:
    name: str
    seed: int


@pytest.mark.parametrize("k", [frozenset({2, 1}), RunKey("base", 3), collections.namedtuple("Pair", "x y")(1, 2),
                               np.dtype([("a", "<i4")]), object()], ids=lambda k: type(k).__name__)  # fmt: skip
def test_a_key_is_refused_naming_its_path_the_key_and_its_type(k: Any) -> None:
    with pytest.raises(UnsupportedValue) as refused:
        encode_state({"seen": {k: 3, "n": 1}})
    msg = str(refused.value)
    assert msg.startswith(f"/seen, the key {repr(k)[:60]}") and type(k).__qualname__ in msg, msg
    assert one_sentence(msg) and "allow_pickle=True" in msg, msg


def test_a_value_under_the_key_dollar_key_is_refused_as_a_value_and_a_bad_key_as_a_key() -> None:
    # A "$"-key makes the dict [key, value] pairs: the value's path ends in /$key, as a key's does.
    with pytest.raises(UnsupportedValue, match=r"^/d/\$key: .*frozenset"):
        encode_state({"d": {"$key": frozenset({1})}})
    with pytest.raises(UnsupportedValue, match=r"^/d, the key <object object at \w+>: .*object"):
        encode_state({"d": {object(): 1}})


def test_generator_states_resume_each_generator_where_it_was() -> None:
    torch_gen, rs, rng = torch.Generator().manual_seed(7), np.random.RandomState(7), np.random.default_rng(7)
    out = round_trip({"torch": torch_gen.get_state(), "rs": rs.get_state(), "rng": rng.bit_generator.state})
    g2, rs2, rng2 = torch.Generator(), np.random.RandomState(0), np.random.default_rng(0)
    g2.set_state(out["torch"])
    rs2.set_state(out["rs"])
    rng2.bit_generator.state = out["rng"]
    assert torch.equal(torch.rand(4, generator=g2), torch.rand(4, generator=torch_gen))
    assert np.array_equal(rs2.rand(4), rs.rand(4)) and np.array_equal(rng2.random(4), rng.random(4))


NO_PLAIN_STORAGE = {
    "coo": ("torch.eye(3).to_sparse()", r"layout torch.sparse_coo .*to_dense"),
    "csr": ("torch.eye(3).to_sparse_csr()", r"layout torch.sparse_csr .*to_dense"),
    "nested": ("torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])", r"nested tensor.*unbind"),
    "jagged": ("torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged)",
               r"nested tensor.*unbind"),
    # No memory behind it: a writer that read its bytes would read address 0.
    "meta": ("torch.empty(300, device='meta')", r"meta device has no data.*to_empty"),
    # A lazy module's before its first forward: torch raises at a look at its storage.
    "lazy": ("torch.nn.LazyLinear(3).weight", r"uninitialized parameter or buffer of a lazy module.*forward pass"),
}  # fmt: skip


@pytest.mark.parametrize("kind", NO_PLAIN_STORAGE)
def test_a_tensor_with_no_plain_storage_is_refused_with_the_fix_named(tmp_path: Path, kind: str) -> None:
    # Each of these is a plain torch.Tensor by type (but the jagged one), so the
    # encoder's first check for the common case must not take them. In a child
    # process, so a save that crashes is a failure, not the end of the suite.
    make, message = NO_PLAIN_STORAGE[kind]
    code = f"""
import sys, warnings, torch
import torch.distributed as dist
from slurm_ckpt import Checkpointer, UnsupportedValue, sharded
from slurm_ckpt.config import Config, EngineConfig
warnings.simplefilter("ignore")
run = sys.argv[1]
for how in ("save", "copy", "fork", "overlap", "sharded"):
    state = {{"b": torch.ones(2), "w": {make}}}
    try:
        if how == "save":
            with Checkpointer(run) as ck:
                ck.save(state, step=1)
        elif how == "sharded":
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
            sharded.save(state, run, 1)
        else:
            with Checkpointer(run, config=Config(engine=EngineConfig(snapshot=how))) as ck:
                ck.save_async(state, step=1).wait()
        print(how, "saved")
    except UnsupportedValue as e:
        print(how, e)
"""
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert [line.split()[0] for line in lines] == ["save", "copy", "fork", "overlap", "sharded"], lines
    for line in lines:
        assert re.search(r"^\S+ /w: .*" + message, line), line
    assert not list(tmp_path.glob("step-*")), "a refused save must not commit anything"




# Every layout torch has, and how to make a tensor of it.
_LAYOUTS = {
    "strided": lambda d: d,
    "sparse_coo": lambda d: d.to_sparse(),
    "sparse_csr": lambda d: d.to_sparse_csr(),
    "sparse_csc": lambda d: d.to_sparse_csc(),
    "sparse_bsr": lambda d: d.to_sparse_bsr((2, 2)),
    "sparse_bsc": lambda d: d.to_sparse_bsc((2, 2)),
    "_mkldnn": lambda d: d.to_mkldnn(),
    "jagged": lambda d: torch.nested.nested_tensor(list(d), layout=torch.jagged),
}


def test_every_layout_is_stored_or_refused_naming_the_path_and_the_layout() -> None:
    names = {n for n in dir(torch) if isinstance(getattr(torch, n), torch.layout)}
    assert names <= set(_LAYOUTS), f"layouts with no case here, and maybe no refusal: {names - set(_LAYOUTS)}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # CSC, the block layouts and jagged are "beta" in torch
        for name in sorted(names):
            if name == "_mkldnn" and not torch.backends.mkldnn.is_available():
                continue  # a torch built without oneDNN makes none
            t = _LAYOUTS[name](torch.eye(4))
            if name == "strided":
                assert encode_state({"w": t}).tensors, name
                continue
            with pytest.raises(UnsupportedValue) as refused:
                encode_state({"w": t})
            msg = str(refused.value)
            assert msg.startswith("/w: ") and (f"torch.{name}" in msg or "nested" in msg) and one_sentence(msg), msg


def test_pickled_objects_load_only_when_trusted(tmp_path: Path) -> None:
    with Checkpointer(tmp_path, allow_pickle=True) as ck:
        ck.save({"obj": Opaque(7), "w": torch.ones(2)}, step=1)
    with Checkpointer(tmp_path) as ck:
        with pytest.raises(UnsafeLoad, match="trusted"):
            ck.load_latest()
        out = ck.load_latest(trusted=True)
    assert isinstance(out["obj"], Opaque) and out["obj"].x == 7


class Strategy(str, enum.Enum):
    STEPS = "steps"


class Level(enum.IntEnum):
    HIGH = 2


class Scale(float):
    pass


def test_str_int_and_float_subclasses_are_named_in_the_warning_as_dict_subclasses_are() -> None:
    """A member of a str or int Enum is a str or an int: stored as one, it loads without its
    Enum (``.value`` fails, ``is`` tests fail); torch.save pickles it whole."""

    state = {"cfg": {"save": Strategy.STEPS, "level": Level.HIGH, "scale": Scale(0.5)},
             "names": [np.str_("cat")], "plain": ["s", 1, 0.5, True]}  # fmt: skip
    with pytest.warns(UserWarning) as seen:
        out = round_trip(state)
    (one,) = seen
    assert str(one.message) == ("stored as plain ones, these load as such: /cfg/save: a Strategy as a str; "
                                "/cfg/level: a Level as an int; /cfg/scale: a Scale as a float")  # fmt: skip
    assert out == {"cfg": {"save": "steps", "level": 2, "scale": 0.5}, "names": ["cat"], "plain": ["s", 1, 0.5, True]}
    assert [type(v) for v in out["cfg"].values()] == [str, int, float]
    keyed = {"by": {Strategy.STEPS: 1}, "level": {Level.HIGH: "x"}, "names": {np.str_("cat"): 1}}
    with pytest.warns(UserWarning) as seen:
        out = round_trip(keyed)
    (one,) = seen
    assert str(one.message) == ("stored as plain ones, these load as such: /by/$key: a Strategy as a str; "
                                "/level/$key: a Level as an int")  # fmt: skip
    assert out == {"by": {"steps": 1}, "level": {2: "x"}, "names": {"cat": 1}}
    assert [type(k) for v in out.values() for k in v] == [str, int, str]


def test_a_state_holding_a_cycle_is_refused_naming_it_not_a_recursion_error() -> None:
    looped: dict[str, Any] = {"lr": 0.1}
    looped["self"] = looped
    rows: list[Any] = []
    rows.append((rows,))
    args = argparse.Namespace(lr=0.1)
    args.parent = {"child": args}
    sd: OrderedDict[str, Any] = OrderedDict(w=1)
    sd._metadata = OrderedDict(back=sd)  # type: ignore[attr-defined]
    for state, where in (({"cfg": looped}, "/cfg/self: the dict at /cfg again"),
                         ({"rows": rows}, "/rows/0/0: the list at /rows again"),
                         ({"args": args}, "/args/parent/child: the Namespace at /args again"),
                         ({"sd": sd}, "/sd/$metadata/back: the OrderedDict at /sd again")):  # fmt: skip
        with pytest.raises(UnsupportedValue, match="^" + re.escape(where + ", inside itself; ")):
            encode_state(state, allow_pickle=True)  # not pickled either: containers are walked
    deep: list[Any] = []
    for _ in range(sys.getrecursionlimit()):
        deep = [deep]
    with pytest.raises(UnsupportedValue, match="nested deeper than Python's recursion limit"):
        encode_state({"deep": deep})

"""Round trip of states through a real checkpoint: bit-exact tensors, plain values, ties, pickle opt-in."""

from __future__ import annotations

import math
import struct
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slurm_ckpt import Checkpointer, UnsafeLoad, UnsupportedValue

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
]


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
ints = st.integers() | st.integers(min_value=2**63, max_value=2**300) | st.just(-(2**80))
keys_str = st.text(max_size=8) | st.sampled_from(
    ["$t", "$items", "a/b", "%2F", "__metadata__", "."]
)


@st.composite
def states(draw: st.DrawFn) -> Any:
    pool = draw(st.lists(tensors(), min_size=1, max_size=6))
    leaf = st.none() | st.booleans() | ints | floats | st.text(max_size=10) | st.binary(max_size=10)
    leaf = leaf | st.sampled_from(pool)  # drawing the same object twice makes a tie
    tree = st.recursive(
        leaf,
        lambda kids: (
            st.lists(kids, max_size=4)
            | st.lists(kids, max_size=3).map(tuple)
            | st.dictionaries(keys_str, kids, max_size=4)
            | st.dictionaries(st.integers(-3, 10**20) | keys_str, kids, max_size=4)
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
    elif isinstance(a, float):
        assert struct.pack("<d", a) == struct.pack("<d", b) or (math.isnan(a) and math.isnan(b)), (
            where
        )
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{where}: keys {list(a)} became {list(b)}"
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


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(states())
def test_round_trip_is_exact_and_keeps_ties(state: Any) -> None:
    out = round_trip(state)
    assert_same(state, out)
    before, after = list(leaves(state)), list(leaves(out))
    for i, x in enumerate(before):
        for j in range(i):
            if isinstance(x, torch.Tensor) and x is before[j] and x.numel():
                assert after[i] is after[j], "tied tensors came back as two tensors"


@settings(max_examples=15, deadline=None)
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
        "__metadata__": torch.ones(2),
    }
    out = round_trip(state)
    assert out["tied"]["a"] is out["tied"]["b"]
    assert out["big"] == 10**5000
    assert out["dtype"] is torch.bfloat16 and out["size"] == (2, 3)
    assert_same(
        {k: v for k, v in state.items() if k not in ("dtype", "size")},
        {k: v for k, v in out.items() if k not in ("dtype", "size")},
    )


class Opaque:
    def __init__(self, x: int) -> None:
        self.x = x


def test_arbitrary_objects_need_allow_pickle(tmp_path: Path) -> None:
    with Checkpointer(tmp_path) as ck, pytest.raises(UnsupportedValue, match="allow_pickle"):
        ck.save({"obj": Opaque(1)}, step=1)
    assert not list(tmp_path.glob("step-*")), "a refused save must not commit anything"


@pytest.mark.parametrize("make", [lambda t: t.to_sparse(), lambda t: t.to_sparse_csr()], ids=["coo", "csr"])
def test_a_sparse_tensor_is_refused_with_the_fix_named(tmp_path: Path, make: Any) -> None:
    # A plain torch.Tensor by type, so the encoder's first check for the
    # common case must look at its layout too.
    sparse = make(torch.eye(3))
    assert type(sparse) is torch.Tensor
    with Checkpointer(tmp_path) as ck, pytest.raises(UnsupportedValue, match=r"/w: sparse .*to_dense"):
        ck.save({"w": sparse, "b": torch.ones(2)}, step=1)
    assert not list(tmp_path.glob("step-*"))


def test_pickled_objects_load_only_when_trusted(tmp_path: Path) -> None:
    with Checkpointer(tmp_path, allow_pickle=True) as ck:
        ck.save({"obj": Opaque(7), "w": torch.ones(2)}, step=1)
    with Checkpointer(tmp_path) as ck:
        with pytest.raises(UnsafeLoad, match="trusted"):
            ck.load_latest()
        out = ck.load_latest(trusted=True)
    assert isinstance(out["obj"], Opaque) and out["obj"].x == 7

"""slurm_ckpt.sharded in one process: what a load returns, values through JSON, and errors that name the fix.

Several ranks (per-rank values, resharding) are in ``tests/integration/test_dcp_dist.py``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from slurm_ckpt import Checkpointer, sharded
from slurm_ckpt.errors import CheckpointCorrupt, ConfigError, UnsafeLoad, UnsupportedValue
from slurm_ckpt.store import verify_checkpoint


@pytest.fixture
def one_rank() -> Iterator[Any]:
    """A real process group of one (gloo), for DTensors on a one-device mesh."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def state() -> dict[str, Any]:
    w = torch.randn(40, 30)
    return {
        "model": {"w": w, "b": torch.arange(5)},
        "head": w,  # tied: the same tensor object at two places
        "rng": torch.get_rng_state(),
        "step": 7,
        "sched": {"milestones": {3: 1, 9: 2}, "gamma": float("inf"), "name": "cosine", "t": (1, 2)},
        "blob": b"\x00\xff",
        "odd#rank0": torch.tensor([5.0]),  # looks like the per-rank suffix, and is not one
    }


def test_a_load_without_into_gives_the_state_back_whole(run_dir: Path) -> None:
    s = state()
    path = sharded.save(s, run_dir, 7)
    assert path == run_dir.absolute() / "step-000000007"
    got = sharded.load(run_dir)
    assert got is not None and got.step == 7 and got.path == path
    assert torch.equal(got.state["model"]["w"], s["model"]["w"]) and torch.equal(got.state["rng"], s["rng"])
    assert got.state["head"] is got.state["model"]["w"]  # ties survive
    assert torch.equal(got.state["odd#rank0"], s["odd#rank0"])
    # Only per-rank copies are stored under a per-rank key: here, none.
    stored = verify_checkpoint(path).tensors
    assert not [k for k in stored if re.search(r"#rank\d+$", k)], sorted(stored)
    assert {k: v for k, v in got.state.items() if k not in ("model", "head", "rng", "odd#rank0")} == {
        k: v for k, v in s.items() if k not in ("model", "head", "rng", "odd#rank0")
    }
    # Plain values are JSON, readable by anyone, and nothing is pickled.
    doc = json.loads((path / "state.json").read_text())
    assert doc["trees"][0]["step"] == 7 and doc["per_rank"] == [] and doc["world_size"] == 1
    assert not (path / "objects.pkl").exists()
    assert sharded.load(run_dir / "nothing-here") is None


def test_into_fills_the_given_tensors_in_place(run_dir: Path) -> None:
    s = state()
    sharded.save(s, run_dir, 1)
    into = {"model": {"w": torch.zeros(40, 30), "b": torch.zeros(5, dtype=torch.int64)}}
    got = sharded.load(run_dir, into=into)
    assert got is not None
    assert got.state["model"]["w"] is into["model"]["w"] and torch.equal(into["model"]["w"], s["model"]["w"])
    assert got.state["model"]["b"] is into["model"]["b"] and torch.equal(into["model"]["b"], s["model"]["b"])
    assert torch.equal(got.state["rng"], s["rng"])  # not in into: comes back whole


def test_into_that_does_not_match_is_refused_before_reading(run_dir: Path) -> None:
    sharded.save(state(), run_dir, 1)
    with pytest.raises(ValueError, match=r"into= holds a tensor at into\['model'\]\['extra'\] where .* holds none"):
        sharded.load(run_dir, into={"model": {"extra": torch.zeros(2)}})
    with pytest.raises(ValueError, match=r"shape \[40, 30\], the tensor is \[30, 40\]"):
        sharded.load(run_dir, into={"model": {"w": torch.zeros(30, 40)}})
    with pytest.raises(ValueError, match=r"'model.w'.*meta device.*assign=True"):
        sharded.load(run_dir, into={"model": {"w": torch.zeros(40, 30, device="meta")}})


class Opaque:
    def __eq__(self, other: object) -> bool:
        return isinstance(other, Opaque)


def test_objects_need_allow_pickle_to_save_and_trusted_to_load(run_dir: Path) -> None:
    with pytest.raises(UnsupportedValue, match="allow_pickle=True"):
        sharded.save({"o": Opaque()}, run_dir, 1)
    sharded.save({"o": Opaque(), "w": torch.ones(2)}, run_dir, 2, allow_pickle=True)
    with pytest.raises(UnsafeLoad, match="trusted=True"):
        sharded.load(run_dir)
    got = sharded.load(run_dir, trusted=True)
    assert got is not None and got.state["o"] == Opaque()


def test_a_damaged_block_falls_back_to_the_previous_checkpoint(run_dir: Path) -> None:
    for step in (1, 2):
        sharded.save({"w": torch.full((300_000,), float(step))}, run_dir, step, keep=5)
    newest = run_dir / "step-000000002"
    at = verify_checkpoint(newest).tensors["w"]["chunks"][0]["at"]
    with (newest / "dcp-00000.safetensors").open("r+b") as f:  # the size stays: only the block crc tells
        f.seek(at + 100)
        f.write(b"\x01\x02")
    skipped: list[Any] = []
    got = sharded.load(run_dir, skipped=skipped)
    assert got is not None and got.step == 1 and torch.equal(got.state["w"], torch.full((300_000,), 1.0))
    assert [s.path for s in skipped] == [newest] and "checksum mismatch" in skipped[0].reason
    # Named explicitly, the damaged one is an error, not a silent fallback.
    with pytest.raises(CheckpointCorrupt, match="checksum mismatch"):
        sharded.load(newest)


def test_each_api_loads_what_the_others_wrote(run_dir: Path) -> None:
    import torch.distributed.checkpoint as dcp

    from slurm_ckpt.dcp import StorageReader, StorageWriter

    with Checkpointer(run_dir / "plain", distributed=False) as ck:
        ck.save({"w": torch.ones(2), "step": 4}, step=1)
    with pytest.raises(ConfigError, match=r"holds no DTensor state .* load it with Checkpointer\.load_latest"):
        sharded.load(run_dir / "plain")
    target = {"w": torch.zeros(2), "step": 0}
    dcp.load(target, storage_reader=StorageReader(run_dir / "plain"))
    assert torch.equal(target["w"], torch.ones(2)) and target["step"] == 4
    with pytest.warns(UserWarning, match="single process"):
        dcp.save({"w": torch.full((2,), 2.0), "n": 5}, storage_writer=StorageWriter(run_dir / "raw", step=1))
    got = sharded.load(run_dir / "raw")
    assert got is not None and torch.equal(got.state["w"], torch.full((2,), 2.0)) and got.state["n"] == 5
    sharded.save({"w": torch.full((2,), 3.0), "step": 6}, run_dir / "sharded", 1)
    for name, want in (("raw", 2.0), ("sharded", 3.0)):
        with Checkpointer(run_dir / name, distributed=False) as ck:
            state = ck.load_latest()
            assert torch.equal(state["w"], torch.full((2,), want)) and ck.loaded_step == 1


def test_conjugate_and_negative_views_are_stored_as_their_values(run_dir: Path, one_rank: Any) -> None:
    """DCP's chunks are values with no record of torch's lazy bits: both writers
    store what the bits make of the bytes, which any reader then gets."""
    import torch.distributed.checkpoint as dcp

    from slurm_ckpt.dcp import StorageReader, StorageWriter

    z = torch.randn(6, dtype=torch.complex64)
    s = {"conj": z.conj(), "neg": z.conj().imag}
    sharded.save(s, run_dir / "sharded", 1)
    dcp.save(s, storage_writer=StorageWriter(run_dir / "dcp", step=1))
    for name in ("sharded", "dcp"):
        target = {"conj": torch.zeros(6, dtype=torch.complex64), "neg": torch.zeros(6)}
        dcp.load(target, storage_reader=StorageReader(run_dir / name))
        assert torch.equal(target["conj"], z.conj()) and torch.equal(target["neg"], -z.imag), name


def test_a_dtensor_state_keeps_numpy_arrays_and_tensors_inside_tuples_and_namespaces(run_dir: Path,
                                                                                     one_rank: Any) -> None:  # fmt: skip
    """What an FSDP2 loop saves beside its model: NumPy's and Python's RNG states (a
    tuple holding an array), and tensors inside a tuple or an ``args`` Namespace."""
    import argparse
    import random

    import numpy as np
    from torch.distributed.tensor import Shard, distribute_tensor

    np.random.seed(3)
    rng = np.random.get_state()
    s = {"w": distribute_tensor(torch.arange(8.0), one_rank, [Shard(0)]), "np": rng, "py": random.getstate(),
         "pair": (torch.arange(3.0), 3), "args": argparse.Namespace(lr=0.1, mask=torch.ones(2)),
         "best": np.array(0.25), "proj": np.arange(6.0).reshape(2, 3).T}  # fmt: skip
    frozen = np.arange(8.0).reshape(4, 2).T  # in Fortran order too, read-only, of another shape
    frozen.flags.writeable = False
    s.update(frozen=frozen, twice=[s["proj"], s["proj"]])
    want = np.random.rand(3)
    with Checkpointer(run_dir, scratch=False) as ck:
        ck.save(s, step=1)
        # into= arrays in either order: read into their own memory.
        proj, best = np.zeros((3, 2)), np.zeros(())
        frozen_into = np.zeros((2, 4), order="F")
        got = ck.load_latest(into={"w": distribute_tensor(torch.zeros(8), one_rank, [Shard(0)]), "proj": proj,
                                   "frozen": frozen_into, "best": best})  # fmt: skip
    for key, target in (("proj", proj), ("frozen", frozen_into), ("best", best)):
        assert np.array_equal(target, s[key]) and np.shares_memory(got[key], target), key
    reversed_rows = np.zeros((6, 2))[::-2]  # negative strides, which torch cannot view: loaded into a copy
    assert np.array_equal(sharded.load(run_dir, into={"proj": reversed_rows}).state["proj"], s["proj"])
    loaded = sharded.load(run_dir)
    assert loaded is not None
    for state in (got, loaded.state):
        np.random.set_state(state["np"])
        assert np.array_equal(np.random.rand(3), want)  # NumPy's generator goes on as saved
        assert state["py"] == s["py"]
        assert torch.equal(state["pair"][0], torch.arange(3.0)) and state["pair"][1] == 3
        assert type(state["args"]) is argparse.Namespace and torch.equal(state["args"].mask, torch.ones(2))
        assert state["best"].shape == () and state["best"] == 0.25
        assert np.array_equal(state["proj"], s["proj"]) and np.array_equal(state["frozen"], frozen)
        assert state["twice"][0] is state["twice"][1] and np.array_equal(state["twice"][0], s["proj"])
    # Stored as DCP reads a tensor's bytes, in C order (a plain Checkpointer.save keeps Fortran order).
    assert loaded.state["proj"].flags.c_contiguous
    # dcp.load cannot be given a value holding tensors or arrays: refused before anything is read.
    import torch.distributed.checkpoint as dcp

    from slurm_ckpt.dcp import StorageReader

    target = {"w": distribute_tensor(torch.zeros(8), one_rank, [Shard(0)]), "np": None}
    with pytest.raises(BaseException, match=r"'np' is a value holding tensors or arrays.*Checkpointer\.load_latest"):
        dcp.load(target, storage_reader=StorageReader(run_dir))
    assert torch.equal(target["w"].full_tensor(), torch.zeros(8))


def test_dtensors_save_whole_and_reload_into_dtensors(run_dir: Path, one_rank: Any) -> None:
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    full = torch.randn(12, 6)
    s = {"sharded": distribute_tensor(full, one_rank, [Shard(1)]), "rep": distribute_tensor(full[:2], one_rank, [Replicate()])}
    sharded.save(s, run_dir, 3)
    into = {"sharded": distribute_tensor(torch.zeros(12, 6), one_rank, [Shard(0)])}
    got = sharded.load(run_dir, into=into)
    assert got is not None
    assert isinstance(got.state["sharded"], DTensor) and torch.equal(got.state["sharded"].full_tensor(), full)
    assert not isinstance(got.state["rep"], DTensor) and torch.equal(got.state["rep"], full[:2])


def test_the_checkpointer_saves_dtensors_to_scratch_and_loads_them_after_the_drain(run_dir: Path, one_rank: Any) -> None:
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from slurm_ckpt.dcp.index import global_index
    from slurm_ckpt.store.manifest import is_chunked

    full = torch.randn(8, 6)
    plain = torch.arange(5.0)
    s = {"model": {"w": distribute_tensor(full, one_rank, [Shard(0)]), "b": plain}, "step": 1, "name": "run"}
    scratch = run_dir.parent / "scratch"
    scratch.mkdir()
    with Checkpointer(run_dir, scratch=scratch) as ck:
        assert ck.tiers is not None
        path = ck.save(s, step=1)
        assert path.parent == ck.tiers.fast.path  # scratch first
        ck.wait()  # the background drain copies it to the run dir, verified
    durable = verify_checkpoint(run_dir / "step-000000001", full=True)
    assert is_chunked(durable) and durable.extra["copied_from"] == str(path)
    assert global_index(durable)["model.w"]["placements"] == ["Shard(dim=0)"]
    assert sorted(durable.files) == ["dcp-00000.safetensors", "state.json"]
    import shutil

    shutil.rmtree(scratch / "ckpt")  # the job ended: scratch is gone, the durable copy is what resumes
    with Checkpointer(run_dir, scratch=False) as ck:
        got = ck.load_latest()
        assert ck.loaded_path == run_dir.absolute() / "step-000000001"
        assert not isinstance(got["model"]["w"], DTensor) and torch.equal(got["model"]["w"], full)
        assert torch.equal(got["model"]["b"], plain) and got["step"] == 1 and got["name"] == "run"
        into = {"model": {"w": distribute_tensor(torch.zeros(8, 6), one_rank, [Shard(1)])}}
        got = ck.load_latest(into=into)
        assert got["model"]["w"] is into["model"]["w"] and torch.equal(into["model"]["w"].full_tensor(), full)


def test_save_async_of_dtensors_holds_the_state_as_it_was_when_it_returned(run_dir: Path, one_rank: Any) -> None:
    from torch.distributed.tensor import Shard, distribute_tensor

    w = distribute_tensor(torch.zeros(64, 1024), one_rank, [Shard(0)])
    with Checkpointer(run_dir, scratch=False) as ck:
        h = ck.save_async({"w": w, "b": torch.zeros(3)}, step=1)
        w.to_local().add_(1.0)  # the trainer changes the shard in place at once
        h.wait()
        got = ck.load_latest()
    assert h.mode == "copy" and torch.equal(got["w"], torch.zeros(64, 1024))
    assert torch.equal(w.full_tensor(), torch.ones(64, 1024))


def test_a_dtensor_changed_while_a_save_writes_it_is_not_committed(run_dir: Path, one_rank: Any,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    from torch.distributed.tensor import Shard, distribute_tensor

    import slurm_ckpt.engine.writer as engine_writer
    from slurm_ckpt.errors import SnapshotChanged

    w = distribute_tensor(torch.zeros(300_000), one_rank, [Shard(0)])
    real = engine_writer.write_image

    def racing(path: Path, image: Any, **kw: Any) -> Any:
        w.to_local()[123_456] = 1.0  # another thread writes into the tensor meanwhile
        return real(path, image, **kw)

    monkeypatch.setattr(engine_writer, "write_image", racing)
    with Checkpointer(run_dir, scratch=False) as ck, pytest.raises(SnapshotChanged, match=r"Checkpointer\.save"):
        ck.save({"w": w}, step=1)
    assert not list(run_dir.glob("step-*"))


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental:UserWarning")
def test_a_0_dim_tensor_of_a_dtype_with_no_stored_form_is_told_a_fix_that_works(run_dir: Path, one_rank: Any) -> None:
    """Both sharded writers name the bytes' view of a 0-dim tensor as the plain path
    does: ``t.view(torch.uint8)`` of one fails until it has a dimension."""
    import torch.distributed.checkpoint as dcp

    from slurm_ckpt.dcp import StorageWriter

    t = torch.tensor([1.5 - 2j], dtype=torch.complex32).reshape(())
    for name, save in (("sharded", lambda s: sharded.save(s, run_dir / "sharded", 1)),
                       ("dcp", lambda s: dcp.save(s, storage_writer=StorageWriter(run_dir / "dcp", step=1)))):  # fmt: skip
        with pytest.raises(BaseException) as refused:  # dcp.save wraps it in its CheckpointException
            save({"t": t})
        found = re.search(r"store a copy of its bytes, (t\.[^,]+), and view them back with (\S+) after",
                          str(refused.value))  # fmt: skip
        assert found is not None, str(refused.value)
        store, back = found.groups()
        sharded.save({"t": eval(store, {"t": t, "torch": torch})}, run_dir / f"{name}-fixed", 1)
        got = sharded.load(run_dir / f"{name}-fixed")
        assert got is not None
        loaded = eval(f"b{back}", {"b": got.state["t"], "torch": torch})  # the message's own expressions
        assert loaded.dtype is torch.complex32 and loaded.shape == ()
        assert torch.equal(loaded.reshape(1).view(torch.uint8), t.reshape(1).view(torch.uint8)), name


def test_into_arrays_no_tensor_can_view_get_the_values(run_dir: Path) -> None:
    """A field of a record array and an array with negative strides are loaded through
    copies, whose values they then get, by both loads of a sharded checkpoint."""
    import numpy as np

    state = {"x": np.arange(3.0) + 0.5, "back": np.arange(12.0).reshape(4, 3), "w": torch.ones(2)}
    sharded.save(state, run_dir, 1)
    for how in ("sharded.load", "load_latest"):
        records = np.zeros(3, dtype=[("x", "<f8"), ("n", "<i4")])
        into = {"x": records["x"], "back": np.zeros((4, 6))[::-1, ::2], "w": torch.zeros(2)}
        if how == "sharded.load":
            got = sharded.load(run_dir, into=into)
            assert got is not None
            loaded = got.state
        else:
            with Checkpointer(run_dir, distributed=False) as ck:
                loaded = ck.load_latest(into=into)
        for key in ("x", "back"):
            assert np.shares_memory(loaded[key], into[key]) and np.array_equal(into[key], state[key]), (how, key)
        assert records["x"].tolist() == [0.5, 1.5, 2.5] and torch.equal(into["w"], state["w"]), how


def test_keys_that_dcp_flattens_alike_load_and_into_is_matched_by_place(run_dir: Path, one_rank: Any) -> None:
    """DCP names a value by its path's keys joined with dots: 1 and "1", or "a.b" and
    a's "b", get one name. Such a checkpoint was saved, and then no load could read it
    (DCP refused its metadata); into= matched by such names swapped the tensors."""
    import torch.distributed.checkpoint as dcp

    from slurm_ckpt.dcp import StorageReader

    a, b = torch.full((3,), 1.0), torch.full((3,), 2.0)
    state = {"d": {1: a, "1": b}, "v": {1: 5, "1": 6}, "a.b": 7, "a": {"b": torch.zeros(1)}}
    sharded.save(state, run_dir, 1)
    got = sharded.load(run_dir)
    assert got is not None and got.state["v"] == {1: 5, "1": 6} and got.state["a.b"] == 7
    assert torch.equal(got.state["d"][1], a) and torch.equal(got.state["d"]["1"], b)
    # dcp.load wraps the refusal in its CheckpointException.
    with pytest.raises(BaseException, match=r"DCP's name 'v.1' stands for 2 places of the saved state \(state\['v'\]\['1'\]: "):
        dcp.load({"v": {1: 0}}, storage_reader=StorageReader(run_dir))
    with pytest.raises(BaseException, match=r"name 'd.1' stands for 2 places .*Checkpointer.load_latest"):
        dcp.load({"d": {1: torch.zeros(3)}}, storage_reader=StorageReader(run_dir))
    with pytest.raises(BaseException, match=r"name 'a.b' stands for 2 places .*\(state\['a.b'\] and state\['a'\]\['b'\]: "):
        dcp.load({"a": {"b": torch.zeros(1)}}, storage_reader=StorageReader(run_dir))
    into = {"d": {"1": torch.zeros(3), 1: torch.zeros(3)}}  # the other order: keyed by the path, swapped
    got = sharded.load(run_dir, into=into)
    assert got is not None
    assert torch.equal(into["d"][1], a) and torch.equal(into["d"]["1"], b)
    assert got.state["d"][1] is into["d"][1] and got.state["d"]["1"] is into["d"]["1"]
    one = torch.zeros(3)  # one tensor for two saved apart: DCP would fill it in an order of its own
    with pytest.raises(ValueError, match=r"one tensor for both 'd.1' and \"d.1'\".*load without into="):
        sharded.load(run_dir, into={"d": {1: one, "1": one}})
    assert not one.any()


def test_two_dtensors_over_one_memory_with_other_placements_are_two(run_dir: Path, one_rank: Any) -> None:
    """Given for one DTensor saved at two places, they are one only if they are laid out
    alike over the mesh: the same local tensor as a shard and as a replica is two."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    d = distribute_tensor(torch.arange(8.0).reshape(4, 2), one_rank, [Shard(0)])
    sharded.save({"a": d, "b": d}, run_dir, 1)
    local = torch.zeros(4, 2)
    shard = DTensor.from_local(local, one_rank, [Shard(0)])
    with pytest.raises(ValueError, match=r"one tensor at both into\['a'\] and into\['b'\]"):
        sharded.load(run_dir, into={"a": shard, "b": DTensor.from_local(local, one_rank, [Replicate()])})
    assert not local.any()
    got = sharded.load(run_dir, into={"a": shard, "b": DTensor.from_local(local, one_rank, [Shard(0)])})
    assert got is not None and torch.equal(local, torch.arange(8.0).reshape(4, 2))

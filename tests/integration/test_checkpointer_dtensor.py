"""FSDP2 states through ``Checkpointer.save``/``save_async``/``load_latest``, in real processes (gloo on CPU).

Two ranks train the small FSDP2 model of ``fsdp_state.py`` and save it three
ways: with the shared run dir of the ``Collective`` placement, with a scratch
dir per rank (the ``CrossNode`` placement: each rank's shard on its own
scratch, drained and assembled on the durable tier), and with ``dcp.save`` and
our ``StorageWriter``. Fresh processes at 3 ranks and at 1 then load each with
``Checkpointer.load_latest`` (and the Checkpointer's checkpoint with
``dcp.load``). The references are the full tensors at save time; every
comparison is bit-exact.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path
from typing import Any

import pytest
from fsdp_state import full, mismatches, model, train

from tests.integration.rank_pool import RankPool

pytestmark = pytest.mark.slow

HERE = "tests.integration.test_checkpointer_dtensor"


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory, rank_pool: RankPool) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("ckpt-dtensor")
    args = {k: str(base / k) for k in ("coll", "cross", "raw", "scratch", "ref.pt")}
    results = rank_pool.launch(2, f"{HERE}:_w_save", args, base / "out-save")
    return {"base": base, "args": args, "ranks": results}


def test_each_rank_writes_its_shards_into_one_committed_checkpoint(saved: dict[str, Any]) -> None:
    from slurm_ckpt.dcp.index import global_index
    from slurm_ckpt.store import find_latest, verify_checkpoint
    from slurm_ckpt.store.manifest import is_chunked

    cand = find_latest([Path(saved["args"]["coll"])])
    assert cand is not None and cand.step == 2
    man = verify_checkpoint(cand.path, full=True)
    assert is_chunked(man) and man.world_size == 2
    assert sorted(man.files) == ["rank-00000/dcp-00000.safetensors", "rank-00000/state.json",
                                 "rank-00001/dcp-00001.safetensors"]  # fmt: skip
    index = global_index(man)
    w = index["model.0.weight"]
    assert w["placements"] == ["Shard(dim=1)"] and w["mesh"] == [2]
    assert sorted((c["offsets"], c["file"]) for c in w["chunks"]) == [
        ([0, 0], "rank-00000/dcp-00000.safetensors"), ([0, 48], "rank-00001/dcp-00001.safetensors")]  # fmt: skip
    # The replicated buffer is written by one rank only; the RNG states once per rank.
    assert len(index["model.scale"]["chunks"]) == 1
    assert {"rng#rank0", "rng#rank1"} <= set(index)
    for r in saved["ranks"]:
        assert r["alone_refused"] is True


def test_save_async_holds_the_state_as_it_was_when_it_returned(saved: dict[str, Any]) -> None:
    for r in saved["ranks"]:
        assert r["async_mode"] == "copy"
        assert r["changed_after"] is True  # training did change the tensors in place meanwhile
        assert r["async_equal"] is True


def test_crossnode_shards_are_drained_and_assembled_and_resume_at_the_same_world_size(saved: dict[str, Any]) -> None:
    from slurm_ckpt.store import find_latest
    from slurm_ckpt.store.manifest import is_chunked

    cand = find_latest([Path(saved["args"]["cross"])], full=True)
    assert cand is not None and cand.step == 2 and is_chunked(cand.manifest)
    assert sorted(cand.manifest.extra["shards"]) == ["rank-00000", "rank-00001"]
    for rank, r in enumerate(saved["ranks"]):
        assert r["crossnode"] is True
        assert Path(r["cross_shard"]).is_relative_to(Path(saved["args"]["scratch"]) / f"rank{rank}")
        # A chunked save resumes from the assembled checkpoint, not from each rank's own shard.
        assert r["cross_loaded"] == str(cand.path)
        assert r["cross_mismatches"] == []


@pytest.mark.parametrize("world", [3, 1])
def test_load_latest_at_another_world_size_reshards_all_three(
    saved: dict[str, Any], world: int, rank_pool: RankPool
) -> None:
    base = saved["base"]
    # A damaged block in step 2 of a copy: every rank must move to step 1 together.
    bad = Path(saved["args"]["coll"] + f"-bad{world}")
    shutil.copytree(saved["args"]["coll"], bad)
    data = bad / "step-000000002" / "rank-00001" / "dcp-00001.safetensors"
    with data.open("r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        # Rank 1's rows of the last layer's weight: every world size reads them.
        begin, _ = json.loads(f.read(n))["model.2.weight@20,0"]["data_offsets"]
        f.seek(8 + n + begin + 10)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    args = {**saved["args"], "bad": str(bad)}
    results = rank_pool.launch(world, f"{HERE}:_w_load", args, base / f"out-load{world}")
    for rank, r in enumerate(results):
        assert r["coll"] == [], r["coll"]
        assert r["cross"] == [] and r["raw"] == [] and r["dcp_load"] == []
        assert r["values"] == {"pos": 100 + (rank if rank < 2 else 0), "epoch": 7, "rng_of": rank if rank < 2 else 0}
        assert r["param_groups"] is True
        assert r["bad"] == {"step": 1, "skipped": ["step-000000002"], "equal": True}
        assert r["trained_after_load"] is True
        if world == 1:
            assert r["whole"] == []


def test_a_rank_whose_part_fails_unexpectedly_fails_the_load_on_every_rank_instead_of_hanging(
    saved: dict[str, Any], rank_pool: RankPool
) -> None:
    # Rank 1's plan raises what no check expects (a bug, say); rank 0 is already waiting
    # for every rank's word. A rank that left without it would leave rank 0 waiting forever.
    results = rank_pool.launch(2, f"{HERE}:_w_load_fails", saved["args"], saved["base"] / "out-fails", timeout=120)
    assert [r["error"] for r in results] == ["ConfigError", "RuntimeError"], results
    assert "rank 1: RuntimeError: injected" in results[0]["message"], results[0]


# ---------------------------------------------------------------- the ranks' side


def _state(msd: Any, osd: Any, rank: int) -> dict[str, Any]:
    import torch

    return {"model": msd, "optim": osd, "rng": torch.get_rng_state(), "pos": 100 + rank, "epoch": 7}


def _w_save(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from slurm_ckpt import Checkpointer
    from slurm_ckpt.dcp import StorageWriter
    from slurm_ckpt.errors import ConfigError
    from slurm_ckpt.placement import CrossNode

    out: dict[str, Any] = {}
    m, opt = model(world)
    torch.manual_seed(rank)
    rngs: list[Any] = [None] * world
    with Checkpointer(args["coll"], scratch=False) as ck:
        train(m, opt, 1, rank)
        msd, osd = get_state_dict(m, opt)
        ck.save(_state(msd, osd, rank), step=1)
        ref1 = full({"model": msd, "optim": osd["state"]})
        train(m, opt, 2, rank)
        msd, osd = get_state_dict(m, opt)
        state = _state(msd, osd, rank)
        dist.all_gather_object(rngs, state["rng"].tolist())
        ref2 = full({"model": msd, "optim": osd["state"]})
        h = ck.save_async(state, step=2)
        out["async_mode"] = h.mode
        train(m, opt, 99, rank)  # optimizer.step() changes parameters and moments in place
        out["changed_after"] = bool(mismatches(full({"model": msd, "optim": osd["state"]}), ref2))
        h.wait()
        fresh, fopt = model(world)
        fmsd, fosd = get_state_dict(fresh, fopt)
        got = ck.load_latest(into={"model": fmsd, "optim": fosd})
        set_state_dict(fresh, fopt, model_state_dict=got["model"], optim_state_dict=got["optim"])
        fmsd, fosd = get_state_dict(fresh, fopt)
        out["async_equal"] = ck.loaded_step == 2 and not mismatches(full({"model": fmsd, "optim": fosd["state"]}), ref2)
    with Checkpointer(Path(args["scratch"]) / f"alone{rank}", distributed=False) as alone:
        try:
            alone.save(state, step=1)
            out["alone_refused"] = False
        except ConfigError as e:
            out["alone_refused"] = "every rank of its mesh must save it together" in str(e)

    # Each rank its own scratch, as on two nodes: the CrossNode placement.
    msd, osd = get_state_dict(m, opt)
    cross = _state(msd, osd, rank)
    ref_cross = full({"model": msd, "optim": osd["state"]})
    scratch = Path(args["scratch"]) / f"rank{rank}"
    scratch.mkdir(parents=True)
    with Checkpointer(args["cross"], scratch=scratch) as ck:
        out["crossnode"] = isinstance(ck.placement, CrossNode)
        out["cross_shard"] = str(ck.save(cross, step=2))
        ck.wait()
    dist.barrier()  # every rank's shard drained: step 2 is assembled
    dcp.save({"model": msd, "optim": osd}, storage_writer=StorageWriter(args["raw"], step=2))
    fresh, fopt = model(world)
    fmsd, fosd = get_state_dict(fresh, fopt)
    with Checkpointer(args["cross"], scratch=scratch) as ck:
        got = ck.load_latest(into={"model": fmsd, "optim": fosd})
        out["cross_loaded"] = str(ck.loaded_path)
    set_state_dict(fresh, fopt, model_state_dict=got["model"], optim_state_dict=got["optim"])
    fmsd, fosd = get_state_dict(fresh, fopt)
    out["cross_mismatches"] = mismatches(full({"model": fmsd, "optim": fosd["state"]}), ref_cross)
    if rank == 0:
        torch.save({"ref1": ref1, "ref2": ref2, "cross": ref_cross, "rng": rngs}, args["ref.pt"])
    return out


def _load_into(world: int, ck_or_dir: Any, *, use_dcp: bool = False, **kw: Any) -> tuple[Any, Any, Any]:
    """A fresh model at this world size, loaded from a Checkpointer (or with dcp.load from a run dir)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from slurm_ckpt.dcp import StorageReader

    m, opt = model(world)
    msd, osd = get_state_dict(m, opt)
    if use_dcp:
        got = {"model": msd, "optim": osd}
        dcp.load(got, storage_reader=StorageReader(ck_or_dir))
    else:
        got = ck_or_dir.load_latest(into={"model": msd, "optim": osd}, **kw)
    set_state_dict(m, opt, model_state_dict=got["model"], optim_state_dict=got["optim"])
    return m, opt, got


def _w_load(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from slurm_ckpt import Checkpointer

    ref = torch.load(args["ref.pt"])
    out: dict[str, Any] = {}

    def compare(m: Any, opt: Any, want: dict[str, Any]) -> list[str]:
        msd, osd = get_state_dict(m, opt)
        return mismatches(full({"model": msd, "optim": osd["state"]}), want)

    with Checkpointer(args["coll"], scratch=False) as ck:
        m, opt, got = _load_into(world, ck)
        out["coll"] = compare(m, opt, ref["ref2"])
        rng_of = next((i for i, s in enumerate(ref["rng"]) if s == got["rng"].tolist()), None)
        out["values"] = {"pos": got["pos"], "epoch": got["epoch"], "rng_of": rng_of}
        if world == 1:
            whole = ck.load_latest()
            plain = {f"model.{k}": v for k, v in whole["model"].items()}
            plain |= {f"optim.{k}": v for k, v in full(whole["optim"]["state"]).items()}
            out["whole"] = mismatches(plain, ref["ref2"])
    train(m, opt, 3, rank)  # loaded DTensors work in every torch API, optimizer.step() too
    out["trained_after_load"] = bool(compare(m, opt, ref["ref2"]))
    with Checkpointer(args["cross"], scratch=False) as ck:
        out["cross"] = compare(*_load_into(world, ck)[:2], ref["cross"])
    with Checkpointer(args["raw"], scratch=False) as ck:
        out["raw"] = compare(*_load_into(world, ck)[:2], ref["cross"])
    m, opt, got = _load_into(world, args["coll"], use_dcp=True)
    out["dcp_load"] = compare(m, opt, ref["ref2"])
    out["param_groups"] = got["optim"]["param_groups"][0]["lr"] == 0.01
    skipped: list[Any] = []
    with Checkpointer(args["bad"], scratch=False) as ck:
        m, opt, _ = _load_into(world, ck, skipped=skipped)
        out["bad"] = {"step": ck.loaded_step, "skipped": [s.path.name for s in skipped],
                      "equal": not compare(m, opt, ref["ref1"])}  # fmt: skip
    return out


def _w_load_fails(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from slurm_ckpt import Checkpointer
    from slurm_ckpt.sharded import loader

    if rank == 1:
        def broken(*_: Any, **__: Any) -> Any:
            raise RuntimeError("injected")

        loader._plan = broken  # this process's own copy: the rank exits after
    m, opt = model(world)
    msd, osd = get_state_dict(m, opt)
    with Checkpointer(args["coll"], scratch=False) as ck:
        try:
            ck.load_latest(into={"model": msd, "optim": osd})
        except Exception as e:
            return {"error": type(e).__name__, "message": str(e)}
    return {"error": None, "message": ""}

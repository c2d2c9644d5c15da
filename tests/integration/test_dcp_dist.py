"""FSDP2 states through slurm_ckpt.dcp and slurm_ckpt.sharded, in real processes (gloo on CPU).

Two ranks train a small FSDP2 model (one layer sharded on dim 1, the rest on
dim 0, a replicated buffer) with AdamW and save; then fresh processes at 3
ranks and at 1 rank load it. The references are the full tensors
(``full_tensor()``) at save time; every comparison is bit-exact. A last pair
of ranks is killed with SIGKILL in the middle of a save.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from dist_ranks import start  # the same directory
from fsdp_state import full as _full
from fsdp_state import mismatches as _mismatches
from fsdp_state import model as _model
from fsdp_state import train as _train

from tests.integration.rank_pool import RankPool

pytestmark = pytest.mark.slow

HERE = "tests.integration.test_dcp_dist"


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory, rank_pool: RankPool) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("dcp-dist")
    args = {"run": str(base / "run"), "raw": str(base / "raw"), "ref": str(base / "ref.pt")}
    results = rank_pool.launch(2, f"{HERE}:_w_train_and_save", args, base / "out-save")
    return {"base": base, "args": args, "ranks": results}


def test_same_world_resume_continues_exactly_as_an_uninterrupted_run(saved: dict[str, Any]) -> None:
    for r in saved["ranks"]:
        assert r["resumed_equal"] is True
        assert r["resumed_step"] == 2


def test_dcp_save_and_load_round_trip_at_the_same_world_size(saved: dict[str, Any]) -> None:
    for r in saved["ranks"]:
        assert r["raw_equal"] is True
        assert r["raw_extra"] == {"n": 5, "name": "run"}


def test_async_save_holds_the_state_as_it_was_when_called(saved: dict[str, Any]) -> None:
    for r in saved["ranks"]:
        assert r["async_changed_after"] is True  # the trainer did change the tensors meanwhile
        assert r["async_equal"] is True


def test_a_checkpoint_written_by_two_ranks_is_one_committed_checkpoint(saved: dict[str, Any]) -> None:
    from slurm_ckpt.dcp.index import is_dcp
    from slurm_ckpt.store import find_latest, verify_checkpoint

    run = Path(saved["args"]["run"])
    cand = find_latest([run])
    assert cand is not None and cand.step == 2
    man = verify_checkpoint(cand.path, full=True)
    assert is_dcp(man) and man.world_size == 2
    assert sorted(man.files) == ["dcp-00000.safetensors", "dcp-00001.safetensors", "state.json"]
    w = man.tensors["model.0.weight"]
    assert w["placements"] == ["Shard(dim=1)"] and w["mesh"] == [2] and len(w["chunks"]) == 2
    assert [c["offsets"] for c in w["chunks"]] == [[0, 0], [0, 48]]
    # The replicated buffer is stored once; the per-rank RNG states once per rank.
    assert "model.scale" in man.tensors and "rng#rank0" in man.tensors and "rng#rank1" in man.tensors
    assert not [p for p in run.iterdir() if p.name.startswith(".tmp")]


def test_load_at_three_ranks_reshards_model_and_optimizer(saved: dict[str, Any], rank_pool: RankPool) -> None:
    base = saved["base"]
    results = rank_pool.launch(3, f"{HERE}:_w_load", {**saved["args"], "into": True}, base / "out-load3")
    total = _data_bytes(Path(saved["args"]["run"]))
    for rank, r in enumerate(results):
        assert r["step"] == 2
        assert r["mismatches"] == [], r["mismatches"]
        assert r["raw_mismatches"] == []
        assert r["trained_after_load"] is True
        # Each rank reads its part (and whole small chunks around it), never everything.
        assert r["needed"] <= r["read"] < total
        # Values: per-rank ones come back to the rank that saved them; a new rank gets rank 0's.
        assert r["pos"] == 100 + (rank if rank < 2 else 0)
        assert r["rng_is_saved"] == (rank if rank < 2 else 0)
        assert r["epoch"] == 7


def test_load_at_one_rank_gives_whole_tensors_with_or_without_into(saved: dict[str, Any], rank_pool: RankPool) -> None:
    base = saved["base"]
    (r,) = rank_pool.launch(1, f"{HERE}:_w_load", {**saved["args"], "into": True, "whole": True}, base / "out-load1")
    assert r["mismatches"] == [] and r["whole_mismatches"] == []
    # One rank needs every tensor byte but rank 1's own values, and reads exactly those.
    assert r["read"] == r["needed"] == _tensor_bytes(Path(saved["args"]["run"]), but="#rank1")


def test_kill_9_of_a_writer_mid_save_leaves_the_previous_checkpoint_newest(tmp_path: Path) -> None:
    import torch
    from click.testing import CliRunner

    from slurm_ckpt import sharded
    from slurm_ckpt.cli import main
    from slurm_ckpt.store import find_latest

    run = tmp_path / "run"
    procs = start(2, f"{HERE}:_w_crash", {"run": str(run)}, tmp_path, stdin=subprocess.PIPE)
    try:
        # Rank 1 says when its file of step 2 is written and fsynced, then waits on stdin.
        assert procs[1].stdout is not None
        for line in procs[1].stdout:
            if line.startswith("written step 2"):
                break
        else:
            pytest.fail(f"rank 1 ended before writing step 2: exit {procs[1].wait()}")
        staged = list(run.glob(".tmp-step-000000002-*"))
        assert staged and (staged[0] / "dcp-00001.safetensors").is_file()
        for p in (procs[1], procs[0]):  # a node failure: both writers die at once
            os.kill(p.pid, signal.SIGKILL)
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                p.kill()
            p.wait()
    assert not (run / "step-000000002").exists()
    cand = find_latest([run])
    assert cand is not None and cand.step == 1
    cli = CliRunner().invoke(main, ["resume", "--dir", str(run)])
    assert cli.exit_code == 0 and cli.stdout.strip().endswith("step-000000001")
    # The next writer clears the dead one's staging dir and commits.
    sharded.save({"w": torch.ones(4)}, run, 3)
    assert not list(run.glob(".tmp-*"))
    got = sharded.load(run)
    assert got is not None and got.step == 3 and torch.equal(got.state["w"], torch.ones(4))


def test_two_ranks_on_one_node_commit_on_its_scratch_and_the_drain_makes_it_durable(
    tmp_path: Path, rank_pool: RankPool
) -> None:
    """dcp.save with scratch shared by both ranks (one node): the commit goes to
    ``<scratch>/ckpt`` and the drain copies it to the run dir, which alone then loads
    bit-exact. Ranks naming different scratch dirs (as on two nodes) commit to the run dir."""
    from slurm_ckpt.store import verify_checkpoint

    run, shared = tmp_path / "run", tmp_path / "scratch"
    own = [tmp_path / "scratch-0", tmp_path / "scratch-1"]
    for d in (shared, *own):
        d.mkdir()
    args = {"run": str(run), "shared": str(shared), "own": [str(d) for d in own]}
    ranks = rank_pool.launch(2, f"{HERE}:_w_tiers", args, tmp_path / "out")
    assert ranks[0]["committed"] == [str(shared / "ckpt" / "step-000000001"), str(run / "step-000000002")]
    for r in ranks:
        assert r["drained"] is True
        assert r["loaded_from"] == str(run / "step-000000001")
        assert r["equal"] is True
    man = verify_checkpoint(run / "step-000000001", full=True)
    assert man.extra["copied_from"] == str(shared / "ckpt" / "step-000000001")
    assert sorted(f for f in man.files if f.startswith("dcp-")) == ["dcp-00000.safetensors", "dcp-00001.safetensors"]


def test_async_save_in_dcp_s_own_process_is_done_once_durable(tmp_path: Path, rank_pool: RankPool) -> None:
    """dcp.async_save with a process executor, scratch shared by both ranks: DCP's
    process gets a new copy of the writer for each save, and nothing would wait for
    that copy's drain, so its save ends only once the checkpoint is in the run dir.
    Checked right after each future is done (two saves through one process), and
    again once the job has killed DCP's process; then the run dir alone loads
    bit-exact the state as it was at each call. A third save, whose copy fails,
    fails its future and stays on scratch."""
    run, scratch = tmp_path / "run", tmp_path / "scratch"
    scratch.mkdir()
    ranks = rank_pool.launch(2, f"{HERE}:_w_process_executor", {"run": str(run), "scratch": str(scratch)}, tmp_path / "out")
    assert ranks[0]["durable_when_done"] == [True, True]
    assert (scratch / "ckpt" / "step-000000002").is_dir(), "saved to scratch first"
    assert "is locked by another writer" in ranks[0]["failed"] and ranks[0]["third_durable"] is False
    assert (scratch / "ckpt" / "step-000000003" / "MANIFEST.json").is_file()
    for r in ranks:
        assert r["changed_after"] is True  # the trainer did change the tensors meanwhile
        assert r["equal"] == [True, True]
        assert r["closed"] is True


def _tensor_bytes(run: Path, *, but: str) -> int:
    import math

    from slurm_ckpt.store import find_latest
    from slurm_ckpt.store.codec import torch_dtype

    cand = find_latest([run])
    assert cand is not None
    return sum(math.prod(c["sizes"]) * torch_dtype(e["dtype"]).itemsize
               for k, e in cand.manifest.tensors.items() if not k.endswith(but) for c in e["chunks"])  # fmt: skip


def _data_bytes(run: Path) -> int:
    from slurm_ckpt.store import find_latest

    cand = find_latest([run])
    assert cand is not None
    return sum(r.size for n, r in cand.manifest.files.items() if n.startswith("dcp-"))


# ---------------------------------------------------------------- the ranks' side


def test_a_rank_whose_torch_lacks_a_saved_dtype_fails_every_rank_at_once(tmp_path: Path, rank_pool: RankPool) -> None:
    # Rank 1 stands for a node with an older torch. It must say why, and rank 0 must
    # not wait in the collective load for it until the group's timeout.
    results = rank_pool.launch(2, f"{HERE}:_w_older_torch_on_one_rank", {"run": str(tmp_path / "run")}, tmp_path / "out",
                     timeout=120)  # fmt: skip
    assert results[1]["error"] == "ImportError" and "upgrade torch" in results[1]["message"]
    assert results[0]["error"] == "ConfigError"
    assert "rank 1: ImportError" in results[0]["message"] and "F8_E4M3FNUZ" in results[0]["message"]

def _w_train_and_save(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from slurm_ckpt import sharded
    from slurm_ckpt.dcp import StorageReader, StorageWriter

    out: dict[str, Any] = {}
    model, opt = _model(world)
    torch.manual_seed(rank)
    for step in (1, 2):
        _train(model, opt, step, rank)
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd, "rng": torch.get_rng_state(), "pos": 100 + rank, "epoch": 7}
        sharded.save(state, args["run"], step)
    ref = _full({"model": msd, "optim": osd["state"]})
    rngs: list[Any] = [None] * world
    dist.all_gather_object(rngs, state["rng"].tolist())
    if rank == 0:
        torch.save({"ref": ref, "rng": rngs}, args["ref"])

    # Raw DCP with our writer and reader, at the same world size.
    dcp.save({"model": msd, "optim": osd, "extra": {"n": 5, "name": "run"}}, storage_writer=StorageWriter(args["raw"], step=2))
    fresh, fresh_opt = _model(world)
    fmsd, fosd = get_state_dict(fresh, fresh_opt)
    target = {"model": fmsd, "optim": fosd, "extra": {"n": 0, "name": ""}}
    dcp.load(target, storage_reader=StorageReader(args["raw"]))
    out["raw_equal"] = not _mismatches(_full({"model": fmsd, "optim": fosd["state"]}), ref)
    out["raw_extra"] = target["extra"]

    # Resume at the same world size into fresh objects: training goes on exactly as before.
    for step in (3, 4):
        _train(model, opt, step, rank)
    final = _full(get_state_dict(model, opt)[0])
    model2, opt2 = _model(world)
    msd2, osd2 = get_state_dict(model2, opt2)
    loaded = sharded.load(args["run"], into={"model": msd2, "optim": osd2})
    assert loaded is not None
    set_state_dict(model2, opt2, model_state_dict=loaded.state["model"], optim_state_dict=loaded.state["optim"])
    torch.set_rng_state(loaded.state["rng"])
    for step in (3, 4):
        _train(model2, opt2, step, rank)
    out["resumed_step"] = loaded.step
    out["resumed_equal"] = not _mismatches(_full(get_state_dict(model2, opt2)[0]), final)

    # Async: the checkpoint holds the state as it was at the call, whatever training does next.
    side = dist.new_group(backend="gloo")
    msd, osd = get_state_dict(model, opt)
    before = _full({"model": msd, "optim": osd["state"]})
    fut = sharded.save_async({"model": msd, "optim": osd}, args["raw"], 3, process_group=side)
    _train(model, opt, 99, rank)  # changes parameters and optimizer states in place
    out["async_changed_after"] = bool(_mismatches(_full({"model": msd, "optim": osd["state"]}), before))
    fut.result(timeout=300)
    got = sharded.load(Path(args["raw"]) / "step-000000003", process_group=side)
    out["async_equal"] = got is not None and not _mismatches(_full({"model": got.state["model"], "optim": got.state["optim"]["state"]}), before)
    return out


def _w_load(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from slurm_ckpt import sharded
    from slurm_ckpt.dcp import StorageReader

    saved = torch.load(args["ref"])
    ref = saved["ref"]
    model, opt = _model(world)
    msd, osd = get_state_dict(model, opt)
    got = sharded.load(args["run"], into={"model": msd, "optim": osd})
    assert got is not None
    set_state_dict(model, opt, model_state_dict=got.state["model"], optim_state_dict=got.state["optim"])
    msd2, osd2 = get_state_dict(model, opt)
    out: dict[str, Any] = {
        "step": got.step,
        "read": got.bytes_read,
        "needed": got.bytes_needed,
        "mismatches": _mismatches(_full({"model": msd2, "optim": osd2["state"]}), ref),
        "pos": got.state["pos"],
        "epoch": got.state["epoch"],
        "rng_is_saved": next((i for i, s in enumerate(saved["rng"]) if s == got.state["rng"].tolist()), None),
    }
    _train(model, opt, 3, rank)  # the loaded tensors work in every torch API, optimizer.step() too
    out["trained_after_load"] = bool(_mismatches(_full(get_state_dict(model, opt)[0]), {k: v for k, v in ref.items() if k.startswith("model.")}))
    fresh, fresh_opt = _model(world)
    fmsd, fosd = get_state_dict(fresh, fresh_opt)
    dcp.load({"model": fmsd, "optim": fosd}, storage_reader=StorageReader(args["raw"] + "/step-000000002"))
    out["raw_mismatches"] = _mismatches(_full({"model": fmsd, "optim": fosd["state"]}), ref)
    if args.get("whole"):
        whole = sharded.load(args["run"])
        assert whole is not None
        plain = {f"model.{k}": v for k, v in whole.state["model"].items()}
        plain |= {f"optim.{k}": v for k, v in _full(whole.state["optim"]["state"]).items()}
        out["whole_mismatches"] = _mismatches(plain, ref)
    return out


def _w_crash(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from slurm_ckpt import sharded
    from slurm_ckpt.dcp import StorageWriter

    class StallAfterWrite(StorageWriter):
        def write_data(self, plan: Any, planner: Any) -> Any:
            fut = super().write_data(plan, planner)
            if self.rank == 1:
                print("written step 2", flush=True)
                sys.stdin.readline()  # until the test kills this process
            return fut

    state = {"w": torch.full((1000,), float(rank))}
    sharded.save(state, args["run"], 1)
    big = distribute_tensor(torch.arange(4096.0), init_device_mesh("cpu", (world,)), [Shard(0)])
    dcp.save({"w": big}, storage_writer=StallAfterWrite(args["run"], step=2))
    return {"unexpected": "step 2 finished"}


def _w_tiers(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from slurm_ckpt.dcp import StorageReader, StorageWriter

    model, opt = _model(world)
    _train(model, opt, 1, rank)
    msd, osd = get_state_dict(model, opt)
    ref = _full({"model": msd, "optim": osd["state"]})
    committed = []
    w = StorageWriter(args["run"], step=1, scratch=args["shared"])
    dcp.save({"model": msd, "optim": osd}, storage_writer=w)
    committed.append(str(w.last_committed))
    drained = w.close(timeout=300)  # the coordinator's drain; at once on the other rank
    w = StorageWriter(args["run"], step=2, scratch=args["own"][rank])
    dcp.save({"model": msd, "optim": osd}, storage_writer=w)
    committed.append(str(w.last_committed))
    w.close()
    dist.barrier()
    fresh, fresh_opt = _model(world)
    fmsd, fosd = get_state_dict(fresh, fresh_opt)
    r = StorageReader(Path(args["run"]) / "step-1", scratch=False)
    dcp.load({"model": fmsd, "optim": fosd}, storage_reader=r)
    equal = not _mismatches(_full({"model": fmsd, "optim": fosd["state"]}), ref)
    return {"committed": committed, "drained": drained, "loaded_from": str(r.checkpoint), "equal": equal}


def _w_process_executor(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    from slurm_ckpt.dcp import StorageReader, StorageWriter
    from slurm_ckpt.store import RunDir
    from slurm_ckpt.store.verify import is_committed

    os.environ["MASTER_ADDR"] = "127.0.0.1"  # where DCP's processes meet
    run = Path(args["run"])
    model, opt = _model(world)
    w = StorageWriter(run, scratch=args["scratch"])
    refs, durable, changed = [], [], False
    for step in (1, 2):
        _train(model, opt, 1, rank)
        msd, osd = get_state_dict(model, opt)
        refs.append(_full({"model": msd, "optim": osd["state"]}))
        fut = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=str(run / f"step-{step}"), storage_writer=w,
                             async_checkpointer_type=AsyncCheckpointerType.PROCESS)  # fmt: skip
        _train(model, opt, 1, rank)  # changes the tensors while DCP's process writes
        now = _full({"model": model.state_dict()})
        changed = changed or bool(_mismatches(now, {k: v for k, v in refs[-1].items() if k in now}))
        (fut.upload_completion if hasattr(fut, "upload_completion") else fut).result(timeout=300)
        durable.append(is_committed(run, step))
    # A copy that fails (another writer holds the run dir) fails the future, and
    # the checkpoint stays on scratch for the epilog.
    held = RunDir(run)
    if rank == 0:
        held.lock()
    fut = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=str(run / "step-3"), storage_writer=w,
                         async_checkpointer_type=AsyncCheckpointerType.PROCESS)  # fmt: skip
    try:
        (fut.upload_completion if hasattr(fut, "upload_completion") else fut).result(timeout=300)
        failed = ""
    except CheckpointException as e:  # the copy's error in it
        failed = str(e)
    held.unlock()
    from torch.distributed.checkpoint import _async_process_executor as executor

    proc = executor._CHECKPOINT_PROCESS
    if proc is not None:  # the job ends: nothing of DCP's process outlives it
        proc._save_process.kill()
        proc._save_process.join()
        executor._CHECKPOINT_PROCESS = None
    closed = w.close(timeout=0)
    dist.barrier()
    equal = []
    for step, ref in zip((1, 2), refs, strict=True):
        fresh, fresh_opt = _model(world)
        fmsd, fosd = get_state_dict(fresh, fresh_opt)
        dcp.load({"model": fmsd, "optim": fosd}, storage_reader=StorageReader(run / f"step-{step}", scratch=False))
        equal.append(not _mismatches(_full({"model": fmsd, "optim": fosd["state"]}), ref))
    return {"durable_when_done": durable, "changed_after": changed, "equal": equal, "closed": closed,
            "failed": failed, "third_durable": is_committed(run, 3)}  # fmt: skip


def _w_older_torch_on_one_rank(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    import torch

    from slurm_ckpt import sharded
    from slurm_ckpt.store import codec

    run = Path(args["run"])
    sharded.save({"w": torch.zeros(8, dtype=torch.uint8).view(torch.float8_e4m3fnuz)}, run, 1)
    if rank == 1:  # torch's own collectives name the dtype: only slurm-ckpt's reader is made not to find it
        monkeypatch = pytest.MonkeyPatch()
        monkeypatch.setitem(codec._DTYPES, "F8_E4M3FNUZ", "float8_of_a_newer_torch")
    try:
        sharded.load(run)
    except Exception as e:
        return {"error": type(e).__name__, "message": str(e)}
    return {"error": None, "message": ""}

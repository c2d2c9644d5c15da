"""Peer replicas of scratch shards, in real processes (gloo on CPU), three "nodes".

Three ranks play three nodes (``SLURMD_NODENAME`` node0..node2, one scratch
dir each, one shared durable run dir) and save the small FSDP2 model of
``fsdp_state.py`` with ``scratch.replicas: 1`` and the drain off, so that
every step lives on scratch only. Each shard is copied to the next node's
scratch. Then node2's scratch is wiped, and two fresh ranks on node0 and
node1 resume: the newest step is staged from node0's and node1's own shards
and replicas, assembled on the durable tier and loaded at world size 2,
bit-exact against the state saved. The same at ``replicas: 0`` finds nothing
to resume from.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from fsdp_state import full, mismatches, model, train

from tests.integration.rank_pool import RankPool

pytestmark = pytest.mark.slow

HERE = "tests.integration.test_replicas"


def _w_save(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    import os

    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from slurm_ckpt import Checkpointer
    from slurm_ckpt.config import Config, ScratchConfig, StorageConfig

    os.environ["SLURMD_NODENAME"] = f"node{rank}"
    cfg = Config(storage=StorageConfig(drain=False), scratch=ScratchConfig(replicas=int(args["replicas"])))
    m, opt = model(world)
    out: dict[str, Any] = {}
    scratch = Path(args["scratch"]) / f"node{rank}"
    scratch.mkdir(parents=True, exist_ok=True)
    with Checkpointer(args["run"], scratch=scratch, config=cfg) as ck:
        for step in (1, 2):
            train(m, opt, step, rank)
            msd, osd = get_state_dict(m, opt)
            ck.save({"model": msd, "optim": osd, "step": step}, step=step)
        out["replicated"] = ck.placement.replicated(60)  # type: ignore[attr-defined]
        rep = ck.placement.replicator  # type: ignore[attr-defined]
        out["stats"] = None if rep is None else {"sent": rep.stats.bytes_sent, "received": rep.stats.bytes_received,
                                                 "nodes": rep.stats.nodes}  # fmt: skip
        out["metrics"] = ck.metrics.render()
        ref = full({"model": msd, "optim": osd["state"]})
    if rank == 0:
        torch.save(ref, args["ref"])
    return out


def _w_resume(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    import os

    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from slurm_ckpt import Checkpointer
    from slurm_ckpt.config import Config, ScratchConfig, StorageConfig

    os.environ["SLURMD_NODENAME"] = f"node{rank}"
    cfg = Config(storage=StorageConfig(drain=False), scratch=ScratchConfig(replicas=int(args["replicas"])))
    m, opt = model(world)
    msd, osd = get_state_dict(m, opt)
    with Checkpointer(args["run"], scratch=Path(args["scratch"]) / f"node{rank}", config=cfg) as ck:
        got = ck.load_latest(into={"model": msd, "optim": osd})
        out: dict[str, Any] = {"step": ck.loaded_step, "path": str(ck.loaded_path)}
    if got is None:
        return out
    set_state_dict(m, opt, model_state_dict=got["model"], optim_state_dict=got["optim"])
    msd, osd = get_state_dict(m, opt)
    out["mismatches"] = mismatches(full({"model": msd, "optim": osd["state"]}), torch.load(args["ref"]))
    return out


def _ls(run: str) -> list[str]:
    from click.testing import CliRunner

    from slurm_ckpt.cli import main

    res = CliRunner().invoke(main, ["ls", "--dir", run])
    assert res.exit_code == 0, res.output
    return [" ".join(line.split()) for line in res.stdout.splitlines()[1:]]


def _run(rank_pool: RankPool, base: Path, replicas: int) -> tuple[list[Any], list[Any], dict[str, str]]:
    args = {"run": str(base / "run"), "scratch": str(base / "scratch"), "ref": str(base / "ref.pt"),
            "replicas": str(replicas)}  # fmt: skip
    saved = rank_pool.launch(3, f"{HERE}:_w_save", args, base / "out-save")
    assert not list((base / "run").glob("step-*")), "the drain is off: nothing on the durable tier yet"
    args["ls_saved"] = "\n".join(_ls(args["run"]))
    shutil.rmtree(base / "scratch" / "node2")  # node2 is lost with its scratch
    resumed = rank_pool.launch(2, f"{HERE}:_w_resume", args, base / "out-resume")
    args["ls_resumed"] = "\n".join(_ls(args["run"]))
    return saved, resumed, args


def test_a_step_on_scratch_only_survives_a_lost_node_and_resumes_at_two_ranks_bit_exact(
    tmp_path: Path, rank_pool: RankPool
) -> None:
    saved, resumed, args = _run(rank_pool, tmp_path, replicas=1)
    assert all(r["replicated"] for r in saved)
    scratch = Path(args["scratch"])
    # Ring by node: node k keeps node k-1's shard, committed under a name that says whose it is.
    for k, prev in ((0, 2), (1, 0)):
        rep = scratch / f"node{k}" / "ckpt" / "replicas" / f"rank-{prev:05d}" / "step-000000002"
        man = json.loads((rep / "MANIFEST.json").read_text())
        assert man["extra"]["shard"]["rank"] == prev and man["extra"]["replica"]["from"] == f"node{prev}"
        own = json.loads((scratch / f"node{prev}" / "ckpt" / f"rank-{prev:05d}" / "step-000000002" / "MANIFEST.json").read_text()) \
            if prev != 2 else None  # fmt: skip
        if own is not None:
            assert man["files"] == own["files"] and man["extra"]["save_id"] == own["extra"]["save_id"]
    for r in saved:
        assert r["stats"]["nodes"] == {"1": 2, "2": 2}, r["stats"]
        assert r["stats"]["sent"] > 0 and r["stats"]["received"] > 0
        assert "slurm_ckpt_replica_nodes{" in r["metrics"] and r["metrics"].count("slurm_ckpt_replica_bytes_sent_total{") == 1
    assert sum(r["stats"]["sent"] for r in saved) == sum(r["stats"]["received"] for r in saved)
    index = json.loads((Path(args["run"]) / ".replicas.json").read_text())
    assert index["2"]["nodes"] == 2
    rows = args["ls_saved"].splitlines()
    assert [r.split()[0] for r in rows] == ["2", "1"] and all(r.endswith("on scratch only, on 2 nodes") for r in rows), rows
    # Resume at 2 ranks: step 2, assembled from own shards and node0's replica of node2's.
    assert [r["step"] for r in resumed] == [2, 2], resumed
    assert all(r["mismatches"] == [] for r in resumed), resumed
    man = json.loads((Path(args["run"]) / "step-000000002" / "MANIFEST.json").read_text())
    assert man["world_size"] == 3 and "resume" in man["extra"]["assembled_by"]
    assert args["ls_resumed"].splitlines()[0].endswith("ok (sizes); also on 2 nodes' scratch"), args["ls_resumed"]


def test_without_replicas_the_lost_node_takes_the_step_with_it(tmp_path: Path, rank_pool: RankPool) -> None:
    saved, resumed, args = _run(rank_pool, tmp_path, replicas=0)
    assert all(r["stats"] is None for r in saved)
    assert [r["step"] for r in resumed] == [None, None], resumed
    assert args["ls_saved"] == "" and not (Path(args["run"]) / ".replicas.json").exists()


def _w_damaged(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    from slurm_ckpt.placement.replicas import Replicator
    from slurm_ckpt.store import RunDir
    from slurm_ckpt.store import shards as shd
    from slurm_ckpt.store.codec import encode_state
    from slurm_ckpt.store.manifest import Manifest
    from slurm_ckpt.store.writer import write_state

    fast = Path(args["scratch"]) / f"node{rank}" / "ckpt"
    enc = encode_state({"blob": bytes(range(256)) * 4096, "rank": rank})
    rd = RunDir(fast / shd.shard_name(rank))
    path = rd.commit(3, lambda tmp: write_state(tmp, enc), world_size=world, nbytes=enc.nbytes,
                     extra=shd.shard_extra(rank, world, "cd" * 8))  # fmt: skip
    rd.unlock()
    man = Manifest.read(path)
    if rank == 0:  # rank 0's shard rots on its disk after its commit
        data = path / max(man.files, key=lambda n: man.files[n].size)
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 1
        data.write_bytes(bytes(raw))
    rep = Replicator(dist, dist.new_group(backend="gloo"), rank, world, [(True, "node0"), (True, "node1")], 1,
                     fast, Path(args["run"]), 3)  # fmt: skip
    rep.submit(3, "cd" * 8, shd.LocalShard(3, "cd" * 8, rank, world, path, man))
    done = rep.wait(60)
    rep.close(10)
    held = sorted(str(p.relative_to(fast)) for p in fast.glob("replicas/*/step-*"))
    return {"done": done, "held": held, "nodes": rep.stats.nodes, "sent": rep.stats.bytes_sent}


def test_a_shard_damaged_on_its_disk_is_sent_but_never_committed_as_a_replica(
    tmp_path: Path, rank_pool: RankPool
) -> None:
    args = {"run": str(tmp_path / "run"), "scratch": str(tmp_path / "scratch")}
    (tmp_path / "run").mkdir()
    got = rank_pool.launch(2, f"{HERE}:_w_damaged", args, tmp_path / "out")
    assert [g["done"] for g in got] == [True, True]
    assert all(g["sent"] > 0 for g in got)
    # node1 got rank 0's bytes, which do not match rank 0's manifest: no replica there; node0 holds rank 1's.
    assert got[1]["held"] == [] and got[0]["held"] == ["replicas/rank-00001/step-000000003"], got
    assert got[0]["nodes"] == {"3": 1}  # rank 0's shard lives on one node only
    assert not list((tmp_path / "scratch" / "node1" / "ckpt" / "replicas").glob("*/.tmp-*"))

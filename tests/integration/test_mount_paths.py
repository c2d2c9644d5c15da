"""Ranks that reach the run dir by different paths save and load one checkpoint, by every route.

On a cluster each node may mount the shared filesystem at a place of its own,
so rank 0 sees the run dir as ``/mnt/a/run`` and rank 1 as ``/mnt/b/run``:
what the ranks send each other about a checkpoint must be a name in the run
dir, never a path. Here each rank runs in a mount namespace of its own, in
which one shared directory is bind-mounted at that rank's own path
(``m0`` or ``m1``); the other rank's path does not lead there. The storage lab
runs the same worker on two mounts of GlusterFS and CephFS
(``tests/storage/test_storage_sharded.py``).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.integration import dist_ranks

pytestmark = pytest.mark.root

WORKER = "tests.integration.test_mount_paths:_w_routes"
ROWS = 512  # rows of the sharded weight: 512 x 64 float32


def _weight(scale: float) -> Any:
    import torch

    g = torch.Generator().manual_seed(43)
    return torch.randn(ROWS, 64, generator=g) * scale


def _w_routes(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    """Save and load through Checkpointer (without scratch, and with each rank's own
    scratch ``args["scratch"][rank]``), sharded (sync and async) and dcp with our writer
    and reader, each rank in its own dir ``args["dirs"][rank]``."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from slurm_ckpt import Checkpointer, sharded
    from slurm_ckpt.dcp import StorageReader, StorageWriter

    base = Path(args["dirs"][rank])
    assert not Path(args["dirs"][1 - rank]).exists(), "the other rank's path must not reach the shared dir"
    mesh = init_device_mesh("cpu", (world,))

    def state(scale: float) -> dict[str, Any]:
        return {"model": {"w": distribute_tensor(_weight(scale), mesh, [Shard(0)])}, "step": int(scale)}

    def same(got: Any, scale: float) -> bool:
        rows = ROWS // world  # this rank's rows of the weight (Shard(0)); no collective: got may be None
        mine = _weight(scale)[rank * rows:(rank + 1) * rows]
        return got is not None and bool(torch.equal(got["model"]["w"].to_local(), mine))

    out: dict[str, Any] = {}
    with Checkpointer(base / "ck", scratch=False) as ck:
        out["Checkpointer.save"] = ck.save(state(1), step=1).name
        got = ck.load_latest(into=state(0))
        out["Checkpointer.load_latest"] = [ck.loaded_step, same(got, 1)]

    run = base / "sharded"
    out["sharded.save"] = sharded.save(state(2), run, 2).name
    group = dist.new_group(backend="gloo")  # save_async runs its collectives on a thread
    out["sharded.save_async"] = sharded.save_async(state(3), run, 3, process_group=group).result(timeout=60).name
    loaded = sharded.load(run, into=state(0))
    out["sharded.load"] = None if loaded is None else [loaded.step, same(loaded.state, 3)]

    # Each rank its own scratch: the cross-node placement, whose DTensor checkpoints
    # resume from the durable tier (the run dir) once the drains assembled them.
    with Checkpointer(base / "cross", scratch=args["scratch"][rank]) as ck:
        ck.save(state(5), step=5)
        ck.wait()
    dist.barrier()  # both shards staged: the last one in committed step 5
    with Checkpointer(base / "cross", scratch=args["scratch"][rank]) as ck:
        got = ck.load_latest(into=state(0))
        out["cross-node load_latest"] = [ck.loaded_step, same(got, 5)]

    run = base / "dcp"
    dcp.save(state(4), storage_writer=StorageWriter(run, step=4, scratch=False))
    into = state(0)
    dcp.load(into, storage_reader=StorageReader(run))
    out["dcp.save"] = sorted(p.name for p in run.iterdir() if p.name.startswith("step-"))
    out["dcp.load"] = same(into, 4)
    return out


def _bind_each_rank(shared: Path, mounts: list[Path]) -> dist_ranks.Wrap:
    """Rank r in a mount namespace of its own, with ``shared`` bind-mounted at ``mounts[r]``."""

    def wrap(rank: int) -> list[str]:
        return ["unshare", "--mount", "--propagation", "private",
                "sh", "-c", 'mount --bind "$0" "$1" && shift && exec "$@"', str(shared), str(mounts[rank])]  # fmt: skip

    return wrap


def run_routes(dirs: list[Path], out: Path, *, wrap: dist_ranks.Wrap) -> list[dict[str, Any]]:
    """Run the worker on two ranks, rank r with its run dirs under ``dirs[r]``; their results by rank."""
    scratch = [out / f"scratch{r}" for r in range(2)]
    for d in scratch:
        d.mkdir(parents=True)
    args = {"dirs": [str(d) for d in dirs], "scratch": [str(d) for d in scratch]}
    return dist_ranks.launch(2, WORKER, args, out, timeout=90, wrap=wrap)


def check_routes(ranks: list[dict[str, Any]]) -> None:
    for r, got in enumerate(ranks):
        assert got == {
            "Checkpointer.save": "step-000000001",
            "Checkpointer.load_latest": [1, True],
            "sharded.save": "step-000000002",
            "sharded.save_async": "step-000000003",
            "sharded.load": [3, True],
            "cross-node load_latest": [5, True],
            "dcp.save": ["step-000000004"],
            "dcp.load": True,
        }, f"rank {r}: {got}"


def test_ranks_on_two_paths_to_one_dir_save_and_load_one_checkpoint_by_every_route(tmp_path: Path) -> None:
    from slurm_ckpt.store import verify_checkpoint

    if os.geteuid() != 0:
        pytest.skip("bind mounts in a mount namespace need root")
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1): the ranks need mount namespaces of their own")
    shared, mounts = tmp_path / "shared", [tmp_path / "m0", tmp_path / "m1"]
    for d in (shared, shared / "runs", *mounts):
        d.mkdir()
    check_routes(run_routes([m / "runs" for m in mounts], tmp_path / "out", wrap=_bind_each_rank(shared, mounts)))
    # One checkpoint per save, both ranks' parts in it, in the one shared dir.
    for run, step in (("ck", 1), ("sharded", 3), ("cross", 5), ("dcp", 4)):
        man = verify_checkpoint(shared / "runs" / run / f"step-{step:09d}", full=True)
        assert man.world_size == 2, (run, man.world_size)

"""A sharded save by two ranks on two mounts of one network filesystem commits one checkpoint.

Rank 0 sees the filesystem only through mount ``a``, rank 1 only through
mount ``b``: each rank runs in a mount namespace of its own from which the
other mount is gone, as on two nodes. The state holds a DTensor sharded over
both ranks (gloo on CPU), a tensor that differs between the ranks and plain
values; it is saved with ``Checkpointer.save``, loaded back collectively by
the ranks through their own mounts, and whole by one process through each
mount, and compared bit for bit.
"""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.integration import dist_ranks
from tests.integration.test_mount_paths import check_routes, run_routes
from tests.storage.lab import Lab

pytestmark = pytest.mark.root

HERE = "tests.storage.test_storage_sharded"
ROWS = 4096  # rows of the sharded weight: 4096 x 256 float32, 4 MiB
STEP = 7


def _full_weight() -> Any:
    import torch

    g = torch.Generator().manual_seed(41)
    return torch.randn(ROWS, 256, generator=g)


def _w_save_and_load(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from slurm_ckpt import Checkpointer
    from slurm_ckpt.store import verify_checkpoint
    from slurm_ckpt.store.manifest import is_chunked

    run = Path(args["dirs"][rank])
    # The other rank's mount is not there for this rank.
    assert not Path(args["dirs"][1 - rank]).parent.exists()
    mesh = init_device_mesh("cpu", (world,))
    weight = distribute_tensor(_full_weight(), mesh, [Shard(0)])
    state = {"model": {"w": weight}, "own": torch.full((16,), float(rank)), "step": STEP}
    with Checkpointer(run, scratch=False, keep=2) as ck:
        path = ck.save(state, step=STEP)
        assert path.parent == run, f"rank {rank} committed {path}, not in its own run dir {run}"
        into = {"model": {"w": distribute_tensor(torch.zeros(ROWS, 256), mesh, [Shard(0)])},
                "own": torch.zeros(16), "step": 0}  # fmt: skip
        got = ck.load_latest(into=into)
        loaded_step = ck.loaded_step
    return {
        "path": path.name,
        "chunked": is_chunked(verify_checkpoint(path)),
        "loaded_step": loaded_step,
        "shard_equal": bool(torch.equal(got["model"]["w"].to_local(), weight.to_local())),
        "own": got["own"].tolist()[:1],
    }


def _on_own_mount(lab: Lab, fs: str) -> dist_ranks.Wrap:
    """Rank r on mount r only: its own mount namespace, with the other mount unmounted there."""

    def wrap(rank: int) -> list[str]:
        other = lab.mount(fs, "b" if rank == 0 else "a")
        return ["unshare", "--mount", "--propagation", "private", "sh", "-c", 'umount -l "$0" && exec "$@"',
                str(other)]  # fmt: skip

    return wrap


def _launch(lab: Lab, fs: str, dirs: list[Path], out: Path) -> list[dict[str, Any]]:
    return dist_ranks.launch(2, f"{HERE}:_w_save_and_load", {"dirs": [str(d) for d in dirs]}, out, timeout=120,
                             wrap=_on_own_mount(lab, fs))  # fmt: skip


@pytest.mark.parametrize("fs", ["gluster", "ceph"])
def test_sharded_save_from_ranks_on_both_mounts_commits_one_checkpoint(lab: Lab, fs: str, tmp_path: Path) -> None:
    import torch

    from slurm_ckpt import Checkpointer
    from slurm_ckpt.store import verify_checkpoint

    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1): the ranks need mount namespaces of their own")
    name = f"s-{uuid.uuid4().hex[:8]}"
    a, b = lab.mount(fs, "a") / name, lab.mount(fs, "b") / name
    a.mkdir()
    try:
        ranks = _launch(lab, fs, [a / "run", b / "run"], tmp_path / "out")
        for r, got in enumerate(ranks):
            assert got["path"] == f"step-{STEP:09d}", got
            assert got["loaded_step"] == STEP and got["shard_equal"] is True, (r, got)
            assert got["own"] == [float(r)], (r, got)
            assert got["chunked"] is True, got
        # One checkpoint, as both mounts see it: both ranks' shards, verified in full.
        for mount in (a, b):
            steps = [p.name for p in (mount / "run").iterdir() if not p.name.startswith(".")]
            assert steps == [f"step-{STEP:09d}"], steps
            man = verify_checkpoint(mount / "run" / steps[0], full=True)
            assert man.world_size == 2
            assert {f.split("/")[0] for f in man.files} == {"rank-00000", "rank-00001"}
            # Whole, by one process, through this mount.
            with Checkpointer(mount / "run", scratch=False) as ck:
                whole = ck.load_latest()
            assert whole is not None and whole["step"] == STEP
            assert torch.equal(whole["model"]["w"], _full_weight())
    finally:
        shutil.rmtree(a, ignore_errors=True)


@pytest.mark.parametrize("fs", ["gluster", "ceph"])
def test_sharded_and_dcp_saves_from_ranks_on_both_mounts_load_on_both(lab: Lab, fs: str, tmp_path: Path) -> None:
    from slurm_ckpt.store import verify_checkpoint

    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1): the ranks need mount namespaces of their own")
    name = f"r-{uuid.uuid4().hex[:8]}"
    a, b = lab.mount(fs, "a") / name, lab.mount(fs, "b") / name
    (a / "runs").mkdir(parents=True)
    try:
        check_routes(run_routes([a / "runs", b / "runs"], tmp_path / "out", wrap=_on_own_mount(lab, fs)))
        for mount in (a, b):
            for run, step in (("ck", 1), ("sharded", 3), ("cross", 5), ("dcp", 4)):
                man = verify_checkpoint(mount / "runs" / run / f"step-{step:09d}", full=True)
                assert man.world_size == 2, (mount, run, man.world_size)
    finally:
        shutil.rmtree(a, ignore_errors=True)

"""The epilog's stage-out child against a hostile user: where it writes, what it writes, what it holds.

Real unprivileged user, scratch on its own tmpfs with per-job loop filesystems,
durable run dirs on the test's temp filesystem, /dev/shm as the node's memory.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

import filelock
import pytest

from slurm_ckpt.node import run_epilog, run_prolog
from slurm_ckpt.node.stageresult import StageResult
from slurm_ckpt.store import verify_checkpoint
from slurm_ckpt.store.layout import list_steps
from slurm_ckpt.store.manifest import MANIFEST, Manifest
from tests.node.helpers import User, craft_ckpt, make_cfg, owned_tree, write_ckpt

MiB = 2**20


@pytest.fixture
def shm(user: User) -> Path:
    """A name in /dev/shm (the node's memory) for this test, removed afterwards."""
    path = Path("/dev/shm") / f"sckt-{user.name}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


def tier(job: Path, durable: Path, user: User) -> None:
    """The job's TIER.json, as its user writes it."""
    user.run("sh", "-c", f"printf '{{\"durable\": \"{durable}\"}}' > {job}/ckpt/TIER.json")


def test_a_destination_outside_the_roots_or_on_scratch_is_refused(pub_tmp: Path, scratch_base: Path, user: User,
                                                                  shm: Path) -> None:  # fmt: skip
    root = pub_tmp / "shared"
    mine = root / user.name
    owned_tree(mine, user)
    # storage.root and a second allowed root, which holds the scratch filesystem too.
    cfg = make_cfg(scratch_base, root, stage_out_roots=(root, pub_tmp))
    cases = {
        "41": shm / "x",  # the node's memory
        "42": Path("/tmp") / f"sckt-{user.name}-x",  # the root filesystem
        "43": scratch_base / f"sckt-{user.name}",  # allowed root, but the scratch filesystem
        "44": mine / "link" / "run",  # a link inside an allowed root, into /dev/shm
    }
    user.run("mkdir", str(shm))
    user.run("ln", "-s", str(shm), str(mine / "link"))
    for job_id, durable in cases.items():
        env = user.env(job_id, SLURM_JOB_COMMENT="ckpt_scratch=16M")
        run_prolog(env, cfg)
        job = scratch_base / f"job_{job_id}"
        write_ckpt(job / "ckpt", 4, owner=user)
        tier(job, durable, user)
        res = run_epilog(env, cfg)
        assert res is not None and res.status == "staged", res
        # Refused, and said so; the checkpoint went to the default run dir instead.
        assert f"refused {durable}" in res.detail and res.path == str(mine / f"job_{job_id}" / "step-000000004")
        verify_checkpoint(Path(res.path), full=True)
        assert not os.path.lexists(durable) and not job.exists()
    assert os.listdir(shm) == []


def test_an_allowed_destination_is_used_through_its_fd(pub_tmp: Path, scratch_base: Path, user: User) -> None:
    root, other = pub_tmp / "shared", pub_tmp / "project"
    owned_tree(root / user.name, user)
    owned_tree(other, user)
    cfg = make_cfg(scratch_base, root, stage_out_roots=(root, other))
    env = user.env("45")
    run_prolog(env, cfg)
    job = scratch_base / "job_45"
    write_ckpt(job / "ckpt", 2, owner=user)
    tier(job, other / "deep" / "run", user)  # missing dirs are made, as the user
    res = run_epilog(env, cfg)
    assert res is not None and res.status == "staged" and res.path == str(other / "deep" / "run" / "step-000000002")
    assert "/proc/self/fd" not in res.detail and "refused" not in res.detail
    assert os.stat(other / "deep" / "run").st_uid == user.uid


def test_a_sparse_checkpoint_past_the_reservation_is_not_written_out_dense(pub_tmp: Path, scratch_base: Path,
                                                                           user: User) -> None:  # fmt: skip
    root = pub_tmp / "shared"
    durable = root / user.name / "job_46"
    owned_tree(root / user.name, user)
    cfg = make_cfg(scratch_base, root)
    env = user.env("46", SLURM_JOB_COMMENT="ckpt_scratch=8M")
    run_prolog(env, cfg)
    ckpt = scratch_base / "job_46" / "ckpt"
    write_ckpt(ckpt, 1, owner=user)
    # 96 MiB of holes in an 8 MiB scratch: checksums and sizes all valid, no blocks stored.
    sparse = craft_ckpt(ckpt, 2, {"blob.bin": 96 * MiB}, owner=user)
    assert os.stat(sparse / "blob.bin").st_blocks * 512 < MiB
    res = run_epilog(env, cfg)
    assert res is not None and res.status == "staged" and res.step == 1, res  # the older, dense one
    assert "sparse files of 100663296 bytes" in res.detail
    assert [s for s, _ in list_steps(durable)] == [1]
    # Alone on scratch, it is not staged at all, and scratch is kept for the admin to see.
    env = user.env("47", SLURM_JOB_COMMENT="ckpt_scratch=8M")
    run_prolog(env, cfg)
    craft_ckpt(scratch_base / "job_47" / "ckpt", 2, {"blob.bin": 96 * MiB}, owner=user)
    res = run_epilog(env, cfg)
    assert res is not None and res.status == "failed" and "written out dense" in res.detail
    assert not (root / user.name / "job_47").exists() or not list_steps(root / user.name / "job_47")


def test_a_sparse_file_within_the_reservation_is_staged(pub_tmp: Path, scratch_base: Path, user: User) -> None:
    root = pub_tmp / "shared"
    owned_tree(root / user.name, user)
    cfg = make_cfg(scratch_base, root)
    env = user.env("48", SLURM_JOB_COMMENT="ckpt_scratch=16M")
    run_prolog(env, cfg)
    craft_ckpt(scratch_base / "job_48" / "ckpt", 3, {"blob.bin": 4 * MiB, "x.json": b"{}"}, owner=user)
    res = run_epilog(env, cfg)
    assert res is not None and res.status == "staged" and res.step == 3, res


def test_the_durable_side_gets_the_scratch_screens(pub_tmp: Path, scratch_base: Path, user: User) -> None:
    """A durable checkpoint with a FIFO for a file, or an oversized manifest, is no newer checkpoint."""
    root = pub_tmp / "shared"
    durable = root / user.name / "job_49"
    owned_tree(durable, user)
    cfg = make_cfg(scratch_base, root)
    env = user.env("49")
    run_prolog(env, cfg)
    write_ckpt(scratch_base / "job_49" / "ckpt", 5, owner=user)
    # Step 9: its manifest names a 0-byte file, which is a FIFO (sizes match; never opened).
    fifo = craft_ckpt(durable, 9, {"x.bin": b""}, owner=user)
    (fifo / "x.bin").unlink()
    user.run("mkfifo", str(fifo / "x.bin"))
    # Step 8: a valid manifest past the 64 MiB the scratch side accepts.
    big = craft_ckpt(durable, 8, {"y.bin": b"y"}, owner=user, extra={"pad": " " * (65 * MiB)})
    assert (big / MANIFEST).stat().st_size > 64 * MiB and Manifest.read(big).step == 8
    res = run_epilog(env, cfg)
    assert res is not None and res.status == "staged" and res.step == 5, res
    verify_checkpoint(durable / "step-000000005", full=True)


def test_the_durable_side_gets_the_screens_for_shards_too(pub_tmp: Path, scratch_base: Path, user: User) -> None:
    """A sharded job's stage-out decides what the durable tier still needs with the same screens."""
    from slurm_ckpt.store.shards import new_save_id, shard_extra

    root = pub_tmp / "shared"
    durable = root / user.name / "job_51"
    owned_tree(durable, user)
    cfg = make_cfg(scratch_base, root)
    env = user.env("51")
    run_prolog(env, cfg)
    # This node's shard (rank 0 of 2) of step 5, and on the durable tier a "step 9" whose file is a FIFO.
    rank = scratch_base / "job_51" / "ckpt" / "rank-00000"
    craft_ckpt(rank, 5, {"x.bin": b"shard"}, owner=user, extra=shard_extra(0, 2, new_save_id()))
    fifo = craft_ckpt(durable, 9, {"x.bin": b""}, owner=user)
    (fifo / "x.bin").unlink()
    user.run("mkfifo", str(fifo / "x.bin"))
    res = run_epilog(env, cfg)
    assert res is not None and res.status == "staged" and "waiting for other nodes' shards" in res.detail, res
    assert list(durable.glob(".shards-step-000000005-*/rank-00000"))


def _child_of(uid: int, deadline: float) -> int:
    """Our forked stage-out child, once it runs as ``uid``."""
    while time.monotonic() < deadline:
        for proc in Path("/proc").iterdir():
            try:
                status = (proc / "status").read_text() if proc.name.isdigit() else ""
            except OSError:
                continue
            if f"\nPPid:\t{os.getpid()}\n" in status and f"\nUid:\t{uid}\t" in status:
                return int(proc.name)
        time.sleep(0.005)
    raise AssertionError("the stage-out child never appeared")


def test_the_child_holds_no_fd_that_root_opened(pub_tmp: Path, scratch_base: Path, user: User) -> None:
    root = pub_tmp / "shared"
    durable = root / user.name / "job_50"
    owned_tree(durable, user)
    user.run("touch", str(durable / ".lock"))
    secret = pub_tmp / "root-secret"
    secret.write_text("root only\n")
    secret.chmod(0o600)
    cfg = make_cfg(scratch_base, root)
    env = user.env("50")
    run_prolog(env, cfg)
    write_ckpt(scratch_base / "job_50" / "ckpt", 3, owner=user)
    held = os.open(secret, os.O_RDONLY)  # inheritable, like any fd a hook might hold
    result: list[StageResult | None] = []
    try:
        # The test holds the run dir's lock: the child waits there, as the user, while we look.
        with filelock.FileLock(str(durable / ".lock")):
            t = threading.Thread(target=lambda: result.append(run_epilog(env, cfg)))
            t.start()
            pid = _child_of(user.uid, time.monotonic() + 10)
            fds = {}
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    fds[int(fd)] = os.readlink(f"/proc/{pid}/fd/{fd}")
                except FileNotFoundError:
                    continue
        t.join(60)
    finally:
        os.close(held)
    assert fds[0] == "/dev/null" and {fds[1], fds[2], fds[3]} <= {v for v in fds.values() if v.startswith("pipe:")}
    rooted = [v for v in fds.values() if v in (str(secret), str(scratch_base), str(scratch_base / ".slurm-ckpt"))]
    assert not rooted, fds
    assert result and result[0] is not None and result[0].status == "staged"

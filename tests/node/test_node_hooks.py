"""Prolog and epilog end to end on real filesystems with a real unprivileged user (no Slurm)."""

from __future__ import annotations

import json
import os
import signal
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path

import filelock
import pytest

from slurm_ckpt.node import Ledger, run_epilog, run_prolog, task_prolog
from slurm_ckpt.node.scratch import STATE_DIR
from slurm_ckpt.node.stageresult import StageResult
from slurm_ckpt.store import find_latest, verify_checkpoint
from slurm_ckpt.store.layout import list_steps
from tests.node.helpers import User, fuse_of, make_cfg, owned_tree, sh, write_ckpt

MiB = 2**20


def ledger(base: Path) -> dict[str, dict[str, object]]:
    return Ledger(base / STATE_DIR, 1).entries()


def lines_for(base: Path, job_id: str, localid: str = "0") -> list[str]:
    return task_prolog({"SLURM_JOB_ID": job_id, "SLURM_CKPT_SCRATCH_BASE": str(base),
                        "SLURM_CKPT_CONFIG": "/dev/null", "SLURM_LOCALID": localid})  # fmt: skip


def test_prolog_then_epilog_stages_out_as_the_user(pub_tmp: Path, scratch_base: Path, user: User) -> None:
    base, root = scratch_base, pub_tmp / "shared"
    owned_tree(root / user.name, user)
    cfg = make_cfg(base, root)
    env = user.env("101", SLURM_JOB_COMMENT="ckpt_scratch=8M")
    report = run_prolog(env, cfg)
    assert report is not None and report.scratch == str(base / "job_101") and report.size == 8 * MiB
    st = os.lstat(base / "job_101")
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (user.uid, 0o700)
    assert ledger(base)["101"]["size"] == 8 * MiB
    assert f"export SLURM_CKPT_SCRATCH={base}/job_101" in lines_for(base, "101")
    # The job checkpoints to its fast tier; step 2 never reached the durable dir.
    write_ckpt(base / "job_101" / "ckpt", 1, owner=user)
    write_ckpt(base / "job_101" / "ckpt", 2, owner=user)
    res = run_epilog(env, cfg)
    assert res is not None and res.status == "staged" and res.step == 2
    durable = root / user.name / "job_101"
    staged = durable / "step-000000002"
    verify_checkpoint(staged, full=True)
    # Written with the user's identity: root never wrote into the user's tree.
    assert {p.stat().st_uid for p in [durable, staged, *staged.iterdir()]} == {user.uid}
    assert not (base / "job_101").exists() and "101" not in ledger(base)
    assert not (base / STATE_DIR / "job_101.json").exists()
    assert run_epilog(env, cfg) is None  # a second epilog is harmless
    assert [s for s, _ in list_steps(durable)] == [2]


def test_tier_json_names_the_durable_dir_and_up_to_date_is_not_copied(pub_tmp: Path, scratch_base: Path,
                                                                      user: User) -> None:  # fmt: skip
    base, custom = scratch_base, pub_tmp / "elsewhere" / "run"
    owned_tree(custom.parent, user)
    cfg = make_cfg(base, pub_tmp / "unused-root", stage_out_roots=(pub_tmp / "elsewhere",))
    env = user.env("102")
    run_prolog(env, cfg)
    ckpt = base / "job_102" / "ckpt"
    write_ckpt(ckpt, 5, owner=user)
    (ckpt / "TIER.json").write_text(json.dumps({"durable": str(custom)}))
    write_ckpt(custom, 5, owner=user)  # the background drain already copied it
    mtime = (custom / "step-000000005" / "MANIFEST.json").stat().st_mtime_ns
    res = run_epilog(env, cfg)
    assert res is not None and res.status == "up-to-date" and res.step == 5
    assert (custom / "step-000000005" / "MANIFEST.json").stat().st_mtime_ns == mtime
    assert not (base / "job_102").exists()


def test_failed_stage_out_keeps_scratch_and_reservation_until_a_rerun(pub_tmp: Path, scratch_base: Path,
                                                                     user: User) -> None:  # fmt: skip
    base, root = scratch_base, pub_tmp / "shared"
    (root / user.name).mkdir(parents=True)  # root-owned: the user cannot create its run dir
    cfg = make_cfg(base, root)
    env = user.env("103")
    run_prolog(env, cfg)
    write_ckpt(base / "job_103" / "ckpt", 7, owner=user)
    res = run_epilog(env, cfg)
    assert res is not None and res.status == "failed" and "Permission denied" in res.detail
    assert (base / "job_103" / "ckpt" / "step-000000007").is_dir()  # the only copy: kept
    assert "stage-out failed" in str(ledger(base)["103"]["kept"])
    os.chown(root / user.name, user.uid, user.gid)  # the admin fixes it and reruns the epilog
    res = run_epilog(env, cfg)
    assert res is not None and res.status == "staged"
    assert not (base / "job_103").exists() and "103" not in ledger(base)


def _children_as(uid: int) -> set[int]:
    """Our live (not zombie) child processes running as ``uid``."""
    found = set()
    for proc in Path("/proc").iterdir():
        try:
            status = (proc / "status").read_text() if proc.name.isdigit() else ""
        except OSError:
            continue
        if f"\nPPid:\t{os.getpid()}\n" in status and f"\nUid:\t{uid}\t" in status and "\nState:\tZ" not in status:
            found.add(int(proc.name))
    return found


def _child_running_as(uid: int, deadline: float, before: set[int]) -> int:
    """The pid of a new child of ours once it has dropped to ``uid`` (the stage-out child);
    ``before``: children that were there already (a test user's uid may be an earlier one's)."""
    while time.monotonic() < deadline:
        new = _children_as(uid) - before
        if new:
            return new.pop()
        time.sleep(0.005)
    raise AssertionError("the stage-out child never appeared")


def test_stage_out_past_its_deadline_is_killed_and_scratch_kept(pub_tmp: Path, scratch_base: Path, user: User) -> None:
    base, root = scratch_base, pub_tmp / "shared"
    durable = root / user.name / "job_104"
    owned_tree(root / user.name, user)
    owned_tree(durable, user)
    cfg = make_cfg(base, root, epilog_timeout=6.5)  # 1.5 s for stage-out, 5 s kept for cleanup
    env = user.env("104")
    run_prolog(env, cfg)
    write_ckpt(base / "job_104" / "ckpt", 3, owner=user)
    # The durable run dir hangs for real, as on a dead NFS server: the child's
    # first look at it never returns.
    with fuse_of(user, durable, hung=True):
        res = run_epilog(env, cfg)
    assert isinstance(res, StageResult) and res.status == "timeout"
    assert (base / "job_104" / "ckpt" / "step-000000003").is_dir()
    kept = ledger(base)["104"]
    assert "timeout" in str(kept["kept"]) and kept["restarts"] == 0 and kept["uid"] == user.uid


def test_a_stopped_stage_out_is_not_waited_for(pub_tmp: Path, scratch_base: Path, user: User) -> None:
    """The child runs as the user, so the user can SIGSTOP it; the epilog sees it stopped
    and kills it instead of waiting out the stage-out's whole deadline.

    Scratch is a filesystem of its own, so the durable dir is an allowed destination
    and the child really reaches its lock (on one filesystem it would be refused at
    once, and only a SIGSTOP faster than the child would be seen)."""
    base, root = scratch_base, pub_tmp / "shared"
    durable = root / user.name / "job_105"
    owned_tree(durable, user)
    user.run("touch", str(durable / ".lock"))
    cfg = make_cfg(base, root, epilog_timeout=600)
    env = user.env("105")
    run_prolog(env, cfg)
    write_ckpt(base / "job_105" / "ckpt", 3, owner=user)
    result: list[object] = []
    # The child waits on the durable dir's lock while we stop it there.
    before = _children_as(user.uid)
    with filelock.FileLock(str(durable / ".lock")):
        t = threading.Thread(target=lambda: result.append(run_epilog(env, cfg)))
        t.start()
        os.kill(_child_running_as(user.uid, time.monotonic() + 30, before), signal.SIGSTOP)
        t.join(timeout=60)  # hang guard: without the check it would wait 595 s
    res = result[0] if result else None
    assert isinstance(res, StageResult) and res.status == "failed" and "stopped" in res.detail
    assert (base / "job_105" / "ckpt" / "step-000000003").is_dir()
    assert "stopped" in str(ledger(base)["105"]["kept"])


def test_over_reservation_warns_and_shrinks_or_gives_none(loop_fs: Callable[..., Path], user: User,
                                                         other_user: User) -> None:  # fmt: skip
    base = loop_fs("ext4", "128M")
    cap = os.statvfs(base).f_blocks * os.statvfs(base).f_frsize
    cfg = make_cfg(base, headroom=8 * MiB)
    a = run_prolog(user.env("201", SLURM_JOB_COMMENT="ckpt_scratch=80M"), cfg)
    assert a is not None and a.size == 80 * MiB and not a.warnings
    b = run_prolog(other_user.env("202", SLURM_JOB_COMMENT="ckpt_scratch=100M"), cfg)
    assert b is not None and b.size == cap - 8 * MiB - 80 * MiB and b.scratch
    out = lines_for(base, "202")
    assert any(line.startswith("print slurm-ckpt: warning: this job asked for 100.0MiB") for line in out)
    assert not [x for x in lines_for(base, "202", localid="3") if x.startswith("print")]  # once per node
    cfg_none = make_cfg(base, headroom=8 * MiB, over_reserve="none")
    c = run_prolog(user.env("203", SLURM_JOB_COMMENT="ckpt_scratch=1G"), cfg_none)
    assert c is not None and c.size == 0 and c.scratch is None and not (base / "job_203").exists()
    out = lines_for(base, "203")
    assert not any(x.startswith("export SLURM_CKPT_SCRATCH") for x in out)
    assert any("no node-local scratch" in x for x in out)
    for env in (user.env("201"), other_user.env("202"), user.env("203")):
        run_epilog(env, cfg)
    assert ledger(base) == {}


def test_loop_enforcement_stops_a_job_at_its_size_not_its_neighbour(loop_fs: Callable[..., Path],
                                                                    user: User, other_user: User) -> None:  # fmt: skip
    base = loop_fs("ext4", "1G")
    cfg = make_cfg(base, enforce="loop")
    ra = run_prolog(user.env("301", SLURM_JOB_COMMENT="ckpt_scratch=32M"), cfg)
    rb = run_prolog(other_user.env("302", SLURM_JOB_COMMENT="ckpt_scratch=32M"), cfg)
    assert ra is not None and rb is not None and ra.enforce == rb.enforce == "loop"
    a, b = base / "job_301", base / "job_302"
    assert os.stat(a).st_dev != os.stat(base).st_dev and os.stat(a).st_uid == user.uid
    # Job A writes past its 32 MiB: the kernel says ENOSPC, at about its size.
    p = user.run("dd", "if=/dev/zero", f"of={a}/fill", "bs=1M", "count=48", "conv=fsync", check=False)
    assert p.returncode != 0 and "No space left on device" in p.stderr
    assert 24 * MiB <= (a / "fill").stat().st_size <= 32 * MiB  # less the filesystem overhead
    # Its neighbour still writes what it reserved.
    q = other_user.run("dd", "if=/dev/zero", f"of={b}/fill", "bs=1M", "count=24", "conv=fsync")
    assert q.returncode == 0 and (b / "fill").stat().st_size == 24 * MiB
    # The job cannot escalate through its filesystem: it is nosuid,nodev.
    opts = next(line.split()[5] for line in Path("/proc/self/mountinfo").read_text().splitlines()
                if line.split()[4] == str(a))  # fmt: skip
    assert {"nosuid", "nodev"} <= set(opts.split(","))
    for env in (user.env("301"), other_user.env("302")):
        res = run_epilog(env, cfg)
        assert res is not None and res.status == "none"
    assert not a.exists() and not b.exists()
    assert not list((base / STATE_DIR / "img").iterdir())
    assert str(a) not in Path("/proc/self/mountinfo").read_text()


def test_kept_loop_scratch_is_mounted_again_and_adopted(loop_fs: Callable[..., Path], user: User,
                                                        pub_tmp: Path) -> None:  # fmt: skip
    base, root = loop_fs("ext4", "512M"), pub_tmp / "shared"
    (root / user.name).mkdir(parents=True)  # not writable by the user: stage-out fails
    cfg = make_cfg(base, root, enforce="loop")
    env = user.env("303", SLURM_JOB_COMMENT="ckpt_scratch=16M")
    run_prolog(env, cfg)
    write_ckpt(base / "job_303" / "ckpt", 4, owner=user)
    assert run_epilog(env, cfg).status == "failed"  # type: ignore[union-attr]
    sh("umount", str(base / "job_303"))  # as after a reboot
    r = run_prolog(env, cfg)  # requeued onto this node
    assert r is not None and r.size == 16 * MiB
    assert find_latest([base / "job_303" / "ckpt"]) is not None
    os.chown(root / user.name, user.uid, user.gid)
    assert run_epilog(env, cfg).status == "staged"  # type: ignore[union-attr]
    assert not (base / "job_303").exists()


def test_bad_config_or_job_never_raises(pub_tmp: Path) -> None:
    base = pub_tmp / "scratch"
    env = {"SLURM_JOB_ID": "../../etc", "SLURM_JOB_UID": "0", "SLURM_CKPT_CONFIG": "/dev/null",
           "SLURM_CKPT_SCRATCH_BASE": str(base)}  # fmt: skip
    assert run_prolog(env) is None and run_epilog(env) is None
    assert not base.exists()
    env = {"SLURM_JOB_ID": "5", "SLURM_JOB_UID": "0", "SLURM_CKPT_CONFIG": str(pub_tmp / "missing.yaml")}
    assert run_prolog(env) is None


def test_missing_scratch_disk_is_a_node_fault(pub_tmp: Path) -> None:
    (pub_tmp / "file").write_text("not a dir")
    cfg = make_cfg(pub_tmp / "file" / "base")
    from slurm_ckpt.errors import StorageError

    with pytest.raises(StorageError, match="scratch base unusable"):
        run_prolog({"SLURM_JOB_ID": "9", "SLURM_JOB_UID": "0"}, cfg)


def test_epilog_removes_only_this_jobs_metrics_files(pub_tmp: Path, user: User) -> None:
    import dataclasses

    from slurm_ckpt.config import MetricsConfig

    prom = pub_tmp / "textfiles"
    prom.mkdir()
    for name in ("slurm_ckpt_601_0.prom", "slurm_ckpt_601_1.prom", "slurm_ckpt_6011_0.prom", "other.prom"):
        (prom / name).write_text("# x\n")
    cfg = dataclasses.replace(make_cfg(pub_tmp / "scratch"), metrics=MetricsConfig(textfile_dir=str(prom)))
    run_prolog(user.env("601"), cfg)
    run_epilog(user.env("601"), cfg)
    assert sorted(p.name for p in prom.iterdir()) == ["other.prom", "slurm_ckpt_6011_0.prom"]


def test_loop_mount_lands_on_the_opened_dir_even_if_the_name_is_swapped(
    loop_fs: Callable[..., Path], pub_tmp: Path
) -> None:
    from slurm_ckpt.node.deadline import Deadline
    from slurm_ckpt.node.loopfs import mount_image, unmount_image

    base = loop_fs("ext4", "256M")
    (base / ".slurm-ckpt").mkdir(mode=0o711)
    victim = pub_tmp / "victim"
    victim.mkdir()
    (base / "job_9").mkdir()
    fd = os.open(base / "job_9", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    state = os.open(base / ".slurm-ckpt", os.O_RDONLY | os.O_DIRECTORY)
    try:
        # The race a writable base would allow: the name now points elsewhere.
        (base / "job_9").rename(base / "moved")
        (base / "job_9").symlink_to(victim)
        mount_image(state, "job_9", fd, 16 * MiB, "ext4", 0, Deadline(30))
    finally:
        os.close(fd)
    points = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
    assert str(base / "moved") in points and str(victim) not in points
    sh("umount", str(base / "moved"))
    (base / "job_9").unlink()
    bfd = os.open(base, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert unmount_image(bfd, state, "job_9", 30) is None
    finally:
        os.close(bfd)
        os.close(state)
    assert not list((base / ".slurm-ckpt" / "img").iterdir())


def test_a_failing_mkfs_costs_the_job_its_scratch_not_the_node(loop_fs: Callable[..., Path], user: User) -> None:
    base = loop_fs("ext4", "256M")
    cfg = make_cfg(base, enforce="loop", loop_fstype="xfs")  # mkfs.xfs refuses under 300 MiB
    report = run_prolog(user.env("701", SLURM_JOB_COMMENT="ckpt_scratch=16M"), cfg)
    assert report is not None and report.scratch is None and report.size == 0
    assert any("mkfs.xfs failed" in w for w in report.warnings)
    assert "701" not in ledger(base)
    run_epilog(user.env("701"), cfg)
    assert not (base / "job_701").exists()


def test_each_loop_step_gets_its_share_of_one_deadline(loop_fs: Callable[..., Path],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """mkfs and mount each get a part of the prolog's one deadline, never all of it.

    The commands run for real; the spy only records the timeout each was given
    (a slow mkfs cannot be made to order here)."""
    from slurm_ckpt.node import commands
    from slurm_ckpt.node.deadline import Deadline
    from slurm_ckpt.node.loopfs import mount_image

    seen: list[tuple[str, float, float]] = []
    real = commands.run

    def spy(argv: list[str], timeout: float, pass_fds: tuple[int, ...] = ()) -> tuple[int, str]:
        seen.append((argv[0], time.monotonic(), timeout))
        return real(argv, timeout, pass_fds)

    monkeypatch.setattr(commands, "run", spy)
    base = loop_fs("ext4", "256M")
    (base / ".slurm-ckpt").mkdir(mode=0o711)
    (base / "job_9").mkdir()
    fd = os.open(base / "job_9", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    state = os.open(base / ".slurm-ckpt", os.O_RDONLY | os.O_DIRECTORY)
    deadline = Deadline(20)
    try:
        mount_image(state, "job_9", fd, 16 * MiB, "ext4", 0, deadline)
    finally:
        os.close(fd)
        os.close(state)
        sh("umount", str(base / "job_9"), check=False)
    (mkfs, at_mkfs, t_mkfs), (mount, at_mount, t_mount) = seen
    assert (mkfs, mount) == ("mkfs.ext4", "mount")
    # mkfs: at most 60% of what was left when its part began; the mount: what is left then.
    # Both end within the one deadline (the spy reads the clock a moment after each).
    assert t_mkfs <= 0.6 * 20 and at_mkfs + t_mkfs <= deadline.end + 0.01, seen
    assert at_mount + t_mount <= deadline.end + 0.01, seen


def _shard(parent: Path, rank: int, world: int, step: int, save_id: str, owner: User) -> Path:
    """A rank's shard as CrossNode commits it (own: ``ckpt/rank-K``; a peer's: ``ckpt/replicas/rank-K``)."""
    from slurm_ckpt.store import RunDir
    from slurm_ckpt.store import shards as shd
    from slurm_ckpt.store.codec import encode_state
    from slurm_ckpt.store.writer import write_state

    enc = encode_state({"blob": os.urandom(4096), "rank": rank})
    rd = RunDir(parent / shd.shard_name(rank))
    try:
        path = rd.commit(step, lambda tmp: write_state(tmp, enc), world_size=world, nbytes=enc.nbytes,
                         extra=shd.shard_extra(rank, world, save_id))  # fmt: skip
    finally:
        rd.unlock()
    sh("chown", "-R", f"{owner.uid}:{owner.gid}", str(parent))
    return path


def test_prolog_reserves_room_for_replicas_and_the_epilog_stages_them_as_own_shards(
    pub_tmp: Path, scratch_base: Path, user: User
) -> None:
    base, root = scratch_base, pub_tmp / "shared"
    owned_tree(root / user.name, user)
    cfg = make_cfg(base, root)
    env = user.env("111", SLURM_JOB_COMMENT="ckpt_scratch=8M ckpt_replicas=1")
    report = run_prolog(env, cfg)
    # Room for the node's own shards and one peer's replicas, and the ledger says which is which.
    assert report is not None and report.size == 16 * MiB and report.replicas == 1
    entry = ledger(base)["111"]
    assert (entry["size"], entry["replicas"], entry["replica_bytes"]) == (16 * MiB, 1, 8 * MiB)
    assert "export SLURM_CKPT_SCRATCH_REPLICAS=1" in lines_for(base, "111")
    # This node kept rank 0's shard of step 4 and a replica of rank 1's (whose node is lost):
    # together the whole save, which the drain never copied.
    ckpt = base / "job_111" / "ckpt"
    _shard(ckpt, 0, 2, 4, "ab" * 8, user)
    _shard(ckpt / "replicas", 1, 2, 4, "ab" * 8, user)
    res = run_epilog(env, cfg)
    assert res is not None and res.status == "staged" and res.step == 4, res
    man = verify_checkpoint(root / user.name / "job_111" / "step-000000004", full=True)
    assert sorted(man.extra["shards"]) == ["rank-00000", "rank-00001"]
    assert man.extra["shards"]["rank-00001"]["staged_from"].endswith("ckpt/replicas/rank-00001/step-000000004")
    assert not (base / "job_111").exists() and "111" not in ledger(base)
    # Without the token the site default holds (0 here): no room set aside, nothing exported.
    env2 = user.env("112", SLURM_JOB_COMMENT="ckpt_scratch=8M ckpt_replicas=x")
    report = run_prolog(env2, cfg)
    assert report is not None and report.size == 8 * MiB and report.replicas == 0
    assert any("ckpt_replicas='x'" in w for w in report.warnings)
    assert "replicas" not in ledger(base)["112"]
    assert not [x for x in lines_for(base, "112") if "REPLICAS" in x]
    run_epilog(env2, cfg)

"""A hostile user against the scratch lifecycle: removal bounded by the epilog's deadline,
the graveyard and its reaper, kept scratch that expires, job ids that come back.

Real users, real filesystems (tmpfs, loop-mounted ext4), real FUSE mounts.
Where a test ages a kept scratch, it moves the ledger's ``kept_since`` back
as the days would, since no test can wait a week.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from slurm_ckpt.node import Ledger, run_epilog, run_prolog
from slurm_ckpt.node.graveyard import GRAVE_DIR, reap
from slurm_ckpt.node.ledger import GRAVE
from slurm_ckpt.node.scratch import STATE_DIR
from slurm_ckpt.node.stageresult import StageResult
from slurm_ckpt.store import find_latest
from tests.node.helpers import PATH, User, fuse_of, make_cfg, sh, write_ckpt

MiB = 2**20


def entries(base: Path) -> dict[str, dict[str, Any]]:
    return Ledger(base / STATE_DIR, 1).entries()


def graves(base: Path) -> list[str]:
    d = base / STATE_DIR / GRAVE_DIR
    return sorted(os.listdir(d)) if d.exists() else []


def as_user(user: User, script: str, *args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(["bash", "-c", script, "bash", *args], user=user.uid, group=user.gid,
                            extra_groups=[], cwd="/", env={"PATH": PATH}, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip


def wait_for(what: str, cond: Callable[[], bool], timeout: float = 60) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.02)


def stop(p: subprocess.Popen[bytes]) -> None:
    os.killpg(p.pid, signal.SIGKILL)
    p.wait(30)


ATTACK = """
import os, sys
os.chdir(sys.argv[1])
i = 0
while True:  # chains 70 levels deep, as fast as it can
    i += 1
    try:
        os.makedirs(f"c{i}/" + "d/" * 70)
    except OSError:
        pass
"""


def test_a_second_job_filling_the_dying_dir_cannot_hold_the_epilog(pub_tmp: Path, user: User) -> None:
    """Another job of the user, two processes working inside the dying job's dir, makes
    chains 70 levels deep as fast as it can. The epilog stops at its deadline, the rest
    goes to the graveyard with the reservation, and the reaper takes it once the other
    job is gone."""
    python = shutil.which("python3", path=PATH)  # the system's: the user cannot run the venv's
    assert python is not None
    base = pub_tmp / "scratch"
    cfg = make_cfg(base, epilog_timeout=4, reap_budget=0.5, enforce="none")
    env = user.env("801")
    run_prolog(env, cfg)
    job = base / "job_801"
    attackers = []
    for w in ("w1", "w2"):
        user.run("mkdir", str(job / w))
        attackers.append(subprocess.Popen([python, "-c", ATTACK, str(job / w)], user=user.uid, group=user.gid,
                                          extra_groups=[], cwd="/", env={"PATH": PATH}, start_new_session=True,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))  # fmt: skip
    try:
        wait_for("the other job to start filling", lambda: all(len(os.listdir(job / w)) > 3 for w in ("w1", "w2")))
        result: list[StageResult | None] = []
        t = threading.Thread(target=lambda: result.append(run_epilog(env, cfg)))
        t.start()
        t.join(120)  # hang guard only; the epilog's own deadline is 4 s
        assert not t.is_alive(), "the epilog did not stop at its deadline"
        assert result and result[0] is not None and result[0].status == "none"
        assert not job.exists()  # the name is free at once
        held = entries(base)
        assert "801" not in held
        (grave,) = graves(base)
        assert held[GRAVE + grave]["size"] == 64 * MiB and held[GRAVE + grave]["job"] == "801"
        assert reap(str(base), cfg.scratch.keep_failed, 0.5, wait=True)  # a short one: the attack goes on
    finally:
        for a in attackers:
            stop(a)
    assert graves(base) == [grave]
    assert reap(str(base), cfg.scratch.keep_failed, 300, wait=True)
    assert graves(base) == [] and entries(base) == {}


@pytest.mark.parametrize("enforce", ["none", "loop"])
def test_a_users_fuse_mount_in_scratch_is_detached_not_a_pin(pub_tmp: Path, user: User, enforce: str) -> None:
    """The job mounted FUSE in its scratch; its daemon died with the job. Root's stat of the
    mount point fails with EACCES: scratch is removed anyway (with loop: the job's filesystem
    unmounted, the FUSE mounts inside it taken along), and the reservation released."""
    base = pub_tmp / "scratch"
    cfg = make_cfg(base, enforce=enforce)
    env = user.env("802")
    run_prolog(env, cfg)
    job = base / "job_802"
    user.run("mkdir", "-p", str(job / "ckpt" / "fuse"), str(job / "fuse"))
    with fuse_of(user, job / "fuse", hung=False), fuse_of(user, job / "ckpt" / "fuse", hung=False):
        with pytest.raises(PermissionError):
            os.stat(job / "fuse")
        res = run_epilog(env, cfg)
        assert res is not None and res.scratch_disposable, res
        assert not job.exists() and entries(base) == {} and graves(base) == []


def test_a_hung_fuse_mount_as_the_fast_tier_is_not_staged_from(pub_tmp: Path, user: User) -> None:
    """``<scratch>/ckpt`` itself is the user's FUSE mount whose daemon never answers:
    it is not the job's scratch, so the stage-out neither waits on it nor keeps it."""
    from slurm_ckpt.node.job import Job
    from slurm_ckpt.node.stageout import StageLimits, stage_out

    base = pub_tmp / "scratch"
    cfg = make_cfg(base, pub_tmp / "shared", epilog_timeout=60, enforce="none")
    env = user.env("803")
    run_prolog(env, cfg)
    job = base / "job_803"
    user.run("mkdir", str(job / "ckpt"))
    with fuse_of(user, job / "ckpt", hung=True):
        # The child, as the user, would hang on any call into it; it makes none.
        limits = StageLimits((str(pub_tmp / "shared"),), frozenset(), 64 * MiB)
        res = stage_out(job / "ckpt", pub_tmp / "shared" / user.name / "job_803", Job.from_env(env), 60, limits)
        assert res.status == "none" and "a mount" in res.detail, res
        result: list[StageResult | None] = []
        t = threading.Thread(target=lambda: result.append(run_epilog(env, cfg)))
        t.start()
        t.join(120)  # hang guard
        assert not t.is_alive()
    assert result[0] is not None and result[0].status == "none", result
    assert not job.exists() and entries(base) == {}


def _age(base: Path, key: str, days: float) -> None:
    """Move a kept entry's clock back by ``days``, as if they had passed."""
    path = base / STATE_DIR / "ledger.json"
    data = json.loads(path.read_text())
    data[key]["kept_since"] -= days * 86400
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("enforce", ["none", "loop"])
def test_kept_scratch_expires_after_keep_failed(pub_tmp: Path, user: User, capfd: pytest.CaptureFixture[str],
                                                enforce: str) -> None:  # fmt: skip
    base, root = pub_tmp / "scratch", pub_tmp / "shared"
    (root / user.name).mkdir(parents=True)  # root-owned: the user cannot create its run dir
    cfg = make_cfg(base, root, keep_failed=3 * 86400, enforce=enforce)
    env = user.env("804")
    run_prolog(env, cfg)
    write_ckpt(base / "job_804" / "ckpt", 7, owner=user)
    res = run_epilog(env, cfg)
    assert res is not None and res.status == "failed"
    first = entries(base)["804"]["kept_since"]
    assert run_epilog(env, cfg).status == "failed"  # type: ignore[union-attr]
    assert entries(base)["804"]["kept_since"] == first  # a rerun does not restart the clock
    _age(base, "804", 2.5)
    assert reap(str(base), cfg.scratch.keep_failed, 60, wait=True)
    assert (base / "job_804" / "ckpt" / "step-000000007").is_dir()  # not yet
    _age(base, "804", 1)
    capfd.readouterr()
    assert reap(str(base), cfg.scratch.keep_failed, 60, wait=True)
    err = capfd.readouterr().err
    assert "job 804: kept scratch job_804 expired: kept since" in err and "3.0 days" in err
    assert not (base / "job_804").exists() and entries(base) == {} and graves(base) == []
    assert not list((base / STATE_DIR).glob("img/*"))  # the image too, with loop


def test_an_expired_kept_scratch_is_reaped_in_the_background_by_the_next_hook(pub_tmp: Path, user: User,
                                                                                other_user: User) -> None:  # fmt: skip
    base, root = pub_tmp / "scratch", pub_tmp / "shared"
    (root / user.name).mkdir(parents=True)
    cfg = make_cfg(base, root, enforce="none")
    run_prolog(user.env("805"), cfg)
    write_ckpt(base / "job_805" / "ckpt", 3, owner=user)
    assert run_epilog(user.env("805"), cfg).status == "failed"  # type: ignore[union-attr]
    _age(base, "805", 8)  # past the default 7 days
    report = run_prolog(other_user.env("806"), cfg)  # any hook on the node
    assert report is not None and report.scratch
    wait_for("the reaper", lambda: not (base / "job_805").exists() and "805" not in entries(base))
    # The reaper removes the grave, then releases its ledger entry: wait for both.
    wait_for("the grave to go", lambda: graves(base) == [] and not any(k.startswith(GRAVE) for k in entries(base)))
    run_epilog(other_user.env("806"), cfg)
    assert entries(base) == {}


@pytest.mark.parametrize("enforce", ["none", "loop"])
@pytest.mark.parametrize("who", ["other user", "same user, a new job"])
def test_a_reused_job_id_never_gets_the_old_jobs_kept_scratch(pub_tmp: Path, user: User, other_user: User,
                                                              who: str, enforce: str) -> None:  # fmt: skip
    """Job 807 of ``user`` was requeued (its epilog saw restart count 1) and its stage-out
    failed. The id then comes back for another job (a controller that lost its state):
    that job starts with an empty scratch, and the old one waits in the graveyard."""
    base, root = pub_tmp / "scratch", pub_tmp / "shared"
    (root / user.name).mkdir(parents=True)
    cfg = make_cfg(base, root, enforce=enforce)
    old = user.env("807", SLURM_JOB_RESTART_COUNT="1")
    run_prolog(old, cfg)
    write_ckpt(base / "job_807" / "ckpt", 5, owner=user)
    assert run_epilog(old, cfg).status == "failed"  # type: ignore[union-attr]
    newcomer = other_user if who == "other user" else user
    report = run_prolog(newcomer.env("807"), cfg)  # restart count 0: a new job
    assert report is not None and report.scratch
    assert set(os.listdir(base / "job_807")) <= {"lost+found"}  # a fresh filesystem, with loop
    assert os.stat(base / "job_807").st_uid == newcomer.uid
    (grave,) = graves(base)
    kept = entries(base)[GRAVE + grave]
    assert kept["uid"] == user.uid and kept["job"] == "807" and "stage-out failed" in kept["kept"]
    with _opened(base / STATE_DIR / GRAVE_DIR / grave, pub_tmp) as old_scratch:
        assert find_latest([old_scratch / "ckpt"]) is not None  # not deleted
    assert reap(str(base), cfg.scratch.keep_failed, 60, wait=True)
    assert graves(base) == [grave]  # waits for keep_failed
    run_epilog(newcomer.env("807"), cfg)
    assert set(entries(base)) == {GRAVE + grave}


@contextlib.contextmanager
def _opened(grave: Path, pub_tmp: Path) -> Iterator[Path]:
    """A grave's tree: the dir itself, or an image, mounted read-only for the test."""
    if grave.is_dir():
        yield grave
        return
    mnt = pub_tmp / "grave-view"
    mnt.mkdir()
    sh("mount", "-o", "loop,ro", str(grave), str(mnt))
    try:
        yield mnt
    finally:
        sh("umount", str(mnt))


@pytest.mark.parametrize("enforce", ["none", "loop"])
def test_the_next_run_of_a_requeued_job_gets_its_kept_scratch_back(pub_tmp: Path, user: User, enforce: str) -> None:
    """The epilog after a requeue sees the restart count the next run will have: that run,
    and only it, adopts the kept scratch."""
    base, root = pub_tmp / "scratch", pub_tmp / "shared"
    (root / user.name).mkdir(parents=True)
    cfg = make_cfg(base, root, enforce=enforce)
    run_prolog(user.env("808"), cfg)
    write_ckpt(base / "job_808" / "ckpt", 9, owner=user)
    assert run_epilog(user.env("808", SLURM_JOB_RESTART_COUNT="1"), cfg).status == "failed"  # type: ignore[union-attr]
    report = run_prolog(user.env("808", SLURM_JOB_RESTART_COUNT="1"), cfg)
    assert report is not None and report.scratch
    assert find_latest([base / "job_808" / "ckpt"]) is not None and graves(base) == []
    assert "kept" not in entries(base)["808"]  # adopted: no longer a kept scratch


def test_a_ckpt_scratch_of_1P_no_longer_takes_all_free_space(pub_tmp: Path, user: User, other_user: User) -> None:
    base = pub_tmp / "scratch"
    cfg = make_cfg(base, headroom=0, enforce="none")
    huge = run_prolog(user.env("809", SLURM_JOB_COMMENT="ckpt_scratch=1P"), cfg)
    assert huge is not None and huge.size == cfg.scratch.default_size and huge.asked == 2**50
    assert any("more than this node could ever reserve" in w for w in huge.warnings)
    capped = make_cfg(base, max_size=32 * MiB, enforce="none")
    r = run_prolog(other_user.env("810", SLURM_JOB_COMMENT="ckpt_scratch=1G"), capped)
    assert r is not None and r.size == 32 * MiB and any("scratch.max_size" in w for w in r.warnings)
    for u, j in ((user, "809"), (other_user, "810")):
        run_epilog(u.env(j), cfg)


def _underlying(base: Path, pub_tmp: Path, name: str) -> os.stat_result:
    """The job dir as it is on the base filesystem, under whatever is mounted on it."""
    view = pub_tmp / "view"
    view.mkdir(exist_ok=True)
    sh("mount", "--bind", str(base), str(view))
    try:
        return os.stat(view / name)
    finally:
        sh("umount", str(view))


def test_loop_scratch_is_mounted_before_the_user_gets_it(loop_fs: Callable[..., Path], pub_tmp: Path,
                                                         user: User) -> None:  # fmt: skip
    """Under the mount, the job dir stays root's 0700: no process of the user ever holds an
    fd into the unlimited base filesystem through it."""
    base = loop_fs("ext4", "256M")
    cfg = make_cfg(base, enforce="loop", max_inodes=200)
    run_prolog(user.env("811", SLURM_JOB_COMMENT="ckpt_scratch=32M"), cfg)
    job = base / "job_811"
    assert os.stat(job).st_uid == user.uid and os.stat(job).st_dev != os.stat(base).st_dev
    under = _underlying(base, pub_tmp, "job_811")
    assert (under.st_uid, under.st_mode & 0o777) == (0, 0o700)
    # mkfs -N: the job's filesystem holds at most max_inodes entries, whatever its size.
    p = user.run("bash", "-c", f'cd {job} && for i in $(seq 400); do : > f$i || exit 1; done', check=False)
    assert p.returncode != 0 and "No space left on device" in p.stderr
    assert 150 <= len(os.listdir(job)) <= 200
    assert run_epilog(user.env("811"), cfg) is not None
    assert not job.exists() and entries(base) == {}


def test_a_busy_loop_image_keeps_its_reservation_until_it_is_really_unmounted(
    loop_fs: Callable[..., Path], user: User
) -> None:
    """A process of the user holds a file in the job's filesystem past the job: the mount is
    detached so the name is free, but the image's blocks are still in use, so its
    reservation stays until the reaper finds the loop device let go."""
    base = loop_fs("ext4", "512M")
    cfg = make_cfg(base, enforce="loop")
    run_prolog(user.env("812", SLURM_JOB_COMMENT="ckpt_scratch=64M"), cfg)
    job = base / "job_812"
    holder = as_user(user, 'exec 3>"$1/held"; echo x >&3; exec sleep 600', str(job))
    try:
        wait_for("the holder", lambda: (job / "held").exists())
        res = run_epilog(user.env("812"), cfg)
        assert res is not None and res.status == "none"
        assert not job.exists()
        held = entries(base)
        (grave,) = graves(base)
        assert grave.startswith("job_812.img-") and held == {GRAVE + grave: held[GRAVE + grave]}
        assert held[GRAVE + grave]["size"] == 64 * MiB
        assert reap(str(base), cfg.scratch.keep_failed, 60, wait=True)
        assert graves(base) == [grave]  # still held: not freed
    finally:
        stop(holder)

    def freed() -> bool:
        # The loop device lets go once the holder is gone; a reaper (this one, or one a hook
        # started in the background) then deletes the image and releases its reservation.
        reap(str(base), cfg.scratch.keep_failed, 60, wait=True)
        return graves(base) == []

    wait_for("the image to be freed", freed)
    assert entries(base) == {}


@pytest.mark.parametrize("opener", ["graveyard", "image dir"])
def test_a_root_state_subdir_owned_by_a_user_is_refused(tmp_path: Path, user: User, opener: str) -> None:
    from slurm_ckpt.errors import StorageError
    from slurm_ckpt.node import loopfs
    from slurm_ckpt.node.graveyard import open_grave

    open_dir, name = {"graveyard": (open_grave, GRAVE_DIR), "image dir": (loopfs.open_image_dir, loopfs.IMAGE_DIR)}[opener]
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    state_fd = os.open(state, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.close(open_dir(state_fd))  # made root's, 0700
        assert (os.stat(state / name).st_uid, os.stat(state / name).st_mode & 0o777) == (0, 0o700)
        os.chown(state / name, user.uid, user.gid)
        with pytest.raises(StorageError, match=f"uid {user.uid}; remove it"):
            open_dir(state_fd)
    finally:
        os.close(state_fd)

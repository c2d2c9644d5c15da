"""Quotas and the shared-storage space check.

This test kernel is built without quota support (no CONFIG_XFS_QUOTA, no
CONFIG_QFMT_V2): a filesystem mounted with prjquota fails to mount, so the
project-quota enforcement test skips here, saying so, and runs where the
kernel has it. The project id itself is set by ioctl on plain XFS for real,
and `quota`/`lfs quota` output is parsed from recorded text (the seam: no
quota-enabled filesystem and no Lustre exist here).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from slurm_ckpt.fsinfo import (
    Mount,
    get_project,
    mount_of,
    parse_quota_lines,
    set_project,
    user_quota,
)
from slurm_ckpt.node import commands, run_epilog, run_prolog
from slurm_ckpt.node.job import Job
from slurm_ckpt.node.quota import limit_argv
from slurm_ckpt.node.space import check_shared, newest_checkpoint_size
from tests.faultfs.control import FaultFS
from tests.node.helpers import User, make_cfg, owned_tree, sh, write_ckpt

MiB = 2**20


def test_project_id_is_set_through_the_fd_and_inherited(loop_fs: Callable[..., Path]) -> None:
    base = loop_fs("xfs", "512M")
    (base / "job_5").mkdir()
    fd = os.open(base / "job_5", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        assert get_project(fd) == (0, False)
        set_project(fd, 4242)
        assert get_project(fd) == (4242, True)
    finally:
        os.close(fd)
    (base / "job_5" / "f").write_text("x")
    assert "projid = 4242" in sh("xfs_io", "-c", "lsproj", str(base / "job_5" / "f")).stdout


def test_xfs_project_quota_stops_a_job_at_its_size(loop_fs: Callable[..., Path], user: User,
                                                   other_user: User) -> None:  # fmt: skip
    try:
        base = loop_fs("xfs", "512M", options="prjquota")
    except subprocess.CalledProcessError as e:
        pytest.skip(f"this kernel cannot mount XFS with prjquota (no CONFIG_XFS_QUOTA): {e.stderr.strip()}")
    cfg = make_cfg(base)  # enforce: auto picks the project quota
    for u, job in ((user, "401"), (other_user, "402")):
        r = run_prolog(u.env(job, SLURM_JOB_COMMENT="ckpt_scratch=32M"), cfg)
        assert r is not None and r.enforce == "quota"
    p = user.run("dd", "if=/dev/zero", f"of={base}/job_401/fill", "bs=1M", "count=48", check=False)
    assert p.returncode != 0 and "quota exceeded" in p.stderr.lower()
    q = other_user.run("dd", "if=/dev/zero", f"of={base}/job_402/fill", "bs=1M", "count=24")
    assert q.returncode == 0
    for u, job in ((user, "401"), (other_user, "402")):
        run_epilog(u.env(job), cfg)


QUOTA_OUT = """\
Disk quotas for user alice (uid 1001):
     Filesystem   space   quota   limit   grace   files   quota   limit   grace
         /home  1048580*  1048576  2097152  1700000000      12       0    1000       0
       /shared     4096       0       0       0       3       0       0       0
"""
LFS_OUT = "        /lustre  5242880  4194304  6291456  6d23h59m  100  0  150  -\n"


def test_quota_and_lfs_output_are_parsed() -> None:
    home = parse_quota_lines(QUOTA_OUT, "/home", "quota")
    assert home is not None and home.used == 1048580 * 1024 and home.hard == 2 * 2**30
    assert (home.files, home.files_hard) == (12, 1000)
    assert parse_quota_lines(QUOTA_OUT, "/scratch", "quota") is None
    lus = parse_quota_lines(LFS_OUT, "/lustre", "lfs quota")
    assert lus is not None and (lus.used, lus.soft, lus.hard) == (5 * 2**30, 4 * 2**30, 6 * 2**30)


def test_quota_tool_on_a_filesystem_without_quota_says_nothing(pub_tmp: Path) -> None:
    mount = mount_of(pub_tmp)
    assert mount is not None
    assert user_quota(mount, "root", 0, 10, commands.run) is None  # the real `quota` binary, no quota here


@pytest.fixture
def small_shared(pub_tmp: Path, user: User) -> Path:
    root = pub_tmp / "shared"
    root.mkdir()
    sh("mount", "-t", "tmpfs", "-o", "size=8m,nr_inodes=20,mode=755", "tmpfs", str(root))
    yield root
    sh("umount", str(root))


def test_space_check_warns_before_the_job_runs_out(small_shared: Path, user: User, pub_tmp: Path) -> None:
    job = Job.from_env(user.env("501", SLURM_JOB_COMMENT="ckpt_size=4M"))
    owned_tree(small_shared / user.name, user)
    chk = check_shared(str(small_shared), job, 3, 4 * MiB, "--comment ckpt_size", timeout=10)
    assert chk.need_bytes == 16 * MiB and chk.free_bytes <= 8 * MiB
    assert any("8.0MiB free; this job needs up to 16.0MiB" in w for w in chk.warnings)
    assert any("free inodes" in w for w in chk.warnings)
    # Through the prolog: the warning reaches the job's report (and so its output).
    cfg = make_cfg(pub_tmp / "scratch", small_shared)
    report = run_prolog(user.env("501", SLURM_JOB_COMMENT="ckpt_size=4M"), cfg)
    assert report is not None and report.checks["storage"]["need_bytes"] == 16 * MiB
    assert any("this job needs up to 16.0MiB" in w for w in report.warnings)
    run_epilog(user.env("501"), cfg)


def test_expected_size_comes_from_the_newest_checkpoint(pub_tmp: Path, user: User) -> None:
    root = pub_tmp / "shared"
    owned_tree(root / user.name, user)
    write_ckpt(root / user.name / "job_502", 1, nbytes=100_000, owner=user)
    newest = write_ckpt(root / user.name / "job_502", 2, nbytes=300_000, owner=user)
    size = sum(p.stat().st_size for p in newest.iterdir())
    assert newest_checkpoint_size(str(root), user.name, "job_502") == (size, 2)
    chk = check_shared(str(root), Job.from_env(user.env("502")), 3, None, "", timeout=10)
    assert chk.expected_size == size and chk.need_bytes == size * 2  # keep 3 + 1 in flight - 2 there
    # A link planted in place of the job dir is not followed, even to a real run dir.
    (root / user.name / "job_503").symlink_to(root / user.name / "job_502")
    assert newest_checkpoint_size(str(root), user.name, "job_503") == (0, 0)


def test_a_hung_storage_check_costs_the_prolog_only_check_timeout(
    fault_dir: Path, faultfs: FaultFS, pub_tmp: Path, user: User
) -> None:
    """storage.root on the fault-injecting FUSE fs, where statfs stalls as on a hung NFS."""
    import time

    cfg = make_cfg(pub_tmp / "scratch", fault_dir, check_timeout=0.5)
    with faultfs.faults({"op": "statfs", "delay": 4}):
        t0 = time.monotonic()
        report = run_prolog(user.env("503"), cfg)
        took = time.monotonic() - t0
    assert took < 3, f"the prolog waited {took:.1f}s for a stalled statfs"
    assert report is not None and report.scratch  # the job still gets its scratch
    assert any("did not finish in 0s" in w or "did not finish in 1s" in w for w in report.warnings)
    run_epilog(user.env("503"), cfg)


def test_project_limits_bound_inodes_as_well_as_blocks() -> None:
    """The command that sets a job's project quota (the seam: this kernel has no quota)."""
    xfs = Mount("/scratch", "xfs", "/dev/sdb", (8, 16), {"prjquota": ""})
    ext4 = Mount("/scratch", "ext4", "/dev/sdb", (8, 16), {"prjquota": ""})
    assert limit_argv(xfs, 77, 2 * MiB, 5000) == ["xfs_quota", "-x", "-c",
                                                  f"limit -p bhard={2 * MiB} ihard=5000 77", "/scratch"]  # fmt: skip
    assert limit_argv(ext4, 77, 2 * MiB, 5000) == ["setquota", "-P", "77", "0", "2048", "0", "5000", "/scratch"]
    assert "ihard=0" in limit_argv(xfs, 77, 0)[3]  # clearing removes both limits


def test_auto_prefers_a_loop_filesystem(loop_fs: Callable[..., Path], user: User) -> None:
    """A project quota limits nothing in the init user namespace (see the next test): auto takes loop."""
    base = loop_fs("xfs", "512M")
    cfg = make_cfg(base)  # enforce: auto
    r = run_prolog(user.env("404", SLURM_JOB_COMMENT="ckpt_scratch=16M"), cfg)
    assert r is not None and r.enforce == "loop" and os.stat(base / "job_404").st_dev != os.stat(base).st_dev
    run_epilog(user.env("404"), cfg)
    assert not (base / "job_404").exists()


def test_the_epilog_reports_files_whose_project_id_the_user_changed(
    loop_fs: Callable[..., Path], user: User, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Project ids for real (XFS, the user's own chattr); faked are only the two steps this
    kernel lacks quota support for: the prjquota mount option and setting the limit."""
    from slurm_ckpt.node import quota

    base = loop_fs("xfs", "512M")
    monkeypatch.setattr(quota, "has_project_quota", lambda m: m is not None and m.fstype == "xfs")
    monkeypatch.setattr(quota, "set_project_limit", lambda *a: None)
    cfg = make_cfg(base, enforce="quota")
    r = run_prolog(user.env("405"), cfg)
    assert r is not None and r.enforce == "quota"
    job = base / "job_405"
    user.run("sh", "-c", f"cd {job} && echo a > kept && echo b > escaped && mkdir d && echo c > d/charged")
    user.run("chattr", "-p", "0", str(job / "escaped"))  # out of every quota
    user.run("chattr", "-p", "406", str(job / "d"), str(job / "d" / "charged"))  # onto job 406's
    fd = os.open(job / "kept", os.O_RDONLY)
    try:
        assert get_project(fd)[0] == 405
    finally:
        os.close(fd)
    capsys.readouterr()
    res = run_epilog(user.env("405"), cfg)
    assert res is not None and not job.exists()
    found = [x for x in capsys.readouterr().err.splitlines() if "changed the project id" in x]
    assert len(found) == 1, found
    assert f"job 405 (user {user.name}) changed the project id of 3 file(s)" in found[0]
    assert "2 to project 406 (job 406)" in found[0] and "1 to project 0 (no quota)" in found[0]
    assert "'escaped' (project 0)" in found[0]

"""``doctor`` on real CephFS and GlusterFS mounts: inodes, directory quotas, and hung servers."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from slurm_ckpt.doctor import Report, Severity, run_doctor
from slurm_ckpt.node.job import Job
from slurm_ckpt.node.space import check_shared
from tests.storage.lab import Lab

pytestmark = pytest.mark.root


def _doctor(path: Path, **kw: float) -> Report:
    return run_doctor(path, probe_bytes=8 << 20, probe_seconds=1, slurm_conf="/nonexistent", **kw)  # type: ignore[arg-type]


def _by_check(report: Report, check: str) -> list[str]:
    return [f"{f.severity}: {f.message}" for f in report.findings if f.check == check]


def test_healthy_mounts_read_clean(netfs: tuple[Path, Path]) -> None:
    a, _ = netfs
    report = _doctor(a)
    # CephFS reports its free inodes as -1: not an error, there is no fixed inode count.
    assert report.worst < Severity.ERROR, report.to_text()
    assert all(f.check != "storage" for f in report.findings)


def test_cephfs_quota_on_a_parent_is_found_through_the_other_mount(lab: Lab) -> None:
    name = f"quota-{os.getpid()}"
    top_a, top_b = lab.mount("ceph", "a") / name, lab.mount("ceph", "b") / name
    (top_a / "user" / "run").mkdir(parents=True)
    os.setxattr(top_a / "user", "ceph.quota.max_bytes", b"50000000")
    try:
        report = _doctor(top_b / "user" / "run")
    finally:
        os.setxattr(top_a / "user", "ceph.quota.max_bytes", b"0")
    quota = [f for f in report.findings if f.check == "quota"]
    assert [f.data.get("directory") for f in quota] == [str(top_b / "user")], report.to_text()
    assert quota[0].data["limit_bytes"] == 50_000_000
    assert quota[0].severity == Severity.ERROR  # 50 MB: under the room one checkpoint needs
    assert "ceph.quota.max_bytes" in quota[0].recommendation


def test_the_prologs_space_check_sees_a_cephfs_quota_that_df_does_not(lab: Lab) -> None:
    """The prolog checks the user's dir on the checkpoint storage before the job: a CephFS
    quota on the site's root is the limit, not the filesystem's free space."""
    root = lab.mount("ceph", "a") / f"root-{os.getpid()}"
    (root / "alice").mkdir(parents=True)
    job = Job("901", 0, 0, "alice", "/", "p", "", 0)
    os.setxattr(root, "ceph.quota.max_bytes", str(100 << 20).encode())
    try:
        chk = check_shared(str(root), job, 2, 64 << 20, "--comment ckpt_size", timeout=10)
    finally:
        os.setxattr(root, "ceph.quota.max_bytes", b"0")
    assert chk.free_bytes > 3 * (64 << 20)  # statvfs shows the whole filesystem
    quota = [w for w in chk.warnings if "CephFS quota" in w]
    assert len(quota) == 1 and str(root) in quota[0] and "setfattr -n ceph.quota.max_bytes" in quota[0], chk.warnings
    assert check_shared(str(root), job, 2, 64 << 20, "", timeout=10).warnings == []


def test_glusterfs_directory_quota_is_found(lab: Lab) -> None:
    name = f"quota-{os.getpid()}"
    (lab.mount("gluster", "a") / name / "run").mkdir(parents=True)
    lab.gluster("volume", "quota", lab.volume, "enable")
    try:
        lab.gluster("volume", "quota", lab.volume, "limit-usage", f"/{name}", "40MB")
        run = lab.mount("gluster", "b") / name / "run"
        # The clients take the new limit a moment after the CLI returns.
        deadline = time.monotonic() + 30
        while os.statvfs(run).f_blocks * os.statvfs(run).f_frsize != 40 << 20 and time.monotonic() < deadline:
            time.sleep(0.2)
        report = _doctor(run)
    finally:
        lab.gluster("volume", "quota", lab.volume, "disable")
    quota = [f for f in report.findings if f.check == "quota"]
    assert [f.data.get("limit_bytes") for f in quota] == [40 << 20], report.to_text()
    assert "gluster volume quota" in quota[0].recommendation


@pytest.mark.parametrize(("fs", "server"), [("gluster", "gluster"), ("ceph", "ceph-osd"), ("ceph", "ceph-mds")])
def test_hung_mount_is_reported_within_seconds(lab: Lab, fs: str, server: str) -> None:
    run = lab.mount(fs, "b") / f"hung-{os.getpid()}-{server}"
    with lab.hung(server, bound=45):
        t0 = time.monotonic()
        report = _doctor(run, hang_seconds=2)
        took = time.monotonic() - t0
    hung = [f for f in report.findings if f.data.get("hung")]
    assert took < 10, report.to_text()
    assert len(hung) == 1 and hung[0].severity == Severity.ERROR, report.to_text()
    assert hung[0].data["fstype"] == f"fuse.{'glusterfs' if fs == 'gluster' else 'ceph-fuse'}"

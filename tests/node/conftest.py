"""Fixtures for the node hooks: a real unprivileged user, real loop-mounted filesystems.

Everything a fixture creates (users, mounts, loop devices) is removed
afterwards, also when the test fails.
"""

from __future__ import annotations

import os
import pwd
import secrets
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests import machine
from tests.faultfs.fixtures import fault_dir, faultfs  # noqa: F401 - fixtures
from tests.node.helpers import User, need_root, remove_tree, sh


def _make_user() -> Iterator[User]:
    name = f"sckt{secrets.token_hex(3)}"
    sh("useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", "--user-group", name)
    try:
        pw = pwd.getpwnam(name)
        yield User(name, pw.pw_uid, pw.pw_gid)
    finally:
        sh("userdel", name, check=False)


@pytest.fixture
def user() -> Iterator[User]:
    """An unprivileged user created for this test, removed afterwards."""
    need_root()
    yield from _make_user()


@pytest.fixture
def other_user() -> Iterator[User]:
    need_root()
    yield from _make_user()


def _unmount(mnt: Path) -> None:
    if sh("umount", str(mnt), check=False).returncode != 0:
        sh("umount", "-l", str(mnt), check=False)


@pytest.fixture
def pub_tmp() -> Iterator[Path]:
    """A temp dir every user can traverse (pytest's own tmp_path is root-only, mode 0700)."""
    path = Path(tempfile.mkdtemp(prefix="sckt-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    remove_tree(path)  # unmounts first what a failed test left mounted (a kept loop image)


def _unmount_under(path: Path) -> None:
    """Unmount everything mounted below ``path`` (per-job scratch images), innermost first."""
    from slurm_ckpt.node.mounts import table

    for point in reversed([m.point for m in table() if m.point.startswith(str(path) + "/")]):
        _unmount(Path(point))


@pytest.fixture
def scratch_base(pub_tmp: Path) -> Iterator[Path]:
    """``pub_tmp/scratch`` on a tmpfs of its own, as node-local scratch is: the stage-out
    refuses a durable run dir on the scratch filesystem, and pub_tmp holds the durable ones."""
    need_root()
    base = pub_tmp / "scratch"
    base.mkdir()
    sh("mount", "-t", "tmpfs", "-o", "size=512m,mode=0755", "sckt-scratch", str(base))
    yield base
    _unmount_under(base)
    _unmount(base)


@pytest.fixture
def loop_fs(pub_tmp: Path) -> Iterator[Callable[..., Path]]:
    """Factory: a fresh filesystem of ``fstype`` on a loop device, mounted; removed afterwards."""
    machine.need(machine.loop_devices())
    mounts: list[Path] = []

    def make(fstype: str = "xfs", size: str = "512M", options: str = "") -> Path:
        img = pub_tmp / f"fs{len(mounts)}.img"
        mnt = pub_tmp / f"mnt{len(mounts)}"
        mnt.mkdir()
        sh("truncate", "-s", size, str(img))
        mkfs = {"xfs": ["mkfs.xfs", "-q", "-f"], "ext4": ["mkfs.ext4", "-q", "-F"]}[fstype]
        sh(*mkfs, str(img))
        sh("mount", "-o", ",".join(filter(None, ["loop", options])), str(img), str(mnt))
        mounts.append(mnt)
        os.chmod(mnt, 0o755)
        return mnt

    yield make
    for mnt in reversed(mounts):
        _unmount_under(mnt)  # per-job scratch images mounted inside go first
        _unmount(mnt)



"""Scratch dirs made and removed by root through dir fds: no link is followed, nothing outside is touched."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from slurm_ckpt.node.deadline import Deadline
from slurm_ckpt.node.scratch import (
    clear_dir,
    hand_over,
    make_job_dir,
    open_base,
    open_state_dir,
    remove_job_dir,
)
from tests.node.helpers import User, sh


def snapshot(path: Path) -> tuple[int, int, int, float]:
    st = os.lstat(path)
    return st.st_mode, st.st_uid, st.st_gid, st.st_mtime


@pytest.fixture
def base(pub_tmp: Path) -> Path:
    b = pub_tmp / "base"
    b.mkdir(mode=0o755)
    return b


def test_creates_0700_root_owned_then_hands_over(base: Path, user: User) -> None:
    bfd = open_base(str(base))
    fd = make_job_dir(bfd, "job_1", user.uid)
    # Root's until the limit is on: no process of the user can open it before.
    st = os.lstat(base / "job_1")
    assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == 0
    hand_over(fd, user.uid, user.gid)
    os.close(fd)
    st = os.lstat(base / "job_1")
    assert stat.S_IMODE(st.st_mode) == 0o700 and (st.st_uid, st.st_gid) == (user.uid, user.gid)
    sfd = open_state_dir(bfd)
    assert stat.S_IMODE(os.fstat(sfd).st_mode) == 0o711 and os.fstat(sfd).st_uid == 0
    os.close(sfd)
    os.close(bfd)


@pytest.mark.parametrize("target", ["/etc", "other-user-dir"])
def test_symlink_at_the_scratch_path_is_set_aside_not_followed(base: Path, user: User,
                                                               other_user: User, target: str) -> None:  # fmt: skip
    if target == "other-user-dir":
        victim = base.parent / "victim"
        victim.mkdir(mode=0o700)
        os.chown(victim, other_user.uid, other_user.gid)
        target = str(victim)
    before = snapshot(Path(target))
    (base / "job_2").symlink_to(target)
    bfd = open_base(str(base))
    fd = make_job_dir(bfd, "job_2", user.uid)
    hand_over(fd, user.uid, user.gid)
    os.close(fd)
    os.close(bfd)
    assert snapshot(Path(target)) == before  # not chowned, not chmodded
    assert not (base / "job_2").is_symlink() and os.lstat(base / "job_2").st_uid == user.uid
    aside = [p for p in base.iterdir() if p.name.startswith(".aside-job_2-")]
    assert len(aside) == 1 and os.readlink(aside[0]) == target


def test_another_users_dir_at_the_path_is_set_aside(base: Path, user: User, other_user: User) -> None:
    (base / "job_3").mkdir()
    os.chown(base / "job_3", other_user.uid, other_user.gid)
    bfd = open_base(str(base))
    fd = make_job_dir(bfd, "job_3", user.uid)
    hand_over(fd, user.uid, user.gid)
    os.close(fd)
    assert os.lstat(base / "job_3").st_uid == user.uid
    assert any(p.name.startswith(".aside-job_3-") and p.stat().st_uid == other_user.uid
               for p in base.iterdir())  # fmt: skip
    # The job's own dir (kept by an epilog) is adopted with its content.
    (base / "job_3" / "keep").write_text("x")
    os.close(make_job_dir(bfd, "job_3", user.uid))
    assert (base / "job_3" / "keep").read_text() == "x"
    os.close(bfd)


def test_removal_never_leaves_the_job_dir(base: Path, pub_tmp: Path, user: User) -> None:
    outside = pub_tmp / "outside"
    outside.mkdir()
    (outside / "precious").write_text("keep me")
    secret = base / "root-secret"  # same filesystem, so it can be hardlinked
    secret.write_text("root only")
    secret.chmod(0o600)
    bfd = open_base(str(base))
    fd = make_job_dir(bfd, "job_4", user.uid)
    hand_over(fd, user.uid, user.gid)
    os.close(fd)
    job = base / "job_4"
    # What a hostile job leaves behind, made as the user where a user can.
    user.run("mkdir", "-p", str(job / "d" / "e"))
    user.run("ln", "-s", str(outside), str(job / "link-dir"))
    user.run("ln", "-s", str(outside / "precious"), str(job / "d" / "link-file"))
    user.run("ln", "-s", "/etc", str(job / "d" / "e" / "etc"))
    user.run("mkfifo", str(job / "fifo"))
    user.run("touch", str(job / "new\nline"), str(job / "d" / "$(touch${IFS}pwned);reboot"))
    os.link(secret, job / "hardlink")  # fs.protected_hardlinks stops the user: root plants it
    os.mknod(job / "null", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    sh("mkdir", "-p", str(job / "deep"))
    deep = job / "deep"
    # 300 levels: more than the fds the walk may hold at once.
    rel = "/".join(["d"] * 300)
    os.makedirs(deep / rel)
    sh("chown", "-R", f"{user.uid}:{user.gid}", str(deep))
    etc_before = snapshot(Path("/etc"))
    out = remove_job_dir(bfd, "job_4")
    assert out.done and out.stuck == 0 and out.moved >= 300 // 64, out
    assert not job.exists()
    assert (outside / "precious").read_text() == "keep me"
    assert secret.read_text() == "root only" and os.lstat(secret).st_nlink == 1
    assert snapshot(Path("/etc")) == etc_before
    assert not Path("/pwned").exists() and not Path("/tmp/pwned").exists()
    assert remove_job_dir(bfd, "job_4").done  # twice is harmless
    os.close(bfd)


def test_a_mount_point_inside_is_detached_and_nothing_on_it_deleted(base: Path, user: User) -> None:
    bfd = open_base(str(base))
    os.close(make_job_dir(bfd, "job_5", user.uid))
    inner = base / "job_5" / "mnt"
    inner.mkdir()
    sh("mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(inner))
    held = os.open(inner, os.O_RDONLY | os.O_DIRECTORY)  # the tmpfs, whatever happens to its name
    try:
        (inner / "data").write_text("on another filesystem")
        out = remove_job_dir(bfd, "job_5")
        assert out.done and out.detached == 1, out
        assert not (base / "job_5").exists()
        assert os.listdir(held) == ["data"]  # detached, not emptied
    finally:
        os.close(held)
        sh("umount", str(inner), check=False)
    os.close(bfd)


def test_clear_dir_on_a_symlink_at_the_job_path_unlinks_only_the_link(base: Path, tmp_path: Path) -> None:
    target = tmp_path / "t"
    target.mkdir()
    (target / "f").write_text("x")
    (base / "job_6").symlink_to(target)
    bfd = open_base(str(base))
    assert remove_job_dir(bfd, "job_6").done
    os.close(bfd)
    assert not os.path.lexists(base / "job_6") and (target / "f").exists()
    fd = os.open(target, os.O_RDONLY | os.O_DIRECTORY)
    assert clear_dir(fd).done and not (target / "f").exists()
    os.close(fd)


class CountingDeadline(Deadline):
    """A deadline that runs out after ``calls`` looks at it: where a removal stops,
    set by count instead of by the clock of a machine of unknown speed."""

    def __init__(self, calls: int) -> None:
        super().__init__(3600)
        self.calls = calls

    def left(self, reserve: float = 0.0) -> float:
        self.calls -= 1
        return 1.0 if self.calls >= 0 else 0.0


def test_removal_stops_at_its_deadline_and_the_rest_is_taken_later(base: Path) -> None:
    tree = base / "t"
    (tree / "a" / "b").mkdir(parents=True)
    for d in (tree, tree / "a", tree / "a" / "b"):
        for i in range(300):
            (d / f"f{i}").touch()
    fd = os.open(tree, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert clear_dir(fd, CountingDeadline(0)).removed == 0  # out of time before the first entry
        first = clear_dir(fd, CountingDeadline(400))
        assert not first.done and 0 < first.removed <= 400, first
        rest = clear_dir(fd, CountingDeadline(10_000))
        assert rest.done and first.removed + rest.removed == 902  # 900 files, 2 dirs
    finally:
        os.close(fd)
    assert os.listdir(tree) == []


def test_removal_never_lists_a_whole_directory_into_memory(base: Path) -> None:
    """A directory of 20,000 entries is removed in memory that does not grow with it."""
    import tracemalloc

    tree = base / "many"
    (tree / "sub").mkdir(parents=True)
    fd = os.open(tree, os.O_RDONLY | os.O_DIRECTORY)
    sub = os.open(tree / "sub", os.O_RDONLY | os.O_DIRECTORY)
    try:
        for i in range(20_000):  # half at the top, half a level down
            where = fd if i % 2 else sub
            os.close(os.open(f"entry-with-a-long-name-{i:08d}", os.O_CREAT | os.O_WRONLY, 0o600, dir_fd=where))
        os.close(sub)
        tracemalloc.start()
        try:
            out = clear_dir(fd)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    finally:
        os.close(fd)
    assert out.done and out.removed == 20_001
    # A listing of either directory would hold 10,000 names (over 700 kB of str objects) at once.
    assert peak < 256 * 1024, f"peak {peak} bytes"


def test_a_2000_level_chain_is_removed_with_bounded_fds(base: Path) -> None:
    tree = base / "chain"
    tree.mkdir()
    fd = os.open(tree, os.O_RDONLY | os.O_DIRECTORY)
    cur = os.dup(fd)
    for _ in range(2000):  # by fd: the path would be too long for the kernel
        os.mkdir("d", dir_fd=cur)
        nxt = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=cur)
        os.close(cur)
        cur = nxt
    os.close(cur)
    try:
        before = len(os.listdir("/proc/self/fd"))
        out = clear_dir(fd)
        assert out.done and out.removed == 2000 and out.moved >= 2000 // 64, out
        assert len(os.listdir("/proc/self/fd")) == before
    finally:
        os.close(fd)

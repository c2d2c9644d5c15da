"""Quotas: project quotas that enforce a job's scratch size, and users' quotas on shared storage.

Project quotas (XFS, or ext4 with the ``project`` feature, mounted with
``prjquota``): the job dir gets the job id as its project id, with the inherit
flag, set by ``ioctl`` on the open directory fd (no path to follow); the limit
is set with ``xfs_quota`` or ``setquota``. User quotas are read with
``quota`` or, on Lustre, ``lfs quota``.
"""

from __future__ import annotations

import collections
import fcntl
import logging
import os
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from . import commands
from .escape import escape
from .mounts import Mount

__all__ = [
    "ProjectScan",
    "QuotaUsage",
    "changed_projects",
    "clear_project_limit",
    "get_project",
    "has_project_quota",
    "limit_argv",
    "parse_quota_lines",
    "set_project",
    "set_project_limit",
    "user_quota",
]

log = logging.getLogger("slurm_ckpt.node")

# struct fsxattr from <linux/fs.h>: xflags, extsize, nextents, projid, cowextsize, pad[8].
_FSXATTR = struct.Struct("=IIIII8s")
FS_IOC_FSGETXATTR = 0x801C581F  # _IOR('X', 31, struct fsxattr)
FS_IOC_FSSETXATTR = 0x401C5820  # _IOW('X', 32, struct fsxattr)
FS_XFLAG_PROJINHERIT = 0x00000200
MAX_PROJECT_ID = 2**32 - 2


def has_project_quota(mount: Mount | None) -> bool:
    """True where a project quota would be enforced (XFS or ext4 mounted with prjquota)."""
    if mount is None or mount.fstype not in ("xfs", "ext4"):
        return False
    opts = mount.options
    return "pqnoenforce" not in opts and bool(opts & {"prjquota", "pquota", "pqenforce"})


def get_project(fd: int) -> tuple[int, bool]:
    """(project id, inherit flag) of the open file or directory ``fd``."""
    raw = fcntl.ioctl(fd, FS_IOC_FSGETXATTR, bytes(_FSXATTR.size))
    xflags, _, _, projid, _, _ = _FSXATTR.unpack(raw)
    return projid, bool(xflags & FS_XFLAG_PROJINHERIT)


def set_project(fd: int, projid: int) -> None:
    """Give directory ``fd`` project ``projid``, inherited by everything created in it."""
    raw = fcntl.ioctl(fd, FS_IOC_FSGETXATTR, bytes(_FSXATTR.size))
    xflags, extsize, nextents, _, cow, pad = _FSXATTR.unpack(raw)
    new = _FSXATTR.pack(xflags | FS_XFLAG_PROJINHERIT, extsize, nextents, projid, cow, pad)
    fcntl.ioctl(fd, FS_IOC_FSSETXATTR, new)


@dataclass
class ProjectScan:
    """What :func:`changed_projects` found: entries off the job's project, by project id."""

    changed: int = 0
    by_project: collections.Counter[int] = field(default_factory=collections.Counter)
    examples: list[str] = field(default_factory=list)
    seen: int = 0
    complete: bool = True

    def summary(self) -> str:
        """One line: counts per project (a project id is the job id that set it) and a few names."""
        where = ", ".join(f"{n} to {'project 0 (no quota)' if p == 0 else f'project {p} (job {p})'}"
                          for p, n in self.by_project.most_common(5))  # fmt: skip
        return f"{where}; e.g. {', '.join(self.examples)}"


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_NOATIME | os.O_CLOEXEC
_MAX_DEPTH = 64


def changed_projects(dir_fd: int, projid: int, *, seconds: float, max_entries: int = 200_000) -> ProjectScan:
    """Directories and regular files under ``dir_fd`` whose project id is not ``projid``.

    A bounded walk (``seconds``, ``max_entries``, 64 levels; ``complete``
    says whether it saw everything) through directory fds: nothing is
    followed, no other filesystem entered, nothing but a directory or a
    regular file opened.
    """
    scan = ProjectScan()
    end = time.monotonic() + seconds
    dev = os.fstat(dir_fd).st_dev

    def check(fd: int, name: str) -> None:
        got, _ = get_project(fd)
        if got != projid:
            scan.changed += 1
            scan.by_project[got] += 1
            if len(scan.examples) < 3:
                scan.examples.append(f"{escape(name, 200)!r} (project {got})")

    check(dir_fd, ".")
    stack: list[tuple[int, Iterator[os.DirEntry[str]], str]] = [(dir_fd, os.scandir(dir_fd), "")]
    try:
        while stack:
            fd, entries, where = stack[-1]
            entry = next(entries, None)
            if entry is None:
                stack.pop()
                if stack:
                    os.close(fd)
                continue
            scan.seen += 1
            if scan.seen > max_entries or time.monotonic() > end:
                scan.complete = False
                break
            name = f"{where}/{entry.name}" if where else entry.name
            try:
                if entry.is_dir(follow_symlinks=False):
                    if len(stack) >= _MAX_DEPTH:
                        scan.complete = False
                        continue
                    sub = os.open(entry.name, _DIR_FLAGS, dir_fd=fd)
                    if os.fstat(sub).st_dev != dev:  # a mount inside (a user's FUSE): not ours
                        os.close(sub)
                        continue
                    stack.append((sub, os.scandir(sub), name))
                    check(sub, name)
                elif entry.is_file(follow_symlinks=False):
                    f = os.open(entry.name, _FILE_FLAGS, dir_fd=fd)
                    try:
                        check(f, name)
                    finally:
                        os.close(f)
            except OSError:
                continue  # gone meanwhile, or not a file that has a project
    finally:
        for i, (fd, entries, _) in enumerate(stack):
            entries.close()  # type: ignore[attr-defined]
            if i:
                os.close(fd)
    return scan


def limit_argv(mount: Mount, projid: int, nbytes: int, inodes: int = 0) -> list[str]:
    """The command that sets ``projid``'s hard block and inode limits (0: none)."""
    if mount.fstype == "xfs":
        return ["xfs_quota", "-x", "-c", f"limit -p bhard={nbytes} ihard={inodes} {projid}", mount.mount_point]
    kib = -(-nbytes // 1024)
    return ["setquota", "-P", str(projid), "0", str(kib), "0", str(inodes), mount.mount_point]


def set_project_limit(mount: Mount, projid: int, nbytes: int, timeout: float, inodes: int = 0) -> str | None:
    """Set the hard block and inode limits of ``projid``; return None, or why it failed.

    The inode limit bounds how many entries a job can leave for the epilog
    to remove, as the block limit bounds its bytes.
    """
    rc, out = commands.run(limit_argv(mount, projid, nbytes, inodes), timeout)
    return None if rc == 0 else f"{out.strip()[-300:]} (exit {rc})"


def clear_project_limit(mount: Mount, projid: int, timeout: float) -> None:
    """Remove the limits again (0 means none), so a reused project id starts clean."""
    set_project_limit(mount, projid, 0, timeout)


@dataclass(frozen=True)
class QuotaUsage:
    """A user's usage and limits on one filesystem, in bytes and inodes (0: no limit)."""

    used: int
    soft: int
    hard: int
    files: int
    files_soft: int
    files_hard: int
    tool: str


def _num(token: str) -> int:
    token = token.rstrip("*")
    return int(token) if token.isdigit() else 0


def parse_quota_lines(text: str, mount_point: str, tool: str) -> QuotaUsage | None:
    """Parse ``quota -w --show-mntpoint --hide-device`` or ``lfs quota -q`` output.

    Both print one line per filesystem: name, KiB used, soft, hard, grace,
    files, soft, hard, grace; a ``*`` marks a value over its soft limit.
    """
    for line in text.splitlines():
        tok = line.split()
        if len(tok) >= 8 and tok[0] == mount_point:
            kib = [_num(t) for t in tok[1:4]]
            files = [_num(t) for t in tok[5:8]]
            return QuotaUsage(kib[0] * 1024, kib[1] * 1024, kib[2] * 1024, files[0], files[1], files[2], tool)
    return None


def user_quota(mount: Mount, user: str, uid: int, timeout: float) -> QuotaUsage | None:
    """The user's quota on ``mount``, or None where there is none or no tool to ask."""
    if mount.fstype == "lustre":
        argv, tool = ["lfs", "quota", "-q", "-u", user, mount.mount_point], "lfs quota"
    else:
        argv = ["quota", "-w", "-p", "-Q", "--show-mntpoint", "--hide-device",
                f"--filesystem={mount.mount_point}", "-u", str(uid)]  # fmt: skip
        tool = "quota"
    rc, out = commands.run(argv, timeout)
    if rc in (124, 127):
        return None
    # `quota` exits 1 when the user is over a limit: the lines are still there.
    return parse_quota_lines(out, mount.mount_point, tool)

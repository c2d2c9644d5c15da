"""Quotas: project quotas that enforce a job's scratch size, and users' quotas on shared storage.

Project quotas (XFS, or ext4 with the ``project`` feature, mounted with
``prjquota``): the job dir gets the job id as its project id, with the inherit
flag, set by ``ioctl`` on the open directory fd (no path to follow); the limit
is set with ``xfs_quota`` or ``setquota``. User quotas are read with
``quota`` or, on Lustre, ``lfs quota``.
"""

from __future__ import annotations

import fcntl
import logging
import struct
from dataclasses import dataclass

from . import commands
from .mounts import Mount

__all__ = [
    "QuotaUsage",
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

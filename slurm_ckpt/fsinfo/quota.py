"""Quotas: project ids on XFS/ext4, and the limits a user, group or project has on a filesystem.

Two readers, for two callers. ``get_quota`` asks quotactl(2) directly, for
this process's own ids on a local block device (``doctor``). ``user_quota``
runs ``quota`` or, on Lustre, ``lfs quota``, for another user on any
filesystem those tools know (the root-run hooks); the caller hands in its
command seam.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass

from .mounts import Mount

__all__ = [
    "DirQuota",
    "Quota",
    "QuotaUsage",
    "ceph_quotas",
    "free_inodes",
    "get_project",
    "get_quota",
    "parse_quota_lines",
    "project_id",
    "set_project",
    "user_quota",
]

# struct fsxattr from <linux/fs.h>: xflags, extsize, nextents, projid, cowextsize, pad[8].
_FSXATTR = struct.Struct("=IIIII8s")
FS_IOC_FSGETXATTR = 0x801C581F  # _IOR('X', 31, struct fsxattr)
FS_IOC_FSSETXATTR = 0x401C5820  # _IOW('X', 32, struct fsxattr)
FS_XFLAG_PROJINHERIT = 0x00000200

_Q_GETQUOTA = 0x800007
_KINDS = {"user": 0, "group": 1, "project": 2}
_BLOCK = 1024  # quotactl's dqb_*limit unit (QIF_DQBLKSIZE)


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


def project_id(path: str | os.PathLike[str]) -> int | None:
    """The XFS/ext4 project id of ``path``, or None where it has none or cannot be read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return get_project(fd)[0]
    except OSError:
        return None
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Quota:
    """One quotactl limit: ``kind`` (user, group, project) and id, in bytes."""

    kind: str
    id: int
    used: int
    """Bytes used."""
    limit: int
    """Bytes allowed: the soft limit if set (writes fail past its grace time), else the hard one."""


def get_quota(device: str, kind: str, qid: int) -> Quota | None:
    """The limit of ``kind`` id ``qid`` on block device ``device``; None if no limit is set."""
    import ctypes  # here: the hooks never call quotactl, and start without ctypes
    import ctypes.util

    class DqBlk(ctypes.Structure):
        _fields_ = [(n, ctypes.c_uint64) for n in (
            "bhardlimit", "bsoftlimit", "curspace", "ihardlimit", "isoftlimit", "curinodes", "btime", "itime"
        )] + [("valid", ctypes.c_uint32)]  # fmt: skip

    libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    dq = DqBlk()
    cmd = (_Q_GETQUOTA << 8) | _KINDS[kind]
    if libc.quotactl(cmd, os.fsencode(device), qid, ctypes.byref(dq)) != 0:
        err = ctypes.get_errno()
        if err in (errno.ESRCH, errno.ENOSYS, errno.EINVAL, errno.ENOTBLK, errno.ENOENT, errno.ENODEV):
            return None  # quotas off, or not a quota-capable block device
        raise OSError(err, os.strerror(err), device)
    limit = dq.bsoftlimit or dq.bhardlimit
    if not limit:
        return None
    return Quota(kind, qid, int(dq.curspace), int(limit) * _BLOCK)


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


Runner = Callable[[list[str], float], tuple[int, str]]
"""Runs an argv with a timeout; returns (exit status, output). 127: not installed, 124: timed out."""


def user_quota(mount: Mount, user: str, uid: int, timeout: float, run: Runner) -> QuotaUsage | None:
    """The user's quota on ``mount``, or None where there is none or no tool to ask."""
    if mount.fstype == "lustre":
        argv, tool = ["lfs", "quota", "-q", "-u", user, mount.mount_point], "lfs quota"
    else:
        argv = ["quota", "-w", "-p", "-Q", "--show-mntpoint", "--hide-device",
                f"--filesystem={mount.mount_point}", "-u", str(uid)]  # fmt: skip
        tool = "quota"
    rc, out = run(argv, timeout)
    if rc in (124, 127):
        return None
    # `quota` exits 1 when the user is over a limit: the lines are still there.
    return parse_quota_lines(out, mount.mount_point, tool)


@dataclass(frozen=True)
class DirQuota:
    """A CephFS directory quota: limits in bytes and files (0: none), usage as the MDS counts it."""

    directory: str
    max_bytes: int
    max_files: int
    used_bytes: int
    used_files: int


def free_inodes(vfs: os.statvfs_result) -> int | None:
    """The inodes left for unprivileged users, or None where the filesystem has no
    fixed count: btrfs reports 0 inodes in all, CephFS -1 free."""
    return None if vfs.f_files == 0 or vfs.f_favail < 0 else vfs.f_favail


def _xattr_int(path: str, name: str) -> int:
    try:
        return int(os.getxattr(path, name).split(b"\0")[0] or 0)
    except (OSError, ValueError):
        return 0


def ceph_quotas(path: str | os.PathLike[str], mount_point: str) -> list[DirQuota]:
    """The CephFS quotas on ``path`` and each parent up to ``mount_point``, nearest first.

    CephFS keeps a quota as the ``ceph.quota.max_bytes`` / ``max_files``
    xattrs of any directory, and the client enforces every one above a file.
    ``statvfs`` inside such a directory still shows the whole filesystem (unless
    the directory is the mount's root), so ``df`` does not see them. Usage is
    the recursive ``ceph.dir.rbytes`` / ``rfiles``, which the MDS updates a
    few seconds behind the writes.
    """
    out = []
    p = os.path.realpath(path)
    top = os.path.realpath(mount_point)
    while True:
        max_bytes, max_files = _xattr_int(p, "ceph.quota.max_bytes"), _xattr_int(p, "ceph.quota.max_files")
        if max_bytes or max_files:
            out.append(DirQuota(p, max_bytes, max_files, _xattr_int(p, "ceph.dir.rbytes"),
                                _xattr_int(p, "ceph.dir.rfiles")))  # fmt: skip
        if p == top or p == os.path.dirname(p):
            return out
        p = os.path.dirname(p)

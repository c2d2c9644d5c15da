"""Quotas that apply to the checkpoint dir: user, group and project (XFS/ext4 via quotactl).

``df`` does not show a user quota, and a project quota only shows when the
directory inherits the project; a checkpoint that hits either fails with
EDQUOT. quotactl(2) reads the limits without the ``quota`` tools.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass

from ..store.retry import Mount
from .finding import Context, Report, Severity, fmt_bytes

__all__ = ["Quota", "check_quota", "get_quota", "project_id"]

_Q_GETQUOTA = 0x800007
_KINDS = {"user": 0, "group": 1, "project": 2}
_FS_IOC_FSGETXATTR = 0x801C581F
_BLOCK = 1024  # quotactl's dqb_*limit unit (QIF_DQBLKSIZE)


class _DqBlk(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in (
        "bhardlimit", "bsoftlimit", "curspace", "ihardlimit", "isoftlimit", "curinodes", "btime", "itime"
    )] + [("valid", ctypes.c_uint32)]  # fmt: skip


@dataclass(frozen=True)
class Quota:
    kind: str
    id: int
    used: int
    """Bytes used."""
    limit: int
    """Bytes allowed: the soft limit if set (writes fail past its grace time), else the hard one."""


def project_id(path: str | os.PathLike[str]) -> int | None:
    """The XFS/ext4 project id of ``path`` (FS_IOC_FSGETXATTR), or None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        buf = fcntl.ioctl(fd, _FS_IOC_FSGETXATTR, bytes(28))
        return int(struct.unpack("IIII", buf[:16])[3])
    except OSError:
        return None
    finally:
        os.close(fd)


def get_quota(device: str, kind: str, qid: int) -> Quota | None:
    """The limit of ``kind`` id ``qid`` on block device ``device``; None if no limit is set."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    dq = _DqBlk()
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


def check_quota(report: Report, ctx: Context, mount: Mount | None,
                getter: Callable[[str, str, int], Quota | None] = get_quota) -> None:  # fmt: skip
    """Report each quota that limits ``ctx.probe_dir``.

    ``getter`` is the quotactl seam: kernels built without CONFIG_QUOTA cannot
    hold a quota at all, so tests of the limit arithmetic pass their own.
    """
    if mount is None:
        return
    if not mount.source.startswith("/dev/"):
        if mount.fstype == "lustre":
            report.add("quota", Severity.INFO, "Lustre quota not read here",
                       f"check it with: lfs quota -h -u $USER {mount.mount_point}")  # fmt: skip
        elif mount.fstype in ("nfs", "nfs4"):
            report.add("quota", Severity.INFO, "NFS quota is kept on the server",
                       "check it with: quota -s")  # fmt: skip
        return
    ids = [("user", os.geteuid()), ("group", os.getegid())]
    pid = project_id(ctx.probe_dir)
    if pid:
        ids.append(("project", pid))
    found = False
    for kind, qid in ids:
        try:
            q = getter(mount.source, kind, qid)
        except OSError as e:
            report.add("quota", Severity.INFO, f"cannot read {kind} quota: {e.strerror}")
            continue
        if q is None:
            continue
        found = True
        left = max(0, q.limit - q.used)
        msg = f"{kind} quota {q.id}: {fmt_bytes(q.used)} used of {fmt_bytes(q.limit)}, {fmt_bytes(left)} left"
        data = {"kind": kind, "id": q.id, "used_bytes": q.used, "limit_bytes": q.limit}
        fix = "ask for more quota, lower storage.keep, or delete old checkpoints"
        need = ctx.ckpt_size or 0
        if left < max(need, 64 << 20):
            report.add("quota", Severity.ERROR, msg + ": the next checkpoint fails with EDQUOT", fix, **data)
        elif need and left < 2 * need:
            report.add("quota", Severity.WARN, msg + ": room for one more checkpoint", fix, **data)
        else:
            report.add("quota", Severity.OK, msg, **data)
    if not found:
        report.add("quota", Severity.OK, f"no user, group or project quota on {mount.source}")

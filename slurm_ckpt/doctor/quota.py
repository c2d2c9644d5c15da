"""Quotas that apply to the checkpoint dir: user, group and project (XFS/ext4 via
quotactl), and the directory quotas of CephFS and GlusterFS.

``df`` does not show a user quota, and a project quota only shows when the
directory inherits the project; a checkpoint that hits either fails with
EDQUOT. quotactl(2) reads the limits without the ``quota`` tools. A CephFS
quota is an xattr of any directory above the run dir, which ``df`` does not
show; a GlusterFS directory quota shows as the directory's own ``df``
(``features.quota-deem-statfs``, on by default).
"""

from __future__ import annotations

import os
from collections.abc import Callable

from ..fsinfo import CEPH_FS, GLUSTER_FS, Mount, Quota, ceph_quotas, get_quota, project_id
from .finding import Context, Report, Severity, fmt_bytes

__all__ = ["check_quota"]


def check_quota(report: Report, ctx: Context, mount: Mount | None,
                getter: Callable[[str, str, int], Quota | None] = get_quota) -> None:  # fmt: skip
    """Report each quota that limits ``ctx.probe_dir``.

    ``getter`` is the quotactl seam: kernels built without CONFIG_QUOTA cannot
    hold a quota at all, so tests of the limit arithmetic pass their own.
    """
    if mount is None:
        return
    if mount.fstype in CEPH_FS:
        _ceph(report, ctx, mount)
        return
    if mount.fstype in GLUSTER_FS:
        _gluster(report, ctx, mount)
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
        _grade(report, ctx, msg, left, _FIX, **data)
    if not found:
        report.add("quota", Severity.OK, f"no user, group or project quota on {mount.source}")


_FIX = "ask for more quota, lower storage.keep, or delete old checkpoints"


def _grade(report: Report, ctx: Context, msg: str, left: int, fix: str, **data: object) -> None:
    need = ctx.ckpt_size or 0
    if left < max(need, 64 << 20):
        report.add("quota", Severity.ERROR, msg + ": the next checkpoint fails with EDQUOT", fix, **data)
    elif need and left < 2 * need:
        report.add("quota", Severity.WARN, msg + ": room for one more checkpoint", fix, **data)
    else:
        report.add("quota", Severity.OK, msg, **data)


def _ceph(report: Report, ctx: Context, mount: Mount) -> None:
    quotas = ceph_quotas(ctx.probe_dir, mount.mount_point)
    if not quotas:
        report.add("quota", Severity.OK, f"no CephFS quota on {ctx.probe_dir} or its parents "
                   f"up to {mount.mount_point}")  # fmt: skip
    for q in quotas:
        data = {"kind": "cephfs", "directory": q.directory, "used_bytes": q.used_bytes,
                "limit_bytes": q.max_bytes, "used_files": q.used_files, "limit_files": q.max_files}  # fmt: skip
        raise_it = f"{_FIX}; an admin raises it with `setfattr -n ceph.quota.max_%s -v %s {q.directory}`"
        if q.max_bytes:
            left = max(0, q.max_bytes - q.used_bytes)
            _grade(report, ctx, f"CephFS quota on {q.directory}: {fmt_bytes(q.used_bytes)} used of "
                   f"{fmt_bytes(q.max_bytes)}, {fmt_bytes(left)} left", left, raise_it % ("bytes", "BYTES"),
                   **data)  # fmt: skip
        if q.max_files:
            left = max(0, q.max_files - q.used_files)
            msg = f"CephFS quota on {q.directory}: {q.used_files} of {q.max_files} files"
            # A checkpoint is a directory of a few files.
            sev = Severity.ERROR if left < 8 else Severity.WARN if left < 100 else Severity.OK
            report.add("quota", sev, msg, "" if sev is Severity.OK else raise_it % ("files", "FILES"), **data)


def _gluster(report: Report, ctx: Context, mount: Mount) -> None:
    try:
        here, top = os.statvfs(ctx.probe_dir), os.statvfs(mount.mount_point)
    except OSError as e:
        report.add("quota", Severity.INFO, f"cannot read the GlusterFS quota: {e.strerror}")
        return
    if (here.f_blocks, here.f_frsize) == (top.f_blocks, top.f_frsize):
        report.add("quota", Severity.OK, f"no GlusterFS directory quota shows at {ctx.probe_dir}",
                   "quotas show as a directory's df with features.quota-deem-statfs on (the default); "
                   "admins list them with `gluster volume quota VOLUME list`")  # fmt: skip
        return
    limit = here.f_blocks * here.f_frsize
    left = here.f_bavail * here.f_frsize
    used = limit - here.f_bfree * here.f_frsize
    _grade(report, ctx, f"GlusterFS directory quota: {fmt_bytes(used)} used of {fmt_bytes(limit)}, "
           f"{fmt_bytes(left)} left", left,
           f"{_FIX}; admins see and raise it with `gluster volume quota VOLUME list` and "
           "`gluster volume quota VOLUME limit-usage DIR SIZE`",
           kind="glusterfs", used_bytes=used, limit_bytes=limit)  # fmt: skip

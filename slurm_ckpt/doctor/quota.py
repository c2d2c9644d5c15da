"""Quotas that apply to the checkpoint dir: user, group and project (XFS/ext4 via quotactl).

``df`` does not show a user quota, and a project quota only shows when the
directory inherits the project; a checkpoint that hits either fails with
EDQUOT. quotactl(2) reads the limits without the ``quota`` tools.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from ..fsinfo import Mount, Quota, get_quota, project_id
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

"""Free space and free inodes where the checkpoints go."""

from __future__ import annotations

import os

from ..fsinfo import free_inodes
from .finding import Context, Report, Severity, fmt_bytes

__all__ = ["check_space"]

MIN_FREE = 64 << 20
"""Below this, even a small checkpoint's temp dir will not fit."""


def check_space(report: Report, ctx: Context) -> None:
    try:
        sv = os.statvfs(ctx.probe_dir)
    except OSError as e:
        report.add("space", Severity.ERROR, f"statvfs({ctx.probe_dir}) failed: {e.strerror}",
                   "check that the filesystem is mounted and reachable")  # fmt: skip
        return
    free, total = sv.f_bavail * sv.f_frsize, sv.f_blocks * sv.f_frsize
    need = ctx.ckpt_size
    data = {"free_bytes": free, "total_bytes": total, "free_inodes": sv.f_favail,
            "total_inodes": sv.f_files, "checkpoint_bytes": need}  # fmt: skip
    msg = f"{fmt_bytes(free)} free of {fmt_bytes(total)}"
    if need:
        msg += f"; one checkpoint is {fmt_bytes(need)}"
    fix = "free space, lower storage.keep, or point SLURM_CKPT_DIR at a larger filesystem"
    if free < max(need or 0, MIN_FREE):
        report.add("space", Severity.ERROR, msg + ": the next checkpoint will not fit", fix, **data)
    elif (need and free < 2 * need) or (total and free < 0.05 * total):
        report.add("space", Severity.WARN, msg + ": little room left", fix, **data)
    else:
        report.add("space", Severity.OK, msg, **data)
    if free_inodes(sv) is None:
        return
    imsg = f"{sv.f_favail} of {sv.f_files} inodes free"
    ifix = "delete small files (old checkpoints, logs) on this filesystem"
    if sv.f_favail < 100:
        report.add("inodes", Severity.ERROR, imsg + ": new files cannot be created", ifix, **data)
    elif sv.f_favail < 0.01 * sv.f_files:
        report.add("inodes", Severity.WARN, imsg, ifix, **data)
    else:
        report.add("inodes", Severity.OK, imsg, **data)

"""``slurm-ckpt doctor``: diagnose the storage and the Slurm setup checkpoints depend on.

Each check adds findings with a severity and a recommendation; the worst
severity becomes the CLI's exit code. Everything here is stdlib-only and never
imports torch, so the doctor starts fast on a login node.
"""

from __future__ import annotations

import os
from pathlib import Path

from .cgroupio import check_cgroup_io
from .finding import Context, Finding, Report, Severity
from .mounts import check_mount
from .owners import check_owners
from .pagecache import check_pagecache
from .probe import check_probe
from .quota import check_quota
from .slurmconf import SlurmConf, check_slurm_conf, check_timing, find_slurm_conf
from .space import check_space

__all__ = ["Context", "Finding", "Report", "Severity", "run_doctor"]


def _existing(path: Path) -> Path:
    p = path.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def _latest_size(path: Path) -> int | None:
    from ..store.verify import find_latest

    try:
        cand = find_latest([path], full=False)
    except OSError:
        return None
    if cand is None:
        return None
    m = cand.manifest
    return int(m.nbytes or sum(r.size for r in m.files.values()))


def run_doctor(
    path: str | os.PathLike[str],
    *,
    slurm_conf: str | None = None,
    lead_time: float | None = None,
    ckpt_size: int | None = None,
    keep: int = 3,
    probe_bytes: int = 128 << 20,
    probe_seconds: float = 5.0,
    storage_root: str = "",
) -> Report:
    """Run every check on ``path`` (a run dir, or where run dirs will go); ``storage_root``:
    the config's, whose per-user dirs are checked too."""
    p = Path(path)
    ctx = Context(path=p, probe_dir=_existing(p), keep=keep,
                  lead_time=lead_time if lead_time is not None else 120.0,
                  lead_time_given=lead_time is not None)  # fmt: skip
    report = Report(str(p.absolute()))
    if ctx.probe_dir != p.absolute():
        report.add("path", Severity.INFO, f"{p} does not exist yet; checking {ctx.probe_dir}")
    elif not p.is_dir():
        report.add("path", Severity.ERROR, f"{p} is not a directory", "give a run dir or its parent")
        return report
    ctx.ckpt_size = ckpt_size or _latest_size(ctx.probe_dir)
    mount = check_mount(report, ctx)
    check_space(report, ctx)
    check_owners(report, ctx, storage_root)
    check_quota(report, ctx, mount)
    res = check_probe(report, ctx.probe_dir, probe_bytes, probe_seconds)
    ctx.bandwidth = res.bandwidth if res.error is None else 0.0
    check_pagecache(report, ctx)
    conf_path = find_slurm_conf(slurm_conf)
    conf = None
    if conf_path is None:
        report.add("slurm", Severity.INFO, "no slurm.conf found: Slurm checks skipped",
                   "pass --slurm-conf or set SLURM_CONF")  # fmt: skip
    else:
        try:
            conf = SlurmConf(conf_path)
        except OSError as e:
            report.add("slurm", Severity.WARN, f"cannot read {conf_path}: {e.strerror}",
                       "pass --slurm-conf with the slurm.conf the controller uses")  # fmt: skip
        else:
            check_slurm_conf(report, ctx, conf)
    check_timing(report, ctx, conf)
    check_cgroup_io(report, ctx, mount)
    return report

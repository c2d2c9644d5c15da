"""``slurm-ckpt doctor``: diagnose the storage and the Slurm setup checkpoints depend on.

Each check adds findings with a severity and a recommendation; the worst
severity becomes the CLI's exit code. The checks that touch the storage run in
a child process (``child.py``), so a hung mount is reported, not waited on. Everything here is stdlib-only and never
imports torch, so the doctor starts fast on a login node.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..fsinfo import Mount, mount_named
from .cgroupio import check_cgroup_io
from .child import Outbox, messages
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


class _Sent(Report):
    """The child's report: each finding also goes up the pipe the moment it is made."""

    def __init__(self, path: str, box: Outbox) -> None:
        super().__init__(path)
        self.box = box

    def add(self, check: str, severity: Severity, message: str, recommendation: str = "", /,
            **data: Any) -> Finding:  # fmt: skip
        f = super().add(check, severity, message, recommendation, **data)
        self.box.send("finding", f)
        return f


def _storage_checks(box: Outbox, ctx: Context, ckpt_size: int | None, probe_bytes: int,
                    probe_seconds: float) -> None:  # fmt: skip
    """Every check that touches ``ctx.path``, run in the child; results go up ``box``."""
    p = ctx.path
    report = _Sent(str(p.absolute()), box)
    box.send("check", "path", 0.0)
    ctx.probe_dir = _existing(p)
    if ctx.probe_dir != p.absolute():
        report.add("path", Severity.INFO, f"{p} does not exist yet; checking {ctx.probe_dir}")
    elif not p.is_dir():
        report.add("path", Severity.ERROR, f"{p} is not a directory", "give a run dir or its parent")
        box.send("stop")
        return
    ctx.ckpt_size = ckpt_size or _latest_size(ctx.probe_dir)
    box.send("ctx", ctx.probe_dir, ctx.ckpt_size)
    box.send("check", "mount", 0.0)
    mount = check_mount(report, ctx)
    box.send("mount", mount)
    box.send("check", "space", 0.0)
    check_space(report, ctx)
    box.send("check", "quota", 0.0)
    check_quota(report, ctx, mount)
    box.send("check", "probe", probe_seconds)
    res = check_probe(report, ctx.probe_dir, probe_bytes, probe_seconds)
    box.send("bandwidth", res.bandwidth if res.error is None else 0.0)


def _hung(report: Report, ctx: Context, check: str, waited: float) -> Mount | None:
    # Found by the path as written: stat-ing it would hang the doctor too.
    m = mount_named(ctx.path)
    where = f"{m.fstype} at {m.mount_point} from {m.source}" if m else "its filesystem"
    report.add("storage", Severity.ERROR,
               f"the {check} check on {ctx.path} did not answer within {waited:.0f} s: "
               f"{where} is hung or very slow",
               "check the file servers and the network (CephFS: `ceph -s`, `ceph health detail`; "
               "GlusterFS: `gluster volume status`; NFS: `nfsstat -m`); a save there blocks until "
               "they answer: give jobs node-local scratch (SLURM_CKPT_SCRATCH) so saves commit "
               "there and drain later", check=check, waited_s=round(waited, 1), hung=True,
               fstype=m.fstype if m else None)  # fmt: skip
    return m


def run_doctor(
    path: str | os.PathLike[str],
    *,
    slurm_conf: str | None = None,
    lead_time: float | None = None,
    ckpt_size: int | None = None,
    keep: int = 3,
    probe_bytes: int = 128 << 20,
    probe_seconds: float = 5.0,
    hang_seconds: float = 5.0,
    storage_root: str = "",
) -> Report:
    """Run every check on ``path`` (a run dir, or where run dirs will go); ``storage_root``:
    the config's, whose per-user dirs are checked too.

    The checks that touch the storage run in a child process: one that does not
    answer within ``hang_seconds`` (the probe: ``probe_seconds`` more) is
    reported as a hung mount, and the doctor goes on without it.
    """
    p = Path(path)
    ctx = Context(path=p, probe_dir=p.absolute(), keep=keep,
                  lead_time=lead_time if lead_time is not None else 120.0,
                  lead_time_given=lead_time is not None)  # fmt: skip
    report = Report(str(p.absolute()))
    mount: Mount | None = None
    with messages(lambda box: _storage_checks(box, ctx, ckpt_size, probe_bytes, probe_seconds)) as recv:
        check, budget = "path", hang_seconds
        while True:
            msg = recv(budget)
            if msg is None:
                mount = _hung(report, ctx, check, budget)
                break
            kind = msg[0]
            if kind == "check":
                check, budget = msg[1], msg[2] + hang_seconds
            elif kind == "finding":
                report.findings.append(msg[1])
            elif kind == "ctx":
                ctx.probe_dir, ctx.ckpt_size = msg[1], msg[2]
            elif kind == "mount":
                mount = msg[1]
            elif kind == "bandwidth":
                ctx.bandwidth = msg[1]
            elif kind == "crashed":
                report.add(check, Severity.ERROR, f"the {check} check failed: {msg[1]}",
                           "run `slurm-ckpt doctor` again; report it if it repeats")  # fmt: skip
            elif kind == "stop":
                return report
            else:  # "ended"
                break
    check_owners(report, ctx, storage_root)
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

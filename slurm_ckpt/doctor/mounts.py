"""Filesystem type and mount options: what they mean for checkpoint safety and speed."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Callable

from ..fsinfo import Mount, mount_for
from .finding import Context, Report, Severity

__all__ = ["check_mount", "lustre_stripe"]

Runner = Callable[[list[str]], str]


def _run(cmd: list[str]) -> str:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=True).stdout


def lustre_stripe(path: str, run: Runner = _run) -> int | None:
    """The directory's default stripe count from ``lfs getstripe -d``, or None without ``lfs``."""
    if shutil.which("lfs") is None:
        return None
    try:
        out = run(["lfs", "getstripe", "-d", path])
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"stripe_count:\s*(-?\d+)", out)
    return int(m.group(1)) if m else None


def lustre_full_osts(mount_point: str, run: Runner = _run, limit: int = 95) -> list[str] | None:
    """OSTs at or above ``limit`` % used, from ``lfs df``; None without ``lfs``.

    A file striped over a full OST gets ENOSPC while ``df`` of the whole
    filesystem still shows free space.
    """
    if shutil.which("lfs") is None:
        return None
    try:
        out = run(["lfs", "df", mount_point])
    except (OSError, subprocess.SubprocessError):
        return None
    full = []
    for line in out.splitlines():
        m = re.match(r"^(\S+-OST\w+)\S*\s+\d+\s+\d+\s+\d+\s+(\d+)%", line)
        if m and int(m.group(2)) >= limit:
            full.append(f"{m.group(1)} {m.group(2)}%")
    return full


def check_mount(report: Report, ctx: Context, *, mountinfo: str = "/proc/self/mountinfo",
                run: Runner = _run) -> Mount | None:  # fmt: skip
    m = mount_for(ctx.probe_dir, mountinfo)
    if m is None:
        report.add("mount", Severity.WARN, f"cannot find the mount of {ctx.probe_dir}",
                   "is /proc mounted?")  # fmt: skip
        return None
    o = m.options
    shown = ",".join(k if not v else f"{k}={v}" for k, v in o.items())
    data = {"fstype": m.fstype, "mount_point": m.mount_point, "source": m.source, "options": shown}
    base = f"{m.fstype} at {m.mount_point} from {m.source}"
    if m.read_only:
        report.add("mount", Severity.ERROR, base + " is mounted read-only",
                   "a read-only remount usually follows I/O errors: tell your admins; "
                   "meanwhile save to node-local scratch", **data)  # fmt: skip
    elif m.fstype in ("nfs", "nfs4"):
        _nfs(report, base, o, data)
    elif m.fstype == "lustre":
        _lustre(report, base, o, data, str(ctx.probe_dir), ctx.ckpt_size, run)
    elif m.fstype == "tmpfs":
        report.add("mount", Severity.INFO, base + ": in memory, gone at reboot",
                   "fine for node-local scratch; never use it as the durable tier", **data)  # fmt: skip
    elif m.is_network:
        report.add("mount", Severity.INFO, base + ": network/FUSE filesystem; EIO is retried "
                   "as transient here (storage.retry_errnos)", **data)  # fmt: skip
    else:
        report.add("mount", Severity.OK, base + f" ({shown})", **data)
    return m


def _nfs(report: Report, base: str, o: dict[str, str], data: dict[str, str]) -> None:
    vers = o.get("vers") or o.get("nfsvers") or ("4" if "nfs4" in base else "3")
    found = [f"NFS version {vers}"]
    worst, fixes = Severity.OK, []
    if "soft" in o:
        worst = Severity.WARN
        found.append("soft mount")
        fixes.append("mount with 'hard': a soft mount turns a slow server into EIO and lost writes")
    if o.get("local_lock") in ("all", "flock"):
        worst = Severity.WARN
        found.append(f"local_lock={o['local_lock']}")
        fixes.append("flock is node-local with local_lock: two nodes can both lock one run dir; "
                     "give every job its own SLURM_CKPT_DIR")  # fmt: skip
    if "sync" in o:
        worst = max(worst, Severity.INFO)
        found.append("sync (every write waits for the server)")
        fixes.append("'sync' is safe but slow; slurm-ckpt fsyncs what it needs, so 'async' suffices")
    if "noac" in o or o.get("actimeo") == "0":
        worst = max(worst, Severity.INFO)
        found.append("attribute caching off (noac/actimeo=0): slow metadata")
    elif "actimeo" in o:
        found.append(f"actimeo={o['actimeo']}")
    if vers.startswith("3"):
        worst = max(worst, Severity.INFO)
        fixes.append("NFSv3 locks go through lockd/statd: make sure they run on clients and server")
    report.add("mount", worst, f"{base}: " + "; ".join(found), "; ".join(fixes), nfs_version=vers, **data)


def _lustre(report: Report, base: str, o: dict[str, str], data: dict[str, str], path: str,
            size: int | None, run: Runner) -> None:  # fmt: skip
    if "flock" not in o:
        what = "localflock (node-local locks)" if "localflock" in o else "no flock option"
        report.add("mount", Severity.WARN, f"{base}: {what}",
                   "mount Lustre with -o flock so the run dir lock works across nodes", **data)  # fmt: skip
    else:
        report.add("mount", Severity.OK, base + " (flock)", **data)
    full = lustre_full_osts(data["mount_point"], run)
    if full:
        report.add("lustre", Severity.WARN, f"nearly full OSTs: {', '.join(full)}: files striped there "
                   "fail with ENOSPC while df shows free space",
                   "ask the admins to rebalance; stripe checkpoints wide (lfs setstripe -c -1)",
                   full_osts=full)  # fmt: skip
    stripes = lustre_stripe(path, run)
    if stripes is None:
        report.add("lustre", Severity.INFO, "lfs not available: stripe count unknown",
                   "install the Lustre client tools to check striping")  # fmt: skip
    elif stripes == 1 and size and size > 10**10:
        report.add("lustre", Severity.WARN, f"stripe count 1 for {size / 1e9:.0f} GB checkpoints: "
                   "one OST takes every byte and fills first (ENOSPC while df shows space)",
                   f"lfs setstripe -c -1 {path}  (or -c 4..8)", stripe_count=stripes)  # fmt: skip
    else:
        report.add("lustre", Severity.OK, f"stripe count {stripes}", stripe_count=stripes)

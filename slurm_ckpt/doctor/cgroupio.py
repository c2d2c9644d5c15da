"""cgroup I/O limits on the device that holds the checkpoints, and the controls the kernel offers.

A ``blkio.throttle.write_bps_device`` (v1) or ``io.max wbps=`` (v2) limit on
this process's cgroup, or any ancestor, caps every checkpoint write; weights
only act under the BFQ scheduler (or iocost on v2). Throttles live in the block
layer's cgroup code and act under any scheduler; a kernel without BFQ (or
iocost) has no per-job weights at all, and the prolog then sets only throttles.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from ..fsinfo import Mount, block_device, cgroup_mount, read_mounts
from .finding import Context, Report, Severity, fmt_rate

__all__ = ["IOControls", "IOLimit", "check_cgroup_io", "io_controls", "io_limits"]


@dataclass
class IOLimit:
    version: int
    cgroup: str
    """This process's cgroup path (relative to the hierarchy root)."""
    limits: dict[str, int] = field(default_factory=dict)
    """rbps/wbps/riops/wiops: the tightest value over the cgroup and its ancestors."""
    weight: str = ""
    io_controller: bool = True


def _hierarchies(mountinfo: str) -> tuple[Path | None, Path | None]:
    mounts = read_mounts(mountinfo)
    v1, v2 = cgroup_mount("blkio", mounts), cgroup_mount("unified", mounts)
    return (Path(v1.mount_point) if v1 else None), (Path(v2.mount_point) if v2 else None)


def _own_cgroup(proc_cgroup: str, controller: str) -> str | None:
    with open(proc_cgroup) as f:
        for line in f:
            _, ctrls, path = line.rstrip("\n").split(":", 2)
            if (controller == "" and ctrls == "") or controller in ctrls.split(","):
                return path
    return None


def _tighten(limits: dict[str, int], key: str, value: int) -> None:
    if value > 0:
        limits[key] = min(value, limits.get(key, value))


def io_limits(dev: str, *, proc_cgroup: str = "/proc/self/cgroup",
              mountinfo: str = "/proc/self/mountinfo") -> IOLimit | None:  # fmt: skip
    """The I/O limits on ``dev`` for this process, v1 blkio first (the one this site can set)."""
    v1, v2 = _hierarchies(mountinfo)
    if v1 is not None and (cg := _own_cgroup(proc_cgroup, "blkio")) is not None:
        res = IOLimit(1, cg)
        names = {"read_bps_device": "rbps", "write_bps_device": "wbps",
                 "read_iops_device": "riops", "write_iops_device": "wiops"}  # fmt: skip
        for d in _ancestors(v1, cg):
            for fname, key in names.items():
                for line in _lines(d / f"blkio.throttle.{fname}"):
                    parts = line.split()
                    if len(parts) == 2 and parts[0] == dev:
                        _tighten(res.limits, key, int(parts[1]))
        res.weight = (_lines(v1 / cg.lstrip("/") / "blkio.bfq.weight") or [""])[0]
        return res
    if v2 is not None and (cg := _own_cgroup(proc_cgroup, "")) is not None:
        ctrls = (_lines(v2 / "cgroup.controllers") or [""])[0].split()
        res = IOLimit(2, cg, io_controller="io" in ctrls)
        for d in _ancestors(v2, cg):
            for line in _lines(d / "io.max"):
                parts = line.split()
                if parts and parts[0] == dev:
                    for kv in parts[1:]:
                        k, _, v = kv.partition("=")
                        if v.isdigit():
                            _tighten(res.limits, k, int(v))
        res.weight = " ".join(_lines(v2 / cg.lstrip("/") / "io.weight"))
        return res
    return None


@dataclass
class IOControls:
    """What this kernel lets the prolog set for a job on one device."""

    throttles: str
    """The throttle files (``blkio.throttle.*``, ``io.max``), or "" where there are none."""
    weights: str
    """The weight file that acts here (``blkio.bfq.weight``, ``io.bfq.weight``, ``io.weight``), or ""."""
    why_not: str = ""
    """Where weights do not act: why, and what would make them."""


def io_controls(dev: str, *, mountinfo: str = "/proc/self/mountinfo", sysfs: Path = Path("/sys"),
                modules: Path | None = None) -> IOControls | None:  # fmt: skip
    """The I/O controls the kernel offers on ``dev`` ("MAJ:MIN"), v1 blkio first; None without either."""
    v1, v2 = _hierarchies(mountinfo)
    scheds = (_lines(sysfs / "dev/block" / dev / "queue/scheduler") or [""])[0]
    active = next((w.strip("[]") for w in scheds.split() if w.startswith("[")), "")
    if modules is None:
        modules = Path("/lib/modules") / os.uname().release
    if "bfq" in scheds.replace("[", " ").replace("]", " ").split():
        bfq_missing = "" if active == "bfq" else (
            f"the device uses {active or 'no'} scheduler; weights act once it uses bfq "
            f"(echo bfq > /sys/dev/block/{dev}/queue/scheduler, or a udev rule)")
    elif any(modules.glob("kernel/block/bfq.ko*")):
        bfq_missing = "the bfq module is not loaded: modprobe bfq (and use bfq on this device)"
    else:
        bfq_missing = f"this kernel has no BFQ scheduler (schedulers here: {scheds or 'none listed'})"
    if v1 is not None and (v1 / "blkio.throttle.write_bps_device").exists():
        weights = "blkio.bfq.weight" if not bfq_missing else ""
        return IOControls("blkio.throttle.*", weights, bfq_missing)
    if v2 is not None:
        ctrls = (_lines(v2 / "cgroup.controllers") or [""])[0].split()
        if "io" not in ctrls:
            return IOControls("", "", "the cgroup v2 io controller is not available")
        if (v2 / "io.cost.qos").exists() and any(ln.split()[0] == dev and "enable=1" in ln
                                                 for ln in _lines(v2 / "io.cost.qos")):  # fmt: skip
            return IOControls("io.max", "io.weight")
        if not bfq_missing:
            return IOControls("io.max", "io.bfq.weight")
        return IOControls("io.max", "", bfq_missing + "; or enable iocost (io.cost.qos) for this device")
    return None


def _ancestors(root: Path, cg: str) -> list[Path]:
    parts = [p for p in cg.split("/") if p]
    return [root.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]


def _lines(p: Path) -> list[str]:
    try:
        return [ln.strip() for ln in p.read_text().splitlines() if ln.strip()]
    except OSError:
        return []


def check_cgroup_io(report: Report, ctx: Context, mount: Mount | None, *,
                    proc_cgroup: str = "/proc/self/cgroup", mountinfo: str = "/proc/self/mountinfo",
                    sysfs: Path = Path("/sys")) -> None:  # fmt: skip
    if mount is None:
        return
    disk = block_device(mount, sysfs)
    if disk is None:
        report.add("cgroup", Severity.INFO, f"{mount.fstype} has no local block device: cgroup io "
                   "limits do not apply here")  # fmt: skip
        return
    dev = f"{disk[0]}:{disk[1]}"
    _report_controls(report, dev, mountinfo, sysfs)
    try:
        lim = io_limits(dev, proc_cgroup=proc_cgroup, mountinfo=mountinfo)
    except OSError as e:
        report.add("cgroup", Severity.INFO, f"cannot read cgroup io settings: {e}")
        return
    if lim is None:
        report.add("cgroup", Severity.INFO, "no blkio (v1) or io (v2) cgroup controller found")
        return
    sched = (_lines(sysfs / "dev/block" / dev / "queue/scheduler") or [""])[0]
    data = {"cgroup_version": lim.version, "cgroup": lim.cgroup, "device": dev,
            "limits": lim.limits, "weight": lim.weight, "scheduler": sched}  # fmt: skip
    where = f"cgroup v{lim.version} {lim.cgroup} on device {dev}"
    if lim.version == 2 and not lim.io_controller:
        report.add("cgroup", Severity.INFO, f"{where}: the io controller is not enabled", **data)
        return
    wbps = lim.limits.get("wbps")
    if wbps is None:
        extra = f"; weight {lim.weight}" if lim.weight else ""
        note = "" if "[bfq]" in sched or not lim.weight else " (weights act only under bfq)"
        report.add("cgroup", Severity.OK, f"{where}: no write bandwidth limit{extra}{note}", **data)
        return
    msg = f"{where}: writes throttled to {fmt_rate(wbps)}"
    fix = ("raise or remove the limit (blkio.throttle.write_bps_device / io.max wbps) for this job, "
           "or checkpoint to a device without one")  # fmt: skip
    if ctx.ckpt_size and ctx.ckpt_size / wbps > ctx.lead_time:
        report.add("cgroup", Severity.ERROR, msg + f": one checkpoint needs {ctx.ckpt_size / wbps:.0f} s, "
                   f"more than the {ctx.lead_time:.0f} s lead time", fix, **data)  # fmt: skip
    elif wbps < 50_000_000:
        report.add("cgroup", Severity.WARN, msg, fix, **data)
    else:
        report.add("cgroup", Severity.INFO, msg, **data)


def _report_controls(report: Report, dev: str, mountinfo: str, sysfs: Path) -> None:
    try:
        ctl = io_controls(dev, mountinfo=mountinfo, sysfs=sysfs)
    except OSError as e:
        report.add("io-controls", Severity.INFO, f"cannot read the kernel's I/O controls: {e}")
        return
    if ctl is None:
        return
    data = {"device": dev, "throttles": ctl.throttles, "weights": ctl.weights}
    throttles = f"throttles ({ctl.throttles})" if ctl.throttles else "no throttles"
    if ctl.weights:
        report.add("io-controls", Severity.OK, f"device {dev}: {throttles} and weights ({ctl.weights})", **data)
        return
    report.add("io-controls", Severity.INFO, f"device {dev}: {throttles}, no per-job weights: {ctl.why_not}. "
               "The prolog sets the throttles, logs that the weight is not set, and jobs run unweighted",
               **data)  # fmt: skip

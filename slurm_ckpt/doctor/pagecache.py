"""Page-cache writeback settings: how much dirty data an fsync may have to push out.

A checkpoint's fsync waits for its own dirty pages, and on most filesystems it
also queues behind everything else dirty on the device. With vm.dirty_ratio=20
on a 1 TB node that is up to 200 GB; at 1 GB/s the save then takes minutes
longer than the checkpoint size suggests.
"""

from __future__ import annotations

from pathlib import Path

from .finding import Context, Report, Severity, fmt_bytes

__all__ = ["check_pagecache", "dirty_limit"]

_KEYS = ("dirty_ratio", "dirty_bytes", "dirty_background_ratio", "dirty_background_bytes",
         "dirty_expire_centisecs")  # fmt: skip


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _mem_total(meminfo: Path) -> int | None:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def dirty_limit(proc: Path = Path("/proc")) -> tuple[int | None, dict[str, int | None]]:
    """(bytes of dirty page cache allowed before writers block, the raw settings)."""
    vals = {k: _read_int(proc / "sys/vm" / k) for k in _KEYS}
    mem = _mem_total(proc / "meminfo")
    if vals["dirty_bytes"]:
        return vals["dirty_bytes"], vals
    if vals["dirty_ratio"] is not None and mem:
        # The kernel applies the ratio to available memory; MemTotal is the worst case.
        return mem * vals["dirty_ratio"] // 100, vals
    return None, vals


def check_pagecache(report: Report, ctx: Context, proc: Path = Path("/proc")) -> None:
    limit, vals = dirty_limit(proc)
    shown = ", ".join(f"vm.{k}={v}" for k, v in vals.items() if v is not None)
    if limit is None:
        report.add("pagecache", Severity.INFO, f"cannot read the dirty limits ({shown or 'no /proc/sys/vm'})")
        return
    msg = f"up to {fmt_bytes(limit)} of dirty page cache ({shown})"
    data = {"dirty_limit_bytes": limit, **{k: v for k, v in vals.items() if v is not None}}
    if ctx.bandwidth <= 0:
        report.add("pagecache", Severity.INFO, msg, **data)
        return
    flush = limit / ctx.bandwidth
    msg += f"; flushing it at the measured {fmt_bytes(ctx.bandwidth)}/s takes ~{flush:.0f} s"
    if flush > ctx.lead_time:
        report.add("pagecache", Severity.WARN, msg + f", more than the {ctx.lead_time:.0f} s lead time",
                   f"cap dirty data near what the disk writes in a few seconds, e.g. "
                   f"sysctl vm.dirty_bytes={max(256 << 20, int(ctx.bandwidth * 5))} "
                   f"vm.dirty_background_bytes={max(64 << 20, int(ctx.bandwidth))}", **data)  # fmt: skip
    else:
        report.add("pagecache", Severity.OK, msg, **data)

"""A bounded probe of the storage: sequential write + fsync bandwidth, fsync latency.

It writes what a checkpoint writes (large sequential data, then fsync) into a
hidden file in the directory and deletes it. It is bounded by bytes and by
seconds: data is fsynced chunk by chunk, so a throttled or stalled device can
overrun the time budget by at most one chunk, never by a page cache's worth.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import storage_error
from .finding import Report, Severity

__all__ = ["ProbeResult", "check_probe", "probe"]

MIN_CHUNK = 1 << 20
MAX_CHUNK = 64 << 20
BLOCK = 4 << 20


@dataclass
class ProbeResult:
    bytes_written: int = 0
    seconds: float = 0.0
    fsync_ms: list[float] = field(default_factory=list)
    error: OSError | None = None

    @property
    def bandwidth(self) -> float:
        """Bytes per second of write+fsync (0 when nothing was measured)."""
        return self.bytes_written / self.seconds if self.seconds > 0 else 0.0


def probe(directory: Path, max_bytes: int = 128 << 20, max_seconds: float = 5.0,
          latency_samples: int = 20) -> ProbeResult:  # fmt: skip
    """Measure ``directory``; errors are returned in the result, not raised."""
    res = ProbeResult()
    path = directory / f".slurm-ckpt-doctor-{socket.gethostname()}-{os.getpid()}"
    # Random, so compressing filesystems see what model weights look like to them.
    buf = memoryview(os.urandom(BLOCK))
    fd = -1
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        chunk, t0 = MIN_CHUNK, time.monotonic()
        deadline = t0 + max_seconds * 0.8
        while res.bytes_written < max_bytes and time.monotonic() < deadline:
            c0 = time.monotonic()
            chunk = min(chunk, max_bytes - res.bytes_written)
            left = chunk
            while left:
                out = buf[: min(left, BLOCK)]
                while out:
                    n = os.write(fd, out)
                    out, left = out[n:], left - n
            os.fsync(fd)
            res.bytes_written += chunk
            # Grow the chunk while each one is quick, so fast storage is measured
            # with large writes and slow storage still stops near the deadline.
            if time.monotonic() - c0 < max_seconds / 40:
                chunk = min(chunk * 2, MAX_CHUNK)
        res.seconds = time.monotonic() - t0
        # fsync latency of small appends: what the manifest and directory fsyncs cost.
        lat_deadline = time.monotonic() + max_seconds * 0.2
        for _ in range(latency_samples):
            os.write(fd, buf[:4096])
            c0 = time.monotonic()
            os.fsync(fd)
            res.fsync_ms.append((time.monotonic() - c0) * 1000)
            if time.monotonic() > lat_deadline:
                break
    except OSError as e:
        res.error = storage_error(e, "probe write failed", path)
    finally:
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)
    return res


def _mb(bps: float) -> str:
    return f"{bps / 1e6:.0f} MB/s" if bps >= 1e7 else f"{bps / 1e6:.2f} MB/s"


def check_probe(report: Report, directory: Path, max_bytes: int, max_seconds: float) -> ProbeResult:
    res = probe(directory, max_bytes, max_seconds)
    if res.error is not None:
        e = res.error
        name = errno.errorcode.get(e.errno or 0, str(e.errno))
        report.add("probe", Severity.ERROR, f"cannot write to {directory}: {name} ({os.strerror(e.errno or 0)})",
                   getattr(e, "hint", "") or "fix the storage before the next checkpoint",
                   errno=name)  # fmt: skip
        return res
    lat = sorted(res.fsync_ms) or [0.0]
    p50, pmax = statistics.median(lat), lat[-1]
    msg = (f"write+fsync {_mb(res.bandwidth)} ({res.bytes_written >> 20} MiB in {res.seconds:.2f} s); "
           f"fsync latency p50 {p50:.1f} ms, max {pmax:.1f} ms")  # fmt: skip
    data = {"bandwidth_bytes_per_s": round(res.bandwidth), "bytes": res.bytes_written,
            "seconds": round(res.seconds, 3), "fsync_p50_ms": round(p50, 2), "fsync_max_ms": round(pmax, 2)}
    if pmax > 1000:
        report.add("probe", Severity.WARN, msg + " (multi-second fsync stalls)",
                   "the storage stalls: checkpoints there can miss the signal lead time; "
                   "save to node-local scratch (SLURM_CKPT_SCRATCH) and let it drain", **data)  # fmt: skip
    else:
        report.add("probe", Severity.OK, msg, **data)
    return res

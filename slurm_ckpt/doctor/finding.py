"""What the doctor reports: findings with a severity and a recommendation."""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Context", "Finding", "Report", "Severity", "fmt_bytes", "fmt_rate"]


def fmt_bytes(n: float) -> str:
    """Decimal units, as storage vendors and ``df -H`` count: ``40 GB``."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" and n < 10 and n != int(n) else f"{n:.0f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def fmt_rate(bps: float) -> str:
    return fmt_bytes(bps) + "/s"


class Severity(enum.IntEnum):
    """Ordered, so the worst finding is ``max()``; the CLI maps it to the exit code."""

    OK = 0
    INFO = 1
    WARN = 2
    ERROR = 3

    def __str__(self) -> str:
        return self.name.lower()


@dataclass(frozen=True)
class Finding:
    check: str
    """Which check: ``probe``, ``space``, ``mount``, ``quota``, ``pagecache``, ``slurm``, ``cgroup``."""
    severity: Severity
    message: str
    """What was found, with the numbers."""
    recommendation: str = ""
    """What to do about it (empty when nothing needs doing)."""
    data: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"check": self.check, "severity": str(self.severity), "message": self.message,
                "recommendation": self.recommendation, "data": self.data}  # fmt: skip


@dataclass
class Report:
    path: str
    findings: list[Finding] = field(default_factory=list)

    def add(self, check: str, severity: Severity, message: str, recommendation: str = "", /,
            **data: Any) -> Finding:  # fmt: skip
        f = Finding(check, severity, message, recommendation, data)
        self.findings.append(f)
        return f

    @property
    def worst(self) -> Severity:
        return max((f.severity for f in self.findings), default=Severity.OK)

    def to_json(self) -> str:
        return json.dumps({"path": self.path, "worst": str(self.worst),
                           "findings": [f.to_json() for f in self.findings]}, indent=2)  # fmt: skip

    def to_text(self) -> str:
        lines = [f"slurm-ckpt doctor: {self.path}"]
        for f in self.findings:
            lines.append(f"  [{str(f.severity).upper():5}] {f.check}: {f.message}")
            if f.recommendation:
                lines.append(f"          -> {f.recommendation}")
        lines.append(f"worst: {self.worst}")
        return "\n".join(lines)


@dataclass
class Context:
    """What the checks share: the directory, and the numbers the timing checks need."""

    path: Path
    """The directory asked about (it may not exist yet)."""
    probe_dir: Path
    """The nearest existing directory at or above ``path``, where the probe writes."""
    ckpt_size: int | None = None
    """Bytes of one checkpoint (--ckpt-size, else the newest one found in ``path``)."""
    lead_time: float = 120.0
    """Seconds between the checkpoint signal and the end of the job (sbatch --signal=USR1@N)."""
    lead_time_given: bool = False
    keep: int = 3
    bandwidth: float = 0.0
    """Measured write+fsync bytes/s (0 until the probe ran, or when it failed)."""

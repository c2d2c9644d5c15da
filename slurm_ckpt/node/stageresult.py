"""What a stage-out did, as the epilog logs it and the stage-out child reports it across the fork."""

from __future__ import annotations

import json
from dataclasses import dataclass

from .escape import FIELD_LIMIT, escape

__all__ = ["StageResult"]

_STATUSES = ("staged", "up-to-date", "none", "failed", "timeout")
_DONE = ("staged", "up-to-date", "none")


@dataclass(frozen=True)
class StageResult:
    """What a stage-out did: its status, a line saying why, and the step and path it staged or found."""

    status: str
    """staged | up-to-date | none (nothing valid on scratch) | failed | timeout"""
    detail: str = ""
    step: int | None = None
    path: str | None = None

    @property
    def scratch_disposable(self) -> bool:
        """True when deleting scratch loses no checkpoint that exists nowhere else."""
        return self.status in _DONE

    @classmethod
    def from_child(cls, data: bytes) -> StageResult:
        """The child's JSON result, checked field by field; a bad one is a failure."""
        try:
            doc = json.loads(data)
            status, detail, step, path = doc["status"], doc["detail"], doc["step"], doc["path"]
        except (ValueError, TypeError, KeyError):
            return cls("failed", "the stage-out child died without a result")
        if status not in _STATUSES or not isinstance(detail, str):
            return cls("failed", "the stage-out child sent a malformed result")
        return cls(status, escape(detail, 2 * FIELD_LIMIT), step if type(step) is int else None,
                   escape(path) if isinstance(path, str) else None)  # fmt: skip

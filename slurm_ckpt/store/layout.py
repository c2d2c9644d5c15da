"""Names inside a run dir: committed ``step-N`` dirs and in-flight ``.tmp-`` dirs."""

from __future__ import annotations

import os
import re
from pathlib import Path

__all__ = ["LOCK_NAME", "list_steps", "step_dir", "tmp_dir_for", "tmp_dir_owner", "tmp_dir_step"]

STEP_RE = re.compile(r"^step-(\d{9,})$")
TMP_RE = re.compile(r"^\.tmp-step-(\d+)-(?P<host>[^/]+)-(?P<pid>\d+)-[0-9a-f]+$")
LOCK_NAME = ".lock"


def step_dir(run_dir: Path, step: int) -> Path:
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return run_dir / f"step-{step:09d}"


def tmp_dir_for(run_dir: Path, step: int) -> Path:
    """A fresh in-flight name; host and pid in it let a later writer tell if it is stale."""
    host = os.uname().nodename.replace("-", "_")  # socket.gethostname(), without importing socket
    return run_dir / f".tmp-step-{step:09d}-{host}-{os.getpid()}-{os.urandom(4).hex()}"


def tmp_dir_owner(name: str) -> tuple[str, int] | None:
    m = TMP_RE.fullmatch(name)
    return (m.group("host"), int(m.group("pid"))) if m else None


def tmp_dir_step(name: str) -> int | None:
    m = TMP_RE.fullmatch(name)
    return int(m.group(1)) if m else None


def list_steps(run_dir: Path) -> list[tuple[int, Path]]:
    """Committed-looking step dirs, newest first. Nothing here is verified yet."""
    try:
        names = os.listdir(run_dir)
    except FileNotFoundError:
        return []
    out = []
    for name in names:
        m = STEP_RE.fullmatch(name)
        if m:
            out.append((int(m.group(1)), run_dir / name))
    out.sort(reverse=True)
    return out

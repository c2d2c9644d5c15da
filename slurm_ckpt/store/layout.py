"""Names inside a run dir (committed ``step-N`` dirs, in-flight ``.tmp-`` dirs), inside a
checkpoint (its small files), and in a job's scratch (the fast tier's run dir, its tier file).

The node hooks import this module alone, so it imports nothing of the store.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

__all__ = [
    "FAST_SUBDIR",
    "LOCK_NAME",
    "OBJECTS_FILE",
    "STATE_FILE",
    "TIER_FILE",
    "fast_dir",
    "list_steps",
    "step_dir",
    "tmp_dir_for",
    "tmp_dir_owner",
    "tmp_dir_step",
]

STEP_RE = re.compile(r"^step-(\d{9,})$")
TMP_RE = re.compile(r"^\.tmp-step-(\d+)-(?P<host>[^/]+)-(?P<pid>\d+)-[0-9a-f]+$")
LOCK_NAME = ".lock"
TIER_FILE = "TIER.json"
"""In a job's scratch run dir: where its checkpoints go, and how many it keeps (see ``tiers``)."""
FAST_SUBDIR = "ckpt"
STATE_FILE = "state.json"
"""In a checkpoint: its tree (``codec``), the state but for the tensors' bytes."""
OBJECTS_FILE = "objects.pkl"
"""In a checkpoint saved with ``allow_pickle``: the objects the tree could not hold."""


def fast_dir(scratch: Path) -> Path:
    """The fast tier's run dir inside a job's scratch dir."""
    return scratch / FAST_SUBDIR


def step_dir(run_dir: Path, step: int) -> Path:
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return run_dir / f"step-{step:09d}"


def tmp_dir_for(parent: Path, name: str) -> Path:
    """A fresh in-flight name for ``parent/name``; host and pid in it let a later
    writer tell if it is stale (``.tmp-step-N-…`` in a run dir)."""
    host = os.uname().nodename.replace("-", "_")  # socket.gethostname(), without importing socket
    return parent / f".tmp-{name}-{host}-{os.getpid()}-{os.urandom(4).hex()}"


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

"""Retention: keep the newest K valid checkpoints, and clean up dead writers' temp dirs."""

from __future__ import annotations

import logging
import os
import socket
import time
from pathlib import Path

from ..errors import CheckpointCorrupt
from .fsutil import remove_tree
from .layout import list_steps, tmp_dir_owner
from .verify import verify_checkpoint

__all__ = ["apply_retention", "remove_stale_tmp"]

log = logging.getLogger("slurm_ckpt")

FOREIGN_TMP_AGE = 6 * 3600
"""A temp dir from another host is only removed when this old: we cannot see its pid."""


def apply_retention(run_dir: Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` valid checkpoints; return what was deleted.

    Only valid checkpoints count toward ``keep``, so a corrupt newest one can
    never push the newest valid one out. Corrupt ones older than the oldest
    kept are deleted; newer corrupt ones are left for inspection.
    """
    if keep < 1:
        raise ValueError("keep must be >= 1")
    kept = 0
    deleted = []
    for _step, path in list_steps(run_dir):
        try:
            verify_checkpoint(path, full=False)
            valid = True
        except (CheckpointCorrupt, OSError):
            valid = False
        if valid and kept < keep:
            kept += 1
            continue
        if valid or kept >= keep:
            remove_tree(path)
            deleted.append(path)
    if deleted:
        log.info("retention removed %s", ", ".join(p.name for p in deleted))
    return deleted


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_tmp(run_dir: Path, *, keep: set[Path] | None = None) -> list[Path]:
    """Remove temp dirs whose writer is dead. Call with the run dir lock held.

    A temp dir from this host is stale when its pid is gone (or is us but not in
    ``keep``); from another host only after ``FOREIGN_TMP_AGE``.
    """
    host = socket.gethostname().replace("-", "_")
    removed = []
    try:
        names = os.listdir(run_dir)
    except FileNotFoundError:
        return []
    for name in names:
        path = run_dir / name
        if not name.startswith(".tmp-step-") or (keep and path in keep):
            continue
        owner = tmp_dir_owner(name.removesuffix(".old"))
        if owner is None:
            continue
        ohost, pid = owner
        if ohost == host:
            stale = pid == os.getpid() or not _pid_alive(pid)
        else:
            try:
                stale = time.time() - os.lstat(path).st_mtime > FOREIGN_TMP_AGE
            except FileNotFoundError:
                continue
        if stale:
            remove_tree(path)
            removed.append(path)
    return removed

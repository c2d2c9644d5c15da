"""Retention: keep the newest K valid checkpoints, and clean up dead writers' temp dirs."""

from __future__ import annotations

import atexit
import logging
import os
import socket
import threading
import time
from collections.abc import Collection
from pathlib import Path

from ..errors import CheckpointCorrupt, storage_error
from .commit import in_flight
from .fsutil import fsync_dir, remove_tree
from .layout import list_steps, step_dir, tmp_dir_for, tmp_dir_owner, tmp_dir_step
from .manifest import MANIFEST
from .verify import verify_checkpoint

__all__ = ["apply_retention", "discard_checkpoint", "reaped", "remove_stale_tmp"]

log = logging.getLogger("slurm_ckpt")

FOREIGN_TMP_AGE = 6 * 3600
"""A temp dir from another host is only removed when this old: we cannot see its pid."""

ASIDE_SUFFIX = ".old"
"""Suffix of a replaced checkpoint moved aside where RENAME_EXCHANGE is missing."""


def apply_retention(
    run_dir: Path,
    keep: int,
    *,
    protect: Collection[Path] = (),
    before: float | None = None,
    later: bool = False,
) -> list[Path]:
    """Delete all but the newest ``keep`` valid checkpoints; return what was deleted.

    Only valid checkpoints count toward ``keep``, so a corrupt newest one can
    never push the newest valid one out. Corrupt ones older than the oldest
    kept are deleted; newer corrupt ones are left for inspection.

    ``protect`` names checkpoints that must survive whatever their rank: the one
    just committed, and on scratch those not yet copied to durable storage.
    They count toward ``keep``. Checkpoints with a higher step than the newest
    protected one are neither counted nor deleted: they belong to a run that
    was resumed from an older step, usually because they failed verification,
    and the quick check used here cannot tell a flipped byte from a good one.

    ``before`` (a time): valid checkpoints committed at or after it are kept
    too, and counted like the protected ones. A drain trimming scratch after a
    copy passes its item's commit time: a checkpoint committed since may not
    be in ``protect`` yet.

    ``later``: see :func:`discard_checkpoint`.
    """
    if keep < 1:
        raise ValueError("keep must be >= 1")
    protected = {Path(p).name for p in protect}
    ceiling = max((s for s, p in list_steps(run_dir) if p.name in protected), default=None)
    kept = 0
    deleted = []
    for step, path in list_steps(run_dir):
        if path.name in protected:
            kept += 1
            continue
        if ceiling is not None and step > ceiling:
            continue
        try:
            committed = verify_checkpoint(path, full=False).time
            valid = True
        except (CheckpointCorrupt, OSError):
            valid = False
        newer = valid and before is not None and committed >= before
        if newer or (valid and kept < keep):
            kept += 1
            continue
        if valid or kept >= keep:
            discard_checkpoint(path, later=later)
            deleted.append(path)
    if deleted:
        log.info("retention removed %s", ", ".join(p.name for p in deleted))
    return deleted


def discard_checkpoint(path: Path, *, later: bool = False) -> None:
    """Delete a committed checkpoint so that it vanishes whole or not at all.

    It is first renamed to a temp name: a crash in the middle of the delete
    then leaves a stale temp dir (cleaned by the next writer), never a
    half-deleted ``step-N`` that discovery would have to skip with a warning.

    ``later``: the rename happens now, the delete on a thread of its own
    (:func:`reaped` waits for it). Retention after a save uses it, so that the
    save returns at its commit: freeing a large checkpoint's blocks can slow a
    sync save markedly, on an ext4 mounted with ``discard`` most of all, and a
    delete running beside the save costs it about as much, because their
    fsyncs share the journal commit that frees them (``python
    bench/retention.py`` measures both).
    """
    trash = tmp_dir_for(path.parent, path.name)
    try:
        os.rename(path, trash)
    except FileNotFoundError:
        return
    except OSError as e:
        raise storage_error(e, "cannot remove old checkpoint", path) from e
    if later:
        _reaper.submit(trash)
    else:
        remove_tree(trash)


class _Reaper:
    """One thread that deletes discarded checkpoints, in order, and syncs their dir."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._cond = threading.Condition()
        self._todo: list[Path] = []
        self._busy: Path | None = None
        self._thread: threading.Thread | None = None

    def submit(self, trash: Path) -> None:
        with self._cond:
            self._todo.append(trash)
            if self._thread is None:
                # A daemon, so that a trainer's exit is never held by it; the
                # atexit hook below still lets a normal exit finish the deletes.
                self._thread = threading.Thread(target=self._run, name="slurm-ckpt-reaper", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def pending(self) -> frozenset[Path]:
        with self._cond:
            return frozenset([*self._todo, *([self._busy] if self._busy else [])])

    def wait(self, timeout: float | None = None) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: not self._todo and self._busy is None, timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._todo))
                self._busy = self._todo.pop(0)
            path = self._busy
            try:
                remove_tree(path)
                # The journal commit that frees the blocks (and discards them)
                # happens now, not inside the next save's fsync.
                fsync_dir(path.parent)
            except OSError as e:  # a leftover temp dir: the next writer's cleanup removes it
                log.warning("could not finish deleting %s: %s", path, e)
            finally:
                with self._cond:
                    self._busy = None
                    self._cond.notify_all()


_reaper = _Reaper()
# The parent's thread is not in a forked child; its queue is the parent's to finish.
os.register_at_fork(after_in_child=_reaper._reset)

EXIT_WAIT = 60.0
"""Seconds an exiting process waits for the deletes retention queued."""


@atexit.register
def _finish_at_exit() -> None:
    # A normal exit finishes the deletes; a filesystem that hangs must not hang
    # the exit: what is left is a temp dir that the next writer removes.
    if not _reaper.wait(EXIT_WAIT):
        log.warning("exiting with old checkpoints still being deleted: %s", ", ".join(map(str, _reaper.pending())))


def reaped(timeout: float | None = None) -> bool:
    """Wait until checkpoints discarded with ``later=True`` are deleted; False on timeout."""
    return _reaper.wait(timeout)


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

    A temp dir from this host is stale when its pid is gone (or is us, but it is
    neither in ``keep`` nor being written by this process: see
    :func:`~slurm_ckpt.store.commit.in_flight`); from another host only after
    ``FOREIGN_TMP_AGE``. A stale
    checkpoint moved aside for replacement (``.old``) whose ``step-N`` is
    missing is the only copy of that step: it is renamed back, not deleted.
    """
    host = socket.gethostname().replace("-", "_")
    busy = in_flight() | _reaper.pending()
    removed = []
    try:
        names = os.listdir(run_dir)
    except FileNotFoundError:
        return []
    for name in names:
        path = run_dir / name
        if not name.startswith(".tmp-step-") or (keep and path in keep) or path in busy:
            continue
        base = name.removesuffix(ASIDE_SUFFIX)
        owner = tmp_dir_owner(base)
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
        if not stale:
            continue
        if name != base and _restore_aside(path, run_dir, tmp_dir_step(base)):
            continue
        remove_tree(path)
        removed.append(path)
    return removed


def _restore_aside(aside: Path, run_dir: Path, step: int | None) -> bool:
    """Put back a replaced checkpoint whose replacement never landed."""
    if step is None or not (aside / MANIFEST).exists():
        return False
    final = step_dir(run_dir, step)
    if os.path.lexists(final):
        return False
    try:
        os.rename(aside, final)
        fsync_dir(run_dir)
    except OSError:
        return False
    log.warning("restored %s from %s (a replacing save was interrupted)", final, aside.name)
    return True

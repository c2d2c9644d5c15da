"""One writer per run dir: a filelock plus a note saying who holds it."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import stat
import time
from pathlib import Path

import filelock

from .._env import job_id
from ..errors import LockHeld, storage_error
from .fsutil import read_small
from .layout import LOCK_NAME

__all__ = ["RunDirLock"]

log = logging.getLogger("slurm_ckpt")


class RunDirLock:
    """An exclusive lock on a run dir, held for the writer's lifetime.

    ``timeout=0`` fails at once with :class:`LockHeld` naming the holder;
    a positive timeout waits that long; ``None`` waits forever.
    """

    def __init__(self, run_dir: Path, timeout: float | None = 0) -> None:
        self.path = run_dir / LOCK_NAME
        self.owner_path = run_dir / (LOCK_NAME + ".owner")
        self.timeout = -1 if timeout is None else timeout
        self._lock = filelock.FileLock(str(self.path), thread_local=False)

    @property
    def held(self) -> bool:
        return self._lock.is_locked

    def acquire(self) -> None:
        try:
            self._lock.acquire(timeout=self.timeout)
        except filelock.Timeout:
            raise LockHeld(
                f"{self.path.parent} is locked by another writer ({self.holder()}); "
                "stop it, give this job its own SLURM_CKPT_DIR, or pass lock_timeout=SECONDS to wait"
            ) from None
        except OSError as e:
            raise storage_error(e, "cannot lock run dir (does the filesystem support flock?)", self.path) from e
        note = {"host": socket.gethostname(), "pid": os.getpid(),
                "job_id": job_id(), "since": time.time()}  # fmt: skip
        # The note is advisory; the lock itself is what protects. Never blocking:
        # a FIFO planted at its name must not hang the writer (or the epilog's
        # stage-out) waiting for a reader.
        with contextlib.suppress(OSError):
            fd = os.open(self.owner_path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
                         | os.O_CLOEXEC, 0o644)  # fmt: skip
            try:
                if stat.S_ISREG(os.fstat(fd).st_mode):
                    os.ftruncate(fd, 0)
                    os.write(fd, json.dumps(note).encode())
            finally:
                os.close(fd)

    def holder(self) -> str:
        try:
            note = json.loads(read_small(self.owner_path, 4096))
            job = f", job {note['job_id']}" if note.get("job_id") else ""
            return f"pid {note['pid']} on {note['host']}{job}"
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return "holder unknown"

    def release(self) -> None:
        # force: two threads of one writer (a save and the tier drain) may both
        # have taken it; it is held for the writer's lifetime, released once.
        if not self._lock.is_locked:
            return
        try:
            self._lock.release(force=True)
        except OSError as e:
            # The filesystem lost the lock before us: a GlusterFS brick or the
            # CephFS MDS that held it restarted (ENOTCONN). Nothing is left to
            # unlock; closing the descriptor drops whatever the client still keeps.
            log.warning("run dir lock %s was lost by the filesystem (%s); closing it", self.path, e)
            self._drop()

    def _drop(self) -> None:
        ctx = getattr(self._lock, "_context", None)
        fd = getattr(ctx, "lock_file_fd", None)
        if ctx is None or not isinstance(fd, int):
            return
        with contextlib.suppress(OSError):
            os.close(fd)
        ctx.lock_file_fd = None  # held no more: a later release (or the lock's finalizer) does nothing
        ctx.lock_counter = 0

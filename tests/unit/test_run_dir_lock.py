"""The run-dir lock when the filesystem has already lost it."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest


def test_release_after_the_filesystem_lost_the_lock_closes_it_without_raising(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A GlusterFS brick or CephFS MDS that restarted answers the unlock with ENOTCONN:
    # the writer's close must not fail for it, nor leave the descriptor open.
    import filelock._native._unix as native

    from slurm_ckpt.store.lock import RunDirLock

    lock = RunDirLock(tmp_path)
    lock.acquire()
    fd = lock._lock._context.lock_file_fd
    assert isinstance(fd, int)

    def lost(fd: int) -> None:
        raise OSError(errno.ENOTCONN, os.strerror(errno.ENOTCONN))

    monkeypatch.setattr(native, "unlock_fd", lost)
    lock.release()
    assert not lock.held
    with pytest.raises(OSError, match="Bad file descriptor"):
        os.fstat(fd)
    monkeypatch.undo()
    # The run dir can be locked again, by this process or another writer.
    again = RunDirLock(tmp_path)
    again.acquire()
    again.release()

"""The commit protocol, in one function.

A checkpoint becomes visible only by the rename of a complete, fsynced temp
dir to ``step-N``. Readers never look at ``.tmp-*`` dirs, so at every instant
``step-N`` is either absent, or complete and durable.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import storage_error
from .fsutil import exchange_or_replace_dir, fsync_dir, remove_tree, write_file_durably
from .layout import step_dir, tmp_dir_for
from .manifest import MANIFEST, Manifest
from .tensorfile import FileRecord

__all__ = ["WriteFn", "commit", "in_flight"]

log = logging.getLogger("slurm_ckpt")

WriteFn = Callable[[Path], tuple[dict[str, FileRecord], dict[str, Any]]]
"""Writes data files into the temp dir, fsyncs each, returns (files, tensor index)."""

_in_flight: set[Path] = set()
_in_flight_lock = threading.Lock()


def in_flight() -> frozenset[Path]:
    """Temp dirs this process is writing right now.

    Stale-temp cleanup must spare them: a temp dir named with our own pid is
    otherwise taken for a leftover of an earlier process that had the same pid
    (containers reuse small pids), and another thread (the tier drain, a
    background save) may be writing it this very moment.
    """
    with _in_flight_lock:
        return frozenset(_in_flight)


def commit(run_dir: Path, step: int, write: WriteFn, **meta: Any) -> Path:
    """Write a checkpoint for ``step`` into ``run_dir`` and commit it durably.

    ``meta`` goes into the manifest (``world_size``, ``nbytes``, ``extra``).
    On any failure the temp dir is removed and nothing is committed.
    """
    tmp = tmp_dir_for(run_dir, step)
    final = step_dir(run_dir, step)
    with _in_flight_lock:
        _in_flight.add(tmp)
    try:
        return _commit(run_dir, step, write, tmp, final, meta)
    finally:
        with _in_flight_lock:
            _in_flight.discard(tmp)


def _commit(
    run_dir: Path, step: int, write: WriteFn, tmp: Path, final: Path, meta: dict[str, Any]
) -> Path:
    try:
        tmp.mkdir(mode=0o755)
    except OSError as e:
        raise storage_error(e, "cannot create temp dir", tmp) from e
    try:
        # 1-2. Data into the temp dir; the writer fsyncs each file, because a
        # rename is only as durable as the data it points at.
        files, tensors = write(tmp)
        # 3. The manifest last, fsynced: its presence is what "complete" means.
        man = Manifest(step=step, files=files, tensors=tensors, **meta)
        write_file_durably(tmp / MANIFEST, man.to_bytes())
        # 4. fsync the temp dir so its entries (the files just created) survive a crash.
        fsync_dir(tmp)
        # 5. Atomic rename: the checkpoint appears whole or not at all.
        old = exchange_or_replace_dir(tmp, final)
        # 6. fsync the parent: until then the rename itself can be lost on power failure.
        fsync_dir(run_dir)
    except BaseException:
        remove_tree(tmp)
        raise
    if old is not None:
        remove_tree(old)
    log.info("committed %s", final)
    return final

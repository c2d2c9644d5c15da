"""The commit protocol, in one function.

A checkpoint becomes visible only by the rename of a complete, fsynced temp
dir to its final name. Readers never look at ``.tmp-*`` dirs, so at every
instant the final dir is either absent, or complete and durable.

Every commit in the package goes through :func:`commit`: a checkpoint
(``step-N`` in a run dir), a rank's shard (``rank-K`` in a staging dir), and
the assembly of a checkpoint from its staged shards.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from ..errors import storage_error
from .fsutil import exchange_or_replace_dir, fsync_dir, remove_tree, write_file_durably
from .layout import step_dir, tmp_dir_for
from .manifest import MANIFEST, Manifest
from .tensorfile import FileRecord

__all__ = ["IfExists", "WriteFn", "commit", "in_flight"]

log = logging.getLogger("slurm_ckpt")

WriteFn = Callable[[Path], tuple[dict[str, FileRecord], dict[str, Any]]]
"""Writes data files into the temp dir, fsyncs each, returns (files, tensor index)."""

IfExists = Literal["replace", "keep"]
"""What :func:`commit` does when the target is already there: ``replace`` it
atomically (the same step saved again after a resume), or ``keep`` the one in
place and drop the new copy (a shard staged by an earlier attempt)."""

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


def commit(
    parent: Path,
    step: int,
    write: WriteFn,
    *,
    name: str | None = None,
    if_exists: IfExists = "replace",
    into: Path | None = None,
    **meta: Any,
) -> Path:
    """Write checkpoint ``step`` as ``parent/name`` and commit it durably; return its path.

    ``name`` defaults to ``step-N``. ``meta`` goes into the manifest
    (``world_size``, ``nbytes``, ``extra``, ...). ``into`` commits a dir that
    already holds the data (the staged shards of an assembly) instead of a
    fresh temp dir; a manifest left in it by an assembler that died before the
    rename is replaced. On any failure nothing is committed and a fresh temp
    dir is removed; ``into`` is left in place, with its data.
    """
    final = parent / name if name is not None else step_dir(parent, step)
    tmp = into if into is not None else tmp_dir_for(parent, final.name)
    with _in_flight_lock:
        _in_flight.add(tmp)
    try:
        return _commit(parent, step, write, tmp, final, if_exists, into is None, meta)
    finally:
        with _in_flight_lock:
            _in_flight.discard(tmp)


def _commit(parent: Path, step: int, write: WriteFn, tmp: Path, final: Path, if_exists: IfExists,
            fresh: bool, meta: dict[str, Any]) -> Path:  # fmt: skip
    if fresh:
        try:
            tmp.mkdir(mode=0o755)
        except OSError as e:
            raise storage_error(e, "cannot create temp dir", tmp) from e
    else:
        # A manifest left by a commit into this dir that died before its rename
        # (harmless: discovery never reads it); the new one is created O_EXCL.
        (tmp / MANIFEST).unlink(missing_ok=True)
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
        if if_exists == "keep":
            if not _rename_unless_there(tmp, final):
                remove_tree(tmp)  # committed already, by an earlier attempt: keep that one
                return final
            old = None
        else:
            old = exchange_or_replace_dir(tmp, final)
        # 6. fsync the parent: until then the rename itself can be lost on power failure.
        fsync_dir(parent)
    except BaseException:
        if fresh:
            remove_tree(tmp)
        raise
    if old is not None:
        remove_tree(old)
    log.info("committed %s", final)
    return final


def _rename_unless_there(tmp: Path, final: Path) -> bool:
    """Rename ``tmp`` to ``final``; False if ``final`` is a dir already."""
    try:
        os.rename(tmp, final)
    except OSError as e:
        if final.is_dir():
            return False
        raise storage_error(e, "cannot rename checkpoint into place", final) from e
    return True

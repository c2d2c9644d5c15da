"""The commit protocol, in one function.

A checkpoint becomes visible only by the rename of a complete, fsynced temp
dir to its final name. Readers never look at ``.tmp-*`` dirs, so at every
instant the final dir is either absent, or complete and durable.

Every commit in the package goes through :func:`commit`: a checkpoint
(``step-N`` in a run dir), a rank's shard (``rank-K`` in a staging dir), and
the assembly of a checkpoint from its staged shards.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from ..errors import StorageError, storage_error
from .bounded import check_live
from .fsutil import (
    empty_dir,
    exchange_or_replace_dir,
    fsync_file,
    remove_tree_at,
    write_file_durably,
)
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
    on_dev: int | None = None,
    **meta: Any,
) -> Path:
    """Write checkpoint ``step`` as ``parent/name`` and commit it durably; return its path.

    ``name`` defaults to ``step-N``. ``meta`` goes into the manifest
    (``world_size``, ``nbytes``, ``extra``, ...). ``into`` commits a dir of
    ``parent`` that already holds the data (the staged shards of an assembly)
    instead of a fresh temp dir; a manifest left in it by an assembler that
    died before the rename is replaced. On any failure nothing is committed
    and a fresh temp dir is removed; ``into`` is left in place, with its data.

    ``on_dev``: the ``st_dev`` of the filesystem this checkpoint must land
    on, for a caller writing into a tree that others can rename in (the
    epilog's stage-out, into a run dir that any node of the user can
    change). Then ``write`` is handed the temp dir as ``/proc/self/fd/N``,
    so a link swapped in at its name cannot redirect the data, and a
    parent or temp dir on another filesystem is refused.
    """
    final = parent / name if name is not None else step_dir(parent, step)
    tmp = into if into is not None else tmp_dir_for(parent, final.name)
    if tmp.parent != parent:
        raise ValueError(f"commit into {tmp}: not a dir of {parent}, where it is renamed to {final.name}")
    with _in_flight_lock:
        _in_flight.add(tmp)
    try:
        parent_fd = _open_dir(parent, on_dev)
        try:
            return _commit(parent, parent_fd, step, write, tmp, final, if_exists, into is None, on_dev, meta)
        finally:
            os.close(parent_fd)
    finally:
        with _in_flight_lock:
            _in_flight.discard(tmp)


def _commit(parent: Path, parent_fd: int, step: int, write: WriteFn, tmp: Path, final: Path,
            if_exists: IfExists, fresh: bool, on_dev: int | None, meta: dict[str, Any]) -> Path:  # fmt: skip
    # Every name below is taken relative to the parent's fd: what the parent's
    # own name does meanwhile cannot move the commit elsewhere.
    if fresh:
        try:
            os.mkdir(tmp.name, 0o755, dir_fd=parent_fd)  # exclusive: fails if the name exists
        except OSError as e:
            raise storage_error(e, "cannot create temp dir", tmp) from e
    try:
        tmp_fd = _open_dir(tmp.name, on_dev, dir_fd=parent_fd, shown=tmp)
    except BaseException:
        if fresh:
            # What is at the name now (a link put there) goes; a dir is removed only if empty.
            with contextlib.suppress(OSError):
                if stat.S_ISDIR(os.stat(tmp.name, dir_fd=parent_fd, follow_symlinks=False).st_mode):
                    os.rmdir(tmp.name, dir_fd=parent_fd)
                else:
                    os.unlink(tmp.name, dir_fd=parent_fd)
        raise
    try:
        return _commit_in(parent, parent_fd, step, write, tmp, tmp_fd, final, if_exists, fresh, on_dev, meta)
    finally:
        os.close(tmp_fd)


def _commit_in(parent: Path, parent_fd: int, step: int, write: WriteFn, tmp: Path, tmp_fd: int, final: Path,
               if_exists: IfExists, fresh: bool, on_dev: int | None, meta: dict[str, Any]) -> Path:  # fmt: skip
    into = Path(f"/proc/self/fd/{tmp_fd}") if on_dev is not None else tmp
    if not fresh:
        # A manifest left by a commit into this dir that died before its rename
        # (harmless: discovery never reads it); the new one is created O_EXCL.
        (into / MANIFEST).unlink(missing_ok=True)
    try:
        # 1-2. Data into the temp dir; the writer fsyncs each file, because a
        # rename is only as durable as the data it points at.
        files, tensors = write(into)
        # A save given up on (hung storage, store/bounded.py) stops here: the trainer
        # went on, so the data written since may not be the state it saved.
        check_live()
        # 3. The manifest last, fsynced: its presence is what "complete" means.
        man = Manifest(step=step, files=files, tensors=tensors, **meta)
        write_file_durably(into / MANIFEST, man.to_bytes())
        # 4. fsync the temp dir so its entries (the files just created) survive a crash.
        fsync_file(tmp_fd, tmp)
        check_live()
        # 5. Atomic rename: the checkpoint appears whole or not at all. Not if our temp
        # dir was renamed away: the rename would move whatever is at its name now.
        if not _is_at(parent_fd, tmp.name, tmp_fd):
            raise _not_committed(final)
        if if_exists == "keep":
            if not _rename_unless_there(parent_fd, tmp, final):
                _discard(parent_fd, tmp, tmp_fd, final)  # committed already, by an earlier attempt: keep that one
                return final
            old = None
        else:
            old = exchange_or_replace_dir(tmp.name, final.name, dir_fd=parent_fd)
        _check_renamed(parent_fd, tmp_fd, final)
        # 6. fsync the parent: until then the rename itself can be lost on power failure.
        fsync_file(parent_fd, parent)
    except BaseException:
        if fresh:
            _discard(parent_fd, tmp, tmp_fd, final)
        raise
    if old is not None:
        remove_tree_at(parent_fd, old.name)
    log.info("committed %s", final)
    return final


def _open_dir(path: str | Path, on_dev: int | None, *, dir_fd: int | None = None, shown: Path | None = None) -> int:
    """Open a dir of the commit; with ``dir_fd`` (the temp dir), never through a link at its name."""
    shown = shown if shown is not None else Path(path)
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | (os.O_NOFOLLOW if dir_fd is not None else 0)
    try:
        fd = os.open(path, flags, dir_fd=dir_fd)
    except OSError as e:
        swapped = dir_fd is not None and e.errno in (errno.ELOOP, errno.ENOTDIR)
        what = "a symlink or file was put in place of the temp dir" if swapped else "cannot open directory"
        raise storage_error(e, what, shown) from e
    if on_dev is not None and os.fstat(fd).st_dev != on_dev:
        os.close(fd)
        raise storage_error(OSError(errno.EXDEV, os.strerror(errno.EXDEV)),
                            "not on the run dir's filesystem (a mount or link put in its place?)", shown)  # fmt: skip
    return fd


def _is_at(parent_fd: int, name: str, tmp_fd: int) -> bool:
    """Whether ``name`` in ``parent_fd`` is still our temp dir (not renamed away, nothing put in its place)."""
    try:
        st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    except OSError:
        return False
    ours = os.fstat(tmp_fd)
    return (st.st_dev, st.st_ino) == (ours.st_dev, ours.st_ino)


def _discard(parent_fd: int, tmp: Path, tmp_fd: int, final: Path) -> None:
    """Remove a fresh temp dir after a failed commit, wherever another process renamed it.

    It is emptied through its own fd, which follows it; its name is removed only while
    it is still ours, and only empty (rmdir): a link or dir put at the name is not ours.
    Renamed to ``final`` already (the parent's fsync failed), it is left there.
    """
    if _is_at(parent_fd, final.name, tmp_fd):
        return
    empty_dir(tmp_fd)
    if _is_at(parent_fd, tmp.name, tmp_fd):
        with contextlib.suppress(OSError):
            os.rmdir(tmp.name, dir_fd=parent_fd)


def _not_committed(final: Path) -> StorageError:
    return StorageError(errno.ESTALE, "checkpoint not committed", final,
                        hint="its temp dir was renamed and something else put in its place (by another process "
                        "or node); write each run dir from one job at a time")  # fmt: skip


def _check_renamed(parent_fd: int, tmp_fd: int, final: Path) -> None:
    """Make sure the rename moved our temp dir, not what another process put at its name."""
    if _is_at(parent_fd, final.name, tmp_fd):
        return
    with contextlib.suppress(OSError):
        if not stat.S_ISDIR(os.stat(final.name, dir_fd=parent_fd, follow_symlinks=False).st_mode):
            # A link renamed into the checkpoint's name by us: take it back out.
            os.unlink(final.name, dir_fd=parent_fd)
    raise _not_committed(final)


def _rename_unless_there(parent_fd: int, tmp: Path, final: Path) -> bool:
    """Rename ``tmp`` to ``final`` (names in ``parent_fd``); False if ``final`` is a dir already."""
    try:
        os.rename(tmp.name, final.name, src_dir_fd=parent_fd, dst_dir_fd=parent_fd)
    except OSError as e:
        if final.is_dir():
            return False
        raise storage_error(e, "cannot rename checkpoint into place", final) from e
    return True

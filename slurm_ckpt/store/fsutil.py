"""Durability primitives: fsync of files and directories, and atomic rename.

Everything that makes a checkpoint durable goes through these few functions, so
tests and the fault-injecting filesystem exercise one seam.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os
import shutil
import stat
from pathlib import Path

from ..errors import storage_error
from .bounded import progress

__all__ = [
    "empty_dir",
    "exchange_or_replace_dir",
    "fsync_dir",
    "fsync_file",
    "open_regular",
    "preallocate",
    "read_small",
    "remove_tree",
    "remove_tree_at",
    "write_file_durably",
]

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_renameat2 = getattr(_libc, "renameat2", None)
_fallocate = getattr(_libc, "fallocate", None)
if _fallocate is not None:
    _fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]


def open_regular(path: str | os.PathLike[str]) -> int:
    """Open an existing checkpoint file for reading, refusing anything but a regular file.

    Checkpoint trees can be user-writable and are read by the root epilog:
    O_NOFOLLOW keeps a planted symlink from redirecting the read, O_NONBLOCK
    keeps a planted FIFO from hanging it, and the fstat check refuses devices.
    """
    from ..errors import CheckpointCorrupt

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CheckpointCorrupt(f"{path}: is a symlink, not a checkpoint file", path) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CheckpointCorrupt(f"{path}: not a regular file", path)
    return fd


def preallocate(fd: int, size: int) -> bool:
    """Reserve ``size`` bytes for the empty file ``fd`` and set its length; False where unsupported.

    ``fallocate(2)`` itself, not ``posix_fallocate``: where the filesystem
    cannot (NFSv3, FUSE, ...), glibc's ``posix_fallocate`` writes zeros over the
    whole length instead, which would write the file twice.
    """
    if _fallocate is None or size <= 0:
        return False
    while _fallocate(fd, 0, 0, size) != 0:
        err = ctypes.get_errno()
        if err == errno.EINTR:  # a signal (the wrapper's checkpoint request) mid-call; ctypes does not retry
            continue
        if err in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            return False
        raise OSError(err, os.strerror(err))
    return True


def read_small(path: str | os.PathLike[str], limit: int) -> bytes:
    """Read a whole small file via :func:`open_regular`, refusing one over ``limit`` bytes."""
    from ..errors import CheckpointCorrupt

    fd = open_regular(path)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise CheckpointCorrupt(f"{path}: {size} bytes, more than the {limit} expected", path)
        with os.fdopen(os.dup(fd), "rb") as f:
            # Sized by the file, not by the limit: read(n) allocates n bytes first.
            data = f.read(size + 1)
            if len(data) > size:  # it grew since the fstat
                data += f.read(limit + 1 - len(data))
    finally:
        os.close(fd)
    if len(data) > limit:
        raise CheckpointCorrupt(f"{path}: more than the {limit} bytes expected", path)
    return data


def fsync_file(fd: int, path: str | os.PathLike[str]) -> None:
    try:
        os.fsync(fd)
    except OSError as e:
        # A failed fsync means the page cache may have dropped our data (the
        # "fsyncgate" lesson): the file must never be committed after this.
        raise storage_error(e, "fsync failed", path) from e
    progress()


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync a directory so the names in it (creations, renames) are durable."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as e:
        raise storage_error(e, "cannot open directory to fsync it", path) from e
    try:
        fsync_file(fd, path)
    finally:
        os.close(fd)


def write_file_durably(path: Path, data: bytes) -> None:
    """Write a small file and fsync it (the caller fsyncs the directory)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise storage_error(e, "cannot create file", path) from e
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
        fsync_file(fd, path)
    except OSError as e:
        raise storage_error(e, "cannot write file", path) from e
    finally:
        os.close(fd)


def exchange_or_replace_dir(src: Path | str, dst: Path | str, *, dir_fd: int | None = None) -> Path | None:
    """Rename directory ``src`` to ``dst`` atomically.

    If ``dst`` already exists (the same step saved again after a resume), swap
    the two atomically with ``renameat2(RENAME_EXCHANGE)`` so that ``dst`` is at
    every instant either the old complete checkpoint or the new one. Returns the
    path now holding the old contents (for the caller to delete), or None.
    With ``dir_fd``, both are names in that dir, and so is the path returned.
    """
    src, dst = Path(src), Path(dst)
    at = dict(src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    try:
        os.rename(src, dst, **at)
        return None
    except OSError as e:
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.EISDIR):
            raise storage_error(e, "cannot rename checkpoint into place", dst) from e
    if _renameat2 is not None:
        fd = _AT_FDCWD if dir_fd is None else dir_fd
        rc = _renameat2(fd, os.fsencode(src), fd, os.fsencode(dst), _RENAME_EXCHANGE)
        if rc == 0:
            return src
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            raise storage_error(OSError(err, os.strerror(err)), "cannot swap checkpoint", dst)
    # No RENAME_EXCHANGE (NFS, FUSE): move the old one aside first. A crash in
    # between leaves the old copy under the aside name, which discovery ignores;
    # the previous step is still there, so nothing valid is lost.
    aside = src.with_name(src.name + ".old")
    try:
        os.rename(dst, aside, **at)
        os.rename(src, dst, **at)
    except OSError as e:
        raise storage_error(e, "cannot replace existing checkpoint", dst) from e
    return aside


def remove_tree(path: Path) -> None:
    """Delete a directory tree without following symlinks; missing is fine.

    ``shutil.rmtree`` uses the fd-based walk (``os.open`` + ``dir_fd``) on
    Linux, which is immune to a symlink swapped in during the walk.
    """
    assert shutil.rmtree.avoids_symlink_attacks
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return
    shutil.rmtree(path, ignore_errors=True)


def remove_tree_at(dir_fd: int, name: str) -> None:
    """Delete ``name`` in the dir open at ``dir_fd`` (a tree, a file or a link), following no link.

    Only names relative to held fds are used, so a dir above that someone renames
    or swaps for a link meanwhile cannot redirect the removal. Errors are ignored.
    """
    try:
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=dir_fd)
        return
    try:
        empty_dir(fd)
    finally:
        os.close(fd)
    with contextlib.suppress(OSError):
        os.rmdir(name, dir_fd=dir_fd)


def empty_dir(fd: int) -> None:
    """Delete everything in the dir open at ``fd``, wherever it was renamed to; errors are ignored."""
    try:
        with os.scandir(fd) as it:
            entries = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
    except OSError:
        return
    for name, is_dir in entries:
        if is_dir:
            remove_tree_at(fd, name)
        else:
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=fd)

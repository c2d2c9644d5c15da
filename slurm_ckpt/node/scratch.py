"""Per-job scratch directories, made and removed by root without following links.

Root acts here on a tree the job's user wrote, so every step goes through a
directory fd: ``mkdir``/``open`` relative to the parent's fd with
``O_NOFOLLOW``, ``fchown``/``fchmod`` on the opened fd, and an fd-based tree
removal that unlinks symlinks, FIFOs and device nodes without opening them,
never leaves the job's filesystem, and never descends through a link.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import stat
import time

from ..errors import StorageError, storage_error
from .rootdir import open_root_dir

__all__ = ["STATE_DIR", "clear_dir", "make_job_dir", "open_base", "open_state_dir", "remove_job_dir"]

log = logging.getLogger("slurm_ckpt.node")

STATE_DIR = ".slurm-ckpt"
"""Root-owned dir under the base: the ledger, job reports, loop images, set-aside names."""

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_MAX_DEPTH = 64


def open_base(base: str) -> int:
    """Open the admin-configured scratch base, creating it if needed.

    Failure here is a node fault, the one case where the hook should make
    Slurm drain the node: the local disk is missing or read-only, or the base
    is a symlink or not root's alone all the way up (then a user could swap
    it for a place of their choosing: see :func:`open_root_dir`).
    """
    try:
        return open_root_dir(base)
    except OSError as e:
        raise StorageError(e.errno or errno.EIO, f"scratch base unusable: {e.filename or base}: {e.strerror} "
                           "(node-local disk missing or read-only, or not root's alone: make the base "
                           "and every dir above it root-owned and not group/world-writable)", base) from e


def _set_aside(dir_fd: int, name: str, why: str) -> None:
    """Rename an unexpected entry out of the way; renaming never follows it."""
    aside = f".aside-{name}-{int(time.time())}-{secrets.token_hex(3)}"
    log.warning("%s is %s; renamed to %s and left for the admin", name, why, aside)
    os.rename(name, aside, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)


def _open_own_dir(dir_fd: int, name: str, mode: int, owner: tuple[int, ...]) -> int:
    """mkdir-or-open ``name`` as a real directory owned by one of ``owner``."""
    for _ in range(3):
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, mode, dir_fd=dir_fd)
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
        except OSError as e:
            if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
            _set_aside(dir_fd, name, "not a directory (a symlink or file)")
            continue
        if os.fstat(fd).st_uid in owner:
            return fd
        os.close(fd)
        _set_aside(dir_fd, name, "a directory owned by someone else")
    raise StorageError(errno.EEXIST, f"cannot claim {name}: it keeps reappearing", name)


def open_state_dir(base_fd: int) -> int:
    """The root-owned state dir under the base (mode 0711: users may not list it)."""
    try:
        fd = _open_own_dir(base_fd, STATE_DIR, 0o711, (0,))
        os.fchmod(fd, 0o711)
        return fd
    except OSError as e:
        raise storage_error(e, "cannot create the scratch state dir", STATE_DIR) from e


def make_job_dir(base_fd: int, name: str, uid: int, gid: int) -> int:
    """Create ``<base>/<name>`` mode 0700 owned by ``uid:gid``; return its fd.

    A directory already there that the job owns (kept by an epilog that could
    not stage out) is adopted. Anything else at that name — a symlink to
    /etc, a file, another user's directory — is renamed aside, never followed.
    """
    fd = _open_own_dir(base_fd, name, 0o700, (uid, 0))
    try:
        os.fchown(fd, uid, gid)
        os.fchmod(fd, 0o700)
    except OSError:
        os.close(fd)
        raise
    return fd


def clear_dir(root_fd: int) -> list[str]:
    """Delete everything inside the directory ``root_fd``; return what had to stay.

    Entries are unlinked by name (a symlink, FIFO or device node is never
    opened); directories are opened with ``O_NOFOLLOW`` and checked to be the
    inode just looked at. Mount points inside (a user's FUSE mount) are left.
    Trees deeper than 64 levels are renamed up to the top and taken in a later
    pass, so the fds held stay bounded however deep the user made it.
    """
    dev = os.fstat(root_fd).st_dev
    left: list[str] = []
    while _clear_pass(root_fd, dev, left):
        pass
    return left


def _clear_pass(root_fd: int, dev: int, left: list[str]) -> bool:
    moved = False
    # Each frame: (fd of a dir, names left in it, its name in the parent).
    stack: list[tuple[int, list[str], str]] = [(root_fd, os.listdir(root_fd), "")]
    while stack:
        fd, names, own_name = stack[-1]
        if not names:
            stack.pop()
            if stack:
                os.close(fd)
                _quiet(os.rmdir, own_name, stack[-1][0], left)
            continue
        name = names.pop()
        try:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            continue
        if not stat.S_ISDIR(st.st_mode):
            _quiet(os.unlink, name, fd, left)
            continue
        if st.st_dev != dev:
            left.append(f"{name!r}: a mount point, left alone")
            continue
        if len(stack) >= _MAX_DEPTH:
            try:
                os.rename(name, f".deep-{secrets.token_hex(6)}", src_dir_fd=fd, dst_dir_fd=root_fd)
                moved = True
            except OSError as e:
                left.append(f"{name!r}: {e.strerror}")
            continue
        try:
            sub = os.open(name, _DIR_FLAGS, dir_fd=fd)
        except OSError as e:
            left.append(f"{name!r}: {e.strerror}")
            continue
        sst = os.fstat(sub)
        if (sst.st_dev, sst.st_ino) != (st.st_dev, st.st_ino):
            os.close(sub)  # swapped between stat and open: skip, a later pass retries
            left.append(f"{name!r}: changed while being removed")
            continue
        try:
            entries = os.listdir(sub)
        except OSError as e:
            os.close(sub)
            left.append(f"{name!r}: {e.strerror}")
            continue
        stack.append((sub, entries, name))
    return moved


def _quiet(op: object, name: str, dir_fd: int, left: list[str]) -> None:
    try:
        op(name, dir_fd=dir_fd)  # type: ignore[operator]
    except FileNotFoundError:
        pass
    except OSError as e:
        left.append(f"{name!r}: {e.strerror}")


def remove_job_dir(base_fd: int, name: str) -> list[str]:
    """Remove ``<base>/<name>`` and everything in it; return what had to stay.

    Missing is fine (the epilog may run twice). A symlink or file at the name
    is unlinked itself; its target is never touched.
    """
    try:
        st = os.stat(name, dir_fd=base_fd, follow_symlinks=False)
    except FileNotFoundError:
        return []
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(name, dir_fd=base_fd)
        return []
    fd = os.open(name, _DIR_FLAGS, dir_fd=base_fd)
    try:
        left = clear_dir(fd)
    finally:
        os.close(fd)
    if not left:
        _quiet(os.rmdir, name, base_fd, left)
    return left

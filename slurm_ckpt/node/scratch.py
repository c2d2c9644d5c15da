"""Per-job scratch directories, made and removed by root without following links.

Root acts here on a tree the job's user wrote, so every step goes through a
directory fd: ``mkdir``/``open`` relative to the parent's fd with
``O_NOFOLLOW``, ``fchown``/``fchmod`` on the opened fd, and an fd-based tree
removal that unlinks symlinks, FIFOs and device nodes without opening them,
never leaves the job's filesystem, never descends through a link, and stops
at a deadline however many entries the user made.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..errors import StorageError, storage_error
from .mounts import mount_id
from .rootdir import open_root_dir

if TYPE_CHECKING:
    from .deadline import Deadline

__all__ = [
    "STATE_DIR",
    "Removal",
    "clear_dir",
    "hand_over",
    "make_job_dir",
    "mount_id",
    "open_base",
    "open_state_dir",
    "remove_job_dir",
]

log = logging.getLogger("slurm_ckpt.node")

STATE_DIR = ".slurm-ckpt"
"""Root-owned dir under the base: the ledger, job reports, loop images, set-aside names."""

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_MAX_DEPTH = 64
_MAX_REASONS = 10


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


def _token() -> str:
    # os.urandom, not secrets: secrets imports hashlib and hmac, which every hook would pay for.
    return os.urandom(3).hex()


def _set_aside(dir_fd: int, name: str, why: str) -> None:
    """Rename an unexpected entry out of the way; renaming never follows it."""
    aside = f".aside-{name}-{int(time.time())}-{_token()}"
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


def make_job_dir(base_fd: int, name: str, uid: int) -> int:
    """Create ``<base>/<name>`` root-owned, mode 0700; return its fd.

    Root-owned until :func:`hand_over`: the size limit (a mount, a project id)
    goes on first, so no process of the user ever holds an fd into the
    unlimited base filesystem through it. A directory already there that the
    job owns (kept by an epilog that could not stage out) is adopted. Anything
    else at that name — a symlink to /etc, a file, another user's directory —
    is renamed aside, never followed.
    """
    return _open_own_dir(base_fd, name, 0o700, (uid, 0))


def hand_over(fd: int, uid: int, gid: int) -> None:
    """Give the directory ``fd`` to the job's user, mode 0700."""
    os.fchown(fd, uid, gid)
    os.fchmod(fd, 0o700)


@dataclass
class Removal:
    """How far a bounded removal got."""

    done: bool = False
    """True when the directory is empty."""
    removed: int = 0
    """Entries unlinked or removed (directories included)."""
    detached: int = 0
    """Mounts found inside and detached."""
    left: list[str] = field(default_factory=list)
    """Why some entries had to stay (the first few)."""
    stuck: int = 0
    """Entries that could not be removed, counted."""
    moved: int = 0
    """Directories deeper than the walk goes, renamed to the top for a later pass."""

    def note(self, name: str, why: str) -> None:
        self.stuck += 1
        if len(self.left) < _MAX_REASONS:
            # repr(): a name may hold a newline, which must not forge a log line.
            self.left.append(f"{name[:200]!r}: {why}")

    def __str__(self) -> str:
        what = "everything" if self.done else "not everything"
        more = f"; {self.stuck} could not be removed: {'; '.join(self.left)}" if self.stuck else ""
        return f"removed {self.removed} entries ({what}){more}"


def clear_dir(root_fd: int, deadline: Deadline | None = None) -> Removal:
    """Delete everything inside the directory ``root_fd`` until ``deadline``.

    Entries are unlinked by name (a symlink, FIFO or device node is never
    opened); directories are opened with ``O_NOFOLLOW`` and read a block of
    entries at a time, never listed whole into memory, so ten million empty
    files cost no more memory than ten. A mount inside (a user's FUSE mount,
    whose stat fails even for root) is detached, never descended into: the
    files on it are not touched. Trees deeper than 64 levels are renamed up
    to the top and taken in a later pass, so the fds held stay bounded however
    deep the user made it. New entries made meanwhile by another process of
    the user (one holding a directory open) are taken as they come, until the
    deadline; the result then says what is left.
    """
    dev = os.fstat(root_fd).st_dev
    mnt = mount_id(root_fd)
    out = Removal()
    while True:
        before = (out.removed, out.detached, out.moved)
        _clear_pass(root_fd, dev, mnt, out, deadline)
        if _is_empty(root_fd):
            out.done = True
            return out
        if _expired(deadline) or (out.removed, out.detached, out.moved) == before:
            return out  # out of time, or only what cannot be removed is left
        out.left.clear()
        out.stuck = 0


def _expired(deadline: Deadline | None) -> bool:
    return deadline is not None and deadline.left() <= 0


def _is_empty(fd: int) -> bool:
    with os.scandir(fd) as it:
        return next(it, None) is None


def _clear_pass(root_fd: int, dev: int, mnt: int | None, out: Removal, deadline: Deadline | None) -> None:
    # Each frame: (fd of a dir, its entry iterator, its name in the parent).
    stack: list[tuple[int, Iterator[os.DirEntry[str]], str]] = [(root_fd, os.scandir(root_fd), "")]
    try:
        while stack:
            fd, it, own_name = stack[-1]
            entry = next(it, None) if not _expired(deadline) else None
            if entry is None:
                stack.pop()
                it.close()  # type: ignore[attr-defined]
                if stack:
                    os.close(fd)
                    if not _expired(deadline):
                        _remove(os.rmdir, own_name, stack[-1][0], out)
                continue
            name = entry.name
            try:
                is_dir = entry.is_dir(follow_symlinks=False)
            except OSError:
                is_dir = True  # unknown type and stat refused: find out by opening it
            if not is_dir:
                _remove(os.unlink, name, fd, out)
                continue
            if len(stack) >= _MAX_DEPTH:
                try:
                    os.rename(name, f".deep-{_token()}{_token()}", src_dir_fd=fd, dst_dir_fd=root_fd)
                    out.moved += 1
                except OSError as e:
                    out.note(name, e.strerror or str(e))
                continue
            sub = _open_subdir(fd, name, dev, mnt, out)
            if sub is not None:
                stack.append((sub, os.scandir(sub), name))
    finally:
        for fd, it, _ in stack[1:]:
            it.close()  # type: ignore[attr-defined]
            os.close(fd)
        if stack:
            stack[0][1].close()  # type: ignore[attr-defined]


_NOT_OPENED = (errno.EACCES, errno.EPERM, errno.ENOTCONN, errno.EIO, errno.ESTALE)


def _open_subdir(parent: int, name: str, dev: int, mnt: int | None, out: Removal) -> int | None:
    """Open ``name`` to descend into it, or handle it here and return None."""
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno in (errno.ENOTDIR, errno.ELOOP):
            _remove(os.unlink, name, parent, out)  # swapped for a file or link meanwhile
        elif e.errno in _NOT_OPENED and _is_foreign_mount(parent, name, mnt):
            _detach(parent, name, out)
        else:
            out.note(name, e.strerror or str(e))
        return None
    if os.fstat(fd).st_dev != dev:
        os.close(fd)
        _detach(parent, name, out)
        return None
    return fd


def _is_foreign_mount(parent: int, name: str, mnt: int | None) -> bool:
    """Whether ``name`` is the root of another mount, without any call into that filesystem.

    A FUSE mount refuses even root's stat and open unless mounted allow_other;
    an ``O_PATH`` open and the fd's ``mnt_id`` need nothing from it.
    """
    try:
        fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
    except OSError:
        return False
    try:
        other = mount_id(fd)
        return mnt is not None and other is not None and other != mnt
    finally:
        os.close(fd)


def _detach(parent: int, name: str, out: Removal) -> None:
    """Detach the mount on ``name`` lazily: nothing on it is read or deleted, the tree
    under it stays whole; its empty mount point goes in the next pass."""
    from . import commands

    try:
        fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
    except OSError as e:
        out.note(name, e.strerror or str(e))
        return
    try:
        # Through /proc/self/fd: the mount the fd is on, whatever the name points at by now.
        rc, msg = commands.run(["umount", "--no-canonicalize", "-l", f"/proc/self/fd/{fd}"], 10.0, (fd,))
    finally:
        os.close(fd)
    if rc:
        out.note(name, f"a mount point that would not detach: {msg.strip()[-200:]}")
        return
    log.warning("detached a mount inside scratch at %r (nothing on it was deleted)", name[:200])
    out.detached += 1


def _remove(op: Callable[..., None], name: str, dir_fd: int, out: Removal) -> None:
    try:
        op(name, dir_fd=dir_fd)
        out.removed += 1
    except FileNotFoundError:
        pass
    except OSError as e:
        if e.errno in (errno.EISDIR, errno.ENOTEMPTY, errno.EEXIST):
            return  # changed meanwhile (or still filling): the next pass looks again
        if e.errno == errno.EBUSY and op is os.rmdir:
            _detach(dir_fd, name, out)  # an empty mount point: detach, remove next pass
            return
        out.note(name, e.strerror or str(e))


def remove_job_dir(base_fd: int, name: str, deadline: Deadline | None = None) -> Removal:
    """Remove ``<base>/<name>`` and everything in it, until ``deadline``.

    Missing is fine (the epilog may run twice). A symlink or file at the name
    is unlinked itself; its target is never touched.
    """
    try:
        st = os.stat(name, dir_fd=base_fd, follow_symlinks=False)
    except FileNotFoundError:
        return Removal(done=True)
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(name, dir_fd=base_fd)
        return Removal(done=True, removed=1)
    fd = os.open(name, _DIR_FLAGS, dir_fd=base_fd)
    try:
        out = clear_dir(fd, deadline)
    finally:
        os.close(fd)
    if out.done:
        _remove(os.rmdir, name, base_fd, out)
        out.done = not _exists(base_fd, name)
    return out


def _exists(dir_fd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True

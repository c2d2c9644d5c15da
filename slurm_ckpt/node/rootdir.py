"""A directory only root can change, opened one name at a time from ``/``.

The scratch base is where root creates, chowns and deletes every job's
scratch. If any directory above it were writable by a user, that user could
rename the base away and put a symlink or a directory of their own in its
place between two hook runs, and root would then act inside it. So the walk
checks each directory on the way, and opens each next name relative to the
directory already checked, never by the whole path.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat

from ..errors import StorageError

__all__ = ["open_private_subdir", "open_root_dir"]

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_MAX_LINKS = 40  # as the kernel's own limit on links in one lookup


def _unsafe(st: os.stat_result, last: bool) -> str | None:
    """Why a directory is not root's alone, or None."""
    if st.st_uid != 0:
        return f"owned by uid {st.st_uid}, not root"
    mode = stat.S_IMODE(st.st_mode)
    # A sticky dir such as /tmp is fine on the way: no one else may rename root's
    # entries in it. The base itself may not be writable by others at all: they
    # could fill its filesystem outside every job's limit.
    if mode & 0o022 and (last or not mode & stat.S_ISVTX):
        return f"mode {mode:o}, writable by group or others"
    return None


def _split(path: str) -> list[str]:
    """The names of ``path`` as a stack: the first name last."""
    return [p for p in reversed(path.split("/")) if p not in ("", ".")]


def open_root_dir(path: str, create_mode: int | None = 0o755) -> int:
    """Open absolute ``path``, a directory that only root can have made or can change.

    Every directory from ``/`` down must be owned by root and not writable by
    group or others (sticky dirs excepted on the way); ``path`` itself must
    not be a symlink. A symlink on the way (``/local -> /nvme``) is followed
    only when root owns it. Missing directories are created with
    ``create_mode`` (None: refused). Raises :class:`OSError` whose
    ``filename`` is the first path that fails and ``strerror`` says why.
    """
    if not path.startswith("/"):
        raise OSError(errno.EINVAL, "not an absolute path", path)
    todo = _split(path)
    fds = [os.open("/", _DIR_FLAGS)]
    names: list[str] = []
    links = 0
    try:
        if why := _unsafe(os.fstat(fds[0]), not todo):
            raise OSError(errno.EPERM, why, "/")
        while todo:
            name = todo.pop()
            if name == "..":
                if len(fds) > 1:
                    os.close(fds.pop())
                    names.pop()
                continue
            shown = "/" + "/".join([*names, name])
            try:
                target = _step(fds, name, create_mode, last=not todo, links=links)
            except OSError as e:
                raise OSError(e.errno, e.strerror, shown) from None
            if target is None:
                names.append(name)
                continue
            links += 1
            if target.startswith("/"):
                while len(fds) > 1:
                    os.close(fds.pop())
                names.clear()
            todo.extend(_split(target))
        return fds.pop()
    finally:
        for fd in fds:
            os.close(fd)


def _step(fds: list[int], name: str, create_mode: int | None, *, last: bool, links: int) -> str | None:
    """Open ``name`` in ``fds[-1]`` and push its fd, checked; or return the target of a root-owned link."""
    parent = fds[-1]
    try:
        st = os.stat(name, dir_fd=parent, follow_symlinks=False)
    except FileNotFoundError:
        if create_mode is None:
            raise
        os.mkdir(name, create_mode, dir_fd=parent)
        st = os.stat(name, dir_fd=parent, follow_symlinks=False)
    if stat.S_ISLNK(st.st_mode):
        if last:
            raise OSError(errno.ELOOP, "a symlink; name the directory itself")
        if st.st_uid != 0:
            raise OSError(errno.ELOOP, f"a symlink owned by uid {st.st_uid}, not root")
        if links >= _MAX_LINKS:
            raise OSError(errno.ELOOP, "too many levels of symlinks")
        return os.readlink(name, dir_fd=parent)
    fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
    fds.append(fd)
    fst = os.fstat(fd)
    if (fst.st_dev, fst.st_ino) != (st.st_dev, st.st_ino):
        raise OSError(errno.EAGAIN, "replaced while it was checked")
    if why := _unsafe(fst, last):
        raise OSError(errno.EPERM, why)
    return None


def open_private_subdir(parent_fd: int, name: str, what: str) -> int:
    """``name`` under the checked dir ``parent_fd``, made if missing, as an fd: root's, mode 0700.

    Raises StorageError (EPERM) naming ``what`` if someone else owns it: a dir
    of root's state that is not root's was not made by a hook.
    """
    with contextlib.suppress(FileExistsError):
        os.mkdir(name, 0o700, dir_fd=parent_fd)
    fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    st = os.fstat(fd)
    if st.st_uid != os.geteuid():
        os.close(fd)
        raise StorageError(errno.EPERM, f"{what} is owned by uid {st.st_uid}; remove it", name)
    os.fchmod(fd, 0o700)
    return fd

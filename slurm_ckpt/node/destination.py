"""Where the epilog's stage-out may write: a durable run dir under an allowed root, off scratch.

The job's ``TIER.json`` names its durable run dir, and the job's user writes
that file. Left unchecked it could name ``/dev/shm/x`` (the node's memory),
``/tmp/x`` (the root filesystem) or the scratch filesystem itself, outside
every limit. So a destination must lie under one of the admin's roots
(``storage.stage_out_roots``, else ``storage.root``) and on another
filesystem than scratch. It is opened one name at a time from the root with
``O_NOFOLLOW``, as the job's user, and then used only through its fd
(``/proc/self/fd/N``): a link planted on the way, or swapped in after the
check, cannot send the copy elsewhere.

Each dir on the way, the root included, must belong to the job's user or
to root, and no other user may write in it (see :mod:`slurm_ckpt.store.owner`),
or the stage-out refuses. The run dir must be on the root's filesystem, so
that a mount planted on the way (a user's FUSE) is no destination either.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..store.owner import untrusted

__all__ = ["Destination", "open_destination"]

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass(frozen=True)
class Destination:
    """An open durable run dir: ``fd`` is what every operation goes through."""

    fd: int
    shown: Path
    """The path the job named: for logs and results only."""
    dev: int
    """``st_dev`` of its filesystem: everything the stage-out writes must land there."""

    @property
    def path(self) -> Path:
        """The dir as a path that resolves through ``fd``, whatever its names do meanwhile."""
        return Path(f"/proc/self/fd/{self.fd}")

    def show(self, text: str) -> str:
        """``text`` with :attr:`path` written as :attr:`shown`."""
        return text.replace(str(self.path), str(self.shown))


def _below(path: str, prefix: str) -> list[str] | None:
    """The names leading from ``prefix`` down to ``path``, or None if it is not below it."""
    if path == prefix:
        return []
    head = prefix.rstrip("/") + "/"
    return [n for n in path[len(head) :].split("/") if n] if path.startswith(head) else None


def open_destination(
    path: Path, roots: Sequence[str], scratch_devs: Collection[int]
) -> tuple[Destination | None, str]:
    """Open the durable run dir ``path`` (absolute, normalized), creating what is missing.

    Returns the destination, or None and why it is refused. An I/O error on
    the way (``EACCES``: the user may not create it) raises :class:`OSError`.
    Called with the job user's privileges.
    """
    for root in roots:
        # The admin's root may itself be a link (/shared -> /lustre/shared): either spelling counts.
        for prefix in dict.fromkeys((root, os.path.realpath(root))):
            names = _below(str(path), prefix)
            if names is not None:
                return _walk(prefix, names, path, scratch_devs)
    allowed = ", ".join(roots) or "nowhere: set storage.root"
    return None, f"not under a stage-out root ({allowed}; see storage.stage_out_roots)"


def _walk(
    prefix: str, names: list[str], path: Path, scratch_devs: Collection[int]
) -> tuple[Destination | None, str]:
    uid = os.geteuid()
    fd = os.open(prefix, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    where = prefix
    try:
        root_dev = os.fstat(fd).st_dev
        for name in names:
            st = os.fstat(fd)
            if st.st_dev in scratch_devs:
                break
            if why := untrusted(st, uid, last=False):
                os.close(fd)
                return None, f"{where} {why}"
            where = os.path.join(where, name)
            try:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, 0o700, dir_fd=fd)
                sub = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    os.close(fd)
                    return None, f"{where} is a symlink or not a directory"
                raise OSError(e.errno, e.strerror, where) from None
            os.close(fd)
            fd = sub
        st = os.fstat(fd)
        if st.st_dev in scratch_devs:
            os.close(fd)
            return None, f"{where} is on the node's scratch filesystem"
        if st.st_dev != root_dev:
            os.close(fd)
            return None, (f"{where} is on another filesystem than {prefix} (a mount below a stage-out root): "
                          "list it in storage.stage_out_roots if it is durable storage")  # fmt: skip
        if why := untrusted(st, uid, last=True):
            os.close(fd)
            return None, f"{where} {why}"
    except BaseException:
        with contextlib.suppress(OSError):
            os.close(fd)
        raise
    return Destination(fd, path, st.st_dev), ""

"""Mounts in a job's scratch that the hooks did not make: found and detached without a call into them.

A user may mount a FUSE filesystem on any directory they own, their job dir
included (``fusermount`` allows it). Its daemon may be dead (every call fails
with ENOTCONN), or alive and mounted ``allow_other``, answering EIO or never.
Root must neither follow such a mount nor fail on it, so nothing here stats or
opens into one: the mounts come from ``/proc/self/mountinfo``; a mount point is
reached by ``O_PATH | O_NOFOLLOW`` opens relative to a directory fd, which ask
nothing of the filesystem they land on; the fd's mount id says which mount it
is; and it is detached lazily through ``/proc/self/fd/N`` (nothing on it is
read or deleted).
"""

from __future__ import annotations

import logging
import os
import re
import time
from dataclasses import dataclass

from . import commands

__all__ = ["Mount", "detach_foreign", "exists", "mount_id", "table"]

log = logging.getLogger("slurm_ckpt.node")

_OPATH = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC
_ESCAPE = re.compile(rb"\\([0-7]{3})")
_OUR_FSTYPES = ("ext4", "xfs")
_MAX_ROUNDS = 64
"""Mounts detached per call at most: a user stacking more waits for the next hook."""


@dataclass(frozen=True)
class Mount:
    """One line of /proc/self/mountinfo."""

    mount_id: int
    point: str
    fstype: str
    source: str


def _unescape(field: bytes) -> str:
    # mountinfo writes space, tab, newline and backslash as \ooo.
    return os.fsdecode(_ESCAPE.sub(lambda m: bytes([int(m.group(1), 8)]), field))


def table() -> list[Mount]:
    """This mount namespace's mounts, in the kernel's order (a later one may cover an earlier)."""
    out = []
    with open("/proc/self/mountinfo", "rb") as f:
        for line in f:
            left, _, right = line.partition(b" - ")
            fields, rest = left.split(), right.split()
            if len(fields) < 5 or len(rest) < 2:
                continue
            out.append(Mount(int(fields[0]), _unescape(fields[4]), os.fsdecode(rest[0]), _unescape(rest[1])))
    return out


def mount_id(fd: int) -> int | None:
    """The mount an fd is on (``mnt_id`` in /proc/self/fdinfo), or None where not shown."""
    try:
        with open(f"/proc/self/fdinfo/{fd}", "rb") as f:
            for line in f:
                if line.startswith(b"mnt_id:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def exists(dir_fd: int, name: str) -> bool:
    """Whether ``name`` is in ``dir_fd``, asking nothing of a filesystem mounted on it."""
    try:
        os.close(os.open(name, _OPATH, dir_fd=dir_fd))
    except FileNotFoundError:
        return False
    return True


def _ours(m: Mount, point: str) -> bool:
    """The job's loop filesystem, which only root can mount here (a user cannot mount a block device)."""
    return m.point == point and m.fstype in _OUR_FSTYPES and m.source.startswith("/dev/loop")


def _open_point(base_fd: int, parts: list[str]) -> int | None:
    """An O_PATH fd of ``base/parts...``, each step ``O_NOFOLLOW`` relative to the last."""
    fd = os.dup(base_fd)
    try:
        for part in parts:
            nxt = os.open(part, _OPATH, dir_fd=fd)
            os.close(fd)
            fd = nxt
    except OSError:
        os.close(fd)
        return None
    return fd


def detach_foreign(base_fd: int, name: str, timeout: float) -> int:
    """Detach every mount at or below ``<base>/<name>`` that is not the job's loop filesystem.

    Outermost first (a lazy detach takes the mounts below along), the top
    one of a stack first. Returns how many were detached. A mount it cannot
    reach (hidden under another) or detach stays, and the log says so.
    """
    end = time.monotonic() + timeout
    base = os.readlink(f"/proc/self/fd/{base_fd}")  # the base as mountinfo shows it
    prefix = os.path.join(base, name)
    detached = 0
    for _ in range(_MAX_ROUNDS):
        foreign = [m for m in table() if (m.point == prefix or m.point.startswith(prefix + "/"))
                   and not _ours(m, prefix)]  # fmt: skip
        if not foreign or time.monotonic() >= end:
            break
        ids = {m.mount_id for m in foreign}
        if not any(_detach_one(base_fd, name, p, prefix, ids, end) for p in _outermost_first(foreign)):
            log.warning("mounts in %s that the hooks did not make could not be detached: %s", name[:200],
                        ", ".join(f"{m.fstype} on {m.point[:200]!r}" for m in foreign[:5]))  # fmt: skip
            break
        detached += 1
    return detached


def _outermost_first(mounts: list[Mount]) -> list[str]:
    return sorted({m.point for m in mounts}, key=lambda p: p.count("/"))


def _detach_one(base_fd: int, name: str, point: str, prefix: str, ids: set[int], end: float) -> bool:
    rel = point[len(prefix) :].strip("/")
    fd = _open_point(base_fd, [name, *(rel.split("/") if rel else [])])
    if fd is None:
        return False
    try:
        mid = mount_id(fd)
        if mid not in ids:
            return False  # the path leads elsewhere now (renamed meanwhile), or the top is ours
        # Through /proc/self/fd: the mount the fd is on, whatever the path names by now.
        rc, out = commands.run(["umount", "--no-canonicalize", "-l", f"/proc/self/fd/{fd}"],
                               max(0.1, end - time.monotonic()), (fd,))  # fmt: skip
    finally:
        os.close(fd)
    if rc:
        log.warning("cannot detach the mount on %r: %s", point[:200], out.strip()[-200:])
        return False
    log.warning("detached a mount the hooks did not make, on %r (nothing on it was read or deleted)", point[:200])
    return True

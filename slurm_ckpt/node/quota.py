"""Project quotas that enforce a job's scratch size.

Project quotas (XFS, or ext4 with the ``project`` feature, mounted with
``prjquota``): the job dir gets the job id as its project id, with the inherit
flag, set by ``ioctl`` on the open directory fd (no path to follow, see
:func:`slurm_ckpt.fsinfo.set_project`); the limit is set with ``xfs_quota``
or ``setquota``. Reading quotas lives in :mod:`slurm_ckpt.fsinfo`.
"""

from __future__ import annotations

import collections
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from ..fsinfo import Mount, get_project
from . import commands
from .escape import escape

__all__ = [
    "MAX_PROJECT_ID",
    "ProjectScan",
    "changed_projects",
    "clear_project_limit",
    "has_project_quota",
    "limit_argv",
    "set_project_limit",
]

MAX_PROJECT_ID = 2**32 - 2


def has_project_quota(mount: Mount | None) -> bool:
    """True where a project quota would be enforced (XFS or ext4 mounted with prjquota)."""
    if mount is None or mount.fstype not in ("xfs", "ext4"):
        return False
    opts = mount.options
    return "pqnoenforce" not in opts and any(o in opts for o in ("prjquota", "pquota", "pqenforce"))


@dataclass
class ProjectScan:
    """What :func:`changed_projects` found: entries off the job's project, by project id."""

    changed: int = 0
    by_project: collections.Counter[int] = field(default_factory=collections.Counter)
    examples: list[str] = field(default_factory=list)
    seen: int = 0
    complete: bool = True

    def summary(self) -> str:
        """One line: counts per project (a project id is the job id that set it) and a few names."""
        where = ", ".join(f"{n} to {'project 0 (no quota)' if p == 0 else f'project {p} (job {p})'}"
                          for p, n in self.by_project.most_common(5))  # fmt: skip
        return f"{where}; e.g. {', '.join(self.examples)}"


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_NOATIME | os.O_CLOEXEC
_MAX_DEPTH = 64


def changed_projects(dir_fd: int, projid: int, *, seconds: float, max_entries: int = 200_000) -> ProjectScan:
    """Directories and regular files under ``dir_fd`` whose project id is not ``projid``.

    A bounded walk (``seconds``, ``max_entries``, 64 levels; ``complete``
    says whether it saw everything) through directory fds: nothing is
    followed, no other filesystem entered, nothing but a directory or a
    regular file opened.
    """
    scan = ProjectScan()
    end = time.monotonic() + seconds
    dev = os.fstat(dir_fd).st_dev

    def check(fd: int, name: str) -> None:
        got, _ = get_project(fd)
        if got != projid:
            scan.changed += 1
            scan.by_project[got] += 1
            if len(scan.examples) < 3:
                scan.examples.append(f"{escape(name, 200)!r} (project {got})")

    check(dir_fd, ".")
    stack: list[tuple[int, Iterator[os.DirEntry[str]], str]] = [(dir_fd, os.scandir(dir_fd), "")]
    try:
        while stack:
            fd, entries, where = stack[-1]
            entry = next(entries, None)
            if entry is None:
                stack.pop()
                if stack:
                    os.close(fd)
                continue
            scan.seen += 1
            if scan.seen > max_entries or time.monotonic() > end:
                scan.complete = False
                break
            name = f"{where}/{entry.name}" if where else entry.name
            try:
                if entry.is_dir(follow_symlinks=False):
                    if len(stack) >= _MAX_DEPTH:
                        scan.complete = False
                        continue
                    sub = os.open(entry.name, _DIR_FLAGS, dir_fd=fd)
                    if os.fstat(sub).st_dev != dev:  # a mount inside (a user's FUSE): not ours
                        os.close(sub)
                        continue
                    stack.append((sub, os.scandir(sub), name))
                    check(sub, name)
                elif entry.is_file(follow_symlinks=False):
                    f = os.open(entry.name, _FILE_FLAGS, dir_fd=fd)
                    try:
                        check(f, name)
                    finally:
                        os.close(f)
            except OSError:
                continue  # gone meanwhile, or not a file that has a project
    finally:
        for i, (fd, entries, _) in enumerate(stack):
            entries.close()  # type: ignore[attr-defined]
            if i:
                os.close(fd)
    return scan


def limit_argv(mount: Mount, projid: int, nbytes: int, inodes: int = 0) -> list[str]:
    """The command that sets ``projid``'s hard block and inode limits (0: none)."""
    if mount.fstype == "xfs":
        return ["xfs_quota", "-x", "-c", f"limit -p bhard={nbytes} ihard={inodes} {projid}", mount.mount_point]
    kib = -(-nbytes // 1024)
    return ["setquota", "-P", str(projid), "0", str(kib), "0", str(inodes), mount.mount_point]


def set_project_limit(mount: Mount, projid: int, nbytes: int, timeout: float, inodes: int = 0) -> str | None:
    """Set the hard block and inode limits of ``projid``; return None, or why it failed.

    The inode limit bounds how many entries a job can leave for the epilog
    to remove, as the block limit bounds its bytes.
    """
    rc, out = commands.run(limit_argv(mount, projid, nbytes, inodes), timeout)
    return None if rc == 0 else f"{out.strip()[-300:]} (exit {rc})"


def clear_project_limit(mount: Mount, projid: int, timeout: float) -> None:
    """Remove the limits again (0 means none), so a reused project id starts clean."""
    set_project_limit(mount, projid, 0, timeout)

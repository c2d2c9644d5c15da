"""The pre-start check of the shared checkpoint filesystem: free space, free inodes, quota.

Compared with what the job will need: its expected checkpoint size times
``storage.keep + 1`` (a new checkpoint is committed before retention deletes
the oldest). The result is warnings for the job and figures for ``doctor``.
Root reads the user's run dir here, so it is walked by directory fd with
``O_NOFOLLOW`` and only sizes are taken, never contents.
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import asdict, dataclass, field
from typing import Any

from ..config import format_size
from ..fsinfo import CEPH_FS, QuotaUsage, ceph_quotas, free_inodes, mount_of, user_quota
from ..store.layout import STEP_RE
from . import commands
from .job import Job

__all__ = ["SpaceCheck", "check_shared", "newest_checkpoint_size"]

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
FILES_PER_CHECKPOINT = 8
"""Inodes assumed per checkpoint (manifest, state, tensor shards) when checking free inodes."""


@dataclass
class SpaceCheck:
    path: str
    free_bytes: int = 0
    free_inodes: int = 0
    need_bytes: int = 0
    need_inodes: int = 0
    expected_size: int = 0
    expected_from: str = ""
    quota: QuotaUsage | None = None
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def newest_checkpoint_size(root: str, user: str, job_dir: str) -> tuple[int, int]:
    """(bytes of the newest ``step-*`` in ``<root>/<user>/<job_dir>``, number of steps there).

    (0, 0) when there is none or any component is not a plain directory.
    """
    fds: list[int] = []
    try:
        fds.append(os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC))
        for name in (user, job_dir):
            fds.append(os.open(name, _DIR, dir_fd=fds[-1]))
        steps = sorted((n for n in os.listdir(fds[-1]) if STEP_RE.fullmatch(n)), reverse=True)
        if not steps:
            return 0, 0
        fds.append(os.open(steps[0], _DIR, dir_fd=fds[-1]))
        total = 0
        for name in os.listdir(fds[-1]):
            st = os.stat(name, dir_fd=fds[-1], follow_symlinks=False)
            if stat.S_ISREG(st.st_mode):
                total += st.st_size
        return total, len(steps)
    except OSError:
        return 0, 0
    finally:
        for fd in fds:
            os.close(fd)


def _open_fs(root: str, user: str) -> int:
    """An fd of ``<root>/<user>`` if it is a real directory, else of ``<root>``."""
    root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        user_fd = os.open(user, _DIR, dir_fd=root_fd)
    except OSError:
        return root_fd
    os.close(root_fd)
    return user_fd


def check_shared(root: str, job: Job, keep: int, expected: int | None, expected_from: str, *,
                 fallback: int = 0, timeout: float) -> SpaceCheck:  # fmt: skip
    """Check ``storage.root`` for this job.

    The checkpoint size is ``expected``, else that of the job's newest
    checkpoint, else ``fallback`` (``scratch.expected_ckpt_size``; 0: unknown).
    """
    chk = SpaceCheck(root)
    try:
        fd = _open_fs(root, job.user)
        try:
            vfs, dev = os.fstatvfs(fd), os.fstat(fd).st_dev
            where = os.readlink(f"/proc/self/fd/{fd}")  # the dir itself, whatever a path's links say
        finally:
            os.close(fd)
    except OSError as e:
        chk.warnings.append(f"cannot check the checkpoint storage {root}: {os.strerror(e.errno or errno.EIO)}")
        return chk
    chk.free_bytes = vfs.f_bavail * vfs.f_frsize
    chk.free_inodes = vfs.f_favail
    have_size, have_steps = newest_checkpoint_size(root, job.user, job.dir_name)
    if expected is None and have_size:
        expected, expected_from = have_size, "the newest checkpoint of this job"
    elif expected is None and fallback:
        expected, expected_from = fallback, "scratch.expected_ckpt_size"
    more = max(1, keep + 1 - min(have_steps, keep))
    chk.need_inodes = FILES_PER_CHECKPOINT * more
    if expected:
        chk.expected_size, chk.expected_from = expected, expected_from
        chk.need_bytes = expected * more
    plan = (f"{more} more checkpoint(s) of {format_size(expected)} ({expected_from}, "
            f"storage.keep={keep})") if expected else ""  # fmt: skip
    if chk.need_bytes > chk.free_bytes:
        chk.warnings.append(f"the checkpoint storage {root} has {format_size(chk.free_bytes)} free; "
                            f"this job needs up to {format_size(chk.need_bytes)} for {plan}")  # fmt: skip
    if free_inodes(vfs) is not None and chk.free_inodes < chk.need_inodes:
        chk.warnings.append(f"the checkpoint storage {root} has only {chk.free_inodes} free inodes")
    mount = mount_of(root, dev=dev)
    if mount is not None:
        chk.quota = q = user_quota(mount, job.user, job.uid, timeout, commands.run)
        if q is not None:
            _quota_warnings(chk, q, plan)
        if mount.fstype in CEPH_FS:
            _ceph_warnings(chk, where, mount.mount_point, plan)
    return chk


def _ceph_warnings(chk: SpaceCheck, where: str, mount_point: str, plan: str) -> None:
    """CephFS directory quotas on ``where`` or a parent: ``statvfs`` does not show them."""
    for q in ceph_quotas(where, mount_point):
        fix = f"an admin raises it with `setfattr -n ceph.quota.max_%s -v N {q.directory}`"
        if q.max_bytes and q.max_bytes - q.used_bytes < max(chk.need_bytes, 1):
            need = f"; this job needs up to {format_size(chk.need_bytes)} for {plan}" if chk.need_bytes else ""
            chk.warnings.append(f"the CephFS quota on {q.directory} leaves "
                                f"{format_size(max(0, q.max_bytes - q.used_bytes))} of "
                                f"{format_size(q.max_bytes)}{need}; " + fix % "bytes")  # fmt: skip
        if q.max_files and q.max_files - q.used_files < chk.need_inodes:
            chk.warnings.append(f"the CephFS quota on {q.directory} leaves {max(0, q.max_files - q.used_files)} "
                                f"files of {q.max_files}; " + fix % "files")  # fmt: skip


def _quota_warnings(chk: SpaceCheck, q: QuotaUsage, plan: str) -> None:
    where = f"your {q.tool} on {chk.path}"
    if q.hard and q.hard - q.used < max(chk.need_bytes, 1):
        left = format_size(max(0, q.hard - q.used))
        need = f"; this job needs up to {format_size(chk.need_bytes)} for {plan}" if chk.need_bytes else ""
        chk.warnings.append(f"{where} leaves {left} of {format_size(q.hard)}{need}")
    elif q.soft and q.used > q.soft:
        chk.warnings.append(f"{where} is over its soft limit ({format_size(q.used)} of "
                            f"{format_size(q.soft)}); writes fail once the grace time ends")  # fmt: skip
    if q.files_hard and q.files_hard - q.files < chk.need_inodes:
        chk.warnings.append(f"{where} leaves {max(0, q.files_hard - q.files)} files of {q.files_hard}")

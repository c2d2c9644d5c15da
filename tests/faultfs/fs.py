"""A passthrough FUSE filesystem over a real directory that injects faults.

Every call goes to the real directory underneath, except when a rule of the
:class:`~tests.faultfs.rules.Injector` fires: then the call fails with the
rule's errno, writes fewer bytes than asked (a short write), or stalls first.
The kernel returns those errors to the process exactly as a sick NFS server or
a full disk would.

Like FUSE daemons that pass the kernel's data on through buffers of their own,
this one cannot honour ``O_DIRECT``: such an open succeeds, and every read and
write on it fails with ``EINVAL``. Passing the flag down to the real file made
that depend on the filesystem underneath and on where the allocator put each
Python buffer, and a direct write once got through in a CI run.

Run it with ``python -m tests.faultfs ROOT MOUNTPOINT --control SOCKET``; the
control socket (see :mod:`tests.faultfs.control`) changes the rules at run time
so one mount serves a whole test session.
"""

from __future__ import annotations

import errno
import os
from typing import Any

import mfusepy
from mfusepy import FuseOSError

from .rules import Injector

__all__ = ["FaultOps"]

_STAT_KEYS = ("st_mode", "st_ino", "st_dev", "st_nlink", "st_uid", "st_gid", "st_size",
              "st_atime_ns", "st_mtime_ns", "st_ctime_ns", "st_blocks", "st_blksize")  # fmt: skip


def _stat_dict(st: os.stat_result) -> dict[str, Any]:
    out = {k: getattr(st, k) for k in _STAT_KEYS}
    for k in ("st_atime", "st_mtime", "st_ctime"):
        out[k] = out.pop(k + "_ns")
    return out


class FaultOps(mfusepy.Operations):
    """mfusepy operations: passthrough to ``root`` with faults from ``injector``."""

    use_ns = True

    def __init__(self, root: str, injector: Injector) -> None:
        self.root = os.path.realpath(root)
        self.inj = injector
        self._direct: set[int] = set()  # handles opened with O_DIRECT

    def _real(self, path: str) -> str:
        return self.root + path

    def _gate(self, op: str, path: str | None) -> bool:
        """Apply the rules for one call; True means "make this write short"."""
        act = self.inj.check(op, path or "")
        if act.errno:
            raise FuseOSError(act.errno)
        return act.short

    # -- metadata ---------------------------------------------------------
    def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:
        self._gate("getattr", path)
        st = os.fstat(fh) if fh is not None else os.lstat(self._real(path))
        return _stat_dict(st)

    def access(self, path: str, amode: int) -> int:
        self._gate("access", path)
        if not os.access(self._real(path), amode):
            raise FuseOSError(errno.EACCES)
        return 0

    def chmod(self, path: str, mode: int) -> int:
        self._gate("chmod", path)
        os.chmod(self._real(path), mode)
        return 0

    def chown(self, path: str, uid: int, gid: int) -> int:
        self._gate("chown", path)
        os.lchown(self._real(path), uid, gid)
        return 0

    def utimens(self, path: str, times: tuple[int, int] | None = None) -> int:
        self._gate("utimens", path)
        os.utime(self._real(path), ns=times, follow_symlinks=False)
        return 0

    def statfs(self, path: str) -> dict[str, int]:
        self._gate("statfs", path)
        sv = os.statvfs(self._real(path))
        return {k: getattr(sv, k) for k in ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail",
                                            "f_ffree", "f_files", "f_flag", "f_frsize", "f_namemax")}  # fmt: skip

    # -- names ------------------------------------------------------------
    def readdir(self, path: str, fh: int) -> list[str]:
        self._gate("readdir", path)
        return [".", "..", *os.listdir(self._real(path))]

    def opendir(self, path: str) -> int:
        self._gate("opendir", path)
        return os.open(self._real(path), os.O_RDONLY | os.O_DIRECTORY)

    def releasedir(self, path: str, fh: int) -> int:
        os.close(fh)
        return 0

    def fsyncdir(self, path: str, datasync: int, fh: int) -> int:
        self._gate("fsyncdir", path)
        os.fsync(fh)
        return 0

    def mkdir(self, path: str, mode: int) -> int:
        self._gate("mkdir", path)
        os.mkdir(self._real(path), mode)
        return 0

    def rmdir(self, path: str) -> int:
        self._gate("rmdir", path)
        os.rmdir(self._real(path))
        return 0

    def unlink(self, path: str) -> int:
        self._gate("unlink", path)
        os.unlink(self._real(path))
        return 0

    def rename(self, old: str, new: str) -> int:
        self._gate("rename", old)
        os.rename(self._real(old), self._real(new))
        return 0

    def symlink(self, target: str, source: str) -> int:
        self._gate("symlink", target)
        os.symlink(source, self._real(target))
        return 0

    def readlink(self, path: str) -> str:
        self._gate("readlink", path)
        return os.readlink(self._real(path))

    def link(self, target: str, source: str) -> int:
        self._gate("link", target)
        os.link(self._real(source), self._real(target))
        return 0

    # -- file data --------------------------------------------------------
    def _open(self, path: str, flags: int, mode: int = 0o644) -> int:
        fh = os.open(self._real(path), flags & ~os.O_DIRECT, mode)
        if flags & os.O_DIRECT:
            self._direct.add(fh)
        return fh

    def _refuse_direct(self, fh: int) -> None:
        if fh in self._direct:
            raise FuseOSError(errno.EINVAL)

    def open(self, path: str, flags: int) -> int:
        self._gate("open", path)
        return self._open(path, flags)

    def create(self, path: str, mode: int, flags: int = os.O_WRONLY) -> int:
        self._gate("create", path)
        return self._open(path, flags | os.O_CREAT, mode)

    def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
        self._gate("read", path)
        self._refuse_direct(fh)
        return os.pread(fh, size, offset)

    def write(self, path: str, data: bytes, offset: int, fh: int) -> int:
        short = self._gate("write", path)
        self._refuse_direct(fh)
        if short and len(data) > 1:
            data = data[: len(data) // 2]
        return os.pwrite(fh, data, offset)

    def truncate(self, path: str, length: int, fh: int | None = None) -> int:
        self._gate("truncate", path)
        if fh is not None:
            os.ftruncate(fh, length)
        else:
            os.truncate(self._real(path), length)
        return 0

    def flush(self, path: str, fh: int) -> int:
        self._gate("flush", path)
        return 0

    def fsync(self, path: str, datasync: int, fh: int) -> int:
        self._gate("fsync", path)
        if datasync:
            os.fdatasync(fh)
        else:
            os.fsync(fh)
        return 0

    def release(self, path: str, fh: int) -> int:
        self._direct.discard(fh)
        os.close(fh)
        return 0

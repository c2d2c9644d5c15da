"""The mount table: which filesystem holds a path, its type, options and block device.

Read from ``/proc/self/mountinfo`` so the answer is the one of the mount
namespace the caller runs in (a slurmd in its own namespace sees its own
scratch). The store asks it whether EIO is transient, the hooks which disk to
throttle and which filesystem enforces a project quota, ``doctor`` what the
mount options mean for a checkpoint.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "CEPH_FS",
    "DIRECT_IO_SLOW",
    "GLUSTER_FS",
    "NETWORK_FS",
    "Mount",
    "block_device",
    "cgroup_mount",
    "direct_io_pays",
    "mount_for",
    "mount_named",
    "mount_of",
    "read_mounts",
]

MOUNTINFO = "/proc/self/mountinfo"

NETWORK_FS = frozenset({
    "nfs", "nfs4", "lustre", "ceph", "cifs", "smb3", "smbfs", "gpfs", "beegfs", "glusterfs",
    "9p", "afs", "panfs", "wekafs", "orangefs", "pvfs2", "fuse", "fuseblk",
})  # fmt: skip
"""Filesystem types (and every ``fuse.*`` subtype) where EIO is often transient."""

_ESCAPE = re.compile(r"\\([0-7]{3})")


@dataclass(frozen=True)
class Mount:
    """One line of mountinfo."""

    mount_point: str
    fstype: str
    source: str
    dev: tuple[int, int]
    """major, minor of the filesystem (``st_dev`` of every file on it)."""
    options: dict[str, str] = field(default_factory=dict)
    """Superblock options (``vers=``, ``prjquota``...) overlaid by the per-mount ones (``ro``...)."""

    @property
    def device(self) -> str:
        """``major:minor``, as cgroup files write a device."""
        return f"{self.dev[0]}:{self.dev[1]}"

    @property
    def is_network(self) -> bool:
        return self.fstype in NETWORK_FS or self.fstype.startswith("fuse.")

    @property
    def read_only(self) -> bool:
        return "ro" in self.options


def _unescape(field: str) -> str:
    # mountinfo writes space, tab, newline and backslash as \ooo octal escapes.
    return _ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), field)


def _options(*fields: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for f in fields:
        for item in f.split(","):
            if item:
                k, _, v = item.partition("=")
                out[k] = v
    return out


def read_mounts(mountinfo: str = MOUNTINFO) -> list[Mount]:
    """All mounts of this namespace, in mount order."""
    out = []
    with open(mountinfo, encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            left, sep, right = line.rstrip("\n").partition(" - ")
            fields, tail = left.split(), right.split()
            if not sep or len(fields) < 6 or len(tail) < 2:
                continue
            major, _, minor = fields[2].partition(":")
            opts = _options(tail[2] if len(tail) > 2 else "", fields[5])
            out.append(Mount(_unescape(fields[4]), tail[0], _unescape(tail[1]),
                             (int(major), int(minor)), opts))  # fmt: skip
    return out


def _holding(real: str, mounts: list[Mount], dev: tuple[int, int] | None) -> Mount | None:
    best: Mount | None = None
    for m in mounts:
        inside = real == m.mount_point or real.startswith(m.mount_point.rstrip("/") + "/")
        # Longest mount point wins; among equals the later line, which is mounted on top.
        if inside and (dev is None or m.dev == dev) and (best is None or len(m.mount_point) >= len(best.mount_point)):
            best = m
    return best


def mount_of(
    path: str | os.PathLike[str], mounts: list[Mount] | None = None, dev: int | None = None
) -> Mount | None:
    """The mount holding ``path`` (an existing path an admin configured), matched by device.

    ``dev`` (an ``st_dev`` from ``fstat``) names the filesystem when ``path``
    is only a hint, e.g. a user's dir opened without following links.
    """
    real = os.path.realpath(path)
    dev = os.stat(real).st_dev if dev is None else dev
    return _holding(real, mounts if mounts is not None else read_mounts(), (os.major(dev), os.minor(dev)))


def mount_for(path: str | os.PathLike[str], mountinfo: str = MOUNTINFO) -> Mount | None:
    """The mount holding ``path`` or, if it does not exist yet, its nearest existing parent.

    Matched by path alone: a btrfs subvolume's files report a device of
    their own, which mountinfo does not list. None if mountinfo is unreadable.
    """
    p = os.path.abspath(path)
    while not os.path.exists(p) and p != "/":
        p = os.path.dirname(p)
    try:
        mounts = read_mounts(mountinfo)
    except OSError:
        return None
    return _holding(os.path.realpath(p), mounts, None)


def mount_named(path: str | os.PathLike[str], mountinfo: str = MOUNTINFO) -> Mount | None:
    """The mount holding ``path`` as written, found without touching the path.

    Symlinks are not followed: the answer is for asking about a path whose
    filesystem may be hung, where even ``stat`` would block. None if
    mountinfo is unreadable.
    """
    try:
        mounts = read_mounts(mountinfo)
    except OSError:
        return None
    return _holding(os.path.normpath(os.path.abspath(path)), mounts, None)


CEPH_FS = frozenset({"ceph", "fuse.ceph-fuse", "fuse.ceph"})
"""CephFS, through the kernel client or ceph-fuse."""
GLUSTER_FS = frozenset({"glusterfs", "fuse.glusterfs"})
"""GlusterFS through its FUSE client."""


DIRECT_IO_SLOW = frozenset({"fuse.ceph-fuse", "fuse.ceph"})
"""Filesystems that accept ``O_DIRECT`` but run it far slower than buffered I/O.

ceph-fuse sends each direct request to the OSDs and waits for it: 256 MiB
took 9.7 s with ``dd oflag=direct conv=fsync`` against 1.3 s buffered, and
direct reads ran at 300 MB/s against 500 buffered. GlusterFS's FUSE client
is the other way round (1.6 s direct, 2.9 s buffered), so it is not here.
"""

_direct_pays: dict[int, bool] = {}


def direct_io_pays(directory: str | os.PathLike[str]) -> bool:
    """Whether ``O_DIRECT`` on files in ``directory`` is worth asking for.

    Whether ``open`` accepts the flag says nothing about its speed, so this
    goes by the filesystem type. Cached per filesystem (``st_dev``).
    """
    try:
        dev = os.stat(directory).st_dev
    except OSError:
        return True  # the open that follows reports the real problem
    pays = _direct_pays.get(dev)
    if pays is None:
        m = mount_for(directory)
        pays = _direct_pays[dev] = m is None or m.fstype not in DIRECT_IO_SLOW
    return pays


def cgroup_mount(controller: str, mounts: list[Mount] | None = None) -> Mount | None:
    """The cgroup v1 hierarchy holding ``controller``, or the v2 mount for ``"unified"``."""
    for m in mounts if mounts is not None else read_mounts():
        if controller == "unified" and m.fstype == "cgroup2":
            return m
        if m.fstype == "cgroup" and controller in m.options:
            return m
    return None


def block_device(mount: Mount, sysfs: Path = Path("/sys")) -> tuple[int, int] | None:
    """major, minor of the whole disk behind ``mount``, as blkio/io.max want it.

    Throttles apply to whole disks, so a partition maps to its parent. Returns
    None for filesystems with no block device (tmpfs, NFS, FUSE) and for a
    device the kernel does not list in ``sysfs`` (a limit on it is refused).
    """
    major, minor = mount.dev
    if major == 0:
        # btrfs and some others report an anonymous device; the source names the disk.
        try:
            st = os.stat(mount.source)
        except OSError:
            return None
        if not stat.S_ISBLK(st.st_mode):
            return None
        major, minor = os.major(st.st_rdev), os.minor(st.st_rdev)
    sys_dev = sysfs / f"dev/block/{major}:{minor}"
    if not sys_dev.exists():
        return None
    if (sys_dev / "partition").exists():
        try:
            parent = (sys_dev.resolve().parent / "dev").read_text()
        except OSError:
            return major, minor
        major_s, _, minor_s = parent.strip().partition(":")
        return int(major_s), int(minor_s)
    return major, minor

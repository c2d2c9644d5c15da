"""The mount table: which filesystem holds a path, its type, options and block device.

Read from ``/proc/self/mountinfo`` so the answer is the one of the mount
namespace the hook runs in (a slurmd in its own namespace sees its own scratch).
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Mount", "block_device", "cgroup_mount", "mount_of", "read_mounts"]

_ESCAPE = re.compile(r"\\([0-7]{3})")


@dataclass(frozen=True)
class Mount:
    """One line of mountinfo."""

    mount_point: str
    fstype: str
    source: str
    dev: tuple[int, int]
    options: frozenset[str]
    """Per-mount and superblock options together (``prjquota``, ``blkio``...)."""


def _unescape(field: str) -> str:
    # mountinfo writes space, tab, newline and backslash as \ooo octal escapes.
    return _ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), field)


def read_mounts(mountinfo: str = "/proc/self/mountinfo") -> list[Mount]:
    """All mounts of this namespace, in mount order."""
    out = []
    with open(mountinfo, encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            left, _, right = line.rstrip("\n").partition(" - ")
            fields, tail = left.split(" "), right.split(" ")
            if len(fields) < 6 or len(tail) < 3:
                continue
            major, _, minor = fields[2].partition(":")
            opts = set(fields[5].split(",")) | set(tail[2].split(","))
            out.append(Mount(_unescape(fields[4]), tail[0], _unescape(tail[1]),
                             (int(major), int(minor)), frozenset(opts)))  # fmt: skip
    return out


def mount_of(
    path: str | os.PathLike[str], mounts: list[Mount] | None = None, dev: int | None = None
) -> Mount | None:
    """The mount holding ``path`` (an existing path an admin configured).

    ``dev`` (an ``st_dev`` from ``fstat``) names the filesystem when ``path``
    is only a hint, e.g. a user's dir opened without following links.
    """
    real = os.path.realpath(path)
    dev = os.stat(real).st_dev if dev is None else dev
    want = (os.major(dev), os.minor(dev))
    best: Mount | None = None
    for m in mounts if mounts is not None else read_mounts():
        inside = real == m.mount_point or real.startswith(m.mount_point.rstrip("/") + "/")
        # Later mounts on the same point hide earlier ones, hence ">=".
        if inside and m.dev == want and (best is None or len(m.mount_point) >= len(best.mount_point)):
            best = m
    return best


def cgroup_mount(controller: str, mounts: list[Mount] | None = None) -> Mount | None:
    """The cgroup v1 hierarchy holding ``controller``, or the v2 mount for ``"unified"``."""
    for m in mounts if mounts is not None else read_mounts():
        if controller == "unified" and m.fstype == "cgroup2":
            return m
        if m.fstype == "cgroup" and controller in m.options:
            return m
    return None


def block_device(mount: Mount) -> tuple[int, int] | None:
    """major:minor of the whole disk behind ``mount``, as blkio/io.max want it.

    Throttles apply to whole disks, so a partition maps to its parent. Returns
    None for filesystems with no block device (tmpfs, NFS, FUSE).
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
    sys_dev = Path(f"/sys/dev/block/{major}:{minor}")
    if not sys_dev.exists():
        return None
    if (sys_dev / "partition").exists():
        parent = sys_dev.resolve().parent / "dev"
        major_s, _, minor_s = parent.read_text().strip().partition(":")
        return int(major_s), int(minor_s)
    return major, minor

"""Per-job scratch filesystems on loop devices.

A filesystem image the size of the reservation, preallocated on the scratch
disk and loop-mounted at ``<base>/job_<id>``: the kernel enforces the size with
ENOSPC, and the space is really set aside. It needs no quota support in the
kernel, which is why it exists next to project quotas (``scratch.enforce: loop``).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from pathlib import Path

from ..errors import StorageError, storage_error
from . import commands
from .scratch import STATE_DIR

__all__ = ["IMAGE_DIR", "is_mount_point", "mount_image", "unmount_image"]

log = logging.getLogger("slurm_ckpt.node")

IMAGE_DIR = "img"
"""Under the state dir: one ``job_<id>.img`` per job."""

_MKFS = {
    # -i 65536: checkpoints are few large files; fewer inodes leave more of the size usable.
    "ext4": ["mkfs.ext4", "-q", "-F", "-m", "0", "-i", "65536",
             "-E", "lazy_itable_init=1,lazy_journal_init=1,nodiscard"],
    "xfs": ["mkfs.xfs", "-q", "-f", "-K"],
}


def is_mount_point(base_fd: int, name: str) -> bool:
    """True if ``<base>/<name>`` is a directory on another filesystem than the base."""
    try:
        st = os.stat(name, dir_fd=base_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return st.st_dev != os.fstat(base_fd).st_dev


def mount_image(base: Path, name: str, target_fd: int, size: int, fstype: str, timeout: float) -> None:
    """Make a ``size``-byte ``fstype`` image and mount it on the directory ``target_fd``.

    ``target_fd`` is ``<base>/<name>`` opened with ``O_NOFOLLOW``; the mount
    goes onto ``/proc/self/fd/N`` uncanonicalized, so it lands on that very
    directory even if the name were swapped for a link meanwhile. The image
    lives in the root-only ``<base>/.slurm-ckpt/img``; the mount is
    nosuid,nodev so nothing the job writes there gains privileges.
    """
    if fstype not in _MKFS:
        raise StorageError(errno.EINVAL, f"scratch.loop_fstype {fstype!r} not one of {sorted(_MKFS)}")
    img_dir = base / STATE_DIR / IMAGE_DIR
    img = img_dir / f"{name}.img"
    mount = ["mount", "--no-canonicalize", "-t", fstype, "-o", "loop,nosuid,nodev,noatime", str(img),
             f"/proc/self/fd/{target_fd}"]  # fmt: skip
    try:
        img_dir.mkdir(mode=0o700, exist_ok=True)
        fd = os.open(img, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        # Kept by an epilog that could not stage out, then unmounted (a reboot):
        # it may hold the only copy of a checkpoint, so mount it as it is.
        rc, out = commands.run(mount, timeout, (target_fd,))
        if rc == 0:
            log.info("re-mounted kept scratch image %s", img)
            return
        aside = img.with_name(f"{img.name}.unmountable")
        log.error("kept image %s does not mount (%s); moved to %s", img, out.strip(), aside)
        os.replace(img, aside)
        return mount_image(base, name, target_fd, size, fstype, timeout)
    except OSError as e:
        raise storage_error(e, "cannot create scratch image", img) from e
    try:
        try:
            # Preallocate: the reservation is then real blocks, not a promise
            # that a filling disk could break later.
            os.posix_fallocate(fd, 0, size)
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise storage_error(e, "cannot preallocate scratch image", img) from e
            os.ftruncate(fd, size)
    except BaseException:
        img.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)
    for argv in ([*_MKFS[fstype], str(img)], mount):
        rc, out = commands.run(argv, timeout, (target_fd,))
        if rc:
            img.unlink(missing_ok=True)
            # Not EIO: a missing mkfs or no free loop device costs this job its
            # scratch, but is no reason to drain the node.
            raise StorageError(errno.EOPNOTSUPP, f"{argv[0]} failed ({rc}): {out.strip()[-300:]}", img)


def unmount_image(base: Path, name: str, timeout: float) -> None:
    """Detach the filesystem on ``<base>/<name>`` and delete its image. Idempotent.

    The mount point is opened with ``O_NOFOLLOW`` and detached through
    ``/proc/self/fd/N``, so a link planted at the name cannot point the
    unmount elsewhere. Detaching is lazy (``MNT_DETACH``): the stage-out is
    over, and a straggler holding a file must not keep the node's disk busy.
    """
    base_fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=base_fd)
    except OSError:
        fd = -1  # absent, or not a plain directory: nothing of ours is mounted there
    try:
        if fd >= 0 and os.fstat(fd).st_dev != os.fstat(base_fd).st_dev:
            rc, out = commands.run(["umount", "--no-canonicalize", "-l", f"/proc/self/fd/{fd}"],
                                   timeout, (fd,))  # fmt: skip
            if rc:
                raise StorageError(errno.EBUSY, f"cannot unmount scratch: {out.strip()}", base / name)
    finally:
        if fd >= 0:
            os.close(fd)
        os.close(base_fd)
    with contextlib.suppress(FileNotFoundError):
        (base / STATE_DIR / IMAGE_DIR / f"{name}.img").unlink()

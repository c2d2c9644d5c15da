"""Per-job scratch filesystems on loop devices.

A filesystem image the size of the reservation, preallocated on the scratch
disk and loop-mounted at ``<base>/job_<id>``: the kernel enforces the size with
ENOSPC, and the space is really set aside. It needs no quota support in the
kernel, which is why it exists next to project quotas (``scratch.enforce: loop``).

Nothing here goes by a path a user could reach. The image is created with
``O_EXCL | O_NOFOLLOW`` in the root-only image dir, opened through its fd; the
loop device is bound to that fd (``LOOP_CONFIGURE``), ``mkfs`` runs on the
device, and the device is mounted onto the job dir's fd. The device clears
itself (autoclear) once the filesystem is really unmounted.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import stat
import struct
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from ..errors import StorageError, storage_error
from . import commands, mounts
from .rootdir import open_private_subdir

if TYPE_CHECKING:
    from .deadline import Deadline

__all__ = [
    "IMAGE_DIR",
    "attached",
    "is_mount_point",
    "leaked",
    "mkfs_argv",
    "mount_image",
    "open_image_dir",
    "unmount_image",
]

log = logging.getLogger("slurm_ckpt.node")

IMAGE_DIR = "img"
"""Under the state dir: one ``job_<id>.img`` per job."""

_MKFS = {
    "ext4": ["mkfs.ext4", "-q", "-F", "-m", "0", "-E", "lazy_itable_init=1,lazy_journal_init=1,nodiscard"],
    "xfs": ["mkfs.xfs", "-q", "-f", "-K"],
}
_BYTES_PER_INODE = 65536
"""Checkpoints are few large files: fewer inodes leave more of the size usable."""
_XFS_INODE = 512
_FALLOCATE_CHUNK = 1024**3
# The shares of the loop setup's time: preallocation, mkfs, then mount gets the rest.
_SHARE_FALLOCATE, _SHARE_MKFS = 0.4, 0.6

# <linux/loop.h>
_LOOP_CTL_GET_FREE = 0x4C82
_LOOP_CONFIGURE = 0x4C0A
_LOOP_GET_STATUS64 = 0x4C05
_LO_FLAGS_AUTOCLEAR = 4
# struct loop_info64: device, inode, rdevice, offset, sizelimit, number,
# encrypt_type, encrypt_key_size, flags, file_name[64], crypt_name[64], encrypt_key[32], init[2]
_INFO = struct.Struct("=QQQQQIIII64s64s32s2Q")
# struct loop_config: fd, block_size, info, reserved[8]
_CONFIG = struct.Struct("=II" + _INFO.format[1:] + "8Q")
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_RELEASE_WAIT = 2.0
"""Seconds a lazily detached image may take to be let go before it counts as still held."""


def is_mount_point(base_fd: int, name: str) -> bool:
    """True if ``<base>/<name>`` is on another mount than the base.

    By mount id through an ``O_PATH`` fd: a stat would ask the filesystem
    mounted there, which may be a user's FUSE mount that never answers.
    """
    try:
        fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=base_fd)
    except FileNotFoundError:
        return False
    try:
        mine, base = mounts.mount_id(fd), mounts.mount_id(base_fd)
        if mine is None or base is None:
            return os.fstat(fd).st_dev != os.fstat(base_fd).st_dev
        return mine != base
    finally:
        os.close(fd)


def open_image_dir(state_fd: int) -> int:
    """The root-only image dir under the state dir (mode 0700), by fd."""
    return open_private_subdir(state_fd, IMAGE_DIR, "the scratch image dir")


def mkfs_argv(fstype: str, device: str, size: int, max_inodes: int) -> list[str]:
    """The mkfs command for a ``size``-byte image with at most ``max_inodes`` files (0: no cap)."""
    if fstype == "ext4":
        inodes = max(16, size // _BYTES_PER_INODE)
        if max_inodes:
            inodes = min(inodes, max_inodes)
        return [*_MKFS["ext4"], "-N", str(inodes), device]
    argv = list(_MKFS["xfs"])
    if max_inodes:
        # XFS allocates inodes as it goes: cap the space they may take instead.
        pct = max(1, min(100, -(-max_inodes * _XFS_INODE * 100 // size)))
        argv += ["-i", f"maxpct={pct}"]
    return [*argv, device]


def mount_image(state_fd: int, name: str, target_fd: int, size: int, fstype: str, max_inodes: int,
                deadline: Deadline) -> None:  # fmt: skip
    """Make a ``size``-byte ``fstype`` image and mount it on the directory ``target_fd``.

    ``target_fd`` is ``<base>/<name>`` opened with ``O_NOFOLLOW``; the mount
    goes onto ``/proc/self/fd/N`` uncanonicalized, so it lands on that very
    directory even if the name were swapped for a link meanwhile. The mount is
    nosuid,nodev so nothing the job writes there gains privileges. Each step
    (preallocation, mkfs, mount) gets its share of ``deadline``, not all of it.
    """
    if fstype not in _MKFS:
        raise StorageError(errno.EINVAL, f"scratch.loop_fstype {fstype!r} not one of {sorted(_MKFS)}")
    img = f"{name}.img"
    img_dir = open_image_dir(state_fd)
    try:
        try:
            fd = os.open(img, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                         dir_fd=img_dir)  # fmt: skip
        except FileExistsError:
            # Kept by an epilog that could not stage out, then unmounted (a reboot):
            # it may hold the only copy of a checkpoint, so mount it as it is.
            if _mount_kept(img_dir, img, target_fd, fstype, deadline):
                return
            aside = f"{img}.unmountable-{int(time.time())}"
            log.error("kept image %s does not mount; moved to %s", img, aside)
            os.rename(img, aside, src_dir_fd=img_dir, dst_dir_fd=img_dir)
            fd = os.open(img, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                         dir_fd=img_dir)  # fmt: skip
        except OSError as e:
            raise storage_error(e, "cannot create scratch image", img) from e
        try:
            _preallocate(fd, img, size, deadline.part(_SHARE_FALLOCATE))
            with _loop_device(fd) as device:
                step = deadline.part(_SHARE_MKFS)
                _run(mkfs_argv(fstype, device, size, max_inodes), step.left(), ())
                _run(_mount_argv(fstype, device, target_fd), deadline.left(), (target_fd,))
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(img, dir_fd=img_dir)
            raise
        finally:
            os.close(fd)
    finally:
        os.close(img_dir)


def _mount_kept(img_dir: int, img: str, target_fd: int, fstype: str, deadline: Deadline) -> bool:
    fd = os.open(img, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=img_dir)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        with _loop_device(fd) as device:
            rc, out = commands.run(_mount_argv(fstype, device, target_fd), deadline.left(), (target_fd,))
        if rc == 0:
            log.info("re-mounted kept scratch image %s", img)
            return True
        log.error("kept image %s: mount failed: %s", img, out.strip()[-300:])
        return False
    finally:
        os.close(fd)


def _mount_argv(fstype: str, device: str, target_fd: int) -> list[str]:
    return ["mount", "--no-canonicalize", "-t", fstype, "-o", "nosuid,nodev,noatime", device,
            f"/proc/self/fd/{target_fd}"]  # fmt: skip


def _run(argv: list[str], timeout: float, pass_fds: tuple[int, ...]) -> None:
    rc, out = commands.run(argv, timeout, pass_fds)
    if rc:
        # Not EIO: a missing mkfs or a slow disk costs this job its scratch,
        # but is no reason to drain the node.
        raise StorageError(errno.EOPNOTSUPP, f"{argv[0]} failed ({rc}): {out.strip()[-300:]}", argv[-1])


def _preallocate(fd: int, img: str, size: int, deadline: Deadline) -> None:
    """Preallocate in pieces, so a slow disk stops at this step's share of the deadline.

    The reservation is then real blocks, not a promise that a filling disk
    could break later.
    """
    done = 0
    try:
        while done < size:
            if deadline.left() <= 0:
                raise StorageError(errno.ETIMEDOUT, f"preallocating {size} bytes took longer than "
                                   "its share of scratch.prolog_timeout", img)  # fmt: skip
            n = min(_FALLOCATE_CHUNK, size - done)
            os.posix_fallocate(fd, done, n)
            done += n
    except OSError as e:
        if isinstance(e, StorageError):
            raise
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise storage_error(e, "cannot preallocate scratch image", img) from e
        os.ftruncate(fd, size)


@contextlib.contextmanager
def _loop_device(image_fd: int) -> Iterator[str]:
    """A free loop device bound to ``image_fd``, held open for the block; autoclear
    frees it once nothing holds it (after the mount is gone, or at once if it never came)."""
    ctl = os.open("/dev/loop-control", os.O_RDWR | os.O_CLOEXEC)
    try:
        for _ in range(16):
            n = fcntl.ioctl(ctl, _LOOP_CTL_GET_FREE)
            try:
                dev = os.open(f"/dev/loop{n}", os.O_RDWR | os.O_CLOEXEC)
            except FileNotFoundError:
                continue  # udev has not made the node yet
            info = _INFO.pack(0, 0, 0, 0, 0, 0, 0, 0, _LO_FLAGS_AUTOCLEAR, b"", b"", b"", 0, 0)
            try:
                fcntl.ioctl(dev, _LOOP_CONFIGURE, _CONFIG.pack(image_fd, 0, *_INFO.unpack(info), *([0] * 8)))
            except OSError as e:
                os.close(dev)
                if e.errno == errno.EBUSY:
                    continue  # another hook took it between GET_FREE and CONFIGURE
                raise storage_error(e, "cannot set up a loop device", f"/dev/loop{n}") from e
            break
        else:
            raise StorageError(errno.EBUSY, "no free loop device", "/dev/loop-control")
    finally:
        os.close(ctl)
    try:
        yield f"/dev/loop{n}"
    finally:
        os.close(dev)


def attached(fd: int) -> bool:
    """Whether any loop device still holds the file ``fd`` (a lazily detached image)."""
    st = os.fstat(fd)
    return any((dev, ino) == (st.st_dev, st.st_ino) for _, dev, ino, _ in _bound())


def _bound() -> Iterator[tuple[str, int, int, int]]:
    """``(name, backing st_dev, backing inode, bytes)`` of every bound loop device."""
    try:
        names = [n for n in os.listdir("/sys/block") if n.startswith("loop")]
    except OSError:
        return
    for n in names:
        if not os.path.exists(f"/sys/block/{n}/loop"):
            continue  # not bound
        try:
            dev = os.open(f"/dev/{n}", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            info = _INFO.unpack(fcntl.ioctl(dev, _LOOP_GET_STATUS64, bytes(_INFO.size)))
            with open(f"/sys/block/{n}/size", "rb") as f:
                size = int(f.read()) * 512
        except (OSError, ValueError):
            continue
        finally:
            os.close(dev)
        yield n, info[0], info[1], size


def leaked(state_fd: int, known: Callable[[], set[int]]) -> dict[str, int]:
    """Loop devices backed by a file under the hooks' state dir whose inode is not in
    ``known()`` (the images the ledger holds): ``{"<device>:<inode>": bytes}``.

    An image unlinked while a device still held it (a user's own mount
    namespace kept its filesystem mounted) has no name and no ledger entry,
    but its blocks are taken until the device lets go. ``known`` is called
    after the devices are listed: an image is named before its device is
    bound, so one a prolog is making meanwhile is never taken for a leak. Devices on other
    files (a container image a job mounts, anything of the site's) are not scratch.
    """
    state_dev = os.fstat(state_fd).st_dev
    under = os.readlink(f"/proc/self/fd/{state_fd}").rstrip("/") + "/"
    ours = [(n, ino, size) for n, dev, ino, size in _bound() if dev == state_dev and _backing(n).startswith(under)]
    if not ours:
        return {}
    names = known()
    return {f"{n}:{ino}": size for n, ino, size in ours if ino not in names}


def _backing(name: str) -> str:
    """The path the kernel recorded for loop device ``name``'s file ("" if unbound)."""
    try:
        with open(f"/sys/block/{name}/loop/backing_file", "rb") as f:
            return os.fsdecode(f.read().rstrip(b"\n"))
    except OSError:
        return ""


def _mounted_elsewhere(fd: int) -> bool:
    """Whether a filesystem on a loop device of the image ``fd`` is still mounted anywhere.

    The filesystem's entry in /sys/fs lives as long as it is mounted, in
    whatever mount namespace. Read from sysfs, never by opening the device:
    the last close of a device whose mount is gone would make this wait for
    its autoclear.
    """
    path = os.readlink(f"/proc/self/fd/{fd}")
    try:
        names = [n for n in os.listdir("/sys/block") if n.startswith("loop")]
    except OSError:
        return False
    for n in names:
        if _backing(n) == path and any(os.path.exists(f"/sys/fs/{t}/{n}") for t in _MKFS):
            return True
    return False


def _held(fd: int, wait: float) -> bool:
    """Whether a loop device still holds the image ``fd`` after ``wait`` seconds."""
    end = time.monotonic() + wait
    pause = 0.002
    while attached(fd):
        if time.monotonic() >= end:
            return True
        time.sleep(pause)  # autoclear runs in the kernel's own time; nothing to wait on but polling
        pause = min(pause * 2, 0.05)
    return False


def unmount_image(base_fd: int, state_fd: int, name: str, timeout: float, delete: bool = True) -> int | None:
    """Unmount ``<base>/<name>`` and delete its image, once the filesystem is really gone.

    Returns None when the image's blocks are free (or there was none), or an
    fd of the image while some process still holds a file in it: the mount is
    then detached lazily, so the job dir can go, but the blocks stay alive
    until that process lets go, and the caller keeps the image (and its
    reservation) in the graveyard until :func:`attached` says no more.
    ``delete=False`` unmounts and leaves the image where it is.
    """
    # A user's own mounts on or in the job dir go first: a umount by path would take the
    # top one only, and the loop filesystem under it would stay.
    mounts.detach_foreign(base_fd, name, timeout)
    mounted, lazy = is_mount_point(base_fd, name), False
    if mounted:
        # By name under the root-owned base, which no user can change; not by an
        # fd, which would itself hold the mount busy.
        path = f"/proc/self/fd/{base_fd}/{name}"
        rc, out = commands.run(["umount", "--no-canonicalize", path], timeout, (base_fd,))
        if rc and is_mount_point(base_fd, name):
            log.warning("scratch %s is busy (%s): detached; its image stays reserved until "
                        "the last process holding it lets go", name, out.strip()[-200:])  # fmt: skip
            rc, out = commands.run(["umount", "--no-canonicalize", "-l", path], timeout, (base_fd,))
            if rc:
                raise StorageError(errno.EBUSY, f"cannot unmount scratch: {out.strip()}", name)
            lazy = True
    img_dir = open_image_dir(state_fd)
    try:
        try:
            fd = os.open(f"{name}.img", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK,
                         dir_fd=img_dir)  # fmt: skip
        except FileNotFoundError:
            return None
        # Unmounted just now: the loop device lets go of the image as it
        # clears itself, a moment later, unless the filesystem is still
        # mounted elsewhere: in a mount namespace of the user's (unshare -Urm
        # with its cwd inside), where our umount does not reach, or, after a
        # lazy detach, while anyone holds a file in it. Its blocks are taken
        # until then, whatever the image's name says.
        if (lazy and _held(fd, min(timeout, _RELEASE_WAIT))) or (not lazy and _mounted_elsewhere(fd)):
            log.warning("the loop device of %s still holds its image (mounted in another mount namespace, "
                        "or a file in it held open): it stays reserved until the device lets go", name)  # fmt: skip
            return fd
        os.close(fd)
        if delete:
            os.unlink(f"{name}.img", dir_fd=img_dir)
        return None
    finally:
        os.close(img_dir)

"""Real mounts for tests: the fault-injecting FUSE fs, tiny tmpfs, loop filesystems.

Each is a context manager that unmounts on exit, even when the body failed,
and falls back to a lazy unmount when something still holds the mount busy.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .control import FaultFS

__all__ = ["fill_up", "is_mounted", "loopfs", "mount_faultfs", "tmpfs"]

REPO = Path(__file__).resolve().parents[2]


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo.
    return field.encode().decode("unicode_escape")


def is_mounted(path: str | os.PathLike[str], fstype: str | None = None) -> bool:
    want = os.path.realpath(path)
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            if _unescape(left.split()[4]) == want and (fstype is None or right.split()[0] == fstype):
                return True
    return False


def _run(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=60)


def _umount(path: Path) -> None:
    for cmd in (["umount", str(path)], ["umount", "-l", str(path)]):
        if not is_mounted(path):
            return
        subprocess.run(cmd, capture_output=True, timeout=60)


@contextlib.contextmanager
def mount_faultfs(root: Path, mnt: Path, sock: Path, *, timeout: float = 30.0, uid: int | None = None,
                  gid: int | None = None, options: tuple[str, ...] = ()) -> Iterator[FaultFS]:  # fmt: skip
    """Mount the fault fs of ``root`` on ``mnt``; yields a :class:`FaultFS` handle.

    With ``uid``, the daemon runs as that user and mounts through the setuid
    ``fusermount3``, as an ordinary user's would; ``root`` and the dir of
    ``sock`` must then be the user's. ``options`` are FUSE mount options:
    ``allow_other`` lets other users (root too) in, which an ordinary user
    may set only with ``user_allow_other`` in /etc/fuse.conf; ``nonempty``
    mounts over a dir with files in it; ``attr_timeout=0`` sends every stat to the daemon.
    """
    root.mkdir(parents=True, exist_ok=True)
    mnt.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    log = open(sock.with_suffix(".log"), "w+b")  # noqa: SIM115 - closed in finally
    user: dict[str, Any] = {"user": uid, "group": gid, "extra_groups": []} if uid is not None else {}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.faultfs", str(root), str(mnt), "--control", str(sock),
         *(f"--option={o}" for o in options)],
        cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, **user,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + timeout
        while not (is_mounted(mnt, "fuse.faultfs") and sock.exists()):
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"faultfs exited with {proc.returncode}: {log.read().decode()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"faultfs did not mount {mnt} within {timeout}s")
            time.sleep(0.02)
        fs = FaultFS(root=root, mnt=mnt, sock=sock, pid=proc.pid)
        fs.clear()
        yield fs
    finally:
        if is_mounted(mnt):
            # fusermount3 ends the fs process's loop; a lazy unmount copes with busy files.
            subprocess.run(["fusermount3", "-u", str(mnt)], capture_output=True, timeout=60)
            _umount(mnt)
        # Its loop ends only with the last copy of the mount, and a mount namespace made
        # since (a node of the Slurm test cluster) keeps one: end it.
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)
        log.close()


@contextlib.contextmanager
def tmpfs(path: Path, size: str | int, *, options: str = "") -> Iterator[Path]:
    """A real tmpfs of ``size`` (``"1M"``, or bytes) at ``path``: a disk that really fills."""
    path.mkdir(parents=True, exist_ok=True)
    opts = f"size={size}" + (f",{options}" if options else "")
    _run("mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path))
    try:
        yield path
    finally:
        _umount(path)


@contextlib.contextmanager
def loopfs(path: Path, size_mib: int, *, fstype: str = "ext4", options: str = "") -> Iterator[Path]:
    """A real ``fstype`` filesystem on a loop device, mounted at ``path``.

    The image file sits next to the mount point; ``-o loop`` lets umount free
    the loop device (autoclear), so nothing outlives the block.
    """
    path.mkdir(parents=True, exist_ok=True)
    image = path.with_name(path.name + ".img")
    with open(image, "wb") as f:
        f.truncate(size_mib * 1024 * 1024)
    try:
        mkfs = ["mkfs.xfs", "-q", "-f"] if fstype == "xfs" else ["mkfs." + fstype, "-q", "-F"]
        _run(*mkfs, str(image))
        _run("mount", "-o", "loop" + (f",{options}" if options else ""), str(image), str(path))
        try:
            yield path
        finally:
            _umount(path)
    finally:
        image.unlink(missing_ok=True)


def fill_up(directory: Path, name: str = "filler") -> int:
    """Write zeros into ``directory`` until the filesystem says ENOSPC; returns bytes written."""
    import errno

    total = 0
    chunk = b"\0" * (64 * 1024)
    fd = os.open(directory / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        while True:
            try:
                total += os.write(fd, chunk)
            except OSError as e:
                if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                if len(chunk) == 1:
                    break
                chunk = chunk[: len(chunk) // 2]
    finally:
        os.close(fd)
    return total

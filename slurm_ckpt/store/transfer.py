"""Copy a committed checkpoint to another run dir with the same commit protocol.

Used by the tier drain (scratch -> durable), the epilog's stage-out and the
staging of shards. Every byte is checksummed as it is copied and compared
with the source manifest, so a bad source or a bad copy is never committed.
"""

from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path
from typing import Any

from ..errors import CheckpointCorrupt, NoSpace, storage_error
from .bounded import progress
from .commit import commit
from .crc import crc32
from .fsutil import fsync_file, open_regular
from .manifest import Manifest
from .tensorfile import CHUNK, FileRecord
from .verify import crc_file, verify_checkpoint

__all__ = ["ByteBudget", "copy_checkpoint", "copy_file", "copy_files"]

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class ByteBudget:
    """The bytes a copy may still write: the epilog's stage-out gets the job's reservation.

    A checkpoint's files may be sparse, or hard links to one file, so what
    they would become when written out is no measure of what the job stored.
    """

    def __init__(self, limit: int) -> None:
        self.left = limit

    def take(self, size: int, path: Path) -> None:
        if size > self.left:
            raise NoSpace(errno.EFBIG, f"copying {size} more bytes would pass the {self.left} bytes left of "
                          "the job's reservation (sparse files or hard links?); not copied", path)  # fmt: skip
        self.left -= size


def copy_file(src: Path, dst_dir: int, name: str, expected: FileRecord, *, shown: Path,
              budget: ByteBudget | None = None) -> FileRecord:  # fmt: skip
    """Copy one checkpoint file into the new file ``name`` of dir ``dst_dir`` (an fd) and fsync it.

    The source is opened once and checked on that fd: a regular file of the
    size the manifest names. Then at most that many bytes are read: a file
    renamed over it after any earlier screen (a 1 TiB sparse one) is refused
    before a byte is written, and one that grows is not read past its size.
    :class:`CheckpointCorrupt` unless what was read matches ``expected``
    (size and crc32). ``shown`` is ``name``'s path, for messages.
    """
    crc = 0
    size = 0
    # The epilog runs this as the job's user on a user-writable tree: a link,
    # FIFO or device planted there must not redirect or hang the read.
    try:
        sfd = open_regular(src)
    except OSError as e:
        raise storage_error(e, "cannot open checkpoint file", src) from e
    try:
        have = os.fstat(sfd).st_size
        if have != expected.size:
            raise CheckpointCorrupt(f"{src}: size is {have}, manifest expects {expected.size}", src)
        if budget is not None:
            budget.take(expected.size, src)
        buf = bytearray(min(CHUNK, max(1, expected.size)))
        view = memoryview(buf)
        dfd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644,
                      dir_fd=dst_dir)  # fmt: skip
        try:
            while size < expected.size and (n := os.readv(sfd, [view[: expected.size - size]])):
                crc = crc32(view[:n], crc)
                out = view[:n]
                while out:
                    out = out[os.write(dfd, out) :]
                size += n
                progress()
            fsync_file(dfd, shown)
        finally:
            os.close(dfd)
    except OSError as e:
        raise storage_error(e, "cannot copy checkpoint file", shown) from e
    finally:
        os.close(sfd)
    got = FileRecord(size, f"{crc:08x}")
    if got != expected:
        raise CheckpointCorrupt(
            f"{src}: copy read {got.size} bytes crc32 {got.checksum}, manifest expects "
            f"{expected.size} bytes crc32 {expected.checksum}",
            src,
        )
    return got


class _Dirs:
    """The dirs of a copy's destination, opened one name at a time from the top, never through a link.

    The top may be in a tree that others can rename in (the user's durable run
    dir, from another node): a subdir made here and swapped for a link is
    refused, and one on another filesystem than the top too.
    """

    def __init__(self, top: Path) -> None:
        self.top = top
        self.fds: dict[str, int] = {"": os.open(top, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)}
        self.dev = os.fstat(self.fds[""]).st_dev

    def of(self, rel: str) -> int:
        if rel in self.fds:
            return self.fds[rel]
        head, _, name = rel.rpartition("/")
        parent = self.of(head)
        where = self.top / rel
        try:
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, 0o755, dir_fd=parent)
            fd = os.open(name, _DIR, dir_fd=parent)
        except OSError as e:
            raise storage_error(e, "cannot create checkpoint subdir", where) from e
        self.fds[rel] = fd
        if os.fstat(fd).st_dev != self.dev:
            raise storage_error(OSError(errno.EXDEV, os.strerror(errno.EXDEV)), "checkpoint subdir on another "
                                "filesystem (a mount put in its place?)", where)  # fmt: skip
        return fd

    def fsync_subdirs(self) -> None:
        # Shard subdirs (rank-NNNNN/) hold file entries of their own: fsync them
        # too, deepest first, or the files in them can vanish after a crash even
        # though the manifest that lists them survived.
        for rel in sorted(self.fds, key=lambda r: r.count("/"), reverse=True):
            if rel:
                fsync_file(self.fds[rel], self.top / rel)

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)


def copy_files(
    src: Path, dst: Path, files: dict[str, FileRecord], *, read_back: bool = False,
    budget: ByteBudget | None = None,
) -> dict[str, FileRecord]:  # fmt: skip
    """Copy the files a manifest lists from checkpoint dir ``src`` into the new dir ``dst``.

    Each file is checked against its record and fsynced (:func:`copy_file`);
    with ``budget``, their sizes are taken from it first. ``read_back`` reads
    every copy again in full: the checksum taken while copying was computed on
    what was read, not on what landed. ``dst`` itself is not fsynced;
    :func:`~slurm_ckpt.store.commit.commit` does that.
    """
    out = {}
    dirs = _Dirs(dst)
    try:
        for name, rec in files.items():
            head, _, base = name.rpartition("/")
            if not base or base in (".", "..") or ".." in head.split("/"):
                raise CheckpointCorrupt(f"{src / name}: not a file name a checkpoint holds", src / name)
            out[name] = copy_file(src / name, dirs.of(head), base, rec, shown=dst / name, budget=budget)
        if read_back:
            for name, rec in files.items():
                got = FileRecord(os.lstat(dst / name).st_size, crc_file(dst / name))
                if got != rec:
                    raise CheckpointCorrupt(f"{dst / name}: copy has {got.size} bytes crc32 {got.checksum}, "
                                            f"expected {rec.size} bytes crc32 {rec.checksum}", dst / name)  # fmt: skip
        dirs.fsync_subdirs()
    finally:
        dirs.close()
    return out


def copy_checkpoint(src: Path, dst_run_dir: Path, *, on_dev: int | None = None,
                    budget: ByteBudget | None = None) -> Path:  # fmt: skip
    """Copy checkpoint dir ``src`` into ``dst_run_dir`` as the same step; return the new path.

    ``on_dev`` and ``budget``: for a copy into a tree others can rename in, with
    a bound on what it writes (the epilog's stage-out; see :func:`commit`).
    """
    man: Manifest = verify_checkpoint(src, full=False)

    def write(tmp: Path) -> tuple[dict[str, FileRecord], dict[str, Any]]:
        return copy_files(src, tmp, man.files, budget=budget), man.tensors

    extra = dict(man.extra, copied_from=str(src))
    return commit(dst_run_dir, man.step, write, time=man.time, host=man.host, job_id=man.job_id,
                  world_size=man.world_size, nbytes=man.nbytes, extra=extra, on_dev=on_dev)  # fmt: skip

"""Copy a committed checkpoint to another run dir with the same commit protocol.

Used by the tier drain (scratch -> durable) and by the epilog's stage-out.
Every byte is checksummed as it is copied and compared with the source
manifest, so a bad source or a bad copy is never committed.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..errors import CheckpointCorrupt, storage_error
from .commit import commit
from .crc import crc32
from .fsutil import fsync_dir, fsync_file, open_regular
from .manifest import Manifest
from .tensorfile import CHUNK, FileRecord
from .verify import verify_checkpoint

__all__ = ["copy_checkpoint"]


def _copy_file(src: Path, dst: Path, expected: FileRecord) -> FileRecord:
    crc = 0
    size = 0
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    # The epilog runs this as the job's user on a user-writable tree: a link,
    # FIFO or device planted there must not redirect or hang the read.
    try:
        sfd = open_regular(src)
    except OSError as e:
        raise storage_error(e, "cannot open checkpoint file", src) from e
    try:
        dfd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            while n := os.readv(sfd, [view]):
                crc = crc32(view[:n], crc)
                out = view[:n]
                while out:
                    out = out[os.write(dfd, out) :]
                size += n
            fsync_file(dfd, dst)
        finally:
            os.close(dfd)
    except OSError as e:
        raise storage_error(e, "cannot copy checkpoint file", dst) from e
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


def copy_checkpoint(src: Path, dst_run_dir: Path) -> Path:
    """Copy checkpoint dir ``src`` into ``dst_run_dir`` as the same step; return the new path."""
    man: Manifest = verify_checkpoint(src, full=False)

    def write(tmp: Path) -> tuple[dict[str, FileRecord], dict[str, Any]]:
        files = {}
        subdirs = set()
        for name, rec in man.files.items():
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            parent = (tmp / name).parent
            while parent != tmp:
                subdirs.add(parent)
                parent = parent.parent
            files[name] = _copy_file(src / name, tmp / name, rec)
        # Shard subdirs (rank-NNNNN/) hold file entries of their own: fsync them
        # too, or the files in them can vanish after a crash even though the
        # manifest that lists them survived. commit() fsyncs only the top dir.
        for d in sorted(subdirs, key=lambda p: len(p.parts), reverse=True):
            fsync_dir(d)
        return files, man.tensors

    extra = dict(man.extra, copied_from=str(src))
    return commit(dst_run_dir, man.step, write, time=man.time, host=man.host, job_id=man.job_id,
                  world_size=man.world_size, nbytes=man.nbytes, extra=extra)  # fmt: skip

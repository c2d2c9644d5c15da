"""Copy a committed checkpoint to another run dir with the same commit protocol.

Used by the tier drain (scratch -> durable), the epilog's stage-out and the
staging of shards. Every byte is checksummed as it is copied and compared
with the source manifest, so a bad source or a bad copy is never committed.
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
from .verify import crc_file, verify_checkpoint

__all__ = ["copy_checkpoint", "copy_file", "copy_files"]


def copy_file(src: Path, dst: Path, expected: FileRecord) -> FileRecord:
    """Copy one checkpoint file to the new file ``dst`` and fsync it.

    :class:`CheckpointCorrupt` unless what was read matches ``expected``
    (size and crc32).
    """
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


def copy_files(
    src: Path, dst: Path, files: dict[str, FileRecord], *, read_back: bool = False
) -> dict[str, FileRecord]:
    """Copy the files a manifest lists from checkpoint dir ``src`` into the new dir ``dst``.

    Each file is checked against its record and fsynced (:func:`copy_file`).
    ``read_back`` reads every copy again in full: the checksum taken while
    copying was computed on what was read, not on what landed. ``dst``
    itself is not fsynced; :func:`~slurm_ckpt.store.commit.commit` does that.
    """
    out = {}
    for name, rec in files.items():
        (dst / name).parent.mkdir(parents=True, exist_ok=True)
        out[name] = copy_file(src / name, dst / name, rec)
    if read_back:
        for name, rec in files.items():
            got = FileRecord(os.lstat(dst / name).st_size, crc_file(dst / name))
            if got != rec:
                raise CheckpointCorrupt(f"{dst / name}: copy has {got.size} bytes crc32 {got.checksum}, "
                                        f"expected {rec.size} bytes crc32 {rec.checksum}", dst / name)  # fmt: skip
    # Shard subdirs (rank-NNNNN/) hold file entries of their own: fsync them
    # too, deepest first, or the files in them can vanish after a crash even
    # though the manifest that lists them survived.
    subdirs = {p for n in files for p in (dst / n).parents if p != dst and dst in p.parents}
    for d in sorted(subdirs, key=lambda p: len(p.parts), reverse=True):
        fsync_dir(d)
    return out


def copy_checkpoint(src: Path, dst_run_dir: Path) -> Path:
    """Copy checkpoint dir ``src`` into ``dst_run_dir`` as the same step; return the new path."""
    man: Manifest = verify_checkpoint(src, full=False)

    def write(tmp: Path) -> tuple[dict[str, FileRecord], dict[str, Any]]:
        return copy_files(src, tmp, man.files), man.tensors

    extra = dict(man.extra, copied_from=str(src))
    return commit(dst_run_dir, man.step, write, time=man.time, host=man.host, job_id=man.job_id,
                  world_size=man.world_size, nbytes=man.nbytes, extra=extra)  # fmt: skip

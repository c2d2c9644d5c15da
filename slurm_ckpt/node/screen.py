"""The screens a checkpoint written by a job's user passes before the stage-out touches it.

The stage-out (and the shard stage-out) reads checkpoints the user wrote, on
scratch and on the durable tier: both sides get the same screens, run with
the user's rights. They run before the store opens anything: a manifest of
bounded size, regular files only, no other mount, no sparse file that would
grow past the job's reservation when copied out dense.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from .escape import escape
from .scratch import mount_id

if TYPE_CHECKING:
    from ..store import Candidate
    from ..store.manifest import Manifest

__all__ = ["mount_id_of", "newest_step", "screened", "sparse_excess"]

_SPARSE_SLACK = 1024**2
_SKIPS_LOGGED = 5
"""Skipped checkpoints named in the log per screening: a user may make thousands."""

log = logging.getLogger("slurm_ckpt.node")


def screened(run_dir: Path, errors: list[str], mount: int | None = None) -> Iterator[Candidate]:
    """Checkpoints in ``run_dir`` that look valid, newest first (sizes and headers checked).

    The screen runs before the store opens anything: the manifest a regular
    file of bounded size, every file it names a regular file. A corrupt
    checkpoint is skipped, and with ``mount``, so is one on another mount (a
    user's FUSE mount inside scratch). One that cannot be read (EIO, EACCES)
    is skipped too but noted in ``errors``: it might be good, so scratch must
    be kept.
    """
    from ..store import Candidate, verify_checkpoint
    from ..store.layout import list_steps
    from ..store.manifest import MANIFEST, Manifest
    from ..store.verify import plain_files

    skipped = 0

    def skip(path: Path, why: object) -> None:
        nonlocal skipped
        skipped += 1
        if skipped <= _SKIPS_LOGGED:
            log.info("stage-out passes over %s: %s", escape(path), escape(why))

    for step, path in list_steps(run_dir):
        try:
            if mount is not None and mount_id_of(path) != mount:
                skip(path, "on another mount")
                continue
            if not stat.S_ISDIR(os.lstat(path).st_mode) or not plain_files(path, [MANIFEST]):
                skip(path, "not a directory with a regular manifest")
                continue
            if not plain_files(path, list(Manifest.read(path).files)):
                skip(path, "a file it names is not a regular file")
                continue
            man = verify_checkpoint(path, full=False)
        except (OSError, MemoryError) as e:  # no sign the checkpoint is bad: keep scratch
            errors.append(f"{path}: {type(e).__name__}: {e}")
            continue
        except Exception as e:  # CheckpointCorrupt, or a malformed file the checks did not foresee
            skip(path, f"{type(e).__name__}: {e}")
            continue
        yield Candidate(step, path, man)


def mount_id_of(path: Path) -> int | None:
    """The mount ``path`` is on, without a stat (which a user's FUSE mount may refuse)."""
    try:
        fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return mount_id(fd)
    finally:
        os.close(fd)


def newest_step(run_dir: Path) -> int | None:
    """Step of the newest checkpoint in ``run_dir`` that passes the screens and the quick check."""
    cand = next(screened(run_dir, []), None)
    return cand.step if cand else None


def sparse_excess(path: Path, man: Manifest, limit: int) -> str | None:
    """Why checkpoint ``path`` may not be copied out dense, or None.

    A copy writes every byte of a file's apparent size. Holes in a sparse
    file cost scratch nothing, so a job could ask for far more than it ever
    stored: past ``limit`` (its reservation), only what it really stored on
    scratch may be written out.
    """
    apparent = stored = 0
    for name in man.files:
        st = os.lstat(path / name)
        apparent += st.st_size
        stored += st.st_blocks * 512
    if apparent <= max(limit, stored) + _SPARSE_SLACK:
        return None
    return (f"{path}: sparse files of {apparent} bytes ({stored} stored on scratch) would be written out "
            f"dense, more than the job's reservation of {limit} bytes; not staged")  # fmt: skip

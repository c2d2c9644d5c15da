"""Verification and discovery: which checkpoints are valid, and the newest one.

Discovery walks ``step-*`` from the newest down and returns the first that
verifies. It never returns a partial or corrupt checkpoint, and it reports why
it skipped each one it passed over.
"""

from __future__ import annotations

import json
import logging
import os
import stat
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from ..errors import CheckpointCorrupt, storage_error
from .crc import crc32
from .fsutil import open_regular, read_small
from .layout import list_steps, step_dir
from .manifest import MANIFEST, UNTRUSTED_MANIFEST_LIMIT, Manifest
from .tensorfile import CHUNK, read_header

__all__ = [
    "Candidate",
    "Skipped",
    "crc_file",
    "find_latest",
    "is_committed",
    "iter_valid",
    "note_skip",
    "plain_files",
    "verify_checkpoint",
]

log = logging.getLogger("slurm_ckpt")


@dataclass(frozen=True)
class Skipped:
    path: Path
    reason: str


@dataclass(frozen=True)
class Candidate:
    step: int
    path: Path
    manifest: Manifest


def verify_checkpoint(path: Path, *, full: bool = True, parse: bool = True) -> Manifest:
    """Check a checkpoint dir; return its manifest or raise :class:`CheckpointCorrupt`.

    ``full=False`` checks the manifest, every file's presence and size, and the
    data files' headers. ``full=True`` also recomputes every checksum.
    ``parse=False`` (with ``full=False``) leaves the headers and JSON files
    unparsed: for a load, which parses and checksums each file as it reads it
    (a state of 10,000 tensors has a header of 10,000 entries).
    """
    man = Manifest.read(path)
    if man.step != _step_of(path, man.step):
        raise CheckpointCorrupt(f"{path}: manifest says step {man.step}", path / MANIFEST)
    for name, rec in man.files.items():
        fpath = path / name
        try:
            st = os.lstat(fpath)
        except FileNotFoundError:
            raise CheckpointCorrupt(
                f"{fpath}: file missing (manifest expects {rec.size} bytes, crc32 {rec.checksum})",
                fpath,
            ) from None
        except OSError as e:
            raise storage_error(e, "cannot stat checkpoint file", fpath) from e
        if st.st_size != rec.size:
            raise CheckpointCorrupt(
                f"{fpath}: size is {st.st_size}, manifest expects {rec.size}", fpath
            )
        if full:
            got = crc_file(fpath)
            if got != rec.checksum:
                raise CheckpointCorrupt(
                    f"{fpath}: checksum mismatch: expected crc32 {rec.checksum}, got {got}",
                    fpath,
                )
        elif not parse:
            continue
        elif name.endswith(".safetensors"):
            with os.fdopen(_open(fpath), "rb") as f:
                read_header(f, fpath, st.st_size)
        elif name.endswith(".json"):
            try:
                json.loads(read_small(fpath, rec.size))
            except ValueError as e:
                raise CheckpointCorrupt(f"{fpath}: not valid JSON ({e})", fpath) from None
    return man


def plain_files(path: Path, names: list[str]) -> bool:
    """True if each name is a regular file, checked without following links.

    A screen before the store opens anything in a user-writable tree: the
    store refuses non-regular files too, but this one also bounds the manifest
    before it is parsed.
    """
    for name in names:
        try:
            st = os.lstat(path / name)
        except OSError:
            return False
        if not stat.S_ISREG(st.st_mode) or (name == MANIFEST and st.st_size > UNTRUSTED_MANIFEST_LIMIT):
            return False
    return True


def is_committed(run_dir: Path, step: int) -> bool:
    """Whether ``run_dir`` holds checkpoint ``step``, complete (the quick check: no checksums)."""
    try:
        verify_checkpoint(step_dir(run_dir, step), full=False)
    except (CheckpointCorrupt, OSError):
        return False
    return True


def _open(path: Path) -> int:
    try:
        return open_regular(path)
    except CheckpointCorrupt:
        raise
    except OSError as e:
        raise storage_error(e, "cannot open checkpoint file", path) from e


def _step_of(path: Path, default: int) -> int:
    try:
        return int(path.name.removeprefix("step-"))
    except ValueError:
        return default


def crc_file(path: Path) -> str:
    """The crc32 of a checkpoint file as the manifest spells it (8 hex digits).

    Opened with :func:`~slurm_ckpt.store.fsutil.open_regular`: never through a link.
    """
    crc = 0
    try:
        with os.fdopen(_open(path), "rb", buffering=0) as f:
            # Sized to the file: zeroing a whole CHUNK costs more than reading a small one.
            view = memoryview(bytearray(max(1, min(CHUNK, os.fstat(f.fileno()).st_size))))
            while n := f.readinto(view):
                crc = crc32(view[:n], crc)
    except OSError as e:
        raise storage_error(e, "cannot read checkpoint file", path) from e
    return f"{crc:08x}"


def iter_valid(
    run_dirs: Iterable[Path], *, full: bool = True, skipped: list[Skipped] | None = None, parse: bool = True
) -> Iterator[Candidate]:
    """Checkpoints across ``run_dirs`` that verify (``full``, ``parse``: as
    :func:`verify_checkpoint`'s), newest first.

    Each one passed over is appended to ``skipped`` when it is given (the
    caller then reports it; it is logged at INFO only), else logged as a
    warning with its reason. Callers pass over a yielded candidate that later
    fails its checksum by simply continuing the loop.
    """
    dirs = [Path(d) for d in run_dirs]
    seen: set[Path] = set()
    # Another client's retention can delete every checkpoint this listing holds
    # while a newer one, committed after the listing, takes their place: when
    # one vanished, list again (a few times at most) rather than answer "none".
    for _ in range(3):
        candidates = sorted(
            ((step, p) for d in dirs for step, p in list_steps(d) if p not in seen),
            key=lambda sp: sp[0],
            reverse=True,
        )
        for step, path in candidates:
            seen.add(path)
            try:
                man = verify_checkpoint(path, full=full, parse=parse)
            except CheckpointCorrupt as e:
                note_skip(path, str(e), skipped)
                continue
            yield Candidate(step, path, man)
        if all(p.exists() for p in seen):
            return


def note_skip(path: Path, reason: str, skipped: list[Skipped] | None) -> None:
    """Record a checkpoint passed over: into ``skipped`` if given, else as a warning."""
    if skipped is None:
        log.warning("skipping %s: %s", path, reason)
    else:
        log.info("skipping %s: %s", path, reason)
        skipped.append(Skipped(path, reason))


def find_latest(
    run_dirs: Iterable[Path], *, full: bool = True, skipped: list[Skipped] | None = None
) -> Candidate | None:
    """The newest checkpoint across ``run_dirs`` that verifies, or None."""
    return next(iter_valid(run_dirs, full=full, skipped=skipped), None)

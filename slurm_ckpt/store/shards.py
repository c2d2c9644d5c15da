"""Checkpoints whose shards start out on different nodes' scratch.

When every rank has its own node-local scratch, no directory is shared while
the checkpoint is written. Each rank commits its shard on its own node, then
the shards travel to the durable run dir one by one, and the checkpoint is
assembled there once the last one arrives::

    <scratch>/ckpt/rank-00001/step-000000120/   a rank's shard, committed on its node
                                                 (MANIFEST.json: its files, "save_id")
    <durable>/.shards-step-000000120-<save_id>/  staging: never read by discovery
        rank-00000/  MANIFEST.json  data…        each shard committed on its own
        rank-00001/  MANIFEST.json  data…
    <durable>/step-000000120/                    the staging dir, renamed once complete;
        MANIFEST.json                            lists rank-NNNNN/<file> of every rank
        rank-00000/ …  rank-00001/ …

``save_id`` (chosen by rank 0 for each collective save) keeps shards of two
saves of the same step (a run resumed from an older step saves it again) from
being mixed. Whoever stages the last shard of a set, a rank's background drain
or a node's epilog, writes the manifest and renames, under ``.shards.lock``;
anyone who comes later finds the step committed and does nothing. Until then
``step-N`` does not exist, so discovery can never return a checkpoint that
lacks a shard.

No torch and no collectives here: the root epilog (as the job's user) uses it too.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import shutil
import socket
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import filelock

from ..errors import CheckpointCorrupt, LockHeld, storage_error
from .commit import WriteFn
from .fsutil import exchange_or_replace_dir, fsync_dir, remove_tree, write_file_durably
from .layout import list_steps, step_dir
from .manifest import MANIFEST, Manifest
from .retention import apply_retention
from .retry import prune_for_space, pruned_once
from .tensorfile import FileRecord
from .transfer import _copy_file
from .verify import _crc_file, find_latest, verify_checkpoint

__all__ = [
    "ASSEMBLY_LOCK",
    "LocalShard",
    "complete",
    "local_shards",
    "new_save_id",
    "newest_durable_step",
    "plain_files",
    "prune_staging",
    "rank_of",
    "shard_extra",
    "shard_name",
    "stage_shard",
    "staged_shards",
    "staging_dir",
    "write_staged_shard",
]

log = logging.getLogger("slurm_ckpt")

SHARD_PREFIX = "rank-"
STAGING_PREFIX = ".shards-step-"
ASSEMBLY_LOCK = ".shards.lock"
_RANK_RE = re.compile(r"^rank-(\d{5,})$")
_STAGING_RE = re.compile(r"^\.shards-step-(\d{9,})-([0-9a-f]{8,64})$")
MAX_MANIFEST = 64 * 1024**2


def shard_name(rank: int) -> str:
    return f"{SHARD_PREFIX}{rank:05d}"


def assembler(by: str) -> str:
    """How a manifest's ``assembled_by`` names this process (``by``: drain, epilog)."""
    return " ".join(filter(None, [socket.gethostname(), by, f"pid {os.getpid()}"]))


def prefixed(
    rank: int, files: dict[str, FileRecord], tensors: dict[str, Any]
) -> tuple[dict[str, FileRecord], dict[str, Any]]:
    """A shard's file and tensor records as the whole checkpoint's manifest names them."""
    prefix = shard_name(rank) + "/"
    return ({prefix + n: r for n, r in files.items()},
            {prefix + k: {**v, "file": prefix + v["file"]} for k, v in tensors.items()})  # fmt: skip


def rank_of(name: str) -> int | None:
    m = _RANK_RE.match(name)
    return int(m.group(1)) if m else None


def new_save_id() -> str:
    return secrets.token_hex(8)


def staging_dir(durable: Path, step: int, save_id: str) -> Path:
    if not re.fullmatch(r"[0-9a-f]{8,64}", save_id):
        raise ValueError(f"bad save id {save_id!r}")
    return durable / f"{STAGING_PREFIX}{step:09d}-{save_id}"


def shard_extra(rank: int, world: int, save_id: str, **more: Any) -> dict[str, Any]:
    """The manifest ``extra`` of one shard: who it is and which save it belongs to."""
    return {"save_id": save_id, "shard": {"rank": rank, "world_size": world, **more}}


@dataclass(frozen=True)
class LocalShard:
    """A committed shard: one rank's part of one save."""

    step: int
    save_id: str
    rank: int
    world: int
    path: Path
    manifest: Manifest


def _as_shard(path: Path, man: Manifest) -> LocalShard | None:
    info = man.extra.get("shard")
    sid = man.extra.get("save_id")
    if (
        not isinstance(info, dict)
        or not isinstance(sid, str)
        or not re.fullmatch(r"[0-9a-f]{8,64}", sid)
    ):
        return None
    try:
        return LocalShard(man.step, sid, int(info["rank"]), int(info["world_size"]), path, man)
    except (KeyError, TypeError, ValueError):
        return None


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
        if not stat.S_ISREG(st.st_mode) or (name == MANIFEST and st.st_size > MAX_MANIFEST):
            return False
    return True


def _read_shard(path: Path, *, full: bool = False) -> LocalShard | None:
    """The shard committed at ``path``, or None if it is not one (or is corrupt)."""
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode) or not plain_files(path, [MANIFEST]):
            return None
    except FileNotFoundError:
        return None
    try:
        # Screen every file the manifest names before anything opens one.
        if not plain_files(path, list(Manifest.read(path).files)):
            return None
        return _as_shard(path, verify_checkpoint(path, full=full))
    except CheckpointCorrupt as e:
        log.info("skipping shard %s: %s", path, e)
        return None


def local_shards(rank_dir: Path) -> Iterator[LocalShard]:
    """Shards committed in one rank's fast-tier dir, newest first (quick check).

    OSError (EIO, EACCES) propagates: the shard might be good, so the caller
    must not treat it as absent.
    """
    for _, path in list_steps(rank_dir):
        shard = _read_shard(path)
        if shard is not None:
            yield shard


def staged_shards(durable: Path, rank: int | None = None) -> Iterator[LocalShard]:
    """Shards waiting in the durable run dir's staging dirs (of ``rank``, or all)."""
    try:
        names = sorted(os.listdir(durable), reverse=True)
    except FileNotFoundError:
        return
    for name in names:
        if not _STAGING_RE.match(name):
            continue
        stage = durable / name
        try:
            subs = sorted(os.listdir(stage))
        except (FileNotFoundError, NotADirectoryError):
            continue
        for sub in subs:
            r = rank_of(sub)
            if r is None or (rank is not None and r != rank):
                continue
            shard = _read_shard(stage / sub)
            if shard is not None:
                yield shard


def _commit_into(parent: Path, name: str, write: WriteFn, meta: dict[str, Any]) -> Path:
    """Commit one shard as ``parent/name`` with the store's protocol.

    Returns the path; if ``name`` is already there (staged by an earlier
    attempt) the new copy is dropped and the one in place is kept.
    """
    final = parent / name
    host = socket.gethostname().replace("-", "_")
    tmp = parent / f".tmp-{name}-{host}-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        tmp.mkdir(mode=0o755)
    except OSError as e:
        raise storage_error(e, "cannot create shard temp dir", tmp) from e
    try:
        # Data first, each file fsynced by the writer: a rename is only as
        # durable as the data it points at.
        files, tensors = write(tmp)
        # The shard's manifest last, fsynced: its presence is what "shard complete" means.
        write_file_durably(
            tmp / MANIFEST, Manifest(files=files, tensors=tensors, **meta).to_bytes()
        )
        # fsync the temp dir so the names of the files just created survive a crash.
        fsync_dir(tmp)
        try:
            # Atomic rename: the shard appears whole or not at all.
            os.rename(tmp, final)
        except OSError as e:
            if not final.is_dir():
                raise storage_error(e, "cannot rename shard into place", final) from e
            remove_tree(tmp)  # staged already (a retried drain, or the epilog after a drain)
            return final
        # fsync the parent: until then the rename itself can be lost on power failure.
        fsync_dir(parent)
    except BaseException:
        remove_tree(tmp)
        raise
    return final


def write_staged_shard(durable: Path, step: int, save_id: str, rank: int, write: WriteFn,
                       **meta: Any) -> Path:  # fmt: skip
    """Commit a rank's shard straight into the durable staging dir (a rank without scratch)."""
    stage = staging_dir(durable, step, save_id)
    _mkdirs(stage)
    return _commit_into(stage, shard_name(rank), write, {"step": step, **meta})


def stage_shard(shard: LocalShard, durable: Path, *, keep: int | None = None, lock_timeout: float = 60.0) -> Path:
    """Copy a shard committed on scratch into the durable staging dir; return where it is.

    Every byte is checksummed as it is copied and compared with the shard's
    manifest, then the copy is read back in full before it is committed.
    Idempotent: a shard already staged is verified and kept.

    With ``keep``, a durable tier that is full (ENOSPC, EDQUOT) is pruned as the
    other tiers are (``prune_for_space``: ``keep - 1`` checkpoints stay, never
    fewer than the newest one) and the copy is tried once more. The pruning
    takes the assembly lock, under which retention after an assembly runs, so
    two ranks never prune at once.
    """
    stage = staging_dir(durable, shard.step, shard.save_id)
    dst = stage / shard_name(shard.rank)
    if dst.is_dir():
        try:
            verify_checkpoint(dst, full=True)
            return dst
        except CheckpointCorrupt as e:
            log.warning("staged shard %s is damaged (%s); staging it again", dst, e)
            remove_tree(dst)
    src, man = shard.path, shard.manifest
    if not plain_files(src, list(man.files)):
        raise CheckpointCorrupt(f"{src}: a file of the shard is not a regular file", src)

    def copy(tmp: Path) -> tuple[dict[str, FileRecord], dict[str, Any]]:
        files = {}
        for name, rec in man.files.items():
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            files[name] = _copy_file(src / name, tmp / name, rec)
        # Read it back: the copy's checksum was computed on what was read, not on what landed.
        for name, rec in man.files.items():
            _verify_file(tmp / name, rec)
        # Subdirs' entries need an fsync of their own (deepest first); tmp itself is fsynced later.
        subdirs = {p for n in man.files for p in (tmp / n).parents if p != tmp and tmp in p.parents}
        for d in sorted(subdirs, key=lambda p: len(p.parts), reverse=True):
            fsync_dir(d)
        return files, man.tensors

    extra = dict(man.extra, staged_from=f"{man.host}:{src}")
    meta = {"step": man.step, "time": man.time, "host": man.host, "job_id": man.job_id,
            "world_size": man.world_size, "nbytes": man.nbytes, "extra": extra}  # fmt: skip

    def commit() -> Path:
        _mkdirs(stage)
        return _commit_into(stage, shard_name(shard.rank), copy, meta)

    def prune() -> list[Path]:
        if keep is None:
            return []
        with _AssemblyLock(durable, lock_timeout):
            return prune_for_space(durable, keep)

    return pruned_once(commit, prune, f"staging {dst}")


def _verify_file(path: Path, rec: FileRecord) -> None:
    got = FileRecord(os.lstat(path).st_size, _crc_file(path))
    if got != rec:
        raise CheckpointCorrupt(f"{path}: copy has {got.size} bytes crc32 {got.checksum}, expected "
                                f"{rec.size} bytes crc32 {rec.checksum}", path)  # fmt: skip


def _mkdirs(path: Path) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise storage_error(e, "cannot create shard staging dir", path) from e


class _AssemblyLock:
    """``<durable>/.shards.lock``: one assembler at a time, across nodes.

    Not the run dir's writer lock: rank 0 holds that for its whole life, and
    the other ranks (and the epilogs) must be able to assemble meanwhile.
    """

    def __init__(self, durable: Path, timeout: float) -> None:
        self._lock = filelock.FileLock(
            str(durable / ASSEMBLY_LOCK), timeout=timeout, thread_local=False
        )
        self.path = durable / ASSEMBLY_LOCK

    def __enter__(self) -> None:
        try:
            self._lock.acquire()
        except filelock.Timeout:
            raise LockHeld(
                f"{self.path}: another assembler kept the shard lock; is a stage-out stuck?"
            ) from None
        except OSError as e:
            raise storage_error(e, "cannot take the shard assembly lock", self.path) from e

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


def _committed_save(final: Path) -> Manifest | None:
    try:
        return Manifest.read(final)
    except (CheckpointCorrupt, OSError):
        return None


def complete(durable: Path, step: int, save_id: str, world: int, *, keep: int | None = None,
             lock_timeout: float = 60.0, by: str = "") -> Path | None:  # fmt: skip
    """Commit checkpoint ``step`` from its staged shards if all ``world`` are there.

    Returns the committed ``step-N`` (also when someone else committed this
    save before), or None while shards are missing. With ``keep``, retention
    runs on the durable run dir afterwards. ``by`` (drain, epilog) goes into
    the manifest's ``assembled_by``.
    """
    stage = staging_dir(durable, step, save_id)
    final = step_dir(durable, step)
    with _AssemblyLock(durable, lock_timeout):
        done = _committed_save(final)
        if done is not None and done.extra.get("save_id") == save_id:
            return final  # assembled already: another node's drain or epilog came first
        if not stage.is_dir():
            return None
        shards: list[LocalShard] = []
        for rank in range(world):
            shard = _read_shard(stage / shard_name(rank))
            if shard is None:
                return None
            if (shard.step, shard.save_id, shard.rank, shard.world) != (step, save_id, rank, world):
                raise CheckpointCorrupt(f"{shard.path}: shard of step {shard.step} save {shard.save_id} "
                                        f"rank {shard.rank}/{shard.world} in the staging dir of step "
                                        f"{step} save {save_id}", shard.path)  # fmt: skip
            shards.append(shard)
        when = max(s.manifest.time for s in shards)
        if done is not None and done.time > when:
            log.info("not assembling %s: %s holds a newer save of step %d", stage, final, step)
            prune_staging(durable, step)
            return None
        man = _merged(step, save_id, world, shards, when, by)
        # Every shard is committed (fsynced, renamed) in the staging dir. Only now
        # may the manifest that makes the checkpoint whole be written: last, fsynced.
        (stage / MANIFEST).unlink(
            missing_ok=True
        )  # left by an assembler that died before the rename
        write_file_durably(stage / MANIFEST, man.to_bytes())
        # fsync the dir so the manifest's name survives a crash.
        fsync_dir(stage)
        # Atomic rename: step-N appears complete, with every shard, or not at all.
        old = exchange_or_replace_dir(stage, final)
        # fsync the parent: until then the rename itself can be lost on power failure.
        fsync_dir(durable)
        if old is not None:
            remove_tree(old)
        log.info("committed %s from %d shards", final, world)
        prune_staging(durable, step)
        if keep is not None:
            apply_retention(durable, keep, protect=[final])
    return final


def _merged(
    step: int, save_id: str, world: int, shards: list[LocalShard], when: float, by: str
) -> Manifest:
    files: dict[str, FileRecord] = {}
    tensors: dict[str, Any] = {}
    where: dict[str, Any] = {}
    for s in shards:
        f, t = prefixed(s.rank, s.manifest.files, s.manifest.tensors)
        files.update(f)
        tensors.update(t)
        where[shard_name(s.rank)] = {
            "rank": s.rank, "host": s.manifest.host, "staged_from": s.manifest.extra.get("staged_from"),
            "files": len(s.manifest.files), "bytes": sum(r.size for r in s.manifest.files.values()),
        }  # fmt: skip
    first = shards[0].manifest
    extra = {"save_id": save_id, "shards": where, "assembled_at": time.time(),
             "assembled_by": assembler(by)}  # fmt: skip
    return Manifest(step=step, files=files, tensors=tensors, time=when, host=first.host, job_id=first.job_id,
                    world_size=world, nbytes=sum(s.manifest.nbytes for s in shards), extra=extra)  # fmt: skip


def prune_staging(durable: Path, upto: int) -> list[Path]:
    """Remove staging dirs of steps up to ``upto``: a committed step makes them obsolete."""
    removed = []
    try:
        names = os.listdir(durable)
    except FileNotFoundError:
        return []
    for name in names:
        m = _STAGING_RE.match(name)
        if m and int(m.group(1)) <= upto:
            path = durable / name
            # Renamed away first, so a crash mid-delete leaves no half staging dir behind.
            trash = durable / f".shards-trash-{secrets.token_hex(6)}"
            try:
                os.rename(path, trash)
            except OSError:
                continue
            shutil.rmtree(trash, ignore_errors=True)
            removed.append(path)
    for name in names:
        if name.startswith(".shards-trash-"):
            shutil.rmtree(durable / name, ignore_errors=True)
    return removed


def newest_durable_step(durable: Path) -> int | None:
    """Step of the newest checkpoint committed in the durable run dir (quick check)."""
    cand = find_latest([durable], full=False)
    return cand.step if cand else None

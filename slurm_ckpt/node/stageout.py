"""Epilog stage-out: the newest checkpoint that exists only on scratch goes to the durable run dir.

It runs in a child forked by root (:mod:`.userchild`) that closes every fd
root opened, then takes the job user's uid, gid and groups before it reads
anything the user wrote. Everything the child opens, it opens with the user's
rights, so a hardlink to a root-only file, or a symlink to another user's dir,
fails as it would for the user. The destination must be an allowed one (see
:mod:`.destination`).
Both sides get the same screens: a manifest of bounded size, regular files
only. The copy goes through :func:`slurm_ckpt.store.copy_checkpoint`
(checksummed while copied, committed with the store's protocol) and is
verified again in full before it counts.

The durable run dir lies on shared storage, where any node of the user can
rename what the stage-out makes: the copy and its commit go through the fds
of the dirs they made, on the run dir's filesystem only (``on_dev``), so
nothing is written to a link swapped in (to ``/dev/shm``, a tmpfs). Each
source file is opened once and checked on that fd, at most the size its
manifest names is read, and the whole copy writes no more than the job's
reservation (``RLIMIT_FSIZE`` on top, per file).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from ..errors import CheckpointCorrupt, SlurmCkptError
from ..store.layout import TIER_FILE
from .destination import Destination, open_destination
from .escape import FIELD_LIMIT, escape
from .job import Job
from .screen import mount_id_of, screened, sparse_excess
from .stageresult import StageResult
from .userchild import run_as_user

# The rest of the store is imported in the functions that use it, which only
# the stage-out child calls: every epilog imports this module, few stage out.
# The parent imports them before it forks (see _preload): the child, as the
# user, may not be able to read the installation at all.
_CHILD_MODULES = ("..store", "..store.fsutil", "..store.layout", "..store.lock", "..store.manifest",
                  "..store.retention", "..store.retry", "..store.transfer", "..store.verify",
                  "..store.shards", ".shardstage")  # fmt: skip

__all__ = ["StageLimits", "Tier", "read_tier", "stage_out"]

log = logging.getLogger("slurm_ckpt.node")

_MAX_TIER = 64 * 1024
_MAX_KEEP = 1_000_000


class _ShownPaths(logging.Filter):
    """In the child's records, a destination's fd path is written as the path the job named."""

    def __init__(self) -> None:
        super().__init__()
        self.dests: list[Destination] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if self.dests:
            msg = record.getMessage()
            for dest in self.dests:
                msg = dest.show(msg)
            record.msg, record.args = msg, None
        return True


_SHOWN = _ShownPaths()


@dataclass(frozen=True)
class StageLimits:
    """What the epilog allows the stage-out to write, and where."""

    roots: tuple[str, ...]
    """A durable run dir must lie under one of these (``storage.stage_out_allowed()``)."""
    scratch_devs: frozenset[int]
    """``st_dev`` of the scratch filesystems: never a destination."""
    sparse_bytes: int
    """Most bytes a checkpoint stored sparse on scratch may become when copied out dense
    (the job's reservation): past that, holes would turn into real blocks on shared storage."""


@dataclass(frozen=True)
class Tier:
    """What ``TIER.json`` says: where the job's checkpoints go, and how many it keeps."""

    durable: Path
    keep: int | None
    """The job's ``storage.keep``; None where the file does not say (an older writer)."""


def read_tier(scratch_ckpt: Path) -> Tier | None:
    """``TIER.json`` of a job's scratch, or None. Untrusted input.

    Opened without following a link or blocking on a FIFO, size-bounded, and
    the path must be absolute. A ``keep`` that is not a whole number from 1 to
    ``_MAX_KEEP`` is ignored. Called with the user's privileges.
    """
    from ..store.fsutil import read_small

    try:
        data = json.loads(read_small(scratch_ckpt / TIER_FILE, _MAX_TIER))
    except (OSError, ValueError):  # CheckpointCorrupt (not a regular file, too big) included
        return None
    if not isinstance(data, dict):
        return None
    durable, keep = data.get("durable"), data.get("keep")
    if not isinstance(durable, str) or not durable.startswith("/") or "\0" in durable or len(durable) > 4096:
        return None
    if type(keep) is not int or not 1 <= keep <= _MAX_KEEP:
        keep = None
    return Tier(Path(os.path.normpath(durable)), keep)


def _stage(scratch_ckpt: Path, default_durable: Path | None, limits: StageLimits, lock_timeout: float) -> StageResult:
    scratch_mnt = mount_id_of(scratch_ckpt.parent)
    if mount_id_of(scratch_ckpt) != scratch_mnt:
        # Checked before anything is read there: a user's FUSE mount may never answer.
        return StageResult("none", f"{scratch_ckpt} is a mount, not the job's scratch")
    tier = read_tier(scratch_ckpt)
    wanted = [tier.durable] if tier else []
    if default_durable is not None and Path(os.path.normpath(default_durable)) not in wanted:
        wanted.append(Path(os.path.normpath(default_durable)))
    no_durable = StageResult("failed", "no durable run dir: no TIER.json and no storage.root")
    keep = tier.keep if tier else None
    from ..store import RunDir, verify_checkpoint
    from ..store.retention import apply_retention
    from .shardstage import has_shards, stage_shards

    if has_shards(scratch_ckpt):
        # A cross-node sharded job: this node's shards go to the durable staging dirs.
        if not wanted:
            return no_durable
        dest, refused = _destination(wanted, limits)
        if dest is None:
            return StageResult("failed", refused)
        res = stage_shards(scratch_ckpt, dest.path, lock_timeout, keep=keep, sparse_bytes=limits.sparse_bytes,
                           on_dev=dest.dev)  # fmt: skip
        return _shown(res, dest, refused)
    errors: list[str] = []
    candidates = screened(scratch_ckpt, errors, scratch_mnt)
    first = next(candidates, None)
    if first is None:
        if errors:
            return StageResult("failed", "unreadable checkpoint(s): " + "; ".join(errors))
        return StageResult("none", f"no valid checkpoint in {scratch_ckpt}")
    if not wanted:
        return no_durable
    dest, refused = _destination(wanted, limits)
    if dest is None:
        return StageResult("failed", refused)
    newest = next(screened(dest.path, []), None)
    if newest is not None and (why := _foreign(newest.path)):
        return StageResult("failed", dest.show(f"{newest.path} {why}"))
    passed_over: list[str] = []
    for cand in (first, *candidates):
        if newest is not None and newest.step >= cand.step:
            return _shown(StageResult("up-to-date", f"{dest.path} has step {newest.step}", newest.step,
                                      str(newest.path)), dest, refused)  # fmt: skip
        try:
            why = sparse_excess(cand.path, cand.manifest, limits.sparse_bytes)
        except OSError as e:
            why = f"{cand.path}: {e}"
        if why:
            log.warning("%s", why)
            errors.append(why)
            continue
        run = RunDir(dest.path, lock_timeout=lock_timeout)
        run.lock()
        try:
            dst = _copy_in(cand.path, run.path, keep, dest.dev, limits.sparse_bytes)
            verify_checkpoint(dst, full=True)
            if keep:
                # Synchronous, unlike a trainer's retention: this child ends with os._exit.
                apply_retention(run.path, keep, protect=[dst])
        except CheckpointCorrupt as e:
            # Changed since it was screened (a file renamed over), or damaged: an older one may do.
            log.warning("not staging %s: %s", escape(cand.path), escape(e))
            passed_over.append(str(e))
            continue
        finally:
            run.unlock()
        passed = f" (newer ones passed over: {'; '.join(errors)})" if errors else ""
        return _shown(StageResult("staged", f"{cand.path} -> {dst}{passed}", cand.step, str(dst)), dest, refused)
    if errors:
        return StageResult("failed", "checkpoint(s) not staged: " + "; ".join(errors + passed_over))
    why = f" ({'; '.join(passed_over)})" if passed_over else ""
    return StageResult("none", f"no valid checkpoint in {scratch_ckpt}{why}")


def _destination(wanted: list[Path], limits: StageLimits) -> tuple[Destination | None, str]:
    """The first of ``wanted`` (TIER.json's, then the default) that is allowed; why others were refused."""
    refused: list[str] = []
    for path in wanted:
        dest, why = open_destination(path, limits.roots, limits.scratch_devs)
        if dest is not None:
            _SHOWN.dests.append(dest)
            return dest, "; ".join(refused)
        log.warning("not staging to %s: %s", escape(path), why)
        refused.append(f"{path}: {why}")
    return None, "no allowed durable run dir: " + "; ".join(refused)


def _shown(res: StageResult, dest: Destination, refused: str) -> StageResult:
    """``res`` with the destination's real name for its fd path, and what was refused first."""
    detail = dest.show(res.detail) + (f" (refused {refused})" if refused else "")
    return replace(res, detail=detail, path=dest.show(res.path) if res.path else None)


def _foreign(step: Path) -> str | None:
    """Why a durable checkpoint cannot count as the user's own, or None."""
    from ..store.owner import untrusted

    return untrusted(os.lstat(step), os.geteuid(), last=True)


def _copy_in(src: Path, durable: Path, keep: int | None, dev: int, budget: int) -> Path:
    """Copy a checkpoint into the durable run dir (on filesystem ``dev``, at most ``budget``
    bytes); with the job's ``keep``, make room on a full disk the way the job's own drain does."""
    from ..store import copy_checkpoint
    from ..store.retry import prune_for_space, pruned_once
    from ..store.transfer import ByteBudget

    def prune() -> list[Path]:
        return prune_for_space(durable, keep) if keep else []

    def copy() -> Path:
        return copy_checkpoint(src, durable, on_dev=dev, budget=ByteBudget(budget))

    return pruned_once(copy, prune, f"staging {src} out to {durable}")


def _preload() -> None:
    """Import, as root, every module the stage-out child uses: once it is the user, it may not
    be able to read them (an installation under root's 0700 home)."""
    import importlib

    for name in _CHILD_MODULES:
        importlib.import_module(name, __package__)


def stage_out(scratch_ckpt: Path, default_durable: Path | None, job: Job, timeout: float,
              limits: StageLimits) -> StageResult:  # fmt: skip
    """Stage out as ``job``'s user within ``timeout`` seconds; never raises.

    On timeout the child is killed and the result says so: the caller then
    keeps scratch, because it may hold the only copy.
    """

    def work() -> bytes:  # in the child, as the user
        try:
            res = _stage(scratch_ckpt, default_durable, limits, min(10.0, timeout / 2))
        except (SlurmCkptError, OSError) as e:
            res = StageResult("failed", f"{type(e).__name__}: {escape(e)}")
        except BaseException as e:  # reported to the parent, which logs it
            res = StageResult("failed", f"unexpected {type(e).__name__}: {escape(e)}")
        detail = res.detail
        for dest in _SHOWN.dests:  # an error's path through a destination's fd, as the job named it
            detail = dest.show(detail)
        return json.dumps(asdict(replace(res, detail=escape(detail, 2 * FIELD_LIMIT)))).encode()

    _preload()
    from ..store.manifest import UNTRUSTED_MANIFEST_LIMIT

    # Per file, on top of the copy's byte budget: a manifest is bounded on its own.
    file_size = max(limits.sparse_bytes, UNTRUSTED_MANIFEST_LIMIT)
    out = run_as_user(job, work, timeout, name="stage-out", log_filter=_SHOWN, file_size=file_size)
    if out.stopped:
        return StageResult("failed", "the stage-out child was stopped (a SIGSTOP from the job's user?); killed")
    if out.timed_out:
        return StageResult("timeout", f"stage-out still running after {timeout:.0f}s; killed")
    return StageResult.from_child(out.result or b"")

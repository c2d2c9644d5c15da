"""Epilog stage-out: the newest checkpoint that exists only on scratch goes to the durable run dir.

Root forks a child that takes the job user's uid, gid and groups before it
reads anything the user wrote. Everything the child opens, it opens with the
user's rights, so a hardlink to a root-only file, or a symlink to another
user's dir, fails as it would for the user. The copy goes through
:func:`slurm_ckpt.store.copy_checkpoint` (checksummed while copied, committed
with the store's protocol) and is verified again in full before it counts.
"""

from __future__ import annotations

import json
import os
import resource
import select
import signal
import stat
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import CheckpointCorrupt, SlurmCkptError
from .job import Job
from .scratch import mount_id

if TYPE_CHECKING:
    from ..store import Candidate

# The store is imported in the functions that use it, which only the stage-out
# child calls: every epilog imports this module, few stage anything out.

__all__ = ["TIER_FILE", "StageResult", "Tier", "read_tier", "stage_out"]

TIER_FILE = "TIER.json"
_MAX_TIER = 64 * 1024
_MAX_KEEP = 1_000_000
STAGE_MEMORY = 4 * 1024**3
"""Address-space limit of the stage-out child (bytes)."""
_DONE = ("staged", "up-to-date", "none")
_POLL = 0.2
"""Seconds between looks at whether the child was stopped, while it is silent."""


@dataclass(frozen=True)
class StageResult:
    status: str
    """staged | up-to-date | none (nothing valid on scratch) | failed | timeout"""
    detail: str = ""
    step: int | None = None
    path: str | None = None

    @property
    def scratch_disposable(self) -> bool:
        """True when deleting scratch loses no checkpoint that exists nowhere else."""
        return self.status in _DONE


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


def _candidates(scratch_ckpt: Path, errors: list[str]) -> Iterator[Candidate]:
    """Checkpoints on scratch that look valid, newest first (sizes and headers checked).

    A corrupt one is skipped, and so is one on another filesystem than
    scratch (a mount the user made there). One that cannot be read (EIO,
    EACCES) is skipped too but noted in ``errors``: it might be good, so
    scratch must be kept.
    """
    from ..store import Candidate, verify_checkpoint
    from ..store.layout import list_steps
    from ..store.manifest import MANIFEST, Manifest
    from ..store.shards import plain_files

    scratch_mnt = _mount_of(scratch_ckpt.parent)
    for step, path in list_steps(scratch_ckpt):
        try:
            if _mount_of(path) != scratch_mnt:
                continue
            if not stat.S_ISDIR(os.lstat(path).st_mode) or not plain_files(path, [MANIFEST]):
                continue
            # Screen every file the manifest names before the store opens any of them.
            if not plain_files(path, list(Manifest.read(path).files)):
                continue
            man = verify_checkpoint(path, full=False)
        except OSError as e:
            errors.append(f"{path}: {e}")
            continue
        except Exception:  # CheckpointCorrupt, or a malformed file the checks did not foresee
            continue
        yield Candidate(step, path, man)


def _mount_of(path: Path) -> int | None:
    """The mount ``path`` is on, without a stat (which a user's FUSE mount may refuse)."""
    try:
        fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return mount_id(fd)
    finally:
        os.close(fd)


def _stage(scratch_ckpt: Path, default_durable: Path | None, lock_timeout: float) -> StageResult:
    if _mount_of(scratch_ckpt) != _mount_of(scratch_ckpt.parent):
        # Checked before anything is read there: a user's FUSE mount may never answer.
        return StageResult("none", f"{scratch_ckpt} is a mount, not the job's scratch")
    tier = read_tier(scratch_ckpt)
    durable, keep = (tier.durable, tier.keep) if tier else (default_durable, None)
    if durable is None:
        if next(_candidates(scratch_ckpt, []), None) is None:
            return StageResult("none", f"no valid checkpoint in {scratch_ckpt}")
        return StageResult("failed", "no durable run dir: no TIER.json and no storage.root")
    from ..store import RunDir, find_latest, verify_checkpoint
    from ..store.retention import apply_retention
    from .shardstage import has_shards, stage_shards

    if has_shards(scratch_ckpt):
        # A cross-node sharded job: this node's shards go to the durable staging dirs.
        return stage_shards(scratch_ckpt, durable, lock_timeout, keep=keep)
    newest = find_latest([durable], full=False)
    errors: list[str] = []
    for cand in _candidates(scratch_ckpt, errors):
        if newest is not None and newest.step >= cand.step:
            return StageResult("up-to-date", f"{durable} has step {newest.step}", newest.step, str(newest.path))
        run = RunDir(durable, lock_timeout=lock_timeout)
        run.lock()
        try:
            dst = _copy_in(cand.path, run.path, keep)
            verify_checkpoint(dst, full=True)
            if keep:
                # Synchronous, unlike a trainer's retention: this child ends with os._exit.
                apply_retention(run.path, keep, protect=[dst])
        except CheckpointCorrupt:
            continue
        finally:
            run.unlock()
        return StageResult("staged", f"{cand.path} -> {dst}", cand.step, str(dst))
    if errors:
        return StageResult("failed", "unreadable checkpoint(s): " + "; ".join(errors)[:2000])
    return StageResult("none", f"no valid checkpoint in {scratch_ckpt}")


def _copy_in(src: Path, durable: Path, keep: int | None) -> Path:
    """Copy a checkpoint into the durable run dir; with the job's ``keep``, make room
    on a full disk the way the job's own drain does."""
    from ..store import copy_checkpoint
    from ..store.retry import prune_for_space, pruned_once

    def prune() -> list[Path]:
        return prune_for_space(durable, keep) if keep else []

    return pruned_once(lambda: copy_checkpoint(src, durable), prune, f"staging {src} out to {durable}")


def _become(job: Job) -> None:
    """Take the job user's identity for good (real, effective and saved ids)."""
    os.setgroups(os.getgrouplist(job.user, job.gid))
    os.setresgid(job.gid, job.gid, job.gid)
    os.setresuid(job.uid, job.uid, job.uid)
    os.umask(0o077)
    os.chdir("/")
    # This child runs outside the job's cgroup: bound what user data can make it allocate.
    resource.setrlimit(resource.RLIMIT_AS, (STAGE_MEMORY, STAGE_MEMORY))


def _stopped(pid: int) -> bool:
    """Whether the child is stopped. It runs as the user, so the user can stop it; waiting
    for it then would only hold the epilog up until its deadline."""
    try:
        info = os.waitid(os.P_PID, pid, os.WSTOPPED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return False
    return info is not None and info.si_code == os.CLD_STOPPED


def _reap(pid: int, wait: float) -> None:
    # Bounded: a child stuck in an unkillable NFS write must not hang the epilog too.
    end = time.monotonic() + wait
    while os.waitpid(pid, os.WNOHANG) == (0, 0) and time.monotonic() < end:
        time.sleep(0.01)


def stage_out(scratch_ckpt: Path, default_durable: Path | None, job: Job, timeout: float) -> StageResult:
    """Stage out as ``job``'s user within ``timeout`` seconds; never raises.

    On timeout the child is killed and the result says so: the caller then
    keeps scratch, because it may hold the only copy.
    """
    try:
        r, w = os.pipe()
        pid = os.fork()
    except OSError as e:
        return StageResult("failed", f"cannot start the stage-out child: {e}")
    if pid == 0:  # the child: never returns
        os.close(r)
        try:
            _become(job)
            res = _stage(scratch_ckpt, default_durable, min(10.0, timeout / 2))
        except (SlurmCkptError, OSError) as e:
            res = StageResult("failed", f"{type(e).__name__}: {e}")
        except BaseException as e:  # reported to the parent, which logs it
            res = StageResult("failed", f"unexpected {type(e).__name__}: {e}")
        try:
            os.write(w, json.dumps(asdict(res)).encode()[:60000])
        finally:
            os._exit(0)
    os.close(w)
    data = b""
    deadline = time.monotonic() + timeout
    try:
        while (left := deadline - time.monotonic()) > 0:
            if select.select([r], [], [], min(left, _POLL))[0]:
                chunk = os.read(r, 65536)
                if not chunk:
                    break
                data += chunk
            elif _stopped(pid):
                os.kill(pid, signal.SIGKILL)
                _reap(pid, 5.0)
                return StageResult("failed", "the stage-out child was stopped (a SIGSTOP from the job's user?); killed")
        else:
            os.kill(pid, signal.SIGKILL)
            _reap(pid, 5.0)
            return StageResult("timeout", f"stage-out still running after {timeout:.0f}s; killed")
        _reap(pid, 5.0)
    finally:
        os.close(r)
    try:
        return StageResult(**json.loads(data))
    except (ValueError, TypeError):
        return StageResult("failed", "the stage-out child died without a result")

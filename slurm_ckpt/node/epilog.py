"""The epilog: stage out, then remove the job's scratch, reservation, report and I/O cgroup.

Runs as root after the job ended; a requeued job stays COMPLETING until it
returns, so the stage-out finishes before the job can start anywhere else.
It never deletes the only copy of a checkpoint while it may keep it: when
stage-out fails or runs out of time, scratch and its reservation are kept and
the log says why, for a time counted from the job's size and the failure's
cause, within the user's ``scratch.keep_per_user``, and only until another
job needs the room. Removal is bounded by the epilog's own
deadline: what is left goes to the graveyard, never to a drained node.
Running it twice is harmless.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..config import Config, ScratchConfig, format_size
from ..errors import ConfigError
from ..fsinfo import cgroup_mount
from ..store.layout import fast_dir
from . import cgroup, graveyard, loopfs, mounts, quota
from .hook import HookContext, load_context, setup_logging
from .job import InvalidJob
from .ledger import Ledger, kept_oldest_first
from .report import JobReport, report_path
from .scratch import open_state_dir
from .stageout import StageLimits, StageResult, stage_out

__all__ = ["keep_time", "run_epilog"]

log = logging.getLogger("slurm_ckpt.node")

CLEANUP_RESERVE = 5.0
"""Seconds of the epilog's budget kept for cleanup after the stage-out."""
TAIL_RESERVE = 2.0
"""Seconds kept after removing scratch: the quota, ledger, cgroup and metrics steps."""


def run_epilog(env: Mapping[str, str] | None = None, cfg: Config | None = None) -> StageResult | None:
    """Stage out and clean up after one job; return what the stage-out did (None: no scratch).

    Only a node fault (the scratch base or its state dir unusable) raises;
    nothing a user made in scratch can.
    """
    setup_logging("epilog", "?")
    try:
        ctx = load_context("epilog", env, cfg, "epilog_timeout")
    except (ConfigError, InvalidJob) as e:
        log.error("epilog skipped: %s", e)
        return None
    # First, as it is cheap: a few exact names, never a listing of the shared dir.
    try:
        _remove_metrics(ctx)
    except Exception:
        log.exception("epilog step _remove_metrics failed")
    base_fd = ctx.open_base()
    try:
        state_fd = open_state_dir(base_fd)
        ledger = Ledger(ctx.state_dir, 0)
        try:
            result = _stage_and_clean(ctx, base_fd, state_fd, ledger)
        except Exception:  # a bug here must not drain every node
            log.exception("epilog failed; scratch %s left in place", ctx.scratch)
            result = StageResult("failed", "epilog error")
            try:  # kept, so it expires and yields to other jobs, rather than held for good
                ledger.set_kept(ctx.job.job_id, "epilog error", ctx.job.restart_count,
                                keep_time(ctx.cfg.scratch, 0, result))  # fmt: skip
            except Exception:
                log.exception("cannot mark the scratch of job %s kept", ctx.job.job_id)
        try:
            if graveyard.due(ledger.snapshot, state_fd, ctx.cfg.scratch.keep_failed):
                graveyard.start_reaper(ctx)
        except Exception:
            log.exception("cannot check the graveyard")
        finally:
            os.close(state_fd)
    finally:
        os.close(base_fd)
    try:
        _remove_io_cgroup(ctx)
    except Exception:
        log.exception("epilog step _remove_io_cgroup failed")
    log.info("epilog done in %.0f ms: %s", ctx.deadline.elapsed_ms(), result)
    return result


def _stage_and_clean(ctx: HookContext, base_fd: int, state_fd: int, ledger: Ledger) -> StageResult | None:
    job = ctx.job
    name = job.dir_name
    # Before anything looks into scratch: a user's FUSE mount there (a dead daemon, or
    # one answering EIO or never) is detached, never followed.
    mounts.detach_foreign(base_fd, name, ctx.deadline.left(CLEANUP_RESERVE) / 4)
    if not mounts.exists(base_fd, name):
        # Already cleaned (a second run), or the job got no scratch.
        _remove_scratch(ctx, base_fd, state_fd, ledger)
        _remove_report(ctx)
        return None
    if os.path.lexists(fast_dir(ctx.scratch)):
        result = stage_out(fast_dir(ctx.scratch), ctx.default_durable, job, ctx.deadline.left(CLEANUP_RESERVE),
                           _stage_limits(ctx, base_fd, ledger))  # fmt: skip
    else:
        result = StageResult("none", "no ckpt dir in scratch")
    log.info("stage-out %s: %r", result.status, result.detail)
    _report_project_changes(ctx, base_fd)
    if not result.scratch_disposable and _keep(ctx, base_fd, state_fd, ledger, result):
        return result
    _remove_scratch(ctx, base_fd, state_fd, ledger)
    _remove_report(ctx)
    return result


def keep_time(cfg: ScratchConfig, size: int, result: StageResult) -> float:
    """Seconds to keep the scratch of a job whose stage-out ended in ``result``.

    ``scratch.keep_failed`` when the storage failed (slow, full, refused: the
    checkpoint is likely good and an admin may copy it) for a job that
    reserved at most ``default_size``; a seventh of it when the stage-out
    failed on the job's own data (a checkpoint its user made unreadable);
    shorter in proportion for a bigger reservation. Never under an hour.
    """
    own_data = result.status == "failed" and result.detail.startswith("unreadable checkpoint")
    keep = float(cfg.keep_failed) / (7 if own_data else 1)
    if size > cfg.default_size:
        keep *= cfg.default_size / size
    return max(min(3600.0, float(cfg.keep_failed)), keep)


def _keep(ctx: HookContext, base_fd: int, state_fd: int, ledger: Ledger, result: StageResult) -> bool:
    """Keep the job's scratch and reservation (it may hold the only copy of a checkpoint),
    within the user's ``scratch.keep_per_user``; False when it must go anyway."""
    job, sc = ctx.job, ctx.cfg.scratch
    why = f"stage-out {result.status}: {result.detail}"
    size = int(ledger.entries().get(job.job_id, {}).get("size", 0))
    vfs = os.fstatvfs(base_fd)
    cap = int(sc.keep_per_user) or vfs.f_blocks * vfs.f_frsize // 4
    if size > cap:
        log.error("not keeping scratch %s (%s): it is larger than the %s of kept scratch one user may hold "
                  "(scratch.keep_per_user); removing it, and any checkpoint only there, now (%r)",
                  ctx.scratch, format_size(size), format_size(cap), why[:2000])  # fmt: skip
        return False

    def over_cap(entries: dict[str, dict[str, Any]]) -> list[str]:
        mine = [k for k in kept_oldest_first(entries, job.uid) if k != job.job_id]
        total = size + sum(int(entries[k]["size"]) for k in mine)
        out = []
        for k in mine:
            if total <= cap:
                break
            out.append(k)
            total -= int(entries[k]["size"])
        return out

    def drop(key: str, entry: dict[str, Any]) -> str | None:
        return graveyard.drop_kept(base_fd, state_fd, key, ctx.deadline.part(0.5, TAIL_RESERVE))

    ledger.drop_kept(over_cap, drop, f"user {job.user} would hold more than scratch.keep_per_user "
                     f"({format_size(cap)}) of kept scratch")  # fmt: skip
    keep = keep_time(sc, size, result)
    log.error("keeping scratch %s and its reservation for up to %.1f h (scratch.keep_failed, less for a big "
              "reservation or a failure of the job's own data; sooner if another job needs the room): it may hold "
              "the only copy of a checkpoint (%r). Rerun the epilog or copy it by hand.",
              ctx.scratch, keep / 3600, why[:2000])  # fmt: skip
    ledger.set_kept(job.job_id, why[:500], job.restart_count, keep)
    return True


def _remove_scratch(ctx: HookContext, base_fd: int, state_fd: int, ledger: Ledger) -> None:
    """Unmount, bury and remove the job's scratch within the deadline; release its reservation
    once the space is really free, else leave it with the graveyard entry that holds it."""
    job, name = ctx.job, ctx.job.dir_name
    image = None
    held = loopfs.unmount_image(base_fd, state_fd, name, ctx.deadline.left(TAIL_RESERVE))
    if held is not None:
        os.close(held)
        img_dir = loopfs.open_image_dir(state_fd)
        try:
            image = graveyard.bury(img_dir, f"{name}.img", state_fd)
        finally:
            os.close(img_dir)
    # Renamed into the root-only graveyard first: the job's name is free at once,
    # and no process of the user reaches the tree by path any more.
    tree = graveyard.bury(base_fd, name, state_fd)
    done = True
    if tree is not None:
        grave_fd = graveyard.open_grave(state_fd)
        try:
            out = graveyard.clear(grave_fd, tree, ctx.deadline.part(1.0, TAIL_RESERVE))
        finally:
            os.close(grave_fd)
        done = out.done
        if not done:
            log.warning("scratch %s not removed within the epilog's deadline (%s); the rest is in the "
                        "graveyard as %s, removed in the background", ctx.scratch, out, tree)  # fmt: skip
    projid = _project_id(ctx)
    if image is not None:
        ledger.bury(job.job_id, image)
    elif not done and tree is not None:
        ledger.bury(job.job_id, tree, projid=projid)
    else:
        if projid is not None:
            _clear_quota(ctx, projid)
        ledger.release(job.job_id)


def _project_id(ctx: HookContext) -> int | None:
    """The job's project id, if the prolog set a project quota on its scratch."""
    report = JobReport.read(report_path(ctx.state_dir, ctx.job.job_id))  # root's own file
    return int(ctx.job.job_id) if report is not None and report.enforce == "quota" else None


def _clear_quota(ctx: HookContext, projid: int) -> None:
    from ..fsinfo import mount_of

    mount = mount_of(ctx.base)
    if mount is not None:
        quota.clear_project_limit(mount, projid, ctx.deadline.left())


def _open_job_dir(ctx: HookContext, base_fd: int) -> int:
    return os.open(ctx.job.dir_name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=base_fd)


def _stage_limits(ctx: HookContext, base_fd: int, ledger: Ledger) -> StageLimits:
    """Where the stage-out may write (never on scratch), and how far a sparse checkpoint may grow."""
    devs = {os.fstat(base_fd).st_dev}
    vfs = os.fstatvfs(base_fd)
    with contextlib.suppress(OSError):
        fd = _open_job_dir(ctx, base_fd)
        try:
            devs.add(os.fstat(fd).st_dev)  # its own filesystem under enforce: loop
            vfs = os.fstatvfs(fd)
        finally:
            os.close(fd)
    reserved = int(ledger.entries().get(ctx.job.job_id, {}).get("size", 0))
    return StageLimits(ctx.cfg.storage.stage_out_allowed(), frozenset(devs), reserved or vfs.f_blocks * vfs.f_frsize)


def _report_project_changes(ctx: HookContext, base_fd: int) -> None:
    """Under a project quota, log the files whose project id the job's user changed.

    In the init user namespace a file's owner may change its project id:
    ``chattr -p 0`` takes a file out of every quota, ``chattr -p <other job>``
    charges another job for it. The quota cannot stop that; this makes it seen.
    """
    report = JobReport.read(report_path(ctx.state_dir, ctx.job.job_id))  # root's own file
    if report is None or report.enforce != "quota":
        return
    try:
        fd = _open_job_dir(ctx, base_fd)
    except OSError:
        return
    try:
        scan = quota.changed_projects(fd, int(ctx.job.job_id), seconds=min(5.0, ctx.deadline.left(CLEANUP_RESERVE)))
    finally:
        os.close(fd)
    if scan.changed:
        log.warning("job %s (user %s) changed the project id of %d file(s) in its scratch, out of its "
                    "quota or onto another job's: %s", ctx.job.job_id, ctx.job.user, scan.changed,
                    scan.summary())  # fmt: skip
    if not scan.complete:
        log.info("project id check of %s stopped after %d entries", ctx.scratch, scan.seen)


def _remove_report(ctx: HookContext) -> None:
    with contextlib.suppress(FileNotFoundError):
        report_path(ctx.state_dir, ctx.job.job_id).unlink()


def _remove_io_cgroup(ctx: HookContext) -> None:
    io = ctx.cfg.io
    root = Path(io.cgroup_root) if io.cgroup_root else None
    if root is None:
        m = cgroup_mount("blkio")
        root = Path(m.mount_point) if m else None
    if root is None or (root / "cgroup.controllers").exists():
        return  # v2: Slurm removes its own job cgroup
    try:
        cgroup.remove_v1(root, ctx.job.dir_name)
    except OSError as e:
        log.warning("cannot remove the I/O cgroup of the job: %s", e)


def _remove_metrics(ctx: HookContext) -> None:
    """Drop the finished job's textfile metrics, so no alert fires for a job that is gone."""
    if not ctx.cfg.metrics.textfile_dir:
        return
    from ..metrics import remove_job_textfiles

    try:
        remove_job_textfiles(ctx.cfg.metrics.textfile_dir, ctx.job.job_id, until=ctx.deadline.end - TAIL_RESERVE)
    except OSError as e:
        log.warning("cannot remove the job's metrics files: %s", e)

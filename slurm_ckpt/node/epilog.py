"""The epilog: stage out, then remove the job's scratch, reservation, report and I/O cgroup.

Runs as root after the job ended; a requeued job stays COMPLETING until it
returns, so the stage-out finishes before the job can start anywhere else.
It never deletes the only copy of a checkpoint: when stage-out fails or runs
out of time, scratch and its reservation are kept and the log says why.
Running it twice is harmless.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Mapping
from pathlib import Path

from ..config import Config
from ..errors import ConfigError
from ..store.tiers import fast_dir
from . import cgroup, loopfs, quota
from .hook import HookContext, load_context, setup_logging
from .job import InvalidJob
from .ledger import Ledger
from .mounts import cgroup_mount, mount_of
from .report import JobReport, report_path
from .scratch import open_state_dir, remove_job_dir
from .stageout import StageLimits, StageResult, stage_out

__all__ = ["run_epilog"]

log = logging.getLogger("slurm_ckpt.node")

CLEANUP_RESERVE = 5.0
"""Seconds of the epilog's budget kept for cleanup after the stage-out."""


def run_epilog(env: Mapping[str, str] | None = None, cfg: Config | None = None) -> StageResult | None:
    """Stage out and clean up after one job; return what the stage-out did (None: no scratch)."""
    setup_logging("epilog", "?")
    try:
        ctx = load_context("epilog", env, cfg, "epilog_timeout")
    except (ConfigError, InvalidJob) as e:
        log.error("epilog skipped: %s", e)
        return None
    base_fd = ctx.open_base()
    try:
        os.close(open_state_dir(base_fd))
        result = _stage_and_clean(ctx, base_fd)
    except Exception:  # a bug here must not drain every node
        log.exception("epilog failed; scratch %s left in place", ctx.scratch)
        result = StageResult("failed", "epilog error")
    finally:
        os.close(base_fd)
    _remove_io_cgroup(ctx)
    _remove_metrics(ctx)
    log.info("epilog done in %.0f ms: %s", ctx.deadline.elapsed_ms(), result)
    return result


def _stage_and_clean(ctx: HookContext, base_fd: int) -> StageResult | None:
    job = ctx.job
    name = job.dir_name
    ledger = Ledger(ctx.state_dir, 0)
    try:
        os.stat(name, dir_fd=base_fd, follow_symlinks=False)
    except FileNotFoundError:
        # Already cleaned (a second run), or the job got no scratch.
        loopfs.unmount_image(ctx.base, name, ctx.deadline.left())
        ledger.release(job.job_id)
        _remove_report(ctx)
        return None
    if os.path.lexists(fast_dir(ctx.scratch)):
        result = stage_out(fast_dir(ctx.scratch), ctx.default_durable, job, ctx.deadline.left(CLEANUP_RESERVE),
                           _stage_limits(ctx, base_fd, ledger))  # fmt: skip
    else:
        result = StageResult("none", "no ckpt dir in scratch")
    log.info("stage-out %s: %r", result.status, result.detail)
    _report_project_changes(ctx, base_fd)
    if not result.scratch_disposable:
        why = f"stage-out {result.status}: {result.detail}"
        log.error("keeping scratch %s and its reservation: it may hold the only copy of "
                  "a checkpoint (%s). Rerun the epilog or copy it by hand.", ctx.scratch, why)  # fmt: skip
        ledger.set_kept(job.job_id, why[:500])
        return result
    loopfs.unmount_image(ctx.base, name, ctx.deadline.left())
    left = remove_job_dir(base_fd, name)
    if left:
        log.warning("could not remove everything in %s: %s", ctx.scratch, "; ".join(left[:10]))
    mount = mount_of(ctx.base)
    if quota.has_project_quota(mount) and int(job.job_id) <= quota.MAX_PROJECT_ID:
        assert mount is not None
        quota.clear_project_limit(mount, int(job.job_id), ctx.deadline.left())
    ledger.release(job.job_id)
    _remove_report(ctx)
    return result


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
        remove_job_textfiles(ctx.cfg.metrics.textfile_dir, ctx.job.job_id)
    except OSError as e:
        log.warning("cannot remove the job's metrics files: %s", e)

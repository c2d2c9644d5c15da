"""The prolog: reserve and create the job's scratch, set its I/O limits, check its storage.

Runs as root before the job starts. Its exit status decides whether Slurm
drains the node, so it fails (raises :class:`StorageError`) only for a node
fault — the scratch base unusable, an I/O error. Everything that is the job's
or the storage's problem becomes a warning in the job's output instead.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import json
import logging
import os
import stat
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..config import Config, IOLimits, format_size, job_dir_name
from ..errors import ConfigError, StorageError, storage_error
from ..fsinfo import block_device, cgroup_mount, mount_of, set_project
from . import cgroup, commands, graveyard, loopfs, mounts, quota
from .hook import HookContext, load_context, setup_logging
from .job import InvalidJob, comment_replicas, comment_size
from .ledger import GRAVE, Ledger
from .report import JobReport
from .scratch import hand_over, make_job_dir, open_state_dir
from .space import check_shared

__all__ = ["run_prolog"]

log = logging.getLogger("slurm_ckpt.node")

NODE_FAULTS = (errno.EIO, errno.EROFS, errno.ENODEV, errno.ENXIO)


def run_prolog(env: Mapping[str, str] | None = None, cfg: Config | None = None) -> JobReport | None:
    """Prepare the node for one job; return the report the TaskProlog will read."""
    setup_logging("prolog", "?")
    try:
        ctx = load_context("prolog", env, cfg, "prolog_timeout")
    except (ConfigError, InvalidJob) as e:
        log.error("prolog skipped, the job runs without slurm-ckpt scratch: %s", e)
        return None
    base_fd = ctx.open_base()
    try:
        state_fd = open_state_dir(base_fd)
        try:
            report = _prepare(ctx, base_fd, state_fd)
            _write_report(ctx, report, base_fd, state_fd)
        finally:
            os.close(state_fd)
    except OSError as e:
        if e.errno in NODE_FAULTS:
            raise storage_error(e, "scratch disk failing", e.filename) from e
        log.exception("prolog failed; the job runs without slurm-ckpt scratch")
        return None
    except Exception:  # a bug here must not drain every node
        log.exception("prolog failed; the job runs without slurm-ckpt scratch")
        return None
    finally:
        os.close(base_fd)
    log.info("prolog done in %.0f ms: scratch %s (%d bytes, %s), %d warning(s)", ctx.deadline.elapsed_ms(),
             report.scratch, report.size, report.enforce, len(report.warnings))  # fmt: skip
    return report


def _prepare(ctx: HookContext, base_fd: int, state_fd: int) -> JobReport:
    job, sc = ctx.job, ctx.cfg.scratch
    report = JobReport(job.job_id)
    space = _start_space_check(ctx, report)
    vfs = os.fstatvfs(base_fd)
    capacity = vfs.f_blocks * vfs.f_frsize
    asked = comment_size(job, "ckpt_scratch", report.warnings) or sc.default_size
    # Each node also holds the shards of the ``replicas`` nodes before it in the ring
    # (placement/replicas.py): room for them is reserved with the job's own.
    replicas = comment_replicas(job, sc.replicas, report.warnings)
    asked *= 1 + replicas
    want = _capped(asked, sc.default_size, sc.max_size, max(0, capacity - sc.headroom), report.warnings)
    ledger = Ledger(ctx.state_dir, capacity, sc.headroom)
    # A mount left on this job's name (a kept scratch's, a reused id's) is detached, never followed.
    mounts.detach_foreign(base_fd, job.dir_name, ctx.deadline.left(2.0) / 4)

    def alive(key: str, entry: dict[str, Any]) -> bool:
        if key.startswith(GRAVE):  # held until the reaper has removed it
            return _exists(f"{graveyard.GRAVE_DIR}/{key[len(GRAVE):]}", state_fd)
        # A reservation younger than a prolog's time budget may still be making its dir.
        young = time.time() - float(entry.get("since", 0)) < 2 * sc.prolog_timeout
        return young or _exists(job_dir_name(key), base_fd)

    def set_aside(job_id: str, entry: dict[str, Any]) -> str | None:
        # The id came back for another job: the old job's kept scratch is not this one's.
        return graveyard.set_aside_kept(base_fd, state_fd, job_dir_name(job_id))

    def drop(key: str, entry: dict[str, Any]) -> str | None:
        return graveyard.drop_kept(base_fd, state_fd, key, ctx.deadline.part(0.25, 2.0))

    grant = ledger.reserve(job.job_id, want, uid=job.uid, policy=sc.over_reserve, min_size=sc.min_size,
                           restarts=job.restart_count, alive=alive, set_aside=set_aside, drop=drop,
                           leaked=loopfs.leaked(state_fd, lambda: _image_inodes(state_fd)),
                           replicas=replicas)  # fmt: skip
    report.asked, report.size, report.replicas = asked, grant.size, replicas
    if grant.warning:
        report.warnings.append(grant.warning)
    if grant.size:
        try:
            report.enforce = _make_scratch(ctx, base_fd, state_fd, ledger, grant.size)
            report.scratch = str(ctx.scratch)
        except StorageError as e:
            if e.errno in NODE_FAULTS:
                raise
            ledger.release(job.job_id)
            report.size = 0
            report.warnings.append(f"no node-local scratch on this node: {e.strerror}")
    if graveyard.due(ledger.snapshot, state_fd, sc.keep_failed):
        graveyard.start_reaper(ctx)
    report.io_cgroup = _io_limits(ctx)
    # The check runs since the start of _prepare; give it what is left of check_timeout.
    space.join(max(0.0, min(sc.check_timeout - ctx.deadline.elapsed_ms() / 1000, ctx.deadline.left())))
    if space.is_alive():
        report.warnings.append(f"the checkpoint storage check did not finish in {sc.check_timeout:.0f}s "
                               f"({ctx.cfg.storage.root} slow or hung?)")  # fmt: skip
    return report


def _capped(asked: int, default: int, max_size: int, reservable: int, warnings: list[str]) -> int:
    """What to reserve for a job asking for ``asked`` bytes: at most ``max_size``, and the
    default for a request no filesystem here could ever hold, never all that is free."""
    if max_size and asked > max_size:
        warnings.append(f"this job asked for {format_size(asked)} of node-local scratch; one job gets "
                        f"at most {format_size(max_size)} on this node (scratch.max_size)")  # fmt: skip
        return max_size
    if not max_size and asked > reservable:
        warnings.append(f"this job asked for {format_size(asked)} of node-local scratch, more than this "
                        f"node could ever reserve ({format_size(reservable)}); it gets the default, "
                        f"{format_size(default)}")  # fmt: skip
        return min(default, reservable)
    return asked


def _image_inodes(state_fd: int) -> set[int]:
    """Inodes of the images the ledger accounts for: in the image dir and the graveyard."""
    out: set[int] = set()
    for sub in (loopfs.IMAGE_DIR, graveyard.GRAVE_DIR):
        try:
            fd = os.open(sub, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=state_fd)
        except OSError:
            continue
        try:
            with os.scandir(fd) as it:
                out.update(e.inode() for e in itertools.islice(it, 100_000))
        finally:
            os.close(fd)
    return out


def _exists(name: str, dir_fd: int) -> bool:
    # Not a stat: another job's dir may carry its user's FUSE mount, dead or answering EIO.
    return mounts.exists(dir_fd, name)


def _write_report(ctx: HookContext, report: JobReport, base_fd: int, state_fd: int) -> None:
    """Root's report, which the job's user may read but not change (see :class:`JobReport`)."""
    job_fd = -1
    if report.scratch:
        with contextlib.suppress(OSError):
            job_fd = os.open(ctx.job.dir_name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                             dir_fd=base_fd)  # fmt: skip
    try:
        how = report.write(state_fd, ctx.job.uid, job_fd if job_fd >= 0 else None)
    finally:
        if job_fd >= 0:
            os.close(job_fd)
    if how == "copy":
        log.warning("%s has no POSIX ACLs: the job reads a read-only copy of its report in %s instead",
                    ctx.base, ctx.scratch)  # fmt: skip
    elif not how:
        log.warning("%s has no POSIX ACLs and no copy of the report is in the job's scratch: its "
                    "warnings are only here: %s", ctx.base, "; ".join(report.warnings) or "none")  # fmt: skip


def _make_scratch(ctx: HookContext, base_fd: int, state_fd: int, ledger: Ledger, size: int) -> str:
    """Create the job dir, enforce ``size`` on it, then hand it over; return how it is enforced.

    The limit goes on before the user gets the directory: no process of the
    user can open it while it is still the unlimited base filesystem.
    """
    job, sc = ctx.job, ctx.cfg.scratch
    fd = make_job_dir(base_fd, job.dir_name, job.uid)
    try:
        mode = sc.enforce
        mount = mount_of(ctx.base)
        if mode == "auto":
            # A loop filesystem wherever it works: a project quota limits nothing in the init
            # user namespace, where a file's owner may change its project id.
            mode = "loop" if _loop_works(sc.loop_fstype) else "quota" if quota.has_project_quota(mount) else "none"
        if mode == "loop":
            if not loopfs.is_mount_point(base_fd, job.dir_name):
                loopfs.mount_image(state_fd, job.dir_name, fd, size, sc.loop_fstype, sc.max_inodes,
                                   ctx.deadline.part(1.0, 2.0))  # fmt: skip
            os.close(fd)
            fd = -1
            _refuse_foreign_image(base_fd, state_fd, ledger, job.dir_name, job.uid)
            # The mounted filesystem's root: made by mkfs (root's), or the job's own (kept).
            fd = make_job_dir(base_fd, job.dir_name, job.uid)
        elif mode == "quota":
            if mount is None or not quota.has_project_quota(mount):
                log.error("scratch.enforce is quota but %s is not mounted with prjquota", ctx.base)
                mode = "none"
            elif int(job.job_id) > quota.MAX_PROJECT_ID:
                mode = "none"
            else:
                projid = int(job.job_id)
                set_project(fd, projid)
                if why := quota.set_project_limit(mount, projid, size, ctx.deadline.left(2.0), sc.max_inodes):
                    log.error("cannot set project quota %d on %s: %s", projid, ctx.scratch, why)
                    mode = "none"
        hand_over(fd, job.uid, job.gid)
        return mode
    finally:
        if fd >= 0:
            os.close(fd)


def _refuse_foreign_image(base_fd: int, state_fd: int, ledger: Ledger, name: str, uid: int) -> None:
    """A kept image that the ledger lost track of, and another user's: set it aside for the
    admin, never hand it to this job."""
    st = os.stat(name, dir_fd=base_fd, follow_symlinks=False)
    if st.st_uid in (uid, 0):
        return
    grave = graveyard.set_aside_kept(base_fd, state_fd, name)
    if grave is not None:
        ledger.hold(GRAVE + grave, {"size": 0, "uid": st.st_uid, "kept": "a kept image of another user "
                                    "with no ledger entry", "kept_since": time.time()})  # fmt: skip
    raise StorageError(errno.EEXIST, "a kept scratch image of another user was in the way; set aside "
                       "for the admin", name)  # fmt: skip


def _loop_works(fstype: str) -> bool:
    """Whether this node can make and mount a per-job image: loop devices, mkfs and mount."""
    return os.path.exists("/dev/loop-control") and bool(commands.which(f"mkfs.{fstype}") and commands.which("mount"))


def _start_space_check(ctx: HookContext, report: JobReport) -> threading.Thread:
    """Check the shared checkpoint storage in a thread, so a hung NFS costs only check_timeout."""
    job, cfg = ctx.job, ctx.cfg

    def check() -> None:
        if not cfg.storage.root:
            return
        warnings: list[str] = []
        expected = comment_size(job, "ckpt_size", warnings)
        chk = check_shared(cfg.storage.root, job, cfg.storage.keep, expected, "--comment ckpt_size",
                           fallback=cfg.scratch.expected_ckpt_size, timeout=cfg.scratch.check_timeout)  # fmt: skip
        report.checks["storage"] = chk.to_dict()
        report.warnings.extend(warnings + chk.warnings)

    t = threading.Thread(target=_logged(check), name="space-check", daemon=True)
    t.start()
    return t


def _logged(fn: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        try:
            fn()
        except Exception:  # a check must never fail the prolog
            log.exception("storage check failed")

    return run


def _io_limits(ctx: HookContext) -> str | None:
    """Set up the job's I/O cgroup; return the v1 path the wrapper should join, if any."""
    io, job = ctx.cfg.io, ctx.job
    limits = io.for_partition(job.partition)
    if not io.enabled or limits == IOLimits():
        return None
    try:
        device = _device(ctx)
        root = Path(io.cgroup_root) if io.cgroup_root else None
        if root is None:
            m = cgroup_mount("blkio") or cgroup_mount("unified")
            root = Path(m.mount_point) if m else None
        if root is None:
            log.info("no blkio or cgroup2 mount: I/O limits not set")
            return None
        if not (root / "cgroup.controllers").exists():
            return str(cgroup.setup_v1(root, job.dir_name, job.uid, job.gid, limits, device))
        if "io" not in (root / "cgroup.controllers").read_text().split():
            log.info("cgroup v2 at %s has no io controller: I/O limits not set", root)
            return None
        _spawn_v2(root, io.v2_job_cgroup.format(job_id=job.job_id), limits, device, io.v2_wait)
    except (OSError, ValueError) as e:
        log.warning("I/O limits not set: %s", e)
    return None


def _device(ctx: HookContext) -> tuple[int, int] | None:
    if ctx.cfg.io.device:
        rdev = os.stat(ctx.cfg.io.device).st_rdev
        return os.major(rdev), os.minor(rdev)
    mount = mount_of(ctx.base)
    return block_device(mount) if mount else None


def _spawn_v2(root: Path, rel: str, limits: IOLimits, device: tuple[int, int] | None, wait: float) -> None:
    """Start a detached helper: Slurm makes the v2 job cgroup only after the prolog exits.

    A fresh interpreter, not a fork: the prolog has a thread running.
    """
    import subprocess
    args = json.dumps({"root": str(root), "rel": rel, "limits": asdict(limits),
                       "device": device, "wait": wait})  # fmt: skip
    # slurmd reads the prolog's output until EOF, so the helper must not hold
    # a pipe to it; a log file (the shim's) is fine.
    err = None if stat.S_ISREG(os.fstat(2).st_mode) else subprocess.DEVNULL
    # Isolated (-I) and from /: with -m, Python would otherwise import from slurmd's
    # working directory first, and a slurm_ckpt/ planted there would run as root.
    subprocess.Popen([sys.executable, "-I", "-m", "slurm_ckpt.node.cgroup", args], cwd="/",
                     start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                     stderr=err)  # fmt: skip

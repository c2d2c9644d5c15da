"""The graveyard: scratch that the hooks could not remove within their own deadline.

A job dir the epilog could not empty in time (ten million files, a chain
thousands of levels deep, another job of the user still filling it), an image
still held by a process after its lazy unmount, a kept scratch past
``scratch.keep_failed`` or one whose job id came back for another job: each
is renamed into ``<base>/.slurm-ckpt/grave/`` (root-only, mode 0700). A
rename takes no time whatever the tree holds, and no user reaches it by path
any more. Its reservation moves with it in the ledger (``grave/<name>``), so
the space counts as taken until it is really free.

A reaper removes graves in the background: the next prolog or epilog starts
one (a fresh interpreter, detached) when there is work, it spends at most
``scratch.reap_budget`` seconds, one runs at a time, and what it leaves waits
for the next. A hook never waits for it, so nothing in the graveyard can make
a hook late or make it fail.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import json
import logging
import os
import stat
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config import job_dir_name
from . import loopfs
from .deadline import Deadline
from .ledger import GRAVE, Ledger
from .rootdir import open_private_subdir
from .scratch import STATE_DIR, Removal, clear_dir

if TYPE_CHECKING:
    from .hook import HookContext

__all__ = ["GRAVE_DIR", "bury", "clear", "drop_kept", "due", "expire_kept", "open_grave", "reap",
           "set_aside_kept", "start_reaper"]  # fmt: skip

log = logging.getLogger("slurm_ckpt.node")

GRAVE_DIR = "grave"
"""Under the state dir."""
REAPER_LOCK = "reaper.lock"
ORPHAN_GRACE = 3600.0
"""Seconds a grave without a ledger entry waits before the reaper takes it: longer than any
hook runs between burying something and recording it."""
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_UMOUNT_TIMEOUT = 30.0


def open_grave(state_fd: int) -> int:
    """The root-only graveyard dir (mode 0700), by fd."""
    return open_private_subdir(state_fd, GRAVE_DIR, "the graveyard")


def bury(src_dir_fd: int, name: str, state_fd: int) -> str | None:
    """Rename ``name`` (in ``src_dir_fd``) into the graveyard; return its name there.

    None when there is nothing at ``name``. Same filesystem, so it is a rename:
    instant, whatever the tree holds, and never following a link.
    """
    grave = f"{name}-{int(time.time())}-{os.urandom(4).hex()}"
    fd = open_grave(state_fd)
    try:
        os.rename(name, grave, src_dir_fd=src_dir_fd, dst_dir_fd=fd)
    except FileNotFoundError:
        return None
    finally:
        os.close(fd)
    return grave


def clear(grave_fd: int, name: str, deadline: Deadline | None) -> Removal:
    """Remove the grave ``name`` until ``deadline``; ``done`` once it is gone.

    An image is deleted only once no loop device holds it any more: until
    then its blocks are alive, whatever the name says.
    """
    try:
        st = os.stat(name, dir_fd=grave_fd, follow_symlinks=False)
    except FileNotFoundError:
        return Removal(done=True)
    if not stat.S_ISDIR(st.st_mode):
        if stat.S_ISREG(st.st_mode):
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=grave_fd)
            try:
                busy = loopfs.attached(fd)
            finally:
                os.close(fd)
            if busy:
                out = Removal()
                out.note(name, "an image still mounted somewhere (a process holds a file in it)")
                return out
        os.unlink(name, dir_fd=grave_fd)
        return Removal(done=True, removed=1)
    fd = os.open(name, _DIR, dir_fd=grave_fd)
    try:
        out = clear_dir(fd, deadline)
    finally:
        os.close(fd)
    if out.done:
        try:
            os.rmdir(name, dir_fd=grave_fd)
            out.removed += 1
        except FileNotFoundError:
            pass
        except OSError as e:
            out.done = False  # refilled meanwhile: a later pass
            out.note(name, e.strerror or str(e))
    return out


def _expired(entry: Mapping[str, Any], keep_failed: float, now: float) -> bool:
    keep = min(keep_failed, float(entry.get("keep_for", keep_failed)))
    return bool(entry.get("kept")) and now - float(entry.get("kept_since", now)) > keep


def _orphan(name: str, entries: Mapping[str, Any], now: float) -> bool:
    """A grave the ledger does not hold (the ledger was reset, a hook died between the rename
    and the ledger), old enough that no hook is still about to record it."""
    if GRAVE + name in entries:
        return False
    try:
        buried = int(name.rsplit("-", 2)[-2])
    except (IndexError, ValueError):
        return True  # not a name we make
    return now - buried > ORPHAN_GRACE


def due(entries: Mapping[str, Mapping[str, Any]], state_fd: int, keep_failed: float) -> bool:
    """Whether a reaper has work: a grave to remove, or a kept scratch past ``keep_failed``."""
    now = time.time()
    for key, entry in entries.items():
        if _expired(entry, keep_failed, now) or (key.startswith(GRAVE) and not entry.get("kept")):
            return True
    try:
        fd = os.open(GRAVE_DIR, _DIR, dir_fd=state_fd)
    except OSError:
        return False
    try:
        with os.scandir(fd) as it:
            return any(_orphan(e.name, entries, now) for e in itertools.islice(it, 10_000))
    finally:
        os.close(fd)


def _release_image(base_fd: int, state_fd: int, name: str, timeout: float = _UMOUNT_TIMEOUT) -> str | None:
    """Unmount ``name``'s image; bury it if a process still holds it. Returns the grave, if any."""
    held = loopfs.unmount_image(base_fd, state_fd, name, timeout)
    if held is None:
        return None
    os.close(held)
    img_dir = loopfs.open_image_dir(state_fd)
    try:
        return bury(img_dir, f"{name}.img", state_fd)
    finally:
        os.close(img_dir)


def set_aside_kept(base_fd: int, state_fd: int, name: str) -> str | None:
    """Move a kept scratch out of its job's name into the graveyard, for the admin.

    For a job id that came back for another job (a different user, or a run
    that is not the next one of the job that kept it). It may hold the only
    copy of the old job's checkpoint, so it is not removed: it waits in the
    graveyard until ``scratch.keep_failed`` is up. Returns the grave's name.
    """
    image = None
    if loopfs.is_mount_point(base_fd, name) or _has_image(state_fd, name):
        # Unmounted and kept as the image itself: it mounts again anywhere.
        held = loopfs.unmount_image(base_fd, state_fd, name, _UMOUNT_TIMEOUT, delete=False)
        if held is not None:
            os.close(held)
        img_dir = loopfs.open_image_dir(state_fd)
        try:
            image = bury(img_dir, f"{name}.img", state_fd)
        finally:
            os.close(img_dir)
        with contextlib.suppress(OSError):
            os.rmdir(name, dir_fd=base_fd)  # the empty mount point
    tree = bury(base_fd, name, state_fd)
    grave = image or tree
    if grave:
        log.warning("%s holds a kept scratch of another job with the same id; moved to %s/%s/%s "
                    "for the admin (removed after scratch.keep_failed)", name, STATE_DIR, GRAVE_DIR, grave)  # fmt: skip
    return grave


def _has_image(state_fd: int, name: str) -> bool:
    try:
        img_dir = loopfs.open_image_dir(state_fd)
    except OSError:
        return False
    try:
        os.stat(f"{name}.img", dir_fd=img_dir, follow_symlinks=False)
    except OSError:
        return False
    finally:
        os.close(img_dir)
    return True


def expire_kept(base_fd: int, state_fd: int, ledger: Ledger, job_id: str, entry: Mapping[str, Any],
                keep_failed: float) -> None:  # fmt: skip
    """Give up on a kept scratch after ``keep_failed``: into the graveyard, with a clear log line."""
    name = job_dir_name(job_id)
    since = float(entry.get("kept_since", 0))
    log.warning("job %s: kept scratch %s expired: kept since %s (%.1f days, scratch.keep_failed is %.1f "
                "days) because %s; removing it now. A checkpoint only there was never staged out.",
                job_id, name, time.strftime("%Y-%m-%d %H:%M", time.localtime(since)),
                (time.time() - since) / 86400, keep_failed / 86400, str(entry.get("kept"))[:300])  # fmt: skip
    image = _release_image(base_fd, state_fd, name)
    tree = bury(base_fd, name, state_fd)
    grave = image or tree
    if grave is None:
        ledger.release(job_id)
    else:
        ledger.bury(job_id, grave, expired=True)
    if image and tree:
        grave_fd = open_grave(state_fd)
        try:
            clear(grave_fd, tree, None)  # the empty mount point the image was on
        finally:
            os.close(grave_fd)


def drop_kept(base_fd: int, state_fd: int, key: str, deadline: Deadline) -> str | None:
    """Remove the kept scratch under ledger key ``key`` now, within ``deadline``.

    For a job that needs its room, or a user over ``scratch.keep_per_user``.
    Returns None once its blocks are free, else the grave that still holds
    them (an image a process holds, a tree too big for the deadline).
    """
    grave_fd = open_grave(state_fd)
    try:
        if key.startswith(GRAVE):  # set aside for the admin, already in the graveyard
            name = key[len(GRAVE):]
            return None if clear(grave_fd, name, deadline).done else name
        name = job_dir_name(key)
        image = _release_image(base_fd, state_fd, name, deadline.left())
        tree = bury(base_fd, name, state_fd)
        if tree is not None and clear(grave_fd, tree, deadline).done:
            tree = None
        return image or tree  # a tree left beside a held image is an orphan: the reaper's
    finally:
        os.close(grave_fd)


def start_reaper(ctx: HookContext) -> None:
    """Start a reaper in the background; the hook does not wait for it.

    A fresh interpreter, not a fork (the prolog has a thread running),
    isolated (``-I``) and started in ``/``, in a session of its own so the
    shim's watchdog never kills it with the hook.
    """
    import subprocess

    sc = ctx.cfg.scratch
    args = json.dumps({"base": sc.base, "keep_failed": sc.keep_failed, "budget": sc.reap_budget})
    # slurmd reads the hook's output until EOF, so the reaper must not hold a
    # pipe to it; the shim's log file is fine.
    err = None if stat.S_ISREG(os.fstat(2).st_mode) else subprocess.DEVNULL
    try:
        subprocess.Popen([sys.executable, "-I", "-m", "slurm_ckpt.node.graveyard", args], cwd="/",
                         start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=err, close_fds=True)  # fmt: skip
    except OSError as e:
        log.warning("cannot start the scratch reaper: %s", e)


def reap(base: str, keep_failed: float, budget: float, wait: bool = False) -> bool:
    """Expire kept scratch past ``keep_failed`` and remove graves, for at most ``budget`` s.

    Returns False if another reaper holds the lock (it does the work), or
    with ``wait``, runs once that one is done. Runs in the background; also
    callable directly (an admin, a test).
    """
    deadline = Deadline(budget)
    base_fd = os.open(base, _DIR)
    try:
        state_fd = os.open(STATE_DIR, _DIR, dir_fd=base_fd)
        try:
            lock = os.open(REAPER_LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                           dir_fd=state_fd)  # fmt: skip
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            except BlockingIOError:
                os.close(lock)
                return False
            try:
                _reap(base, base_fd, state_fd, Ledger(Path(base) / STATE_DIR, 0), keep_failed, deadline)
            finally:
                os.close(lock)
        finally:
            os.close(state_fd)
    finally:
        os.close(base_fd)
    return True


def _reap(base: str, base_fd: int, state_fd: int, ledger: Ledger, keep_failed: float,
          deadline: Deadline) -> None:  # fmt: skip
    now = time.time()
    for key, entry in ledger.entries().items():
        if key.isdigit() and _expired(entry, keep_failed, now):
            try:
                expire_kept(base_fd, state_fd, ledger, key, entry, keep_failed)
            except OSError as e:
                log.error("job %s: cannot expire its kept scratch: %s", key, e)
    entries = ledger.entries()
    grave_fd = open_grave(state_fd)
    try:
        with os.scandir(grave_fd) as it:
            names = [e.name for e in itertools.islice(it, 10_000)]  # bounded; the rest next time
        for name in names:
            if deadline.left() <= 0:
                log.info("reaper out of its budget; the rest waits for the next one")
                return
            if GRAVE + name not in entries and not _orphan(name, entries, now):
                continue  # a hook is about to record it
            entry = entries.get(GRAVE + name, {})
            if entry.get("kept") and not _expired(entry, keep_failed, now):
                continue  # set aside for the admin, not yet due
            out = clear(grave_fd, name, deadline)
            if not out.done:
                log.info("grave %s: %s", name, out)
                continue
            log.info("grave %s removed (%d entries)", name, out.removed)
            size = ledger.release(GRAVE + name)
            if entry.get("projid") is not None:
                _clear_quota(base, int(entry["projid"]))
            if size:
                log.info("released its reservation of %d bytes", size)
    finally:
        os.close(grave_fd)


def _clear_quota(base: str, projid: int) -> None:
    from ..fsinfo import mount_of
    from . import quota

    mount = mount_of(base)
    if mount is not None and quota.has_project_quota(mount):
        quota.clear_project_limit(mount, projid, _UMOUNT_TIMEOUT)


def main(argv: list[str]) -> int:
    from .hook import setup_logging

    setup_logging("reaper", "-")
    try:
        args = json.loads(argv[1])
        with contextlib.suppress(OSError):
            os.nice(19)  # background work: the jobs come first
        reap(str(args["base"]), float(args["keep_failed"]), float(args["budget"]))
    except Exception:  # the reaper is best effort: the next hook starts another
        log.exception("scratch reaper failed")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

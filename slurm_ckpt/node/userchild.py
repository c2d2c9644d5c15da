"""A forked child that does one piece of work as the job's user, with its output captured.

The epilog runs as root; the stage-out reads and writes what the user wrote.
So root forks, and the child, before it reads anything, closes every fd
root opened (the scratch base, the hook log, a lock), takes the user's uid,
gid and groups for good, and bounds its memory. Its log records go through a
pipe that the parent reads up to :data:`OUTPUT_LIMIT` and then logs line by
line, escaped: the child never writes to root's log. Its result comes back
as bytes through a second pipe, within a deadline after which it is killed.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import resource
import select
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn

from .escape import OneLineFormatter, escape
from .job import Job

__all__ = ["CHILD_MEMORY", "OUTPUT_LIMIT", "RESULT_LIMIT", "Outcome", "run_as_user"]

log = logging.getLogger("slurm_ckpt.node")

CHILD_MEMORY = 4 * 1024**3
"""Address space (bytes) the child may map on top of what it inherited from the fork."""
OUTPUT_LIMIT = 16 * 1024
"""Bytes of the child's output (its log records) that reach the hook log."""
RESULT_LIMIT = 64 * 1024
"""Bytes of the child's result that the parent reads."""


@dataclass(frozen=True)
class Outcome:
    """What came back: the result (None: killed at the deadline, or it died first)."""

    result: bytes | None
    timed_out: bool
    stopped: bool = False
    """Killed because it was stopped: it runs as the user, so the user can SIGSTOP it, and
    waiting for it then would only hold the hook up until its deadline."""


_POLL = 0.2
"""Seconds between looks at whether the child was stopped, while it is silent."""


def _stopped(pid: int) -> bool:
    try:
        info = os.waitid(os.P_PID, pid, os.WSTOPPED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return False
    return info is not None and info.si_code == os.CLD_STOPPED


def _keep_only(out_fd: int, result_fd: int) -> None:
    """Close every fd but stdin (/dev/null), stdout and stderr (``out_fd``) and fd 3 (``result_fd``)."""
    # Above 3 first, so that the dup2 calls below cannot clobber one with the other.
    out = fcntl.fcntl(out_fd, fcntl.F_DUPFD, 10)
    res = fcntl.fcntl(result_fd, fcntl.F_DUPFD, 10)
    null = os.open(os.devnull, os.O_RDONLY)
    for src, dst in ((null, 0), (out, 1), (out, 2), (res, 3)):
        os.dup2(src, dst)
    for name in os.listdir("/proc/self/fd"):
        if int(name) > 3:
            with contextlib.suppress(OSError):  # the listing's own fd, closed already
                os.close(int(name))


def _inherited_address_space() -> int:
    """Bytes of address space this process maps now (VmSize)."""
    with open("/proc/self/statm", "rb") as f:
        return int(f.read().split()[0]) * resource.getpagesize()


def _bound_memory() -> None:
    """Let the child map at most :data:`CHILD_MEMORY` more than the fork gave it.

    The limit counts from what the child inherited: the parent's mappings
    (libraries, thread stacks and malloc arenas) are no measure of what user
    data can make the child allocate, and a fixed limit below them would
    leave the child unable to allocate anything at all. A lower limit the
    hook was started with stays.
    """
    limit = _inherited_address_space() + CHILD_MEMORY
    for given in resource.getrlimit(resource.RLIMIT_AS):
        if given != resource.RLIM_INFINITY:
            limit = min(limit, given)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _become(job: Job, groups: list[int], file_size: int | None) -> None:
    """Take the job user's identity for good (real, effective and saved ids)."""
    # This child runs outside the job's cgroup: bound what user data can make it allocate.
    _bound_memory()
    if file_size is not None:
        # And what it can write to one file; a write past it fails (EFBIG) instead of killing the child.
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_size, file_size))
    os.setgroups(groups)
    os.setresgid(job.gid, job.gid, job.gid)
    os.setresuid(job.uid, job.uid, job.uid)
    os.umask(0o077)
    os.chdir("/")


def _child(job: Job, groups: list[int], work: Callable[[], bytes], log_filter: logging.Filter | None,
           out_fd: int, result_fd: int, file_size: int | None) -> NoReturn:  # fmt: skip
    try:
        _keep_only(out_fd, result_fd)
        _become(job, groups, file_size)
        # Records go to the pipe the parent reads, one escaped line each; never to root's log.
        stream = open(2, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False)  # noqa: SIM115
        sys.stdout = sys.stderr = stream
        handler = logging.StreamHandler(stream)
        handler.setFormatter(OneLineFormatter("%(levelname)s: %(message)s"))
        if log_filter is not None:
            handler.addFilter(log_filter)
        for name in ("slurm_ckpt", ""):  # ours, and the root logger others propagate to
            logging.getLogger(name).handlers[:] = [handler]
        result = work()
    except BaseException as e:  # before work() ran (work() reports its own): the parent sees no result
        with contextlib.suppress(Exception):
            log.error("cannot run as user %s: %s: %s", job.user, type(e).__name__, escape(e))
        result = b""
    try:
        sys.stderr.flush()
        if result:
            os.write(3, result[:RESULT_LIMIT])
    finally:
        os._exit(0)


def _reap(pid: int, wait: float) -> None:
    # Bounded: a child stuck in an unkillable NFS write must not hang the epilog too.
    end = time.monotonic() + wait
    while os.waitpid(pid, os.WNOHANG) == (0, 0) and time.monotonic() < end:
        time.sleep(0.01)


def _collect(pid: int, result_fd: int, out_fd: int, timeout: float) -> tuple[bytes | None, bytes, int, bool]:
    """Read the child's result and output until both end; (None, ...) if ``timeout`` passes
    first, or the child is stopped (the last item then True).

    Returns (result, the first OUTPUT_LIMIT bytes of output, bytes of output dropped, stopped).
    Output past the cap is read and thrown away, so a chatty child never blocks on it.
    """
    result, output, dropped = b"", b"", 0
    open_fds = {result_fd, out_fd}
    deadline = time.monotonic() + timeout
    while open_fds:
        left = deadline - time.monotonic()
        if left <= 0:
            return None, output, dropped, False
        ready = select.select(list(open_fds), [], [], min(left, _POLL))[0]
        if not ready and _stopped(pid):
            return None, output, dropped, True
        for fd in ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                open_fds.discard(fd)
            elif fd == result_fd:
                result = (result + chunk)[:RESULT_LIMIT]
            else:
                room = max(0, OUTPUT_LIMIT - len(output))
                output += chunk[:room]
                dropped += len(chunk) - min(room, len(chunk))
    return result, output, dropped, False


def _relay(name: str, output: bytes, dropped: int) -> None:
    """Log the child's captured records, each escaped at its own level (WARNING if it has none)."""
    for line in output.decode("utf-8", "backslashreplace").splitlines():
        level, sep, msg = line.partition(": ")
        lvl = logging.getLevelName(level) if sep else None
        if not isinstance(lvl, int):
            lvl, msg = logging.WARNING, line
        log.log(lvl, "%s: %s", name, escape(msg))
    if dropped:
        log.warning("%s: %d more bytes of its output dropped", name, dropped)


def run_as_user(job: Job, work: Callable[[], bytes], timeout: float, *, name: str,
                log_filter: logging.Filter | None = None, file_size: int | None = None) -> Outcome:  # fmt: skip
    """Run ``work`` as ``job``'s user in a forked child; its output is logged as ``name``.

    ``work`` returns the result bytes and reports its own errors in them; an
    exception out of it leaves no result. ``log_filter`` goes on the child's
    log handler; ``file_size`` bounds each file it writes (``RLIMIT_FSIZE``).
    Every module ``work`` imports must be imported before: the user may not
    be able to read them. Never raises for what the child does.
    """
    try:
        groups = os.getgrouplist(job.user, job.gid)  # here: no name service lookups in the forked child
    except OSError:
        groups = [job.gid]  # fewer rights, never more
    result_r, result_w = os.pipe()
    out_r, out_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        _child(job, groups, work, log_filter, out_w, result_w, file_size)
    os.close(result_w)
    os.close(out_w)
    try:
        result, output, dropped, stopped = _collect(pid, result_r, out_r, timeout)
        if result is None:
            os.kill(pid, signal.SIGKILL)
    finally:
        os.close(result_r)
        os.close(out_r)
    _reap(pid, 5.0)
    _relay(name, output, dropped)
    return Outcome(result or None, result is None and not stopped, stopped)

"""The child's process tree: start it, find every descendant, and end them all.

The wrapper makes itself a *child subreaper* (``PR_SET_CHILD_SUBREAPER``), so a
descendant orphaned by its parent's death (a DataLoader worker, a process that
called ``setsid`` to daemonize) is re-parented to the wrapper instead of init.
"Every descendant" is then the ``ppid`` closure of the wrapper in ``/proc``,
and the tree is gone exactly when that closure is empty. A leftover process
matters on Slurm: one alive after SIGKILL drains the node ("kill task failed").
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

__all__ = ["ProcInfo", "Teardown", "become_subreaper", "descendants", "kill_tree", "reap", "start_child"]

log = logging.getLogger("slurm_ckpt")

_PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Adopt orphaned descendants (Linux >= 3.4). False where that is unavailable."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def start_child(
    argv: Sequence[str], env: Mapping[str, str], ignore: Iterable[signal.Signals]
) -> subprocess.Popen[bytes]:
    """Start ``argv`` with the ``ignore`` signals set to SIG_IGN.

    SIG_IGN survives exec, so a signal that lands while the trainer is still
    importing torch is ignored instead of killing it; the library's handler
    replaces it once installed. The child keeps our session and process group,
    so an interactive ``srun --pty`` still owns its terminal.
    """
    sigs = list(ignore)

    def in_child() -> None:
        for sig in sigs:
            signal.signal(sig, signal.SIG_IGN)

    # preexec_fn is safe here: the wrapper runs no threads.
    return subprocess.Popen(list(argv), env=dict(env), preexec_fn=in_child)


@dataclass(frozen=True)
class ProcInfo:
    pid: int
    ppid: int
    state: str
    """One letter from /proc/PID/stat: R, S, D (uninterruptible I/O), Z (zombie)…"""
    comm: str


def _stat(pid: int) -> ProcInfo | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode(errors="replace")
    except OSError:
        return None
    # comm may hold spaces and parentheses; it ends at the last ')'.
    lpar, rpar = raw.find("("), raw.rfind(")")
    rest = raw[rpar + 2 :].split()
    return ProcInfo(pid, int(rest[1]), rest[0], raw[lpar + 1 : rpar])


def descendants(root: int) -> list[ProcInfo]:
    """Every live or zombie process below ``root``, found through /proc."""
    children: dict[int, list[ProcInfo]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            info = _stat(int(name))
            if info is not None:
                children.setdefault(info.ppid, []).append(info)
    out: list[ProcInfo] = []
    todo = [root]
    while todo:
        for info in children.get(todo.pop(), []):
            out.append(info)
            todo.append(info.pid)
    return out


def reap(on_exit: Callable[[int, int], None] | None = None) -> int:
    """Collect every exited child without blocking; ``on_exit(pid, status)`` for each."""
    n = 0
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return n
        if pid == 0:
            return n
        n += 1
        if on_exit is not None:
            on_exit(pid, status)


@dataclass
class Teardown:
    """What :func:`kill_tree` did: the pids it signalled and any it could not end."""

    terminated: list[int] = field(default_factory=list)
    killed: list[int] = field(default_factory=list)
    stragglers: list[ProcInfo] = field(default_factory=list)


def kill_tree(
    root: int,
    *,
    grace: float = 1.0,
    timeout: float = 10.0,
    on_exit: Callable[[int, int], None] | None = None,
) -> Teardown:
    """End every descendant of ``root`` (normally the wrapper itself): TERM, then KILL.

    SIGTERM first gives a process ``grace`` seconds to clean up; then SIGKILL,
    repeated as re-parented orphans appear, until none is left or ``timeout``
    passes. Survivors (typically stuck in D state on a dead filesystem) are
    returned as stragglers for the caller to report.
    """
    report = Teardown()
    start = time.monotonic()
    for p in descendants(root):
        if p.state != "Z" and _signal(p.pid, signal.SIGTERM):
            report.terminated.append(p.pid)
    while True:
        reap(on_exit)
        left = [p for p in descendants(root)]
        if not left:
            return report
        elapsed = time.monotonic() - start
        if elapsed >= grace:
            for p in left:
                if p.state != "Z" and p.pid not in report.killed and _signal(p.pid, signal.SIGKILL):
                    report.killed.append(p.pid)
        if elapsed >= grace + timeout:
            report.stragglers = left
            return report
        # Polling /proc for a condition, with a deadline: exits of non-children
        # raise no SIGCHLD here, so there is no event to wait on.
        time.sleep(0.02)


def _signal(pid: int, sig: signal.Signals) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False
    except PermissionError as e:
        log.warning("cannot signal pid %d: %s", pid, e)
        return False

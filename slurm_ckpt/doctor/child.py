"""The checks that touch the storage run in a child process, under a deadline.

On a hung network mount, ``stat``, ``statfs`` and ``write`` block, and a
FUSE client such as ceph-fuse may never return an error: the caller sits in
uninterruptible sleep, where even SIGKILL waits until the servers come back.
The doctor must still answer, so those calls happen in a grandchild (reparented
away, so nobody has to reap it) that sends each finding up a pipe as soon as it
has it. The doctor waits for each check only as long as that check may take; a
check that overruns is reported as a hung or slow mount, and the grandchild is
left behind, killed, to finish when its call returns.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import select
import signal
import struct
import time
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["Outbox", "messages"]

_LEN = struct.Struct("=I")


class Outbox:
    """The child's end: each ``send`` is one pickled message, written at once."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def send(self, *msg: Any) -> None:
        data = pickle.dumps(msg)
        out = memoryview(_LEN.pack(len(data)) + data)
        while out:
            out = out[os.write(self.fd, out) :]


def _spawn(work: Callable[[Outbox], None]) -> tuple[int, int]:
    """Start ``work`` in a grandchild; return (its pid, the read end of its pipe)."""
    r, w = os.pipe()
    pid_r, pid_w = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the forked processes
        try:
            os.close(r)
            os.close(pid_r)
            grandchild = os.fork()
            if grandchild:
                os.write(pid_w, _LEN.pack(grandchild))
                os._exit(0)
            os.close(pid_w)
            box = Outbox(w)
            try:
                work(box)
            except BaseException as e:
                box.send("crashed", f"{type(e).__name__}: {e}")
        finally:
            os._exit(0)
    os.close(w)
    os.close(pid_w)
    os.waitpid(child, 0)
    raw = os.read(pid_r, _LEN.size)
    os.close(pid_r)
    return (_LEN.unpack(raw)[0] if len(raw) == _LEN.size else 0), r


def _read(fd: int, n: int, deadline: float) -> bytes | None:
    """``n`` bytes, b"" at end of file, None when ``deadline`` passed first."""
    buf = b""
    while len(buf) < n:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return None
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            return b""
        buf += chunk
    return buf


@contextlib.contextmanager
def messages(work: Callable[[Outbox], None]) -> Iterator[Callable[[float], tuple[Any, ...] | None]]:
    """Run ``work`` in a grandchild; yield ``recv(timeout)``.

    ``recv`` returns the next message, ``("ended",)`` once the child is done,
    or None when ``timeout`` seconds passed first: the child is then stuck, and
    it is killed on the way out (the kill lands when its call returns).
    """
    pid, fd = _spawn(work)
    ended = [False]

    def recv(timeout: float) -> tuple[Any, ...] | None:
        deadline = time.monotonic() + timeout
        head = _read(fd, _LEN.size, deadline)
        body = _read(fd, _LEN.unpack(head)[0], deadline) if head else head
        if body is None:
            return None
        if not body:
            ended[0] = True
            return ("ended",)
        msg: tuple[Any, ...] = pickle.loads(body)  # our own child's pickles
        return msg

    try:
        yield recv
    finally:
        os.close(fd)
        if pid and not ended[0]:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)

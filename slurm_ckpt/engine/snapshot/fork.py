"""The ``fork`` snapshot: a forked child writes the state from its copy-on-write memory image.

``fork()`` gives the child the parent's memory as it is at that instant; the
kernel copies a page only when one side writes to it. So the trainer continues
at once, its later in-place updates never reach the checkpoint, and the extra
memory is only the pages it changes while the child is writing (at most the
state's size). The stall is the fork itself: copying page tables, which
grows with the process's resident memory (less with huge pages). The rest
of the cost comes later: every page the trainer writes while the child lives
is copied in a page fault, and even after the child exits each page takes one
more fault on its next write (fork write-protected them all). ``slurm-ckpt
bench`` measures both against a plain copy.

Fork safety. The child runs no torch, CUDA, logging or lock-taking code: only
``pwrite``, ``memmove``, ``crc32`` and its own new threads, on addresses
computed before the fork. It closes every inherited descriptor except its two
pipes (so it never holds the run dir lock or the trainer's sockets), ignores
the signals Slurm sends to the whole step (the parent decides), and exits with
``os._exit`` so no parent atexit handler or buffer flush runs twice. It checks
between chunks, and every second while idle, that its parent is alive, and
exits if not: a killed trainer leaves only a temp dir, which the next writer
removes. It writes through its own bounce buffers, never with O_DIRECT from
the shared pages: pinning a shared page makes the kernel copy it first.
Processes with CUDA tensors to save never use this path.

What fork does not freeze. Only private memory is copy-on-write: a shared
mapping (``share_memory_()``, ``torch.from_file(shared=True)``, a NumPy
memmap) is the same pages in both processes, so the trainer's later writes
would reach the child's checkpoint; and CUDA's pinned host memory is not
mapped in the child at all. Such tensors are copied into private memory
before the fork (:func:`frozen_by_fork`). The engine's staging and bounce
buffers read as zeros in the child (``buffers.aligned_buffer(wipe_on_fork=
True)``), so the image a child writes must never point into them.

Protocol. The parent sends one JSON line per file to write, ``{"path": ...}``,
and gets ``{"ok": true, "size", "checksum"}`` or ``{"ok": false, "errno",
"message", "path"}`` back. The same snapshot can be written several times
(a retried commit); closing the command pipe ends the child.
"""

from __future__ import annotations

import bisect
import contextlib
import json
import os
import select
import signal
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ...errors import SlurmCkptError, storage_error
from ...store.codec import EncodedState, TensorEntry
from ...store.tensorfile import FileRecord
from ..job import SaveJob
from ..layout import FileImage, plan_file
from ..writer import write_image
from .sync import contiguous

__all__ = ["ForkJob", "ForkedWriter", "fork_job", "frozen_by_fork"]

_CHILD_IGNORES = ("SIGINT", "SIGTERM", "SIGUSR1", "SIGUSR2", "SIGHUP", "SIGQUIT")


def fork_job(enc: EncodedState, *, threads: int, chunk: int, direct: bool) -> ForkJob:
    """Fork a child holding ``enc``'s tensors as they are now; raises ``OSError`` when
    the fork fails (``ENOMEM`` under strict overcommit, ``EAGAIN`` at the process limit)."""
    enc.tensors = frozen_by_fork([contiguous(e) for e in enc.tensors])
    image = plan_file(enc.tensors)  # puts enc.tensors in file order
    return ForkJob(enc, ForkedWriter(image, threads=threads, chunk=chunk, direct=direct))


class ForkJob(SaveJob):
    """Writes from a forked child's copy-on-write snapshot."""

    mode = "fork"

    def __init__(self, enc: EncodedState, writer: ForkedWriter) -> None:
        super().__init__(enc)
        self.writer = writer
        self.captured.set()

    def _write_tensors(self, path: Path) -> FileRecord:
        return self.writer.write(path)

    def close(self) -> None:
        self.writer.close()
        super().close()


def frozen_by_fork(entries: Sequence[TensorEntry]) -> list[TensorEntry]:
    """``entries`` with every tensor whose memory a fork would not freeze replaced
    by a private copy (shared mappings, pinned host memory; see the module docstring)."""
    shared = _shared_mappings()
    pinned = _cuda_initialized()
    out = []
    for e in entries:
        t = e.tensor
        lo = int(t.data_ptr())
        if e.nbytes and (_overlaps(shared, lo, lo + e.nbytes) or (pinned and t.is_pinned())):
            e = TensorEntry(e.key, t.clone(), e.dtype, e.shape)
        out.append(e)
    return out


def _shared_mappings() -> tuple[list[int], list[int]]:
    """The start and end addresses of this process's shared mappings, sorted (``/proc/self/maps``)."""
    starts: list[int] = []
    ends: list[int] = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                span, perms = line.split(maxsplit=2)[:2]
                if perms[3:4] == "s":
                    lo, hi = span.split("-")
                    starts.append(int(lo, 16))
                    ends.append(int(hi, 16))
    except OSError:
        pass
    return starts, ends


def _overlaps(mappings: tuple[list[int], list[int]], lo: int, hi: int) -> bool:
    starts, ends = mappings
    i = bisect.bisect_right(starts, lo) - 1  # the last mapping starting at or before lo
    if i >= 0 and ends[i] > lo:
        return True
    j = i + 1  # the first one starting after lo
    return j < len(starts) and starts[j] < hi


def _cuda_initialized() -> bool:
    # Pinned memory exists only once CUDA is initialized; asking earlier would initialize it.
    import torch

    return bool(torch.cuda.is_initialized())


class ForkedWriter:
    """A child process holding a copy-on-write snapshot of ``image``; forks on creation."""

    def __init__(self, image: FileImage, *, threads: int, chunk: int, direct: bool) -> None:
        cmd_r, self._cmd_w = os.pipe()
        self._res_r, res_w = os.pipe()
        parent = os.getpid()
        with warnings.catch_warnings():
            # Python 3.12+ warns about fork() in a threaded process; the child
            # below only makes calls that do not depend on other threads' state.
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:  # pragma: no cover - runs in the child, which never returns
            _child(cmd_r, res_w, parent, image, threads, chunk, direct)
        os.close(cmd_r)
        os.close(res_w)
        self.pid = pid
        self._status: int | None = None
        self.rusage: Any = None
        """The child's resource usage once reaped (``os.wait4``)."""
        self._buf = b""

    def write(self, path: Path) -> FileRecord:
        """Have the child write the snapshot to ``path`` (fsynced); returns size and crc32."""
        if self._status is not None:
            raise SlurmCkptError(f"background writer {self.pid} already exited; cannot write {path}")
        # A dead child gives EPIPE here; the read below then reports why it died.
        with contextlib.suppress(BrokenPipeError):
            os.write(self._cmd_w, json.dumps({"path": os.fspath(path)}).encode() + b"\n")
        reply = self._read_reply()
        if reply is None:
            self._reap()
            raise SlurmCkptError(
                f"background writer process {self.pid} died while writing {path} "
                f"({_describe(self._status)}); nothing was committed. Check dmesg for the OOM killer."
            )
        if reply.get("ok"):
            return FileRecord(int(reply["size"]), str(reply["checksum"]))
        err = reply.get("errno")
        if err:
            raise storage_error(OSError(int(err), os.strerror(int(err))), "background write failed", reply.get("path") or path)
        raise SlurmCkptError(f"background writer failed writing {path}: {reply.get('message')}")

    def close(self) -> None:
        """End the child (closing its command pipe) and reap it."""
        if self._cmd_w >= 0:
            os.close(self._cmd_w)
            self._cmd_w = -1
        self._reap()
        if self._res_r >= 0:
            os.close(self._res_r)
            self._res_r = -1

    def kill(self) -> None:
        """Stop the child at once (a save being abandoned)."""
        if self._status is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
        self.close()

    def _read_reply(self) -> dict[str, Any] | None:
        while b"\n" not in self._buf:
            chunk = os.read(self._res_r, 65536)
            if not chunk:
                return None
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        reply: dict[str, Any] = json.loads(line)
        return reply

    def _reap(self) -> None:
        if self._status is None:
            _, self._status, self.rusage = os.wait4(self.pid, 0)

    def __del__(self) -> None:
        # A job dropped without close(): do not leave the child (or a zombie) behind.
        if getattr(self, "_status", 0) is None and getattr(self, "pid", None) not in (None, os.getpid()):
            with contextlib.suppress(OSError):
                self.kill()


def _describe(status: int | None) -> str:
    if status is None:
        return "status unknown"
    if os.WIFSIGNALED(status):
        return f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exit code {os.waitstatus_to_exitcode(status)}"


def _child(cmd_r: int, res_w: int, parent: int, image: FileImage, threads: int, chunk: int, direct: bool) -> None:  # pragma: no cover
    code = 1
    try:
        for name in _CHILD_IGNORES:
            signal.signal(getattr(signal, name), signal.SIG_IGN)
        _close_fds_except({0, 1, 2, cmd_r, res_w})

        def orphaned() -> bool:
            return os.getppid() != parent

        buf = b""
        while True:
            while b"\n" not in buf:
                if orphaned():
                    os._exit(3)
                ready, _, _ = select.select([cmd_r], [], [], 1.0)
                if not ready:
                    continue
                data = os.read(cmd_r, 65536)
                if not data:
                    code = 0  # the parent closed the pipe: done
                    return
                buf += data
            line, buf = buf.split(b"\n", 1)
            path = json.loads(line)["path"]
            try:
                # in_place=False: O_DIRECT straight from pages shared with the
                # parent would make the kernel copy each of them (see plan_writes).
                rec = write_image(Path(path), image, threads=threads, chunk=chunk, direct=direct,
                                  in_place=False, cancel=orphaned)  # fmt: skip
                reply: dict[str, Any] = {"ok": True, "size": rec.size, "checksum": rec.checksum}
            except BaseException as e:  # reported to the parent, which raises it
                reply = {"ok": False, "errno": getattr(e, "errno", None), "message": str(e),
                         "path": getattr(e, "filename", None)}  # fmt: skip
            _write_all(res_w, json.dumps(reply).encode() + b"\n")
    except BaseException:  # the parent sees the pipe close and reports the exit status
        code = 2
    finally:
        os._exit(code)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _close_fds_except(keep: set[int]) -> None:
    lo = 0
    for fd in sorted(keep):
        if fd > lo:
            os.closerange(lo, fd)
        lo = fd + 1
    os.closerange(lo, _max_fd())


def _max_fd() -> int:
    try:
        return max(int(n) for n in os.listdir("/proc/self/fd")) + 1
    except (OSError, ValueError):
        return os.sysconf("SC_OPEN_MAX")

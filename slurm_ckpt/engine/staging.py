"""Staging: copy a state into one reusable buffer laid out as the tensor file.

The buffer holds the file's exact bytes (header, then each tensor at its file
offset), page-aligned, so the writer sends it to disk with ``O_DIRECT`` and no
further copy. It is kept between saves and reused when the next state fits, so
after the first save a copy costs no page faults and no allocation; the extra
memory is the state's size, once. A forked child (a DataLoader worker) gets
zeros there instead of sharing its pages, which would make the next copy pay
a copy-on-write fault for every 4 KiB of it.

With CUDA tensors the buffer is pinned host memory: every device-to-host copy
is queued with ``non_blocking=True`` and the stream is synchronized once at the
end, instead of once per tensor.

CPU tensors whose bytes are their values are copied by address
(:func:`~slurm_ckpt.engine.memcopy.copy_bytes`), not with torch's ``copy_``:
the bytes are the same, the call costs a fraction of a torch op's dispatch,
and the copy is split over threads with stores that bypass the cache.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..store.codec import TensorEntry
from ..store.tensorfile import build_header
from .buffers import aligned_buffer
from .layout import FileImage, order_entries
from .memcopy import Piece, copy_bytes, copy_threads

__all__ = ["Pair", "Staging", "available_memory", "copy_pairs", "is_cuda"]

Pair = tuple[TensorEntry, Any]
"""An entry of the state and the tensor at its place in the staging buffer."""

log = logging.getLogger("slurm_ckpt")

_GROW = 2 << 20  # round capacity up to 2 MiB so small growth does not reallocate


def is_cuda(t: Any) -> bool:
    return bool(getattr(t, "is_cuda", False))


class Staging:
    """A reusable file-image buffer. Not thread-safe: one save uses it at a time."""

    def __init__(self, *, pin: bool = True) -> None:
        self.pin = pin
        self._buf: Any = None  # a uint8 torch tensor over the buffer
        self._owner: Any = None  # the mmap behind an unpinned buffer
        self._pinned = False
        self._wanted_pinned = False

    @property
    def capacity(self) -> int:
        return 0 if self._buf is None else int(self._buf.numel())

    def release(self) -> None:
        """Free the buffer (the next stage allocates a new one)."""
        if self._pinned and self._buf is not None:
            _unpin(int(self._buf.data_ptr()))
        self._buf = None
        self._owner = None
        self._pinned = False

    def __del__(self) -> None:
        self.release()

    def _ensure(self, nbytes: int, pinned: bool) -> Any:
        import torch

        if self._buf is not None and self.capacity >= nbytes and self._wanted_pinned == pinned:
            return self._buf
        self.release()  # free first: peak memory stays one buffer, not two
        cap = -(-nbytes // _GROW) * _GROW
        self._owner = aligned_buffer(cap, wipe_on_fork=True)  # DataLoader workers must not share it
        self._buf = torch.frombuffer(self._owner, dtype=torch.uint8)
        # Pinned by registering our own page-aligned memory rather than with
        # pin_memory=True, whose caching allocator rounds up to a power of two
        # (a 1.1 GiB state would hold 2 GiB of pinned memory).
        self._pinned = pinned and _pin(int(self._buf.data_ptr()), cap)
        self._wanted_pinned = pinned
        return self._buf

    def _layout(
        self, entries: Sequence[TensorEntry], metadata: dict[str, str] | None
    ) -> tuple[FileImage, Any, list[TensorEntry], int]:
        """Order ``entries`` as the file, size the buffer, write the header; returns the
        image, the buffer, the entries in file order and where the first one goes."""
        import torch

        ordered = order_entries(entries)
        header = build_header(ordered, metadata)
        total = len(header) + sum(e.nbytes for e in ordered)
        cuda = any(is_cuda(e.tensor) for e in ordered)
        buf = self._ensure(total, pinned=cuda and self.pin and torch.cuda.is_available())
        base = int(buf.data_ptr())
        ctypes.memmove(base, header, len(header))
        return FileImage(size=total, pieces=[(base, total)], keep=[buf]), buf, ordered, len(header)

    def prepare(
        self, entries: Sequence[TensorEntry], metadata: dict[str, str] | None = None
    ) -> tuple[FileImage, list[Pair]]:
        """Lay ``entries`` out in the buffer and write the header; copy no tensor yet.

        Returns the file image and, in file order, each entry paired with its
        place in the buffer, for :func:`copy_pairs`.
        """
        image, buf, ordered, off = self._layout(entries, metadata)
        pairs: list[Pair] = []
        for e in ordered:
            n = e.nbytes
            dst = buf[off : off + n].view(e.tensor.dtype).view(e.tensor.shape) if n else e.tensor.new_empty(e.tensor.shape, device="cpu")
            pairs.append((e, dst))
            off += n
        return image, pairs

    def capture(self, entries: Sequence[TensorEntry], metadata: dict[str, str] | None = None) -> FileImage:
        """Copy ``entries`` (any device, any layout) into the buffer; return the file image.

        What :meth:`stage` does, less the views of the buffer it returns: the
        CPU tensors whose bytes are their values are copied straight to their
        file offsets, with no torch call per tensor. A list ``entries`` is put
        in file order. On return every byte is in host memory.
        """
        image, buf, ordered, off = self._layout(entries, metadata)
        if isinstance(entries, list):
            entries[:] = ordered
        base = int(buf.data_ptr())
        plain: list[Piece] = []
        pairs: list[Pair] = []
        for e in ordered:
            n = e.nbytes
            if n and _plain_cpu(e.tensor):
                plain.append((base + off, int(e.tensor.data_ptr()), n))
            elif n:
                pairs.append((e, buf[off : off + n].view(e.tensor.dtype).view(e.tensor.shape)))
            off += n
        copy_pairs(pairs, plain=plain)
        return image

    def stage(
        self, entries: Sequence[TensorEntry], metadata: dict[str, str] | None = None
    ) -> tuple[FileImage, list[TensorEntry]]:
        """Copy ``entries`` (any device, any layout) into the buffer.

        Returns the file image and entries whose tensors are views of the
        buffer, in file order. On return every byte is in host memory. A
        forked child sees zeros in the buffer: only this process may write
        those views out.
        """
        image, pairs = self.prepare(entries, metadata)
        copy_pairs(pairs)
        return image, [TensorEntry(e.key, dst, e.dtype, e.shape) for e, dst in pairs]


def copy_pairs(pairs: Sequence[Pair], *, plain: Sequence[Piece] = ()) -> None:
    """Copy each entry's tensor to its place in a staging buffer, and the ``plain``
    pieces of CPU memory (:func:`copy_bytes`); on return all are in host memory."""
    import torch

    devices = set()
    plain = list(plain)
    for e, dst in pairs:
        if not e.nbytes:
            continue
        src = e.tensor.detach()
        if _plain_cpu(src):
            plain.append((int(dst.data_ptr()), int(src.data_ptr()), e.nbytes))
            continue
        dst.copy_(src, non_blocking=is_cuda(src))
        if is_cuda(src):
            devices.add(src.device)
    copy_bytes(plain, threads=copy_threads())  # CPU work, while the devices copy
    # One synchronization per device for all its device-to-host copies,
    # not one per tensor.
    for dev in devices:
        torch.cuda.current_stream(dev).synchronize()


def _plain_cpu(t: Any) -> bool:
    """Whether ``t``'s bytes, as they lie in memory, are its values in its dtype."""
    return bool(t.is_cpu and t.is_contiguous() and not t.is_conj() and not t.is_neg())


def _pin(addr: int, nbytes: int) -> bool:
    import torch

    try:
        err = int(torch.cuda.cudart().cudaHostRegister(addr, nbytes, 1))  # 1: portable
    except (AttributeError, RuntimeError) as e:
        err, why = -1, str(e)
    else:
        why = f"cudaError {err}"
    if err:
        log.warning("cannot pin the staging buffer (%s); device-to-host copies will be slower", why)
    return err == 0


def _unpin(addr: int) -> None:
    import torch

    try:
        torch.cuda.cudart().cudaHostUnregister(addr)
    except (AttributeError, RuntimeError) as e:
        log.debug("cudaHostUnregister failed: %s", e)


def available_memory() -> int:
    """Bytes this process can still allocate: MemAvailable, capped by its memory cgroup.

    Slurm confines a job's memory with a cgroup whose limit is usually far
    below the node's free memory, so the cgroup is what decides.
    """
    avail = _meminfo_available()
    for limit_file, usage_file in _cgroup_memory_files():
        try:
            limit = int(Path(limit_file).read_text().strip())
            usage = int(Path(usage_file).read_text().strip())
        except (OSError, ValueError):
            continue  # "max" (v2, no limit) lands here too
        avail = min(avail, max(0, limit - usage))
    return avail


def _meminfo_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 1 << 62


def _cgroup_memory_files() -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return out
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            base = f"/sys/fs/cgroup{path}"
            out.append((f"{base}/memory.max", f"{base}/memory.current"))
        elif "memory" in controllers.split(","):
            base = f"/sys/fs/cgroup/memory{path}"
            out.append((f"{base}/memory.limit_in_bytes", f"{base}/memory.usage_in_bytes"))
    return out

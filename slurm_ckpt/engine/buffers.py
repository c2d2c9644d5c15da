"""Page-aligned memory: bounce buffers for O_DIRECT, and raw views of memory.

O_DIRECT needs the memory address, the file offset and the length aligned to
the device's logical block size; 4 KiB satisfies every common device. Anonymous
``mmap`` memory is page-aligned.

Our own large buffers ask for transparent huge pages (``MADV_HUGEPAGE``; most
distributions set THP to ``madvise``, so nobody gets them without asking):

- a 2 MiB page is physically contiguous, so an 8 MiB O_DIRECT request is a
  handful of segments instead of 2048 scattered 4 KiB pages, and a virtio disk
  (at most 254 segments a request) takes it whole, where one from 4 KiB pages
  is split (``python -m bench.profile_engine`` compares the two);
- one fault maps 2 MiB, so faulting a fresh buffer in is 512 times fewer
  faults. ``MADV_POPULATE_WRITE`` does it in one system call: first-touch
  faults one at a time cost several times more on virtual machines.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import threading

__all__ = ["ALIGN", "HUGE", "TORCH_ALIGN", "BouncePool", "address_of", "aligned_buffer", "huge_buffer",
           "memory_view", "pool", "populate"]  # fmt: skip

ALIGN = 4096
HUGE = 2 << 20
"""A transparent huge page (x86-64 and most arm64 kernels)."""
TORCH_ALIGN = 64
"""Where torch's CPU allocator starts every tensor's memory: at a multiple of 64 bytes.
A vectorized sum or dot product adds in an order that depends on where the data
starts within that, so a tensor placed elsewhere gives other last bits."""
_MADV_POPULATE_WRITE = 23  # Linux 5.14+; older kernels answer EINVAL
_MADV_WIPEONFORK = 18  # Linux 4.14+
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def huge_buffer(nbytes: int, *, huge: bool = True) -> mmap.mmap:
    """A zero-filled, page-aligned private buffer, backed by huge pages where the kernel can.

    Not faulted in yet: see :func:`populate`. ``huge=False``: 4 KiB pages (for comparison).

    Only the 2 MiB-aligned stretches of a mapping can be huge pages, and the
    kernel (6.7 and later) aligns an anonymous mapping only when its length is
    a whole number of huge pages. So a buffer of 2 MiB or more is mapped that
    long, and ``len()`` may exceed ``nbytes``: without it a 16 MiB buffer had
    2 MiB on 4 KiB pages, a 4 MiB one half of it. The bytes past ``nbytes`` are
    kept on 4 KiB pages, so they cost address space, not memory, until touched.
    """
    n = _pages(nbytes)
    length = _length(nbytes, huge)
    mm = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge and length >= HUGE and hasattr(mmap, "MADV_HUGEPAGE"):
        whole = n // HUGE * HUGE
        # THP compiled out or disabled: 4 KiB pages, still correct.
        with contextlib.suppress(OSError):
            mm.madvise(mmap.MADV_HUGEPAGE, 0, whole)
            if whole < length:  # THP "always": the unused end must not fault a whole huge page in
                mm.madvise(mmap.MADV_NOHUGEPAGE, whole, length - whole)
    return mm


def _pages(nbytes: int) -> int:
    return -(-max(nbytes, 1) // ALIGN) * ALIGN


def _length(nbytes: int, huge: bool = True) -> int:
    """How long :func:`huge_buffer` maps a buffer of ``nbytes``."""
    n = _pages(nbytes)
    if not huge or n < HUGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return n
    return -(-n // HUGE) * HUGE


def populate(addr: int, nbytes: int) -> bool:
    """Fault ``[addr, addr + nbytes)`` of private memory in, writable, with one system call.

    False if refused (a kernel before 5.14, or a hole in the range).
    """
    return _libc.madvise(addr, nbytes, _MADV_POPULATE_WRITE) == 0


def aligned_buffer(nbytes: int, *, huge: bool = True, wipe_on_fork: bool = False) -> mmap.mmap:
    """A zero-filled, page-aligned private buffer whose first ``nbytes`` are faulted in
    (huge pages where possible; see :func:`huge_buffer` for its length).

    ``wipe_on_fork``: a child forked later gets zero-filled memory here instead
    of the parent's pages, for buffers only the engine reads (staging, bounce).
    Otherwise fork() shares every page copy-on-write with the child, and while
    the child lives (a DataLoader worker lives for an epoch) the parent's next
    write to each page copies it in a fault, 4 KiB at a time, breaking up huge
    pages (``bench/worker_fork.py``). Never for memory handed to the trainer,
    which its children may read, nor for anything a fork snapshot's child
    writes out (``snapshot/fork.py``).
    """
    mm = huge_buffer(nbytes, huge=huge)
    if wipe_on_fork:
        # A kernel before 4.14 refuses: the buffer is shared with children as before.
        _libc.madvise(address_of(mm), len(mm), _MADV_WIPEONFORK)
    n = _pages(nbytes)
    if not populate(address_of(mm), n):
        for off in range(0, n, mmap.PAGESIZE):  # an old kernel: touch each page
            mm[off] = 0
    return mm


def address_of(buf: mmap.mmap) -> int:
    """The address of an mmap's first byte (it must stay open while used)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def memory_view(addr: int, nbytes: int) -> memoryview:
    """A writable byte view of raw memory; the owner must outlive the view."""
    if nbytes == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * nbytes).from_address(addr)).cast("B")


class BouncePool:
    """Reusable bounce buffers, so a save does not pay page faults for them again.

    Buffers are handed to one writer thread at a time. A forked child gets a
    fresh pool (it must not write into buffers its parent may be using).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: dict[int, list[mmap.mmap]] = {}
        self._pid = os.getpid()

    def acquire(self, nbytes: int) -> mmap.mmap:
        with self._lock:
            if self._pid != os.getpid():
                self._free, self._pid = {}, os.getpid()
            free = self._free.get(_length(nbytes))
            if free:
                return free.pop()
        return aligned_buffer(nbytes, wipe_on_fork=True)

    def release(self, buf: mmap.mmap, keep: int = 16) -> None:
        with self._lock:
            if self._pid != os.getpid():
                return
            free = self._free.setdefault(len(buf), [])
            if len(free) < keep:
                free.append(buf)
                return
        buf.close()

    def _after_fork_in_child(self) -> None:
        # Another thread may have held the lock at the fork; the child starts clean.
        self._lock = threading.Lock()
        self._free, self._pid = {}, os.getpid()

    def clear(self) -> None:
        with self._lock:
            bufs = [b for free in self._free.values() for b in free]
            self._free = {}
        for b in bufs:
            b.close()


pool = BouncePool()
os.register_at_fork(after_in_child=pool._after_fork_in_child)

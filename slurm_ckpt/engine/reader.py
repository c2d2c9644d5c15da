"""The parallel tensor-file reader: checksum verified in the same pass as the read.

Each large tensor gets a buffer of its own (so keeping one tensor does not
keep the whole file in memory; small neighbours share one), worker threads
fill them chunk by chunk with ``O_DIRECT`` reads, and checksum threads
compute each chunk's crc32 as it lands. The per-chunk crcs are combined in
file order and compared with the manifest. One more thread faults the fresh
buffers in ahead of the reads (``MADV_POPULATE_WRITE``): first-touch page
faults, taken one by one by the reading threads, can cost more than the reads
themselves (``python -m bench.fresh_memory`` and ``bench/profile_engine.py``
measure both on a given machine).

``into`` names tensors the caller already has (a model's parameters, say),
by checkpoint key: a large CPU one is read straight into its own memory,
``O_DIRECT`` where its address lines up with the file's pages as it did when
saved, which is the usual case; nothing fresh is allocated, so no page has to
be zeroed, and the caller needs no second copy of the state. It is marked
changed, as ``copy_`` marks what it writes. Others (small, on a GPU, not
contiguous) are copied in once the file is verified, in the order of ``into``.
Targets must not overlap one another in memory, where reads would race: the
load's plan (``store/codec/into.py``) has found those and copies into them
itself, in order, so the reader does not look again.

Every tensor comes back on a storage of its own, as ``torch.load`` gives it:
offset 0, exactly its size, not resizable, and starting at a multiple of 64
bytes (``buffers.TORCH_ALIGN``: a sum over it then adds in the same order as
over the tensor that was saved). It is a window of the buffer it was read
into, so the read needs no copy, and nothing can reach the bytes of its
neighbours in the same buffer. A tensor the file does not place at a multiple
of 64 bytes (a size that is not one, see ``layout``) is moved once read: down
to the boundary within its own buffer, or, sharing one, copied to fresh memory.

``use_mmap=True`` maps the file instead: tensors are zero-copy windows of the
page cache (copy-on-write, so changing them never changes the file), but for
those not at a multiple of 64 bytes in the file, which are copied. With
``verify=True`` every byte is still checksummed once, in parallel.

The header is validated before any byte is placed: tensors must tile the data
region exactly, and each must be as long as its dtype and shape say, so a
damaged header can never make a read land outside a tensor.
"""

from __future__ import annotations

import ctypes
import errno
import math
import mmap as _mmap
import os
import queue
import stat
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ..errors import CheckpointCorrupt, storage_error
from ..store.codec import contiguous_strides, torch_dtype
from ..store.crc import crc32, crc32_combine, crc32_of_chunks, crc_threads
from ..store.tensorfile import CHECKSUM, FileRecord, read_header
from .buffers import ALIGN, TORCH_ALIGN, address_of, huge_buffer, memory_view, populate
from .direct import _Item, _items_into, _read_exactly, open_direct, read_through_bounce

__all__ = ["READ_DEPTH", "read_tensor_file"]

READ_DEPTH = 8
"""Reads in flight by default, whatever the core count: a reading thread waits
on the device, not on a core (the crcs are taken on threads of their own), and
the device streams faster the more reads it has in hand (``python
bench/read_contention.py`` compares 4 with 8). Not for ``use_mmap``, whose
threads each checksum the mapping: the engine passes its core-based count there."""


def read_tensor_file(
    path: Path,
    expected: FileRecord,
    *,
    verify: bool = True,
    threads: int = READ_DEPTH,
    chunk: int = 8 << 20,
    use_mmap: bool = False,
    device: Any = None,
    into: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Every tensor of a safetensors-layout file, checked against ``expected``.

    ``into``: tensors to load into, by key, none overlapping another (see the
    module's docstring), already checked against the manifest by the load's
    plan (``store/codec/into.py``); the result holds them. The reads follow
    the header, so one that places a target's bytes otherwise than the target
    holds them is :class:`CheckpointCorrupt` before anything is read. On
    :class:`CheckpointCorrupt` those read in place may hold part of the file.

    Raises :class:`CheckpointCorrupt` naming the file on a size, header or
    checksum mismatch, and :class:`StorageError` on an I/O error.
    """
    try:
        # O_NOFOLLOW, and regular files only: as the store's own reads (a planted
        # symlink or FIFO in a run dir must not be followed or hang the load).
        with os.fdopen(os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK), "rb", buffering=0) as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise CheckpointCorrupt(f"{path}: not a regular file", path)
            size = os.fstat(f.fileno()).st_size
            if size != expected.size:
                raise CheckpointCorrupt(f"{path}: size is {size}, manifest expects {expected.size}", path)
            raw, header = read_header(f, path, size)
            layout = _layout(path, header, size - len(raw))
            targets = _targets(path, layout, into or {})
            if targets and use_mmap:
                raise ValueError("into= and mmap=True do not mix: mmap maps the file, into= reads into your tensors")
            in_place = {k: t for k, t in targets.items() if _in_place(t)}
            with _suppress_unsupported():
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
            if use_mmap:
                out, crc = _map(f.fileno(), path, len(raw), size, layout, verify, threads, chunk)
            else:
                for t in in_place.values():  # before the reads: an error partway leaves them changed too
                    _changed(t)
                out, crc = _read(f.fileno(), path, len(raw), layout, verify, threads, chunk, in_place)
    except OSError as e:
        raise storage_error(e, "cannot read data file", path) from e
    if verify:
        got = crc32_combine(crc32(raw), crc, size - len(raw))
        if f"{got:08x}" != expected.checksum:
            raise CheckpointCorrupt(
                f"{path}: checksum mismatch: expected {CHECKSUM} {expected.checksum}, got {got:08x}",
                path,
            )
    # In the order of into (a state's, as load_state_dict copies), where targets share memory.
    for key in (k for k in into or {} if k in targets):
        if out[key] is not targets[key]:  # not read in place: copied in only now that the file is verified
            out[key] = targets[key].copy_(out[key])
    if device is not None:
        out = {k: t if k in targets else t.to(device) for k, t in out.items()}
    return out


def _targets(path: Path, layout: list[_Entry], into: Mapping[str, Any]) -> dict[str, Any]:
    """The tensors of ``into`` that the file holds. The plan matched them to the manifest;
    this guards the memory the reads write against a header that disagrees with it."""
    out: dict[str, Any] = {}
    for key, dtype, shape, _, _ in layout:
        t = into.get(key)
        if t is None:
            continue
        if t.dtype != dtype or list(t.shape) != shape:
            raise CheckpointCorrupt(f"{path}: tensor {key!r} is {dtype} {shape} in the file, "
                                    f"{t.dtype} {list(t.shape)} in its manifest", path)  # fmt: skip
        out[key] = t
    return out


def _changed(t: Any) -> None:
    """Mark ``t`` changed in place, as ``copy_`` into it would: its memory was written by
    reads, which torch cannot see, and autograd must know that a graph that saved it
    for backward now holds other values (backward then raises, as after load_state_dict)."""
    import torch

    if t.is_inference():  # no version counter to move (and no in-place op outside inference mode)
        return
    with torch.no_grad():
        t.view(-1)[:0].zero_()  # no element, but an in-place op: the version counter moves


def _in_place(t: Any) -> bool:
    """Whether the reader may write ``t``'s memory directly: its values are its bytes."""
    return (t.nbytes >= _BIG and t.is_cpu and t.is_contiguous() and not t.is_conj()
            and not t.is_neg())  # fmt: skip


_Entry = tuple[str, Any, list[int], int, int]
"""(key, torch dtype, shape, begin, end) with offsets relative to the data region."""
_Placed = tuple[str, int, Any, list[int]]
"""(key, address of its bytes as read, torch dtype, shape)."""


def _layout(path: Path, header: dict[str, Any], data_len: int) -> list[_Entry]:
    entries: list[_Entry] = []
    dtypes: dict[str, Any] = {}  # a state of 10,000 tensors holds a few dtypes
    try:
        for key, info in header.items():
            if key == "__metadata__":
                continue
            # read_header checked the types: offsets and dims are ints, none negative.
            begin, end = info["data_offsets"]
            shape = info["shape"]
            dtype = dtypes.get(info["dtype"]) or dtypes.setdefault(info["dtype"], torch_dtype(info["dtype"]))
            if end - begin != math.prod(shape) * dtype.itemsize:
                raise ValueError(f"tensor {key!r}: {end - begin} bytes do not fit shape {shape}")
            entries.append((key, dtype, shape, begin, end))
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointCorrupt(f"{path}: bad tensor header: {e}", path) from None
    entries.sort(key=lambda e: e[3])
    pos = 0
    for key, _, _, begin, end in entries:
        if begin != pos:
            raise CheckpointCorrupt(f"{path}: tensor {key!r} starts at {begin}, expected {pos}", path)
        pos = end
    if pos != data_len:
        raise CheckpointCorrupt(f"{path}: tensors cover {pos} of {data_len} data bytes", path)
    return entries


_BIG = 1 << 20
"""Tensors at least this large get storage of their own; smaller neighbours share one."""
_RUN = 64 << 20
"""The most bytes of small tensors that share one storage."""


def _regions(layout: list[_Entry], start: int) -> list[tuple[int, int, list[_Entry]]]:
    """Group tensors into (file begin, file end, entries): one per large tensor, runs of small ones."""
    out: list[tuple[int, int, list[_Entry]]] = []
    run: list[_Entry] = []
    for e in layout:
        n = e[4] - e[3]
        if run and (n >= _BIG or run[-1][4] - run[0][3] + n > _RUN):
            out.append((start + run[0][3], start + run[-1][4], run))
            run = []
        if n >= _BIG:
            out.append((start + e[3], start + e[4], [e]))
        else:
            run.append(e)
    if run:
        out.append((start + run[0][3], start + run[-1][4], run))
    return out


def _read(
    fd: int,
    path: Path,
    start: int,
    layout: list[_Entry],
    verify: bool,
    threads: int,
    chunk: int,
    in_place: dict[str, Any],
) -> tuple[dict[str, Any], int]:
    """Read into one buffer per region with O_DIRECT: the disk writes straight into the
    tensors, with no page-cache copy. Regions are read over whole 4 KiB blocks, so a
    block shared by two regions is read twice; only the region's own bytes are checksummed.
    Where O_DIRECT is refused, the same reads go through the page cache. The
    ``in_place`` targets (large, so regions of their own) are read into the caller's memory.

    Each tensor gets a storage of its own that is a window of its region's buffer:
    offset 0, as large as the tensor, and not resizable, as ``torch.load`` gives
    it. A large tensor is a region of its own; runs of small ones share a buffer,
    which stays in memory while any of them does.
    """
    order = {e[0]: i for i, e in enumerate(layout)}
    out: dict[str, Any] = {}
    unaligned: list[list[_Placed]] = []  # per region: copied once read
    moves: list[tuple[int, int, int]] = []  # (to, from, length): a tensor alone in its buffer, aligned once read
    stores: list[Any] = []  # every buffer read into, alive until the end: not all of them have a window
    items: list[_Item] = []
    fresh: list[tuple[int, int]] = []
    for rb, re, entries in _regions(layout, start):
        key = entries[0][0]
        if len(entries) == 1 and key in in_place:
            out[key] = in_place[key]
            items += _items_into(int(in_place[key].data_ptr()), rb, re, chunk)
            continue
        lo, hi = rb - rb % ALIGN, -(-re // ALIGN) * ALIGN
        store = _storage(hi - lo + ALIGN)
        stores.append(store)
        pad = -store.data_ptr() % ALIGN
        base = store.data_ptr() + pad
        buffer = store.numpy()
        odd: list[_Placed] = []
        for key, dtype, shape, begin, end in entries:
            off = pad + start + begin - lo
            skew = (base + off - pad) % TORCH_ALIGN  # the buffer starts on a page
            if skew and len(entries) == 1:
                moves.append((base - pad + off - skew, base - pad + off, end - begin))
                out[key] = _window(store, buffer, off - skew, dtype, shape)
            elif skew:
                odd.append((key, base - pad + off, dtype, shape))
            else:
                out[key] = _window(store, buffer, off, dtype, shape)
        if odd:
            unaligned.append(odd)
        for off in range(lo, hi, chunk):
            n = min(chunk, hi - off)
            wb, we = max(off, rb), min(off + n, re)
            if we > wb:
                items.append(_Item(off, n, base + off - lo, wb, we - wb))
                fresh.append((base + off - lo, n))
    dfd = open_direct(path)
    direct = [dfd >= 0]

    def work(k: int) -> tuple[int, int]:
        off, n, addr, wb, wn, exact = items[k]
        if direct[0]:
            try:
                if exact:
                    read_through_bounce(dfd, path, addr, wb, wn, chunk)
                else:
                    _read_exactly(dfd, path, memory_view(addr, n), off, wb + wn - off)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                direct[0] = False  # the device wants a larger alignment: go buffered
        if not direct[0]:
            _read_exactly(fd, path, memory_view(addr + wb - off, wn), wb, wn)
        if verify:
            landed.put(k)
        return 0, wn

    # The crcs are taken on threads of their own as the reads land: a read
    # thread that stopped to checksum would leave the disk's queue shallower
    # (``bench/profile_engine.py`` compares the read with and without them).
    crcs: list[tuple[int, int]] = [(0, 0)] * len(items)
    landed: queue.SimpleQueue[int | None] = queue.SimpleQueue()
    failed: list[BaseException] = []

    def checksummer() -> None:
        try:
            while (k := landed.get()) is not None:
                off, _, addr, wb, wn, _ = items[k]
                crcs[k] = crc32(memory_view(addr + wb - off, wn)), wn
        except BaseException as e:  # raised below: a crc left out must not read as damage
            failed.append(e)

    stop = threading.Event()
    # Fresh memory costs a page fault per page on first touch, which the read
    # threads would otherwise take inside each read before the device starts;
    # faulting ahead of them on one more thread overlaps that with the I/O.
    ahead = threading.Thread(target=_fault_in, args=(fresh, stop), daemon=True)
    summers = [threading.Thread(target=checksummer, daemon=True) for _ in range(crc_threads() if verify else 0)]
    for t in (ahead, *summers):
        t.start()
    try:
        _parallel(len(items), work, threads)
    finally:
        for _ in summers:
            landed.put(None)  # one stop sign each, after the last read's chunk
        stop.set()
        for t in (ahead, *summers):
            t.join()
        if dfd >= 0:
            os.close(dfd)
    if failed:
        raise failed[0]
    crc = crc32_of_chunks(crcs)
    # Only now: the crcs above were taken where the bytes landed.
    for to, frm, n in moves:
        ctypes.memmove(to, frm, n)
    for odd in unaligned:
        out.update(_aligned_copies(odd))
    return dict(sorted(out.items(), key=lambda kv: order[kv[0]])), crc


def _aligned_copies(tensors: list[_Placed]) -> dict[str, Any]:
    """The tensors of one region (``_regions``), each copied to a 64-byte boundary of
    one fresh buffer, each a window of it as :func:`_window` makes them."""
    import torch

    if not tensors:
        return {}
    slots, end = [], 0
    for _, _, dtype, shape in tensors:
        slots.append(end)
        end += -(-math.prod(shape) * dtype.itemsize // TORCH_ALIGN) * TORCH_ALIGN
    store = torch.empty(end + TORCH_ALIGN, dtype=torch.uint8)
    pad = -store.data_ptr() % TORCH_ALIGN
    buffer = store.numpy()
    out = {}
    for (key, addr, dtype, shape), slot in zip(tensors, slots, strict=True):
        ctypes.memmove(store.data_ptr() + pad + slot, addr, math.prod(shape) * dtype.itemsize)
        out[key] = _window(store, buffer, pad + slot, dtype, shape)
    return out


def _window(store: Any, buffer: Any, off: int, dtype: Any, shape: list[int]) -> Any:
    """The tensor at byte ``off`` of the uint8 tensor ``store`` (``buffer``: its numpy view),
    on a storage of its own (offset 0, its size, not resizable, holding ``store`` alive), as
    ``torch.load`` gives one."""
    import torch

    numel = math.prod(shape)
    if not numel:
        return torch.empty(0, dtype=dtype).set_(store.untyped_storage()[off:off], 0, shape, contiguous_strides(shape))
    # frombuffer: one call makes the storage and the tensor (the cheapest way for the
    # thousands of small ones); set_, not a view, for other shapes, so it has no _base.
    t = torch.frombuffer(buffer, dtype=dtype, offset=off, count=numel)
    if len(shape) != 1:
        t.set_(t.untyped_storage(), 0, shape, contiguous_strides(shape))
    return t


_HUGE_STORAGE = 4 << 20


def _storage(nbytes: int) -> Any:
    """Fresh memory for one region: huge pages for a large one (see ``buffers``), which
    the fault-ahead thread then maps 2 MiB per fault instead of 4 KiB."""
    import torch

    if nbytes < _HUGE_STORAGE:
        return torch.empty(nbytes, dtype=torch.uint8)
    return torch.frombuffer(huge_buffer(nbytes), dtype=torch.uint8)  # the tensor keeps the map alive


def _fault_in(spans: list[tuple[int, int]], stop: threading.Event) -> None:
    """Fault in ``(address, length)`` spans of our own fresh buffers, in order (best effort)."""
    for addr, n in spans:
        if stop.is_set() or not populate(addr, n):
            return


def _map(
    fd: int, path: Path, start: int, size: int, layout: list[_Entry], verify: bool, threads: int, chunk: int
) -> tuple[dict[str, Any], int]:
    """Each tensor on a storage of its own that is a window of one private mapping of
    the file (as ``torch.load(mmap=True)`` gives them): offset 0, its own size, but
    not resizable; changing one copies its pages, never the file."""
    import torch

    mm = _mmap.mmap(fd, size, flags=_mmap.MAP_PRIVATE, prot=_mmap.PROT_READ | _mmap.PROT_WRITE)
    with _suppress_unsupported():
        mm.madvise(_mmap.MADV_SEQUENTIAL)
    whole = torch.frombuffer(mm, dtype=torch.uint8)  # holds a reference to mm
    out: dict[str, Any] = {}
    for _, _, entries in _regions(layout, start):
        odd: list[_Placed] = []
        for key, dtype, shape, begin, _ in entries:
            a = start + begin
            if a % TORCH_ALIGN:  # the mapping starts on a page: copied, to be aligned as torch.load's
                odd.append((key, address_of(mm) + a, dtype, shape))
            else:  # a window keeps the whole mapping alive
                out[key] = _window(whole, mm, a, dtype, shape)
        out.update(_aligned_copies(odd))
    out = {e[0]: out[e[0]] for e in layout}
    crc = 0
    if verify and size > start:
        base_addr = address_of(mm)
        spans = [(off, min(chunk, size - off)) for off in range(start, size, chunk)]

        def work(k: int) -> tuple[int, int]:
            off, m = spans[k]
            return crc32(memory_view(base_addr + off, m)), m

        crc = crc32_of_chunks(_parallel(len(spans), work, threads))
    return out, crc


def _parallel(n: int, work: Callable[[int], tuple[int, int]], threads: int) -> list[tuple[int, int]]:
    """Run ``work(k)`` for k in 0..n-1 on up to ``threads`` threads, in order of k."""
    results: list[tuple[int, int]] = [(0, 0)] * n
    lock = threading.Lock()
    state = {"next": 0}
    errors: list[BaseException] = []

    def worker() -> None:
        while True:
            with lock:
                k = state["next"]
                if errors or k >= n:
                    return
                state["next"] = k + 1
            try:
                results[k] = work(k)
            except BaseException as e:  # re-raised in the caller below
                with lock:
                    errors.append(e)
                return

    count = max(1, min(threads, n))
    if count == 1:
        worker()
    else:
        pool = [threading.Thread(target=worker, name=f"slurm-ckpt-read-{i}", daemon=True) for i in range(count)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
    if errors:
        raise errors[0]
    return results


class _suppress_unsupported:
    """Advice calls are hints: ignore filesystems that do not take them."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, tp: object, exc: object, tb: object) -> bool:
        return isinstance(exc, OSError) and exc.errno in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ESPIPE)

"""The staging copy (slurm_ckpt.engine.memcopy): every byte of every piece, and nothing else.

The native loop streams the body of each piece of 4 KiB or more in whole
64-byte lines after copying up to the destination's first line boundary, and
copies the rest through the cache, so the cases that matter are the edges:
lengths just below, at and above 4096, heads of 0 to 63 bytes, tails of 0 to
63, and sources at every offset within a line. Each piece is written between
guard bytes that must stay as they were.
"""

from __future__ import annotations

import array
import ctypes
import platform
import threading
from unittest import mock

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from slurm_ckpt.engine import memcopy
from slurm_ckpt.engine.memcopy import copy_bytes

GUARD = 0xA5


def test_the_native_copy_is_built_and_streams_on_x86_64() -> None:
    # The test command installs a C compiler; if the build broke, copies fall
    # back to memmove and this says so instead of a bench quietly slowing.
    if platform.machine() != "x86_64":
        pytest.skip("non-temporal stores are built for x86-64 only")
    assert memcopy.nontemporal()


@pytest.mark.parametrize("libc", [False, True], ids=["streaming", "memmove"])
@pytest.mark.parametrize("threads", [1, 2, 3, 8])
def test_copy_bytes_splits_the_pieces_over_threads_and_copies_every_byte(threads: int, libc: bool) -> None:
    g = torch.Generator().manual_seed(threads)
    # Pieces of odd sizes, some far larger than a thread's share, some tiny, some empty.
    sizes = [5, 0, 3 << 20, 4097, 11 << 20, 1, 7 << 20, 123_457]
    src = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in sizes]
    dst = torch.zeros(sum(sizes) + 64, dtype=torch.uint8)
    pieces, off = [], 0
    for t in src:
        pieces.append((dst.data_ptr() + off, t.data_ptr(), t.numel()))
        off += t.numel()
    copy_bytes(pieces, threads=threads, libc=libc)
    assert torch.equal(dst[:off], torch.cat(src)) and not dst[off:].any()


_EDGE = [0, 1, 63, 64, 65, 4032, 4095, 4096, 4097, 4159, 4160, 8191, 65_536 + 37, 300_001]


@given(
    pieces=st.lists(
        st.tuples(st.one_of(st.sampled_from(_EDGE), st.integers(0, 70_000)),  # length
                  st.integers(0, 127),  # destination offset past a 64-byte boundary (and a line)
                  st.integers(0, 127)),  # source offset
        min_size=1, max_size=12),
    threads=st.sampled_from([1, 2, 3]),
    chunk=st.sampled_from([1, 63, 64, 4096, 4097, 2 << 20]),
)  # fmt: skip
def test_every_piece_lands_whole_between_untouched_guards(
    pieces: list[tuple[int, int, int]], threads: int, chunk: int
) -> None:
    g = torch.Generator().manual_seed(len(pieces))
    src = torch.randint(0, 256, (sum(n + s for n, _, s in pieces) + 64,), dtype=torch.uint8, generator=g)
    pad = 192  # guards before and after every destination
    dst = torch.full((sum(n + d + 2 * pad for n, d, _ in pieces),), GUARD, dtype=torch.uint8)
    assert dst.data_ptr() % 64 == 0  # torch's CPU allocator: the offsets below are the alignments
    jobs, want, s_off, d_off = [], [], 0, 0
    for n, d, s in pieces:
        s_off += s
        d_off += pad + d
        jobs.append((dst.data_ptr() + d_off, src.data_ptr() + s_off, n))
        want.append((d_off, s_off, n))
        s_off += n
        d_off += n + pad
    expect = torch.full_like(dst, GUARD)
    for d, s, n in want:
        expect[d : d + n] = src[s : s + n]
    # Split over the threads however small the copy, in chunks that end inside
    # pieces at any alignment and span several small ones.
    with mock.patch.object(memcopy, "_SPLIT", 0), mock.patch.object(memcopy, "_CHUNK", chunk):
        copy_bytes(jobs, threads=threads)
    assert torch.equal(dst, expect)


def test_the_copy_is_exact_when_the_bytes_are_every_value() -> None:
    # Every byte value at every position of a line, in a piece long enough to
    # stream, from a source one byte past a line boundary into one 63 past.
    src = torch.arange(256, dtype=torch.uint8).repeat(257)[1:]  # 65,791 bytes, offset 1 in its line
    dst = torch.zeros(src.numel() + 128, dtype=torch.uint8)
    copy_bytes([(dst.data_ptr() + 63, src.data_ptr(), src.numel())])
    assert torch.equal(dst[63 : 63 + src.numel()], src)
    assert not dst[:63].any() and not dst[63 + src.numel() :].any()


def test_a_shared_copy_hands_out_each_chunk_once_whoever_asks() -> None:
    # The threads of one copy share a cursor of the bytes claimed: a thread
    # copies exactly the chunks it claims, so one that comes after the first
    # 2 chunks were taken leaves them alone, copies the rest, and one that
    # comes after every chunk was taken copies nothing.
    if memcopy._native is None:
        pytest.skip("the native copy is not built")
    src = (torch.arange(3 * 4096 + 5) % 250 + 1).to(torch.uint8)  # 1 to 250: no zeros, room to add 1
    dst = torch.zeros_like(src)
    pieces = [(dst.data_ptr(), src.data_ptr(), 4096 + 1), (dst.data_ptr() + 4097, src.data_ptr() + 4097, 2 * 4096 + 4)]
    flat = array.array("Q", [v for p in pieces for v in p])

    def claim_rest(cursor: ctypes.c_uint64) -> None:
        memcopy._native.sckpt_copy_shared(flat.buffer_info()[0], len(pieces), ctypes.byref(cursor), 1000)

    taken = ctypes.c_uint64(2000)
    claim_rest(taken)
    assert not dst[:2000].any() and torch.equal(dst[2000:], src[2000:])
    assert taken.value >= src.numel()  # every chunk claimed
    claim_rest(ctypes.c_uint64(0))
    assert torch.equal(dst, src)
    src.add_(1)
    claim_rest(taken)
    assert torch.equal(dst, src - 1)  # nothing left to claim


def test_an_interrupted_copy_lets_go_of_the_buffers_only_after_its_helpers(monkeypatch: pytest.MonkeyPatch) -> None:
    # A helper thread copies out of the piece table and into the caller's
    # buffer until its last chunk is done: if the calling thread's own share
    # is interrupted, copy_bytes must still wait for the helpers before it
    # raises, or the caller frees memory a helper is writing.
    started, proceed, helper_done = threading.Event(), threading.Event(), threading.Event()
    outcome: dict[str, bool] = {}

    class Native:
        def sckpt_copy_shared(self, *args: object) -> None:
            if threading.current_thread() is caller:
                started.wait()
                raise KeyboardInterrupt  # as a signal handler would, once the foreign call returns
            started.set()
            proceed.wait()
            helper_done.set()

    def run() -> None:
        try:
            copy_bytes([(0, 0, 64 << 20)], threads=2)
        except KeyboardInterrupt:
            outcome["helper done when it raised"] = helper_done.is_set()

    monkeypatch.setattr(memcopy, "_native", Native())
    caller = threading.Thread(target=run)
    caller.start()
    caller.join(timeout=0.5)
    still_waiting = caller.is_alive()
    proceed.set()
    caller.join()
    assert still_waiting, "copy_bytes raised while a helper was still copying"
    assert outcome == {"helper done when it raised": True}

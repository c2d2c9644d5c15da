"""The engine's parts: crc combining, chunking, the writer and reader, staging, snapshots.

Files go to the real filesystem under tmp_path (ext4 here, O_DIRECT on); small
chunk sizes make even small states span many chunks, unaligned tails included.
"""

from __future__ import annotations

import gc
import json
import mmap as mmap_module
import os
import struct
import zlib
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from slurm_ckpt.config import ConfigError, EngineConfig, load_config
from slurm_ckpt.engine import Engine, gc_paused
from slurm_ckpt.engine.layout import order_entries, plan_file, plan_writes
from slurm_ckpt.engine.reader import read_tensor_file
from slurm_ckpt.engine.staging import Staging
from slurm_ckpt.engine.writer import write_image
from slurm_ckpt.errors import CheckpointCorrupt
from slurm_ckpt.store import crc
from slurm_ckpt.store.codec import TensorEntry, encode_state
from slurm_ckpt.store.commit import commit
from slurm_ckpt.store.crc import crc32_combine, crc32_of_chunks
from slurm_ckpt.store.load import load_state
from slurm_ckpt.store.tensorfile import FileRecord, read_tensors, write_tensor_file
from slurm_ckpt.store.verify import verify_checkpoint

torch = pytest.importorskip("torch")


def mixed_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(7)
    return {
        "w": torch.randn(300, 70, generator=g),  # 84,000 bytes: not a multiple of 4 KiB
        "b": torch.arange(13, dtype=torch.int8),
        "h": torch.randn(9, generator=g).half(),
        "bf": torch.randn(5, generator=g).bfloat16(),
        "d": torch.randn(3, 3, generator=g, dtype=torch.float64),
        "mask": torch.tensor([True, False, True]),
        "empty": torch.empty(0, 4),
        "scalar": torch.tensor(3.5),
        "t": torch.randn(20, 30, generator=g).t(),  # not contiguous
        "small": [torch.full((k,), float(k)) for k in range(1, 40)],
        "step": 12,
    }


def assert_same(got: Any, want: Any) -> None:
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want)
    elif isinstance(want, dict):
        assert got.keys() == want.keys()
        for k in want:
            assert_same(got[k], want[k])
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want)
        for a, b in zip(got, want, strict=True):
            assert_same(a, b)
    else:
        assert got == want


# Both the Python fallback and the one in use (ISA-L's, in C, where installed).
COMBINES = [pytest.param(crc._combine, id="python"), pytest.param(crc32_combine, id="in-use")]


@pytest.mark.parametrize("combine", COMBINES)
@given(st.binary(max_size=3000), st.binary(max_size=3000))
def test_crc32_combine_matches_zlib_on_the_concatenation(combine: Any, a: bytes, b: bytes) -> None:
    assert combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


@pytest.mark.parametrize("combine", COMBINES)
@pytest.mark.parametrize("n", [4096, (2 << 20) - 4096 * 37, (8 << 20) + 12345])
def test_crc32_combine_matches_zlib_at_chunk_lengths(combine: Any, n: int) -> None:
    a, b = b"head" * 1000, bytes(range(256)) * (n // 256) + b"x" * (n % 256)
    assert combine(zlib.crc32(a), zlib.crc32(b), n) == zlib.crc32(a + b)


@pytest.mark.parametrize("n", [0, 1, (1 << 31) - 1, 1 << 31, 1 << 32, 5 << 30, (1 << 40) + 3])
def test_the_combine_in_use_agrees_with_pythons_past_4_gib_and_at_0(n: int) -> None:
    # Lengths no test can afford to checksum: the Python combine is zlib's algorithm
    # step for step, so the two must agree (len 0 with crc2 != 0 included).
    for crc1, crc2 in [(0, 0), (0xDEADBEEF, 0x1234), (0xFFFFFFFF, 0xFFFFFFFF)]:
        assert crc32_combine(crc1, crc2, n) == crc._combine(crc1, crc2, n)


@given(st.lists(st.binary(max_size=500), max_size=8))
def test_crc32_of_chunks_equals_one_pass(parts: list[bytes]) -> None:
    assert crc32_of_chunks([(zlib.crc32(p), len(p)) for p in parts]) == zlib.crc32(b"".join(parts))


@given(
    st.lists(st.tuples(st.integers(0, 30_000), st.integers(0, 4095)), max_size=10),
    st.sampled_from([4096, 8192, 12288]),
    st.booleans(),
)
def test_plan_writes_tiles_the_file_with_aligned_writes(
    spec: list[tuple[int, int]], chunk: int, direct: bool
) -> None:
    # Pieces at various in-page offsets: some line up with the file, most do not.
    pieces, addr = [], 1 << 30
    for n, phase in spec:
        addr = addr - addr % 4096 + 8192 + phase
        pieces.append((addr, n))
        addr += n
    writes = plan_writes(pieces, chunk, direct=direct)
    total = sum(n for _, n in pieces)
    assert sum(w.size for w in writes) == total
    pos = 0
    for i, w in enumerate(writes):
        assert w.offset == pos and 0 < w.size <= chunk
        assert sum(seg.size for seg in w.segments) == w.size
        for seg in w.segments:
            assert sum(m for _, m in seg.pieces) == seg.size
            if seg.in_place:  # written from memory as it is: one aligned piece
                assert direct and len(seg.pieces) == 1 and seg.pieces[0][0] % 4096 == 0
        if direct:
            # O_DIRECT: every segment of every write starts page-aligned, and all
            # but the file's very last bytes come in whole pages.
            seg_pos = w.offset
            for seg in w.segments:
                assert seg_pos % 4096 == 0
                assert seg.size % 4096 == 0 or (i == len(writes) - 1 and seg is w.segments[-1])
                seg_pos += seg.size
        pos += w.size
    # The bytes, in file order, are the pieces' bytes in order.
    flat = [p for w in writes for seg in w.segments for p in seg.pieces]
    joined: list[tuple[int, int]] = []
    for a, m in flat:
        if joined and joined[-1][0] + joined[-1][1] == a:
            joined[-1] = (joined[-1][0], joined[-1][1] + m)
        else:
            joined.append((a, m))
    merged: list[tuple[int, int]] = []
    for a, m in (p for p in pieces if p[1]):
        if merged and merged[-1][0] + merged[-1][1] == a:
            merged[-1] = (merged[-1][0], merged[-1][1] + m)
        else:
            merged.append((a, m))
    assert joined == merged


def test_large_tensors_line_up_with_the_file_and_go_to_disk_in_place(tmp_path: Path) -> None:
    from slurm_ckpt.engine.buffers import aligned_buffer

    # Three 1 MiB tensors 64 bytes past a page boundary, as glibc places large
    # tensors, and a 1 MiB one at another offset that cannot line up with them;
    # each a storage of its own (a view would save the whole buffer, as torch.save does).
    mem = aligned_buffer(8 << 20)
    at = [64, (2 << 20) + 64, (4 << 20) + 64, (6 << 20) + 512]
    big = [torch.frombuffer(mem, dtype=torch.float32, offset=a, count=1 << 18).normal_() for a in at]
    state = {"b": big, "small": torch.randn(10)}
    enc = encode_state(state)
    image = plan_file(enc.tensors)
    assert image.pieces[1][0] % 4096 == 64 and len(image.keep[0]) % 4096 == 64
    writes = plan_writes(image.pieces, 1 << 20)
    in_place = sum(seg.size for w in writes for seg in w.segments if seg.in_place)
    assert in_place >= 3 * ((1 << 20) - 4096)
    path = tmp_path / "x.safetensors"
    rec = write_image(path, image, chunk=1 << 20)
    assert_same(read_tensor_file(path, rec), {e.key: e.tensor for e in enc.tensors})


@pytest.mark.parametrize(("threads", "chunk", "direct"), [(1, 4096, True), (4, 8192, True), (3, 12288, False)])
def test_written_file_reads_back_everywhere(tmp_path: Path, threads: int, chunk: int, direct: bool) -> None:
    enc = encode_state(mixed_state())
    entries = order_entries(enc.tensors)
    path = tmp_path / "x.safetensors"
    rec = write_image(path, plan_file(entries), threads=threads, chunk=chunk, direct=direct)
    data = path.read_bytes()
    assert rec == FileRecord(len(data), f"{zlib.crc32(data):08x}")
    want = {e.key: e.tensor for e in enc.tensors}
    for mmap in (False, True):
        assert_same(read_tensor_file(path, rec, threads=threads, chunk=chunk, use_mmap=mmap), want)
    assert_same(read_tensors(path, rec), want)  # the reference reader
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:  # a third-party reader
        assert_same({k: f.get_tensor(k) for k in f.keys()}, want)  # noqa: SIM118


def test_offsets_are_dtype_aligned_and_whole_rows_of_64_bytes_start_on_64(tmp_path: Path) -> None:
    enc = encode_state(mixed_state())
    path = tmp_path / "x.safetensors"
    rec = write_image(path, plan_file(order_entries(enc.tensors)), chunk=4096)
    (n,) = struct.unpack("<Q", path.read_bytes()[:8])
    assert (8 + n) % 16 == 0
    header = json.loads(path.read_bytes()[8 : 8 + n])
    data = {k: v for k, v in header.items() if k != "__metadata__"}
    for key, info in data.items():
        size = torch_itemsize(info["dtype"])
        assert info["data_offsets"][0] % size == 0, key
    # These tensors' memory has no one phase in a page, so the data starts on one
    # (phase 0): each tensor of a size that is a multiple of 64 bytes starts on 64.
    assert (8 + n) % 4096 == 0
    sized = [k for k, v in data.items() if (v["data_offsets"][1] - v["data_offsets"][0]) % 64 == 0]
    assert len(sized) >= 3 and all(data[k]["data_offsets"][0] % 64 == 0 for k in sized)
    out = read_tensor_file(path, rec, use_mmap=True)
    # Those are windows of the one mapping, with no copy; the others are copied to
    # 64-byte boundaries, as torch.load(mmap=True) places every tensor. Each has a
    # storage of its own.
    first = min(t.data_ptr() - data[k]["data_offsets"][0] for k, t in out.items() if k in sized and t.numel())
    copied = 0
    for key, t in out.items():
        assert t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()
        assert not t.untyped_storage().resizable(), key
        if not t.numel():
            continue
        assert t.data_ptr() % 64 == 0, key
        if data[key]["data_offsets"][0] % 64 == 0:
            assert t.data_ptr() == first + data[key]["data_offsets"][0], key
        else:
            copied += 1
    assert copied >= 10  # the odd sizes of mixed_state's small ones


@pytest.mark.parametrize(("at", "data_at"), [(64, 64), (0, 0), (16, 0)])
def test_the_file_follows_its_tensors_in_page_only_at_a_multiple_of_64(tmp_path: Path, at: int, data_at: int) -> None:
    # Large tensors from torch's allocator sit 64 bytes past a page: the data then
    # starts there too, and the writer sends them in place. numpy's sit at 16: at
    # that phase no tensor of the file would be at a 64-byte boundary, and a load
    # would move every one.
    keep = [_guarded(1 << 21, at) for _ in range(2)]
    enc = encode_state({"a": keep[0][1], "b": keep[1][1], "odd": torch.randn(3), "row": torch.randn(16)})
    path = tmp_path / "x.safetensors"
    rec = write_image(path, plan_file(enc.tensors))
    (n,) = struct.unpack("<Q", path.read_bytes()[:8])
    assert (8 + n) % 4096 == data_at
    header = json.loads(path.read_bytes()[8 : 8 + n])
    assert all(header[k]["data_offsets"][0] % 64 == 0 for k in ("a", "b", "row"))
    got = read_tensor_file(path, rec)
    assert all(t.data_ptr() % 64 == 0 for t in got.values())
    assert torch.equal(got["a"], keep[0][1]) and torch.equal(got["odd"], enc.leaves["odd"])


def torch_itemsize(name: str) -> int:
    from slurm_ckpt.store.codec import torch_dtype

    return int(torch_dtype(name).itemsize)


def test_reads_files_of_the_reference_writer_unaligned_offsets_included(tmp_path: Path) -> None:
    enc = encode_state({"b": torch.arange(3, dtype=torch.int8), "f": torch.randn(5), "d": torch.randn(2).double()})
    path = tmp_path / "ref.safetensors"
    rec = write_tensor_file(path, enc.tensors)  # keeps the given order: f starts at byte 3
    want = {e.key: e.tensor for e in enc.tensors}
    for mmap in (False, True):
        assert_same(read_tensor_file(path, rec, chunk=4096, use_mmap=mmap), want)


@pytest.mark.parametrize("mmap", [False, True])
def test_a_flipped_bit_anywhere_is_caught_naming_the_file(tmp_path: Path, mmap: bool) -> None:
    enc = encode_state(mixed_state())
    path = tmp_path / "x.safetensors"
    rec = write_image(path, plan_file(order_entries(enc.tensors)), chunk=4096)
    size = path.stat().st_size
    for where in (size - 1, size // 2, 4096):
        data = bytearray(path.read_bytes())
        data[where] ^= 0x10
        bad = tmp_path / f"bad-{where}.safetensors"
        bad.write_bytes(data)
        with pytest.raises(CheckpointCorrupt, match="checksum mismatch") as e:
            read_tensor_file(bad, rec, chunk=4096, use_mmap=mmap)
        assert e.value.path == str(bad)


def test_a_checksum_thread_that_fails_raises_its_error_not_a_false_corruption(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The crcs are taken on threads beside the reads; one that dies must not leave
    a chunk's crc out, which would make a sound file read as damaged. Nothing here
    makes crc32 fail by itself, so the test fails its third call."""
    from slurm_ckpt.engine import reader

    enc = encode_state(mixed_state())
    path = tmp_path / "x.safetensors"
    rec = write_image(path, plan_file(order_entries(enc.tensors)), chunk=4096)
    real, calls = reader.crc32, [0]

    def flaky(data: Any, value: int = 0) -> int:
        calls[0] += 1
        if calls[0] == 3:
            raise MemoryError("crc32 failed")
        return int(real(data, value))

    monkeypatch.setattr(reader, "crc32", flaky)
    with pytest.raises(MemoryError, match="crc32 failed"):
        read_tensor_file(path, rec, chunk=4096)
    assert calls[0] >= 3
    monkeypatch.setattr(reader, "crc32", real)
    assert_same(read_tensor_file(path, rec, chunk=4096), {e.key: e.tensor for e in enc.tensors})


def test_a_header_that_does_not_tile_the_data_is_refused_before_reading(tmp_path: Path) -> None:
    enc = encode_state({"a": torch.randn(4), "b": torch.randn(4)})
    path = tmp_path / "x.safetensors"
    write_image(path, plan_file(enc.tensors), chunk=4096)
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    cases = {
        "overlap": {"a": [0, 16], "b": [8, 24]},
        "too long for its shape": {"a": [0, 24], "b": [24, 32]},
    }
    for label, offsets in cases.items():
        h = json.loads(json.dumps(header))
        for k, o in offsets.items():
            h[k]["data_offsets"] = o
        body = json.dumps(h).encode().ljust(n)
        bad = tmp_path / f"{label}.safetensors"
        bad.write_bytes(raw[:8] + body + raw[8 + n :])
        with pytest.raises(CheckpointCorrupt):
            read_tensor_file(bad, FileRecord(bad.stat().st_size, "00000000"), verify=False)


def test_mmap_tensors_are_private_copies_on_write(tmp_path: Path) -> None:
    enc = encode_state({"a": torch.zeros(2048)})
    path = tmp_path / "x.safetensors"
    rec = write_image(path, plan_file(enc.tensors))
    before = path.read_bytes()
    out = read_tensor_file(path, rec, use_mmap=True)
    out["a"].add_(1)
    assert path.read_bytes() == before
    assert_same(read_tensor_file(path, rec), {"a": torch.zeros(2048)})


def test_map_location_moves_tensors(tmp_path: Path) -> None:
    enc = encode_state({"a": torch.randn(8)})
    path = tmp_path / "x.safetensors"
    rec = write_image(path, plan_file(enc.tensors))
    out = read_tensor_file(path, rec, device="meta")
    assert out["a"].device.type == "meta" and out["a"].shape == (8,)


@pytest.mark.parametrize("mode", ["sync", "overlap", "copy", "fork"])
def test_every_mode_commits_the_same_readable_checkpoint(tmp_path: Path, mode: str) -> None:
    state = mixed_state()
    eng = Engine(EngineConfig(chunk_size=8192, threads=3))
    job = eng.job(state, mode=mode)
    try:
        path = commit(tmp_path, 1, job.write, nbytes=job.nbytes)
    finally:
        job.close()
    man = verify_checkpoint(path)  # full: every checksum recomputed
    want = dict(state, t=state["t"].contiguous())
    assert_same(eng.load(path, man), want)
    assert_same(eng.load(path, man, mmap=True), want)
    assert_same(load_state(path, man), want)  # the reference reader


def test_a_read_keeps_eight_reads_in_flight_whatever_the_cores_unless_threads_are_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import slurm_ckpt.engine as engine_module
    from slurm_ckpt.engine import reader

    depths: list[int] = []
    real = reader._parallel
    monkeypatch.setattr(reader, "_parallel", lambda n, work, threads: depths.append(threads) or real(n, work, threads))
    monkeypatch.setattr(engine_module.os, "sched_getaffinity", lambda pid: {0})  # one core: 2 write threads
    state = {"w": torch.randn(1 << 20)}
    for cfg, want in ((EngineConfig(), 8), (EngineConfig(threads=3), 3)):
        eng = Engine(cfg)
        job = eng.job(state)
        try:
            path = commit(tmp_path, want, job.write, nbytes=job.nbytes)
        finally:
            job.close()
        assert_same(eng.load(path, verify_checkpoint(path)), state)
        assert depths[-1] == want and eng.threads == (2 if want == 8 else 3)
        # A mapped file's threads each checksum the mapping, on a core: as many as writes get.
        assert_same(eng.load(path, verify_checkpoint(path), mmap=True), state)
        assert depths[-1] == eng.threads


def test_a_fork_snapshot_after_staged_ones_writes_the_state_not_the_wiped_buffers(tmp_path: Path) -> None:
    # auto falls back to fork once a grown state no longer fits a staging copy,
    # in an engine whose staging and bounce buffers a forked child sees as zeros.
    state = mixed_state()
    eng = Engine(EngineConfig(chunk_size=8192, threads=3))
    want = dict(state, t=state["t"].contiguous())
    for step, mode in enumerate(("copy", "fork", "copy", "fork"), start=1):
        job = eng.job(state, mode=mode)
        try:
            path = commit(tmp_path, step, job.write, nbytes=job.nbytes)
        finally:
            job.close()
        assert_same(eng.load(path, verify_checkpoint(path)), want)
    assert eng.staging.capacity  # the copies used it, and the forks came after


@pytest.mark.parametrize("mode", ["overlap", "copy", "fork"])
def test_in_place_updates_after_the_snapshot_do_not_leak(tmp_path: Path, mode: str) -> None:
    state = {"w": torch.arange(100_000, dtype=torch.float32), "step": 1}
    want = {"w": state["w"].clone(), "step": 1}
    eng = Engine(EngineConfig(chunk_size=8192))
    job = eng.job(state, mode=mode)
    # The trainer goes on at once (overlap copied this small tensor before returning).
    state["w"].add_(1)
    path = commit(tmp_path, 1, job.write)
    job.close()
    assert_same(Engine().load(path, verify_checkpoint(path)), want)


def test_the_forked_writer_reads_the_snapshot_without_copying_it(tmp_path: Path) -> None:
    state = {"w": torch.randn(16 << 20)}  # 64 MiB: 16,384 pages
    job = Engine(EngineConfig(chunk_size=1 << 20)).job(state, mode="fork")
    try:
        commit(tmp_path, 1, job.write)
    finally:
        job.close()
    # O_DIRECT from pages shared with the parent would make the kernel copy
    # (unshare) each one: a page fault per page in the child, and a second copy.
    assert job.writer.rusage.ru_minflt < 16384 // 4
    assert torch.equal(Engine().load(tmp_path / "step-000000001", verify_checkpoint(tmp_path / "step-000000001"))["w"], state["w"])


@pytest.mark.parametrize("memory", ["share_memory_", "torch.from_file", "numpy.memmap"])
def test_a_fork_snapshot_freezes_tensors_in_shared_memory_too(tmp_path: Path, memory: str) -> None:
    # fork() freezes private memory only; pages of a shared mapping stay the
    # parent's, so a change after save_async returned would reach the child.
    n = 1 << 18
    backing = tmp_path / "tensor.bin"
    backing.write_bytes(bytes(4 * n))
    if memory == "share_memory_":
        t = torch.zeros(n).share_memory_()
    elif memory == "torch.from_file":
        t = torch.from_file(str(backing), shared=True, size=n)
    else:
        import numpy as np

        t = torch.from_numpy(np.memmap(backing, dtype=np.float32, mode="r+"))
    t.copy_(torch.arange(n, dtype=torch.float32))
    want = t.clone()
    job = Engine(EngineConfig(chunk_size=1 << 16)).job({"w": t, "step": 1}, mode="fork")
    t.add_(1)  # the trainer goes on before the child has written anything
    (tmp_path / "run").mkdir()
    try:
        path = commit(tmp_path / "run", 1, job.write)
    finally:
        job.close()
    assert torch.equal(Engine().load(path, verify_checkpoint(path))["w"], want)


def test_a_job_can_be_written_twice_like_a_retried_commit(tmp_path: Path) -> None:
    eng = Engine(EngineConfig(chunk_size=8192))
    for mode in ("fork", "copy", "overlap"):
        job = eng.job({"w": torch.randn(5000)}, mode=mode)
        (tmp_path / mode).mkdir()
        try:
            a = commit(tmp_path / mode, 1, job.write)
            b = commit(tmp_path / mode, 2, job.write)
        finally:
            job.close()
        assert (a / "tensors-00000.safetensors").read_bytes() == (b / "tensors-00000.safetensors").read_bytes()


def test_staging_is_reused_and_holds_one_copy(tmp_path: Path) -> None:
    staging = Staging()
    state = {"w": torch.randn(1 << 20), "b": torch.randn(1000)}
    enc = encode_state(state)
    image, _ = staging.stage(enc.tensors)
    first = staging._buf.data_ptr()
    state["w"].add_(1)
    image2, staged = staging.stage(encode_state(state).tensors)
    assert staging._buf.data_ptr() == first  # no new allocation after the first save
    assert staging.capacity <= 1.1 * enc.nbytes + (2 << 20)
    assert image2.size == image.size
    got = {e.key: e.tensor for e in staged}
    assert torch.equal(got["w"], state["w"])
    assert staging._buf.data_ptr() % 4096 == 0


def test_a_child_forked_between_saves_neither_shares_the_staging_buffer_nor_slows_the_next_copy(
    tmp_path: Path,
) -> None:
    # A DataLoader worker forked between two saves lives through the second.
    # Were the staging buffer shared with it copy-on-write, the second copy
    # would take a fault for each 4 KiB of the buffer (16,384 here); the
    # child gets zeros instead, and the copy takes almost none.
    import ctypes
    import mmap
    import resource

    from slurm_ckpt import Checkpointer

    probe = mmap.mmap(-1, mmap.PAGESIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # as the engine maps them
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.madvise(ctypes.c_void_p(ctypes.addressof(ctypes.c_char.from_buffer(probe))), mmap.PAGESIZE, 18):
        pytest.skip("this kernel refuses MADV_WIPEONFORK (Linux 4.14+): children share the buffer")
    state = {f"w{i}": torch.randn(4 << 20) for i in range(4)}  # 64 MiB
    ck = Checkpointer(tmp_path, distributed=False)
    try:
        ck.save_async(state, 1).wait()
        assert ck.engine.staging._buf is not None  # the default copied into staging
        addr = int(ck.engine.staging._buf.data_ptr())
        assert ctypes.string_at(addr, 8) != bytes(8)  # the file's header length
        pages = ck.engine.staging.capacity // 4096
        from_parent, to_child = os.pipe()
        from_child, to_parent = os.pipe()
        pid = os.fork()
        if pid == 0:  # the worker: reports what it sees there, then waits for the parent
            code = 1
            try:
                os.write(to_parent, b"z" if ctypes.string_at(addr, 8) == bytes(8) else b"p")
                os.read(from_parent, 1)
                code = 0
            finally:
                os._exit(code)
        try:
            assert os.read(from_child, 1) == b"z"  # zeros, not the parent's pages
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            handle = ck.save_async(state, 2)
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
            handle.wait()
        finally:
            os.write(to_child, b"x")
            assert os.waitpid(pid, 0)[1] == 0
        assert faults < pages // 8, f"{faults} page faults copying into a staging buffer of {pages} pages"
        loaded = ck.load_latest()
        assert ck.loaded_step == 2
        assert all(torch.equal(loaded[k], v) for k, v in state.items())
    finally:
        ck.close()


def test_staging_copies_views_whose_bytes_are_not_their_values() -> None:
    # Conjugate and negative views, and non-contiguous ones, go through torch's
    # copy; a raw memmove would store the bytes underneath instead of the values.
    # The codec hands over whole storages, so the non-contiguous entry is built
    # here: staging takes any layout.
    state = {"neg": torch.randn(1000)._neg_view(), "t": torch.randn(30, 40).t(), "plain": torch.randn(1000)}
    entries = [TensorEntry(k, v, "F32", list(v.shape)) for k, v in state.items()]
    _, staged = Staging().stage(entries)
    got = {e.key: e.tensor for e in staged}
    for k, v in state.items():
        assert torch.equal(got[k].view(v.shape), v.resolve_neg().contiguous()), k


def test_engine_config_is_validated() -> None:
    with pytest.raises(ConfigError, match="snapshot"):
        load_config(env={"SLURM_CKPT_CONFIG": os.devnull, "SLURM_CKPT_ENGINE_SNAPSHOT": "eager"})
    with pytest.raises(ConfigError, match="chunk_size"):
        load_config(env={"SLURM_CKPT_CONFIG": os.devnull, "SLURM_CKPT_ENGINE_CHUNK_SIZE": "1000"})
    cfg = load_config(env={"SLURM_CKPT_CONFIG": os.devnull, "SLURM_CKPT_ENGINE_SNAPSHOT": "overlap"})
    assert cfg.engine.snapshot == "overlap"


def test_gc_paused_restores_the_callers_setting() -> None:
    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_the_reader_refuses_fifos_and_symlinks(tmp_path: Path) -> None:
    from slurm_ckpt.errors import StorageError

    os.mkfifo(tmp_path / "fifo")  # a read would hang forever without O_NONBLOCK + the check
    with pytest.raises(CheckpointCorrupt, match="not a regular file"):
        read_tensor_file(tmp_path / "fifo", FileRecord(0, "00000000"))
    enc = encode_state({"a": torch.randn(4)})
    rec = write_image(tmp_path / "real.safetensors", plan_file(enc.tensors))
    (tmp_path / "link.safetensors").symlink_to(tmp_path / "real.safetensors")
    with pytest.raises(StorageError):
        read_tensor_file(tmp_path / "link.safetensors", rec)


def _thp_mode() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "never"
    return text.split("[", 1)[1].split("]", 1)[0]


def _anon_huge_kib(addr: int) -> int:
    """AnonHugePages of the mapping that holds ``addr`` (from /proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {addr:#x}")


def _resident_kib(lo: int, hi: int) -> tuple[int, int]:
    """KiB of ``[lo, hi)`` in memory, and of those on transparent huge pages.

    Page by page (``/proc/self/pagemap``, then ``/proc/kpageflags``' THP bit):
    ``smaps`` sums whole mappings, and the kernel merges a buffer's mapping with
    a neighbour that has the same flags (another huge-page buffer), so its
    figures need not be the buffer's own. Needs root for the page frame numbers.
    """
    n = (hi - lo) // 4096
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(lo // 4096 * 8)
        entries = struct.unpack(f"<{n}Q", f.read(n * 8))
    frames = [e & ((1 << 55) - 1) for e in entries if e >> 63 & 1]  # bit 63: present
    huge = 0
    with open("/proc/kpageflags", "rb") as f:
        for pfn in frames:
            f.seek(pfn * 8)
            huge += struct.unpack("<Q", f.read(8))[0] >> 22 & 1  # KPF_THP
    return len(frames) * 4, huge * 4


def _kernel_aligns_huge_mappings() -> bool:
    # Linux 6.7+ puts an anonymous private mapping that is a whole number of
    # huge pages long on a huge-page boundary; older kernels may not.
    mm = mmap_module.mmap(-1, 4 << 20, flags=mmap_module.MAP_PRIVATE | mmap_module.MAP_ANONYMOUS)
    try:
        from slurm_ckpt.engine.buffers import address_of

        return address_of(mm) % (2 << 20) == 0
    finally:
        mm.close()


@pytest.mark.skipif(_thp_mode() == "never", reason="transparent huge pages are off on this kernel")
def test_own_buffers_and_read_storage_get_huge_pages(tmp_path: Path) -> None:
    # THP is 'madvise' on most distributions: without asking, a buffer gets 4 KiB
    # pages, and O_DIRECT requests from it are cut at the disk's segment limit.
    from slurm_ckpt.engine.buffers import address_of, aligned_buffer

    buf = aligned_buffer(16 << 20)
    assert _anon_huge_kib(address_of(buf)) >= 8 << 10
    big = torch.randn(4 << 20)  # 16 MiB: read back into a storage of its own
    enc = encode_state({"w": big})
    image = plan_file(enc.tensors)
    path = tmp_path / "x.safetensors"
    rec = write_image(path, image)
    got = read_tensor_file(path, rec)["w"]
    assert torch.equal(got, big)
    assert _anon_huge_kib(got.data_ptr()) >= 8 << 10


@pytest.mark.skipif(_thp_mode() == "never", reason="transparent huge pages are off on this kernel")
@pytest.mark.skipif(not _kernel_aligns_huge_mappings(), reason="this kernel does not align huge mappings")
@pytest.mark.skipif(os.geteuid() != 0, reason="page frame numbers need root")
def test_buffers_are_huge_pages_end_to_end_and_their_slack_costs_no_memory(tmp_path: Path) -> None:
    # Only 2 MiB-aligned stretches can be huge pages: a buffer of 16 MiB and two
    # pages (what a 16 MiB tensor 64 bytes past a page needs) must be 8 whole huge
    # pages plus two small ones, not 7 and 2 MiB of small pages, nor 9 huge pages.
    from slurm_ckpt.engine.buffers import address_of, aligned_buffer

    for nbytes in [(16 << 20) + 8192, 4 << 20, (3 << 20) + 4096]:
        buf = aligned_buffer(nbytes)
        lo = address_of(buf)
        assert lo % (2 << 20) == 0 and len(buf) >= nbytes
        assert _resident_kib(lo, lo + len(buf)) == (nbytes >> 10, (nbytes >> 21) << 11)
        buf.close()
    # So a tensor read back lands on huge pages from its first byte to its last.
    big = torch.randn(4 << 20)
    enc = encode_state({"w": big})
    path = tmp_path / "x.safetensors"
    got = read_tensor_file(path, write_image(path, plan_file(enc.tensors)))["w"]
    assert torch.equal(got, big)
    assert _resident_kib(got.data_ptr(), got.data_ptr() + (16 << 20)) == (16 << 10, 16 << 10)


def test_fast_crc32_is_zlibs_crc32() -> None:
    # The optional ISA-L crc32 must give exactly zlib's values, or checkpoints
    # written with it would fail verification where it is not installed.
    isal_zlib = pytest.importorskip("isal.isal_zlib")

    assert crc.FAST and crc.crc32 is isal_zlib.crc32
    # Its values: the tests above (an isal without it leaves the Python one in use).
    assert crc.crc32_combine is getattr(isal_zlib, "crc32_combine", crc._combine)
    data = os.urandom(3 << 20)
    for lo, hi in [(0, 0), (0, 1), (7, 4096 + 13), (0, len(data))]:
        view = memoryview(data)[lo:hi]
        assert crc.crc32(view) == zlib.crc32(view)
        assert crc.crc32(view, 0xDEADBEEF) == zlib.crc32(view, 0xDEADBEEF)


def _guarded(nbytes: int, at: int) -> tuple[Any, Any]:
    """A float32 tensor of ``nbytes`` (its own storage) at byte ``at`` of a page-aligned
    buffer filled with a sentinel (0xA5): the bytes around it show any write that strays out of it."""
    from slurm_ckpt.engine.buffers import aligned_buffer

    mem = aligned_buffer(at + nbytes + 3 * 4096)
    raw = torch.frombuffer(mem, dtype=torch.uint8)
    raw.fill_(0xA5)
    return raw, torch.frombuffer(mem, dtype=torch.float32, offset=at, count=nbytes // 4)


@pytest.mark.parametrize(("at", "chunk", "n"), [(64, 1 << 20, (3 << 20) + 12), (64, 8192, (3 << 20) + 12),
                                              (100, 1 << 20, (3 << 20) + 12), (4096, 1 << 20, (3 << 20) + 12),
                                              (64, 1 << 20, (8 << 20) + 12)])  # fmt: skip
def test_into_reads_straight_into_the_callers_tensors_and_nowhere_else(
    tmp_path: Path, at: int, chunk: int, n: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    from slurm_ckpt.engine import reader
    # Saved from memory 64 bytes past a page (as glibc places large tensors), so the
    # file's data sits at that phase. A target at the same phase is read with O_DIRECT
    # in place; at another phase (100, 4096) all of it goes through a bounce buffer.
    # ``n`` is not a whole number of pages: both ends are partial; 8 MiB holds whole
    # huge pages, the only part then read in place.
    _, src = _guarded(n, 64)
    src.copy_(torch.randn(n // 4))
    state = {"w": src, "b": torch.randn(7), "h": torch.randn(3, 5).to(torch.float16)}
    enc = encode_state(state)
    path = tmp_path / "x.safetensors"
    rec = write_image(path, plan_file(enc.tensors))
    raw, w = _guarded(n, at)
    small = torch.zeros(7)
    fresh: list[int] = []
    real_storage = reader._storage
    monkeypatch.setattr(reader, "_storage", lambda nbytes: fresh.append(nbytes) or real_storage(nbytes))
    got = read_tensor_file(path, rec, into={"w": w, "b": small}, chunk=chunk)
    assert max(fresh) < 1 << 20  # only the small tensors' run got memory of its own
    assert got["w"] is w and got["b"] is small
    assert w.data_ptr() == raw.data_ptr() + at
    assert_same(got, {"w": src, "b": state["b"], "h": state["h"]})
    assert bool((raw[:at] == 0xA5).all()) and bool((raw[at + n :] == 0xA5).all())


def test_a_read_cut_short_goes_on_from_where_it_stopped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from slurm_ckpt.engine import reader

    # preadv may return fewer bytes than asked (a signal, a network filesystem):
    # here every call is cut to 5000 bytes.
    data = os.urandom(20_000)
    path = tmp_path / "f"
    path.write_bytes(data)
    real = os.preadv
    monkeypatch.setattr(reader.os, "preadv", lambda fd, bufs, off: real(fd, [bufs[0][:5000]], off))
    buf = bytearray(len(data))
    fd = os.open(path, os.O_RDONLY)
    try:
        reader._read_exactly(fd, path, memoryview(buf), 0, len(data))
        assert buf == data
        with pytest.raises(CheckpointCorrupt, match="unexpected end of file at byte 20000"):
            reader._read_exactly(fd, path, memoryview(bytearray(20_100)), 0, 20_001)
        reader._read_exactly(fd, path, memoryview(bytearray(20_100)), 0, 20_000)  # EOF may cut what is not needed
    finally:
        os.close(fd)


def test_into_splits_the_bytes_exactly_once_in_file_order() -> None:
    from slurm_ckpt.engine.reader import _items_into

    # Memory 64 bytes past a page: whole pages in place; with whole 2 MiB pages in
    # it, only those (the rest of an allocation cannot be huge pages).
    for addr, rb, re, direct in [(64, 64, (3 << 20) + 76, (3 << 20) - 4096), (100, 64, 9000, 0), (4096, 4096, 8192, 4096),
                                 (64, 64, 100, 0), (64, 64, (8 << 20) + 64, 6 << 20)]:  # fmt: skip
        items = _items_into(addr, rb, re, 8192)
        assert sum(i.n for i in items if not i.exact) == direct
        assert [(i.wb, i.wn) for i in items] == [(i.off, i.n) for i in items]
        covered = [b for i in items for b in range(i.wb, i.wb + i.wn, 4)]
        assert covered == list(range(rb, re, 4))
        for i in items:
            assert i.addr == addr + i.wb - rb
            if not i.exact:  # O_DIRECT: memory and file offset both page-aligned
                assert i.addr % 4096 == 0 and i.off % 4096 == 0 and i.n % 4096 == 0
                assert direct < (4 << 20) or (i.addr - (2 << 20)) // (6 << 20) == 0  # inside [2 MiB, 8 MiB)


def test_into_of_another_shape_is_refused_by_the_plan_and_a_disagreeing_header_by_the_reader(
    tmp_path: Path,
) -> None:
    from slurm_ckpt import Checkpointer

    src = torch.randn(1 << 18)
    with Checkpointer(tmp_path / "run") as ck:
        ck.save({"w": src}, step=1)
        wrong = torch.zeros(1 << 17)
        with pytest.raises(ValueError, match=r"'w'.*holds torch.float32 \[262144\].*shaped like the saved one"):
            ck.load_latest(into={"w": wrong})
        assert not wrong.any()
    # The reads follow the file's header: a target it does not fit is damage, refused before a read.
    path = tmp_path / "x.safetensors"
    rec = write_image(path, plan_file(encode_state({"w": src}).tensors))
    for other in (torch.zeros(1 << 17), torch.zeros(1 << 18, dtype=torch.float64)):
        with pytest.raises(CheckpointCorrupt, match="in the file"):
            read_tensor_file(path, rec, into={"w": other})
        assert not other.any()
    with pytest.raises(ValueError, match="do not mix"):
        read_tensor_file(path, rec, into={"w": torch.zeros(1 << 18)}, use_mmap=True)


def test_into_a_corrupt_file_is_caught_and_the_small_targets_stay_untouched(tmp_path: Path) -> None:
    state = {"w": torch.randn(1 << 20), "b": torch.randn(9)}
    path = tmp_path / "x.safetensors"
    rec = write_image(path, plan_file(encode_state(state).tensors))
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))
    small = torch.zeros(9)
    with pytest.raises(CheckpointCorrupt, match="checksum mismatch"):
        read_tensor_file(path, rec, into={"w": torch.zeros(1 << 20), "b": small})
    assert not small.any()  # copied in only after the whole file is verified


def test_load_latest_into_a_models_state_dict_updates_the_model_in_place(tmp_path: Path) -> None:
    from slurm_ckpt import Checkpointer

    torch.manual_seed(0)
    saved = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.Linear(1024, 512))  # 2 MiB weights
    with Checkpointer(tmp_path / "run", keep=2) as ck:
        ck.save({"model": saved.state_dict(), "step": 1}, step=1)
        with torch.no_grad():
            for p in saved.parameters():
                p.mul_(2)
        ck.save({"model": saved.state_dict(), "step": 2}, step=2)
        fresh = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.Linear(1024, 512))
        ptrs = [p.data_ptr() for p in fresh.parameters()]
        with pytest.raises(ValueError, match="shaped like the saved one"):
            ck.load_latest(into=fresh.state_dict())  # not nested as saved: nothing would match
        state = ck.load_latest(into={"model": fresh.state_dict()})
        assert state["step"] == 2 and [p.data_ptr() for p in fresh.parameters()] == ptrs
        for a, b in zip(fresh.parameters(), saved.parameters(), strict=True):
            assert torch.equal(a, b)
        # A damaged newest checkpoint: the older one is loaded over what was read of it.
        data = tmp_path / "run" / "step-000000002" / "tensors-00000.safetensors"
        raw = bytearray(data.read_bytes())
        raw[-100] ^= 0x01
        data.write_bytes(bytes(raw))
        state = ck.load_latest(into={"model": fresh.state_dict()})
        assert state["step"] == 1 and ck.loaded_step == 1
        for a, b in zip(fresh.parameters(), saved.parameters(), strict=True):
            assert torch.equal(a * 2, b)

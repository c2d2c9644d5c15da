"""Block-verified reads of parts of stored chunks (``slurm_ckpt.dcp.ranged``), on real files.

A chunk's bytes sit in a file at some offset, with a crc32 per block; reading
any hypercube of it must give exactly ``chunk[cube]``, read only the blocks
the cube touches, and check each of them.
"""

from __future__ import annotations

import math
import zlib
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slurm_ckpt.dcp.index import Stored, block_size
from slurm_ckpt.dcp.ranged import RangeReader, runs
from slurm_ckpt.errors import CheckpointCorrupt
from slurm_ckpt.store.tensorfile import FileRecord

AT = 123  # the chunk does not start at the file's beginning, nor on a block boundary


def store(path: Path, chunk: torch.Tensor, block: int) -> Stored:
    raw = chunk.contiguous().view(torch.uint8).reshape(-1).tolist() if chunk.numel() else []
    data = bytes(raw)
    path.write_bytes(b"\xee" * AT + data + b"\xee" * 17)
    crcs = tuple(f"{zlib.crc32(data[i : i + block]):08x}" for i in range(0, max(len(data), 1), block))
    return Stored(path.name, AT, len(data), block, crcs)


@st.composite
def cubes(draw: st.DrawFn) -> tuple[list[int], list[int], list[int], torch.dtype, int]:
    sizes = draw(st.lists(st.integers(1, 7), min_size=1, max_size=3))
    offsets = [draw(st.integers(0, s - 1)) for s in sizes]
    lengths = [draw(st.integers(1, s - o)) for s, o in zip(sizes, offsets, strict=True)]
    dtype = draw(st.sampled_from([torch.float32, torch.int16, torch.float64, torch.uint8]))
    block = draw(st.sampled_from([16, 32, 64, 4096]))
    return sizes, offsets, lengths, dtype, block


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=cubes(), contiguous=st.booleans())
def test_any_hypercube_reads_back_exactly_and_only_its_blocks(tmp_path: Path, case: tuple, contiguous: bool) -> None:
    sizes, offsets, lengths, dtype, block = case
    chunk = (torch.arange(math.prod(sizes), dtype=torch.int64) * 7919 % 251).to(dtype).reshape(sizes)
    where = store(tmp_path / "f", chunk, block)
    want = chunk[tuple(slice(o, o + n) for o, n in zip(offsets, lengths, strict=True))]
    dest = torch.full(lengths, 99, dtype=dtype) if contiguous else torch.full(lengths[::-1], 99, dtype=dtype).permute(*reversed(range(len(lengths))))
    rs = runs(sizes, offsets, lengths, dtype.itemsize)
    with RangeReader(tmp_path, {"f": FileRecord(AT + where.length + 17, "")}) as rr:
        rr.read_into(where, rs, dest, sizes=sizes, offsets=offsets)
    assert torch.equal(dest, want)
    assert rr.bytes_needed == want.numel() * dtype.itemsize == sum(e - b for b, e in rs)
    touched = {i for b, e in rs for i in range(b // block, -(-e // block))}
    assert rr.bytes_read == sum(min(block, where.length - i * block) for i in touched)


def test_a_band_of_whole_rows_is_one_run_and_a_column_band_one_per_row() -> None:
    assert runs([6, 4], [2, 0], [3, 4], 4) == [(32, 80)]
    assert runs([6, 4], [0, 1], [2, 2], 4) == [(4, 12), (20, 28)]
    assert runs([2, 3, 4], [0, 0, 0], [2, 3, 4], 2) == [(0, 48)]
    assert runs([5], [0], [0], 4) == []
    with pytest.raises(ValueError, match="exceeds chunk"):
        runs([5], [3], [3], 4)


def test_a_flipped_byte_fails_exactly_the_reads_of_its_block(tmp_path: Path) -> None:
    block = 64
    chunk = torch.arange(80, dtype=torch.float32).reshape(20, 4)  # 320 bytes: 5 blocks of 64
    where = store(tmp_path / "f", chunk, block)
    data = bytearray((tmp_path / "f").read_bytes())
    data[AT + 3 * block + 5] ^= 0x01  # in the 4th block: rows 12-15
    (tmp_path / "f").write_bytes(bytes(data))
    files = {"f": FileRecord(len(data), "")}
    with RangeReader(tmp_path, files) as rr:
        dest = torch.empty(4, 4)
        rr.read_into(where, runs([20, 4], [0, 0], [4, 4], 4), dest)  # rows 0-3: the first block only
        assert torch.equal(dest, chunk[:4])
        with pytest.raises(CheckpointCorrupt, match=r"/f: checksum mismatch in bytes 315-379") as err:
            rr.read_into(where, runs([20, 4], [10, 0], [4, 4], 4), torch.empty(4, 4))  # a block's end
        assert err.value.path == str(tmp_path / "f")
        with pytest.raises(CheckpointCorrupt, match="checksum mismatch"):
            rr.read_into(where, runs([20, 4], [12, 0], [4, 4], 4), torch.empty(4, 4))  # the whole block, in place
        with pytest.raises(CheckpointCorrupt, match="checksum mismatch"):
            rr.read_into(where, runs([20, 4], [0, 2], [20, 1], 4), torch.empty(20, 1), sizes=[20, 4], offsets=[0, 2])


def test_a_file_of_the_wrong_size_is_refused_before_reading(tmp_path: Path) -> None:
    chunk = torch.arange(8, dtype=torch.float32)
    where = store(tmp_path / "f", chunk, 16)
    with RangeReader(tmp_path, {"f": FileRecord(AT + 32 + 16, "")}) as rr, pytest.raises(
        CheckpointCorrupt, match="size is 172, manifest expects 171"
    ):
        rr.read_into(where, [(0, 32)], torch.empty(8))


@given(st.integers(0, 1 << 42))
def test_a_chunk_has_at_most_64_blocks_each_at_least_64_kib(n: int) -> None:
    b = block_size(n)
    assert b >= 64 << 10 and b & (b - 1) == 0
    assert -(-n // b) <= 64
    assert b == 64 << 10 or -(-n // (b // 2)) > 64  # and no larger than that needs


def test_reads_past_the_page_cache_give_exact_bytes_and_still_check_every_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Large reads go through O_DIRECT and the engine's bounce buffers (the chunk starts
    off a page boundary, the destination too); a stretch of many blocks is read at once,
    and each of its blocks is still checked."""
    import slurm_ckpt.dcp.ranged as ranged

    block = 64 << 10
    chunk = (torch.arange(5 << 18, dtype=torch.int64) * 7919 % 65521).to(torch.float32)  # 5 MiB, 80 blocks
    where = store(tmp_path / "f", chunk, block)
    files = {"f": FileRecord(AT + where.length + 17, "")}
    opened: list[int] = []
    real = ranged.open_direct
    monkeypatch.setattr(ranged, "open_direct", lambda path: opened.append(fd := real(path)) or fd)
    with RangeReader(tmp_path, files) as rr:
        dest = torch.full((chunk.numel() - 1000,), -1.0)[1:]  # a view: not page-aligned
        rr.read_into(where, [(4004, where.length)], dest)
        assert torch.equal(dest, chunk[1001:]) and opened and opened[0] >= 0
    data = bytearray((tmp_path / "f").read_bytes())
    data[AT + 61 * block + 5] ^= 0x01  # inside one stretch, far from its ends
    (tmp_path / "f").write_bytes(bytes(data))
    with RangeReader(tmp_path, files) as rr, pytest.raises(CheckpointCorrupt, match=f"in bytes {AT + 61 * block}-"):
        rr.read_into(where, [(0, where.length)], torch.empty_like(chunk))

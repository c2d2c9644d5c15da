"""The benchmarks' raw limit: ``Raw`` reads back what it wrote, reads any other
file to its end, and a read that fails raises instead of timing as a fast one."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bench.disk import Raw
from slurm_ckpt.engine.buffers import ALIGN, aligned_buffer


def test_raw_reads_back_what_it_wrote(tmp_path: Path) -> None:
    raw = Raw(3 * ALIGN, ALIGN, huge=False)
    raw.write(tmp_path / "raw.bin", 2)
    into = aligned_buffer(raw.nbytes, huge=False)
    raw.read(tmp_path / "raw.bin", 2, into=memoryview(into))
    assert bytes(into) == bytes(raw.buf) == (tmp_path / "raw.bin").read_bytes()


def test_raw_reads_a_shorter_file_to_its_end_and_stops(tmp_path: Path) -> None:
    # A checkpoint's data file is read the same way, and its size is no multiple of a page.
    data = os.urandom(2 * ALIGN + 1000)
    (tmp_path / "data").write_bytes(data)
    raw = Raw(len(data), ALIGN, huge=False)
    into = aligned_buffer(raw.nbytes, huge=False)
    landed: list[int] = []
    raw.read(tmp_path / "data", 2, into=memoryview(into), landed=lambda piece: landed.append(len(piece)))
    assert bytes(into[: len(data)]) == data
    assert sum(landed) == raw.nbytes


def test_a_raw_read_that_fails_raises(tmp_path: Path) -> None:
    (tmp_path / "data").write_bytes(os.urandom(2 * ALIGN))
    raw = Raw(2 * ALIGN, ALIGN, huge=False)
    unaligned = memoryview(bytearray(raw.nbytes + 1))[1:]  # O_DIRECT refuses memory off a page boundary
    with pytest.raises(OSError):
        raw.read(tmp_path / "data", 2, into=unaligned)

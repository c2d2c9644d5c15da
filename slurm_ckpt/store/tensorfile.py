"""Tensor data files in the safetensors layout, written and read with a running checksum.

Layout (readable by ``safetensors.safe_open`` and any third-party reader)::

    u64 little-endian N | N bytes of JSON header, space-padded | tensor bytes

The header maps each key to ``{"dtype", "shape", "data_offsets": [begin, end]}``
(offsets relative to the end of the header). We pad the header with spaces so
tensor data starts at a chosen offset within a 4 KiB page: 0 by default, or the
offset at which the tensors' memory sits within its pages, so the engine can
write them with O_DIRECT straight from that memory (see ``engine/layout.py``).
"""

from __future__ import annotations

import ctypes
import json
import os
import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import CheckpointCorrupt, storage_error
from .codec import TensorEntry, torch_dtype
from .crc import crc32
from .fsutil import fsync_file

__all__ = [
    "ALIGN",
    "FileRecord",
    "build_header",
    "read_header",
    "read_tensors",
    "tensor_bytes",
    "write_tensor_file",
]

ALIGN = 4096
CHUNK = 16 * 1024 * 1024
CHECKSUM = "crc32"


@dataclass(frozen=True)
class FileRecord:
    """What the manifest records for one file."""

    size: int
    checksum: str

    def to_json(self) -> dict[str, Any]:
        return {"size": self.size, CHECKSUM: self.checksum}


def tensor_bytes(t: Any) -> memoryview:
    """Zero-copy byte view of a CPU contiguous tensor (the tensor must stay alive)."""
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


def build_header(
    entries: Sequence[TensorEntry], metadata: dict[str, str] | None = None, *, phase: int = 0
) -> bytes:
    """The length prefix and JSON header, space-padded so the data starts at
    ``phase`` bytes past a 4 KiB boundary (a multiple of 16 keeps every dtype aligned)."""
    raw = _header_json(entries, metadata).encode()
    pad = (phase - 8 - len(raw)) % ALIGN
    raw += b" " * pad
    return struct.pack("<Q", len(raw)) + raw


def _header_json(entries: Sequence[TensorEntry], metadata: dict[str, str] | None) -> str:
    """The header's JSON, as ``json.dumps(header, separators=(",", ":"))`` writes it.

    Written entry by entry: the dict of dicts ``json.dumps`` would take costs
    more to build and to walk than the text, and a state of 10,000 small
    tensors has 10,000 entries.
    """
    if len({e.key for e in entries}) != len(entries):  # a dict keeps the last of a key, as before
        header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
        offset = 0
        for e in entries:
            header[e.key] = {"dtype": e.dtype, "shape": e.shape, "data_offsets": [offset, offset + e.nbytes]}
            offset += e.nbytes
        return json.dumps(header, separators=(",", ":"))
    quote = _quote
    parts = [f'"__metadata__":{json.dumps(metadata, separators=(",", ":"))}'] if metadata else []
    offset = 0
    for e in entries:
        end = offset + e.nbytes
        shape = ",".join([str(int(d)) for d in e.shape])
        parts.append(f'{quote(e.key)}:{{"dtype":{quote(e.dtype)},"shape":[{shape}],"data_offsets":[{offset},{end}]}}')
        offset = end
    return "{" + ",".join(parts) + "}"


_quote: Callable[[str], str] = json.encoder.encode_basestring_ascii
"""A JSON string as ``json.dumps`` writes it (ASCII, escaped), in C."""


def _chunks(header: bytes, entries: Sequence[TensorEntry]) -> Iterator[memoryview]:
    yield memoryview(header)
    for e in entries:
        buf = tensor_bytes(e.tensor)
        for i in range(0, len(buf), CHUNK):
            yield buf[i : i + CHUNK]


def write_tensor_file(
    path: Path, entries: Sequence[TensorEntry], metadata: dict[str, str] | None = None
) -> FileRecord:
    """Write ``entries`` to a new file, fsync it, and return its size and checksum.

    The checksum is computed on the bytes as they stream out, not in a second pass.
    """
    header = build_header(entries, metadata)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise storage_error(e, "cannot create data file", path) from e
    crc = 0
    size = 0
    try:
        for chunk in _chunks(header, entries):
            crc = crc32(chunk, crc)
            while chunk:
                n = os.write(fd, chunk)
                size += n
                chunk = chunk[n:]
        fsync_file(fd, path)
    except OSError as e:
        raise storage_error(e, "cannot write data file", path) from e
    finally:
        os.close(fd)
    return FileRecord(size, f"{crc:08x}")


def read_header(f: Any, path: Path, size: int) -> tuple[bytes, dict[str, Any]]:
    """Read and sanity-check the header; returns (raw bytes, parsed header)."""
    raw = f.read(8)
    if len(raw) != 8:
        raise CheckpointCorrupt(f"{path}: truncated header ({len(raw)} bytes)", path)
    (n,) = struct.unpack("<Q", raw)
    if n > size - 8 or n > 512 * 1024 * 1024:
        raise CheckpointCorrupt(f"{path}: header length {n} exceeds file size {size}", path)
    body = f.read(n)
    try:
        header = json.loads(body)
    except ValueError as e:
        raise CheckpointCorrupt(f"{path}: header is not valid JSON ({e})", path) from None
    if not isinstance(header, dict):
        raise CheckpointCorrupt(f"{path}: header is not a JSON object", path)
    for key, info in header.items():
        if key != "__metadata__" and not _valid_entry(info):
            # Anything a reader would index into, checked here: a header
            # missing its offsets is a corrupt file, not a KeyError.
            raise CheckpointCorrupt(f"{path}: header entry {key[:100]!r} has no valid dtype, shape "
                                    "and data_offsets", path)  # fmt: skip
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end != size:
        raise CheckpointCorrupt(
            f"{path}: size {size} does not match the header's {8 + n + end} bytes", path
        )
    return raw + body, header


def _valid_entry(info: Any) -> bool:
    # Runs once per tensor on every load and quick verify, so it unpacks instead of looping.
    if not isinstance(info, dict) or not isinstance(info.get("dtype"), str):
        return False
    offsets, shape = info.get("data_offsets"), info.get("shape")
    if type(offsets) is not list or len(offsets) != 2 or type(shape) is not list:
        return False
    begin, end = offsets
    if type(begin) is not int or type(end) is not int or not 0 <= begin <= end:
        return False
    return all(type(x) is int and x >= 0 for x in shape)


def read_tensors(
    path: Path, expected: FileRecord, *, verify: bool = True, device: Any = None, into: Any = None
) -> dict[str, Any]:
    """Read every tensor of a data file in one sequential pass, checking the checksum.

    Each tensor gets a storage of its own (offset 0, its own size). ``into``
    is not read into here (``load_state`` copies into those tensors afterwards).
    Raises :class:`CheckpointCorrupt` naming the file on a size or checksum mismatch.
    """
    import torch

    try:
        with open(path, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            if size != expected.size:
                raise CheckpointCorrupt(
                    f"{path}: size is {size}, manifest expects {expected.size}", path
                )
            raw, header = read_header(f, path, size)
            crc = crc32(raw) if verify else 0
            out: dict[str, Any] = {}
            order = sorted(
                ((k, v) for k, v in header.items() if k != "__metadata__"),
                key=lambda kv: kv[1]["data_offsets"][0],
            )
            for key, info in order:
                begin, end = info["data_offsets"]
                try:
                    t = torch.empty(info["shape"], dtype=torch_dtype(info["dtype"]))
                except (KeyError, TypeError, ValueError, RuntimeError) as e:
                    raise CheckpointCorrupt(f"{path}: bad tensor header for {key!r}: {e}", path) from None
                buf = tensor_bytes(t)
                if len(buf) != end - begin:
                    raise CheckpointCorrupt(f"{path}: tensor {key!r} does not fit its shape", path)
                got = 0
                while got < len(buf):
                    n = f.readinto(buf[got : got + CHUNK])
                    if not n:
                        raise CheckpointCorrupt(f"{path}: unexpected end of file", path)
                    if verify:
                        crc = crc32(buf[got : got + n], crc)
                    got += n
                out[key] = t if device is None else t.to(device)
    except OSError as e:
        raise storage_error(e, "cannot read data file", path) from e
    if verify and f"{crc:08x}" != expected.checksum:
        raise CheckpointCorrupt(
            f"{path}: checksum mismatch: expected {CHECKSUM} {expected.checksum}, "
            f"got {crc:08x}",
            path,
        )
    return out

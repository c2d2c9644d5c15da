"""One rank's chunks written into one safetensors-layout file, each block of each chunk checksummed.

Both writers of the chunked layout use it: :class:`~slurm_ckpt.dcp.StorageWriter`
(under ``dcp.save``) and the DTensor path of ``Checkpointer.save``
(``slurm_ckpt.sharded.job``). The file is one safetensors file with one entry
per chunk (``index.chunk_key``), written by the engine's parallel ``O_DIRECT``
writer from a file image: the tensors' own memory, or a staged copy of them.

The crc32 of each block (``index.block_size``) is taken from the same memory
the writer sends, and combined with the header's into the whole file's crc32,
which must equal the one the writer computed from the bytes it wrote: a
tensor changed in between (another thread, a trainer that did not wait) would
leave blocks that can never verify, so the save fails instead
(``SnapshotChanged``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..config import EngineConfig
from ..engine import default_threads
from ..engine import writer as engine_writer
from ..engine.buffers import memory_view
from ..engine.layout import FileImage
from ..errors import SnapshotChanged
from ..store.codec import TensorEntry
from ..store.crc import crc32, crc32_combine, crc_threads
from ..store.tensorfile import FileRecord
from .index import Stored, block_size

__all__ = ["write_chunks"]


def write_chunks(path: Path, name: str, image: FileImage, entries: Sequence[TensorEntry], cfg: EngineConfig,
                 *, what: str = "dcp.save") -> tuple[FileRecord, list[Stored]]:  # fmt: skip
    """Write ``image`` (a ``FileImage``: the header, then ``entries``' bytes in this
    order, as ``engine.layout.plan_file`` or ``Staging.stage`` lay it out) to ``path``.

    Returns the file's record and where each entry went (``Stored``, in the
    order of ``entries``, its file named ``name``). ``what`` names the call a
    trainer should not overlap with changes to the state, for the error.
    """
    header = image.size - sum(e.nbytes for e in entries)
    crcs = _block_crcs(entries)
    record = engine_writer.write_image(path, image, threads=cfg.threads or default_threads(),
                                       chunk=cfg.chunk_size, direct=cfg.direct_io)  # fmt: skip
    whole = 0
    left = header
    for addr, n in image.pieces:
        if left <= 0:
            break
        whole = crc32(memory_view(addr, min(n, left)), whole)
        left -= n
    for e, blocks in zip(entries, crcs, strict=True):
        for c, n in zip(blocks, _block_lengths(e.nbytes, block_size(e.nbytes)), strict=True):
            whole = crc32_combine(whole, int(c, 16), n)
    if f"{whole:08x}" != record.checksum:
        raise SnapshotChanged(
            f"{path}: a tensor changed while it was being written (the file's crc32 {record.checksum} does "
            f"not match its blocks' {whole:08x}); nothing was committed. Do not change the state while "
            f"{what} runs, or save in the background, which saves a copy"
        )
    out = []
    at = header
    for e, blocks in zip(entries, crcs, strict=True):
        out.append(Stored(name, at, e.nbytes, block_size(e.nbytes), tuple(blocks)))
        at += e.nbytes
    return record, out


def _block_lengths(n: int, block: int) -> Iterable[int]:
    if n == 0:
        return [0]
    return [min(block, n - i) for i in range(0, n, block)]


def _block_crcs(entries: Sequence[TensorEntry]) -> list[list[str]]:
    """The crc32 of every block of each entry's memory, on a few threads (crc32 releases the GIL)."""

    def one(e: TensorEntry) -> list[str]:
        addr, n = int(e.tensor.data_ptr()), e.nbytes
        block = block_size(n)
        if n == 0:
            return [f"{0:08x}"]
        return [f"{crc32(memory_view(addr + i, min(block, n - i))):08x}" for i in range(0, n, block)]

    small = 4 * block_size(0)
    out: dict[int, list[str]] = {i: one(e) for i, e in enumerate(entries) if e.nbytes <= small}
    big = [i for i, e in enumerate(entries) if e.nbytes > small]
    if big:
        with ThreadPoolExecutor(max_workers=min(crc_threads(), len(big)), thread_name_prefix="slurm-ckpt-crc") as ex:
            for i, crcs in zip(big, ex.map(lambda i: one(entries[i]), big), strict=True):
                out[i] = crcs
    return [out[i] for i in range(len(entries))]

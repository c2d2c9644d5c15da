"""MANIFEST.json: the record that makes a checkpoint directory a checkpoint.

It is written last, so a directory without a readable manifest was never
committed. It lists every file with its size and checksum, and the tensor index.

The manifest checksums itself: its last field, ``manifest_crc32``, is the crc32
of the document's bytes up to that field (with the closing ``\n}`` appended).
Without it a flipped digit in, say, the step time would go unnoticed.
"""

from __future__ import annotations

import json
import re
import socket
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._env import job_id as current_job_id
from ..errors import CheckpointCorrupt, storage_error
from .fsutil import read_small
from .tensorfile import CHECKSUM, FileRecord

__all__ = ["CHUNKED", "FORMAT", "MANIFEST", "READS", "VERSION", "Manifest", "is_chunked"]

FORMAT = "slurm-ckpt"
VERSION = 3
"""Written. 2: ``state.json`` may hold ``$view`` tensors (storages shared, any strides).
3: and ``$npscalar``, ``$size``, ``$complex``, ``$counter``, ``$defaultdict``,
``$namespace``, ``$path``, ``$set``, ``$device``, ``$bytearray`` and ``$npT`` values,
which a reader of 2 would give back as dicts, and ``$view``'s ``conj`` and ``neg``."""
READS = (1, 2, 3)
MANIFEST = "MANIFEST.json"
MANIFEST_LIMIT = 1 << 30
"""A manifest larger than this is damage, not a checkpoint (and would exhaust memory)."""
UNTRUSTED_MANIFEST_LIMIT = 64 * 1024**2
"""The tighter bound for a manifest in a tree its user can write, which the root
epilog reads: checked before it is parsed (``verify.plain_files``)."""
CHUNKED = "dcp"
"""``extra.layout`` of a checkpoint stored as chunks of global tensors (DTensor
states, the DCP backend): its tensor index is described in ``dcp/index.py``."""
_END = b"\n}"
_SELF_CRC = re.compile(rb',\n "manifest_crc32": "([0-9a-f]{8})"\n\}\n\Z')


@dataclass
class Manifest:
    step: int
    files: dict[str, FileRecord]
    tensors: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Tensor key -> {"file", "dtype", "shape"}."""
    time: float = field(default_factory=time.time)
    host: str = field(default_factory=socket.gethostname)
    job_id: str = field(default_factory=current_job_id)
    world_size: int = 1
    nbytes: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def to_bytes(self) -> bytes:
        doc = {
            "format": FORMAT,
            "version": VERSION,
            "step": self.step,
            "time": self.time,
            "time_iso": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.time)),
            "host": self.host,
            "job_id": self.job_id,
            "world_size": self.world_size,
            "nbytes": self.nbytes,
            "checksum": CHECKSUM,
            "files": {name: rec.to_json() for name, rec in sorted(self.files.items())},
            "extra": self.extra,
        }
        head = json.dumps(doc, indent=1).encode()
        assert head.endswith(_END)
        body = head[: -len(_END)] + b',\n "tensors": ' + _tensor_lines(self.tensors)
        return body + b',\n "manifest_crc32": "%08x"\n}\n' % zlib.crc32(body + _END)

    @classmethod
    def read(cls, ckpt_dir: Path) -> Manifest:
        """Parse and validate a manifest; :class:`CheckpointCorrupt` if it is bad."""
        path = ckpt_dir / MANIFEST
        try:
            raw = read_small(path, MANIFEST_LIMIT)
        except FileNotFoundError:
            raise CheckpointCorrupt(f"{path}: manifest missing (never committed?)", path) from None
        except OSError as e:
            raise storage_error(e, "cannot read manifest", path) from e
        try:
            m = _SELF_CRC.search(raw)
            if m is None:
                raise ValueError("its own checksum (manifest_crc32) is missing or damaged")
            want, got = m.group(1).decode(), f"{zlib.crc32(raw[: m.start()] + _END):08x}"
            if got != want:
                raise ValueError(f"checksum mismatch: expected manifest_crc32 {want}, got {got}")
            doc = json.loads(raw)
            if doc.get("format") != FORMAT:
                raise ValueError(f"format is {doc.get('format')!r}, not {FORMAT!r}")
            if doc.get("version") not in READS:
                raise ValueError(
                    f"format version {doc.get('version')} is not one this slurm-ckpt reads "
                    f"({', '.join(map(str, READS))}); upgrade slurm-ckpt to read it"
                )
            if doc.get("checksum") != CHECKSUM:
                raise ValueError(f"unknown checksum {doc.get('checksum')!r}")
            files = {}
            for name, rec in doc["files"].items():
                if name.startswith("/") or ".." in Path(name).parts:
                    raise ValueError(f"file name {name!r} escapes the checkpoint")
                files[name] = FileRecord(int(rec["size"]), str(rec[CHECKSUM]))
            return cls(
                step=int(doc["step"]),
                files=files,
                tensors=dict(doc["tensors"]),
                time=float(doc["time"]),
                host=str(doc["host"]),
                job_id=str(doc["job_id"]),
                world_size=int(doc["world_size"]),
                nbytes=int(doc.get("nbytes", 0)),
                extra=dict(doc.get("extra", {})),
            )
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointCorrupt(f"{path}: invalid manifest: {e}", path) from None


def is_chunked(man: Manifest) -> bool:
    """Whether ``man``'s tensors are stored as chunks of global tensors (see :data:`CHUNKED`).

    A chunked checkpoint loads whole at any world size: every rank reads its
    parts of every rank's files, never just a shard of its own.
    """
    return man.extra.get("layout") == CHUNKED


def _tensor_lines(tensors: dict[str, Any]) -> bytes:
    """The tensor index as JSON, one tensor a line.

    ``indent`` would put every field on a line of its own, and it makes
    ``json`` fall back from its C encoder to pure Python, several times
    slower for a state of many tensors, paid on every save. A ``}, "``
    in the one-line form can only be the end of one entry and the start of
    the next, since a quote inside a JSON string is always escaped; breaking
    the line there keeps the text valid JSON whatever the keys hold.
    """
    if not tensors:
        return b"{}"
    flat = json.dumps(tensors)
    return b"{\n  " + flat[1:-1].replace('}, "', '},\n  "').encode() + b"\n }"

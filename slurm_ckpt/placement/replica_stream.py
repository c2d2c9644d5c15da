"""One shard sent to a peer node, and committed there as a replica (``replicas.py``).

The sender (:class:`Outgoing`) streams the files of its shard's manifest in
order, in chunks of ``CHUNK`` bytes; the receiver (:class:`Incoming`) writes
them into a temp dir of ``<scratch>/ckpt/replicas/rank-K``, checksums every
file as it arrives, and commits the copy with the store's protocol (data
fsynced, the manifest last, rename, parent fsynced) only if every file matches
the sender's manifest. The replica's manifest is the shard's, with
``extra.replica`` saying where it came from. How the chunks travel (which
peers, which group, in step with the other streams) is the Replicator's.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any

from ..errors import CheckpointCorrupt
from ..store import shards as sh
from ..store.commit import commit
from ..store.crc import crc32
from ..store.fsutil import fsync_file, open_regular, remove_tree
from ..store.layout import tmp_dir_for
from ..store.retention import apply_retention
from ..store.shards import REPLICAS_DIR
from ..store.tensorfile import FileRecord

__all__ = ["CHUNK", "Incoming", "Outgoing", "node_name"]

log = logging.getLogger("slurm_ckpt")

CHUNK = 16 * 1024**2
"""Bytes per message of a file being sent."""


def node_name() -> str:
    """This node's name: Slurm's (``SLURMD_NODENAME``), else the host name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


class Outgoing:
    """This rank's shard as a stream of chunks: each file of its manifest in order."""

    def __init__(self, shard: sh.LocalShard | None, head: dict[str, Any]) -> None:
        self.files: list[tuple[str, int]] = []
        self.dir = shard.path if shard is not None else Path()
        if "manifest" in head:
            man = json.loads(head["manifest"])
            self.files = [(name, int(rec["size"])) for name, rec in man["files"].items()]
        self.i, self.left, self.fd = 0, 0, -1

    def next_chunk(self) -> Any:
        import torch

        while self.left == 0:
            if self.fd >= 0:
                os.close(self.fd)
                self.fd = -1
            if self.i >= len(self.files):
                return None
            name, self.left = self.files[self.i]
            self.i += 1
            if self.left:
                try:
                    self.fd = open_regular(self.dir / name)
                except OSError as e:  # the receiver's checksum refuses what is sent instead
                    log.warning("replica: cannot read %s: %s", self.dir / name, e)
        n = min(CHUNK, self.left)
        buf = bytearray(n)
        if self.fd >= 0:
            view, got = memoryview(buf), 0
            while got < n and (k := os.readv(self.fd, [view[got:]])):
                got += k
        self.left -= n
        return torch.frombuffer(buf, dtype=torch.uint8)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class Incoming:
    """One shard arriving from ``src``: written into a temp dir of ``replicas/rank-K``, then committed."""

    def __init__(self, fast: Path | None, keep: int, src: int, head: dict[str, Any]) -> None:
        self.fast, self.keep, self.src, self.head = fast, keep, src, head
        self.error: str | None = head.get("error")
        self.files: list[tuple[str, FileRecord]] = []
        self.man: dict[str, Any] = {}
        self.tmp: Path | None = None
        self.parent: Path | None = None
        if self.error is None:
            self.man = json.loads(head["manifest"])
            self.files = [(n, FileRecord(int(r["size"]), str(r["crc32"] if "crc32" in r else r.get("checksum"))))
                          for n, r in self.man["files"].items()]  # fmt: skip
            self._open()
        self.i, self.left, self.fd, self.crc = 0, 0, -1, 0
        self.got: dict[str, FileRecord] = {}
        self.name = ""

    def _open(self) -> None:
        fast = self.fast
        if fast is None:
            self.error = "no scratch here"
            return
        rank = int(self.head["rank"])
        self.parent = fast / REPLICAS_DIR / sh.shard_name(rank)
        try:
            self.parent.mkdir(parents=True, exist_ok=True)
            self.tmp = tmp_dir_for(self.parent, f"step-{int(self.head['step']):09d}")
            self.tmp.mkdir()
        except OSError as e:
            self.error = f"cannot write {self.parent}: {e}"
            self.tmp = None

    def next_size(self) -> int | None:
        while self.left == 0:
            self._close_file()
            if self.i >= len(self.files):
                return None
            name, rec = self.files[self.i]
            self.i += 1
            self.left, self.crc = rec.size, 0
            if self.error is None and self.tmp is not None:
                if name.startswith("/") or ".." in name.split("/"):
                    self.error = f"bad file name {name!r}"
                else:
                    try:
                        (self.tmp / name).parent.mkdir(parents=True, exist_ok=True)
                        self.fd = os.open(self.tmp / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
                    except OSError as e:
                        self.error = f"cannot write {self.tmp / name}: {e}"
            self.name = name
            if self.left == 0:
                self.got[name] = FileRecord(0, f"{0:08x}")
        return min(CHUNK, self.left)

    def take(self, data: Any) -> None:
        self.left -= len(data)
        self.crc = crc32(memoryview(data), self.crc)
        if self.fd >= 0:
            try:
                view = memoryview(data).cast("B")
                while view:
                    view = view[os.write(self.fd, view) :]
            except OSError as e:
                self.error = f"cannot write {self.name}: {e}"
        if self.left == 0:
            self.got[self.name] = FileRecord(self.files[self.i - 1][1].size, f"{self.crc:08x}")

    def _close_file(self) -> None:
        if self.fd >= 0:
            try:
                fsync_file(self.fd, self.tmp or Path())
            except OSError as e:
                self.error = f"cannot fsync {self.name}: {e}"
            os.close(self.fd)
            self.fd = -1

    def finish(self) -> bool:
        """Commit the replica if every byte matched its record; True if it is committed."""
        self._close_file()
        if self.error is not None or self.tmp is None or self.parent is None:
            log.warning("replica of rank %d's shard not kept: %s", self.src, self.error)
            return False
        bad = [n for n, rec in self.files if self.got.get(n) != rec]
        if bad:
            log.warning("replica of rank %d's shard not kept: %s does not match its checksum", self.src, bad[0])
            return False
        files = dict(self.files)
        m = self.man
        extra = dict(m.get("extra", {}), replica={"from": self.head["host"], "to": node_name(),
                                                  "at": time.time()})  # fmt: skip

        def verified(_: Path) -> tuple[dict[str, FileRecord], dict[str, Any]]:
            _fsync_subdirs(self.tmp, files)  # type: ignore[arg-type]
            return files, m.get("tensors", {})

        try:
            path = commit(self.parent, int(m["step"]), verified, into=self.tmp, time=m["time"], host=m["host"],
                          job_id=m.get("job_id", ""), world_size=m.get("world_size", 1),
                          nbytes=m.get("nbytes", 0), extra=extra)  # fmt: skip
        except (OSError, CheckpointCorrupt) as e:
            log.warning("replica of rank %d's shard of step %s not committed: %s", self.src, m.get("step"), e)
            return False
        self.tmp = None
        try:
            apply_retention(self.parent, self.keep, protect=[path])
        except OSError as e:
            log.warning("retention of replicas in %s failed: %s", self.parent, e)
        return True

    def abandon(self) -> None:
        self._close_file()
        if self.tmp is not None:
            remove_tree(self.tmp)
            self.tmp = None


def _fsync_subdirs(top: Path, files: dict[str, FileRecord]) -> None:
    subs = {str(Path(n).parent) for n in files if "/" in n}
    for rel in sorted(subs, key=lambda r: r.count("/"), reverse=True):
        fd = os.open(top / rel, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fsync_file(fd, top / rel)
        finally:
            os.close(fd)

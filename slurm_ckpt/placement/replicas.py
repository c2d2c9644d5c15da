"""Peer replicas: each node's scratch shards copied to the next nodes' scratch, in a ring.

With ``scratch.replicas: R`` (``CrossNode`` only), once a save is committed on
every node's scratch, a background thread on every rank sends its shard to
the rank in the same slot of the next ``R`` nodes (nodes in the order of
their first rank), over a gloo group of the job's own ``torch.distributed``.
The receiver commits the copy with the store's protocol (data fsynced, the
manifest last, rename, parent fsynced) under a path that names whose shard
it is::

    <scratch>/ckpt/rank-00001/step-000000120/                 its own shard
    <scratch>/ckpt/replicas/rank-00000/step-000000120/        rank 0's shard, from the previous node

Every file is checksummed as it arrives and compared with the sender's
manifest; a copy that does not match is not committed. The replica's
manifest is the shard's (same files, tensors, ``save_id``, rank, world),
with ``extra.replica`` saying where it came from.

All ranks run one exchange per save, in the order of the saves: the ranks
first agree on the newest save each has queued, so a rank that fell behind
skips the same older saves as every other rank. After each exchange the ranks
gather which copies were committed; rank 0 records on how many nodes each
step lives in ``<durable>/.replicas.json`` (read by ``slurm-ckpt ls``) and
every rank updates its metrics.

Resume (``CrossNode.load_latest``) counts replicas as shards: a save whose
shards the surviving ranks hold between them, own or replica, is staged from
where they are and assembled on the durable tier, then loaded at the current
world size. A node's epilog stages out the replicas on its scratch as it does
its own shards.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import CheckpointCorrupt
from ..store import shards as sh
from ..store.commit import commit
from ..store.crc import crc32
from ..store.fsutil import fsync_file, open_regular, write_file_durably
from ..store.layout import tmp_dir_for
from ..store.retention import apply_retention
from ..store.shards import REPLICAS_DIR
from ..store.tensorfile import FileRecord

__all__ = ["REPLICAS_DIR", "REPLICAS_INDEX", "Replicator", "node_name", "read_index", "replica_dirs", "replica_shards", "ring"]

log = logging.getLogger("slurm_ckpt")

REPLICAS_INDEX = ".replicas.json"
"""In the durable run dir: on how many nodes each recent step lives."""
CHUNK = 16 * 1024**2
_INDEX_KEEP = 32


def node_name() -> str:
    """This node's name: Slurm's (``SLURMD_NODENAME``), else the host name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def ring(peers: list[tuple[bool, str]], replicas: int) -> list[tuple[int, int, int]]:
    """(source rank, destination rank, distance) of every copy of one save.

    ``peers[r]`` is (rank r has scratch, its host). Nodes are ordered by their
    first rank; a rank's shard goes to the rank in its slot (its index among
    its node's ranks, modulo that node's count) on each of the next
    ``replicas`` nodes. Ranks without scratch neither send nor receive.
    """
    nodes: dict[str, list[int]] = {}
    for r, (_, host) in enumerate(peers):
        nodes.setdefault(host, []).append(r)
    order = list(nodes.values())
    n = len(order)
    pairs = []
    for i, ranks in enumerate(order):
        for slot, src in enumerate(ranks):
            if not peers[src][0]:
                continue
            for k in range(1, min(replicas, n - 1) + 1):
                there = order[(i + k) % n]
                dst = there[slot % len(there)]
                if peers[dst][0]:
                    pairs.append((src, dst, k))
    return pairs


def replica_dirs(fast: Path) -> list[Path]:
    """The ``replicas/rank-NNNNN`` dirs under a node's ``<scratch>/ckpt`` (never a link)."""
    top = fast / REPLICAS_DIR
    try:
        names = sorted(os.listdir(top))
    except OSError:
        return []
    out = []
    for name in names:
        if sh.rank_of(name) is None:
            continue
        try:
            if os.path.isdir(top / name) and not os.path.islink(top / name):
                out.append(top / name)
        except OSError:
            continue
    return out


def replica_shards(fast: Path) -> Iterator[sh.LocalShard]:
    """Every committed replica on this node (quick check), newest first per rank."""
    for d in replica_dirs(fast):
        yield from sh.local_shards(d)


@dataclass
class _Save:
    seq: int
    step: int
    save_id: str
    shard: sh.LocalShard | None


@dataclass
class Stats:
    """What this rank's replication did, for metrics and the bench."""

    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0
    saves: int = 0
    nodes: dict[int, int] = field(default_factory=dict)
    """step -> on how many nodes every shard of it lives (own copy included)."""


class Replicator:
    """One rank's side of the ring (see the module docstring). Every rank of the group has one."""

    def __init__(self, td: Any, pg: Any, rank: int, world: int, peers: list[tuple[bool, str]],
                 replicas: int, fast: Path | None, durable: Path, keep: int,
                 on_stats: Callable[[Stats], None] | None = None) -> None:  # fmt: skip
        self.td, self.pg, self.rank, self.world = td, pg, rank, world
        self.fast, self.durable, self.keep = fast, durable, keep
        self.hosts = [h for _, h in peers]
        self.pairs = ring(peers, replicas)
        self.out = [(d, k) for s, d, k in self.pairs if s == rank]
        self.into = [(s, k) for s, d, k in self.pairs if d == rank]
        self.stats = Stats()
        self._on_stats = on_stats
        self._cv = threading.Condition()
        self._queue: list[_Save] = []
        self._busy: _Save | None = None
        self._seq = 0
        self._done_seq = 0
        self._closing = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="slurm-ckpt-replicas", daemon=True)
        self._thread.start()

    def submit(self, step: int, save_id: str, shard: sh.LocalShard | None) -> None:
        """Queue one committed save; every rank calls it for every save, in the same order."""
        with self._cv:
            self._seq += 1
            self._queue.append(_Save(self._seq, step, save_id, shard))
            self._cv.notify_all()

    def protected(self) -> set[Path]:
        """This rank's shards still to be sent: retention must keep them."""
        with self._cv:
            items = [*self._queue, *([self._busy] if self._busy else [])]
        return {i.shard.path for i in items if i.shard is not None}

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every save queued so far is replicated (or skipped); True if it is."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            target = self._seq
            while self._done_seq < target and self._thread.is_alive():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cv.wait(left)
            return self._done_seq >= target

    def take_error(self) -> BaseException | None:
        with self._cv:
            err, self._error = self._error, None
            return err

    def close(self, timeout: float | None = None) -> bool:
        done = self.wait(timeout)
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        if done:
            self._thread.join(5)
            if not self._thread.is_alive():
                # Held past destroy_process_group(), the group would be torn down at interpreter
                # exit instead, where gloo can abort the process (see RankGroup.release).
                self.pg = None
        return done

    # -- the thread --------------------------------------------------------------
    def _next(self) -> _Save | None:
        with self._cv:
            while not self._queue and not self._closing:
                self._cv.wait()
            if not self._queue:
                return None
            newest = self._queue[-1].seq
        # Agree with the other ranks on the newest save all of them have: older ones are skipped.
        agreed = min(self._gather(newest))
        with self._cv:
            while self._queue and self._queue[0].seq < agreed:
                skipped = self._queue.pop(0)
                log.info("replicas of step %d skipped: a newer save is queued", skipped.step)
                self._done_seq = max(self._done_seq, skipped.seq)
            self._busy = self._queue.pop(0)
            return self._busy

    def _run(self) -> None:
        while True:
            try:
                item = self._next()
            except Exception as e:  # a peer died: the group is broken for good
                self._fail(e)
                return
            if item is None:
                return
            try:
                self._exchange(item)
            except Exception as e:
                self._fail(e)
                return
            with self._cv:
                self._busy = None
                self._done_seq = max(self._done_seq, item.seq)
                self._cv.notify_all()

    def _fail(self, e: BaseException) -> None:
        log.warning("peer replication stopped: %s", e)
        with self._cv:
            self._error = e
            self._busy = None
            self._queue.clear()
            self._done_seq = self._seq
            self._cv.notify_all()

    def _gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world
        self.td.all_gather_object(out, obj, group=self.pg)
        return out

    def _exchange(self, item: _Save) -> None:
        t0 = time.monotonic()
        sent, received, ok = self._transfer(item)
        # Which copies were committed, everywhere: on how many nodes each shard lives.
        reports = self._gather(ok)
        copies = {r: 1 for r in range(self.world)}
        for got in reports:
            for src in got:
                copies[src] = copies.get(src, 1) + 1
        nodes = min(copies.values()) if copies else 1
        with self._cv:
            st = self.stats
            st.bytes_sent += sent
            st.bytes_received += received
            st.seconds += time.monotonic() - t0
            st.saves += 1
            st.nodes[item.step] = nodes
        if self.rank == 0:
            self._record(item, nodes, copies)
        if self._on_stats is not None:
            self._on_stats(self.stats)

    def _record(self, item: _Save, nodes: int, copies: dict[int, int]) -> None:
        path = self.durable / REPLICAS_INDEX
        try:
            index = read_index(self.durable)
            index[str(item.step)] = {"save_id": item.save_id, "nodes": nodes, "time": time.time(),
                                     "copies": {sh.shard_name(r): c for r, c in sorted(copies.items())}}  # fmt: skip
            keep = sorted(index, key=int)[-_INDEX_KEEP:]
            data = json.dumps({k: index[k] for k in keep}, indent=1).encode()
            tmp = path.with_name(f"{REPLICAS_INDEX}.tmp-{os.getpid()}")
            tmp.unlink(missing_ok=True)
            write_file_durably(tmp, data)
            os.replace(tmp, path)
        except OSError as e:
            log.warning("cannot record the replicas of step %d in %s: %s", item.step, path, e)

    # -- the transfer --------------------------------------------------------------
    def _header(self, item: _Save) -> dict[str, Any]:
        shard = item.shard
        if shard is None or self.fast is None:
            return {"error": f"rank {self.rank} has no shard of step {item.step}"}
        try:
            raw = (shard.path / "MANIFEST.json").read_bytes()
        except OSError as e:
            return {"error": f"rank {self.rank}: cannot read {shard.path}: {e}"}
        return {"step": item.step, "save_id": item.save_id, "rank": self.rank,
                "host": node_name(), "manifest": raw.decode()}  # fmt: skip

    def _p2p(self, sends: list[tuple[int, Any]], recvs: list[tuple[int, Any]], tag: int) -> None:
        works = [self.td.isend(t, dst=p, group=self.pg, tag=tag) for p, t in sends]
        works += [self.td.irecv(t, src=p, group=self.pg, tag=tag) for p, t in recvs]
        for w in works:
            w.wait()

    def _transfer(self, item: _Save) -> tuple[int, int, list[int]]:
        """Send this rank's shard, receive the others' meant for it: (sent, received, sources committed)."""
        import torch

        if not self.out and not self.into:
            return 0, 0, []
        head = json.dumps(self._header(item)).encode() if self.out else b""
        # 1. header sizes, then headers.
        lens_in = [torch.zeros(1, dtype=torch.int64) for _ in self.into]
        self._p2p([(d, torch.tensor([len(head)], dtype=torch.int64)) for d, _ in self.out],
                  [(s, t) for (s, _), t in zip(self.into, lens_in, strict=True)], 1)  # fmt: skip
        heads_in = [torch.empty(int(t.item()), dtype=torch.uint8) for t in lens_in]
        out_head = torch.frombuffer(bytearray(head), dtype=torch.uint8) if head else torch.empty(0, dtype=torch.uint8)
        self._p2p([(d, out_head) for d, _ in self.out],
                  [(s, t) for (s, _), t in zip(self.into, heads_in, strict=True)], 2)  # fmt: skip
        # 2. the files, chunk by chunk, every stream in step.
        sender = _Outgoing(item.shard, json.loads(head) if head else {}) if self.out else None
        receivers = [_Incoming(self, s, json.loads(bytes(t.numpy()))) for (s, _), t in zip(self.into, heads_in, strict=True)]
        sent = received = 0
        try:
            while True:
                chunk = sender.next_chunk() if sender is not None else None
                wants = [(r, n) for r in receivers if (n := r.next_size()) is not None]
                if chunk is None and not wants:
                    break
                bufs = [(r, torch.empty(n, dtype=torch.uint8)) for r, n in wants]
                sends = [(d, chunk) for d, _ in self.out] if chunk is not None else []
                self._p2p(sends, [(r.src, b) for r, b in bufs], 3)
                if chunk is not None:
                    sent += chunk.numel() * len(self.out)
                for r, b in bufs:
                    r.take(b.numpy())
                    received += b.numel()
            ok = [r.src for r in receivers if r.finish()]
        finally:
            if sender is not None:
                sender.close()
            for r in receivers:
                r.abandon()
        return sent, received, ok


class _Outgoing:
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


class _Incoming:
    """One shard arriving from ``src``: written into a temp dir of ``replicas/rank-K``, then committed."""

    def __init__(self, owner: Replicator, src: int, head: dict[str, Any]) -> None:
        self.owner, self.src, self.head = owner, src, head
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
        fast = self.owner.fast
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
            apply_retention(self.parent, self.owner.keep, protect=[path])
        except OSError as e:
            log.warning("retention of replicas in %s failed: %s", self.parent, e)
        return True

    def abandon(self) -> None:
        self._close_file()
        if self.tmp is not None:
            from ..store.fsutil import remove_tree

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


def read_index(durable: Path) -> dict[str, Any]:
    """``<durable>/.replicas.json``: step -> {"nodes", "save_id", "copies", "time"}; {} if none."""
    try:
        data = json.loads((durable / REPLICAS_INDEX).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}

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
with ``extra.replica`` saying where it came from. This module decides who
sends to whom and when; one shard's stream and its commit on arrival are
``replica_stream.py``.

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
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..store import shards as sh
from ..store.fsutil import write_file_durably
from ..store.shards import REPLICAS_DIR
from .replica_stream import Incoming, Outgoing, node_name

__all__ = ["REPLICAS_DIR", "REPLICAS_INDEX", "Replicator", "node_name", "read_index", "replica_dirs", "replica_shards", "ring"]

log = logging.getLogger("slurm_ckpt")

REPLICAS_INDEX = ".replicas.json"
"""In the durable run dir: on how many nodes each recent step lives."""
_INDEX_KEEP = 32


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

    # -- the exchange --------------------------------------------------------------
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
        sender = Outgoing(item.shard, json.loads(head) if head else {}) if self.out else None
        receivers = [Incoming(self.fast, self.keep, s, json.loads(bytes(t.numpy()))) for (s, _), t in zip(self.into, heads_in, strict=True)]
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


def read_index(durable: Path) -> dict[str, Any]:
    """``<durable>/.replicas.json``: step -> {"nodes", "save_id", "copies", "time"}; {} if none."""
    try:
        data = json.loads((durable / REPLICAS_INDEX).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}

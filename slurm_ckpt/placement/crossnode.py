"""Sharded checkpoints across nodes that each have their own node-local scratch.

``Collective`` commits a sharded checkpoint into one temp dir that every rank
sees. With the prolog's scratch on each node no such dir exists, so when any
rank has scratch the save goes this way instead (layout: ``store/shards/``):

1. rank 0 picks a ``save_id`` for the save and broadcasts it;
2. each rank commits its shard on its own node: ``<scratch>/ckpt/rank-K/step-N``
   (fast, and durable on that node). A rank without scratch (its node's
   ledger was full) writes its shard straight into the durable staging dir,
   with a warning at start-up;
3. the ranks exchange their outcomes. If any failed, every rank raises and
   nothing is committed. Otherwise ``save`` returns: the step is saved on
   every node, which is what the wrapper needs to hear;
4. in the background each rank with scratch copies its shard into the
   durable staging dir (verified, committed on its own) and tries to
   assemble: the last shard in writes the manifest and renames the staging
   dir to ``step-N``. Only then is the checkpoint committed on the durable
   tier. What the drain does not finish, each node's epilog does (it runs the
   same two calls as the job's user) before it deletes that node's scratch.

Resume is collective: each rank lists the shards it can read itself (its own
scratch, the staging dirs) and rank 0 the committed checkpoints. A set of
shards counts only when every rank has its shard of that very save; otherwise
the ranks fall back to the durable tier. A chunked save (DTensor states,
``store.manifest.is_chunked``) resumes from the durable tier only: each rank
needs parts of the other ranks' shards (and the ones a rank holds alone,
replicated tensors and the plain values, are written once, by one rank). All ranks load their part of the
same candidate and agree before anyone uses it, moving to the next older one
together if any rank's part fails its checksums.

With peer replicas (``scratch.replicas``, ``replicas.py``) each shard is also
copied to the next nodes' scratch after the save. Resume then also counts a
save whose shards the ranks hold between them (their nodes' own shards and
replicas, saved at any world size, chunked or not): the ranks stage those
shards into the durable staging dir and assemble the checkpoint there, then
load it like any durable one, resharded to the current world size.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import CheckpointCorrupt, ShardError
from ..ranks import RankGroup
from ..store import RunDir, Skipped, iter_valid, note_skip
from ..store import shards as sh
from ..store.commit import WriteFn
from ..store.drainer import Drainer
from ..store.layout import step_dir
from ..store.load import pickled_parts, unsafe
from ..store.manifest import MANIFEST, Manifest, is_chunked
from ..store.retention import apply_retention, discard_checkpoint
from ..store.tiers import Tiers, write_tier_file
from ..store.verify import is_committed
from .base import Load
from .collective import Status, attempt, load_part, verdict
from .replicas import Replicator, node_name, replica_shards

__all__ = ["CrossNode"]

log = logging.getLogger("slurm_ckpt")


@dataclass(frozen=True)
class _Item:
    step: int
    save_id: str
    shard: sh.LocalShard
    at: float


class CrossNode:
    """One rank's side of cross-node sharded checkpoints (see the module docstring)."""

    tiers: Tiers | None = None

    def __init__(self, group: RankGroup, durable: RunDir, fast: Path | None, *, keep: int,
                 lock_timeout: float | None = 0, on_lag: Callable[[float], None] | None = None,
                 drain: bool = True, replicas: int = 0, peers: list[tuple[bool, str]] | None = None,
                 on_replicas: Callable[[int, int, int], None] | None = None) -> None:  # fmt: skip
        self.group, self.durable, self.keep = group, durable, keep
        self._top = fast
        self.rank, self.world = group.rank, group.world
        self.fast = (
            None
            if fast is None
            else RunDir(fast / sh.shard_name(group.rank), lock_timeout=lock_timeout)
        )
        self._on_lag = on_lag
        self._durable: set[int] = set()
        self._drainer: Drainer[_Item] = Drainer(
            self._stage,
            name="slurm-ckpt-shard-drain",
            describe=lambda item: f"copying shard {sh.shard_name(self.rank)} of step {item.step} "
            f"to the durable tier {self.durable.path}",
            enabled=drain,
            on_done=self._done,
            on_change=self._report_lag,
        )
        self.replicator: Replicator | None = None
        if replicas > 0 and peers is not None:
            def heard(st: Any) -> None:
                if on_replicas is not None:
                    on_replicas(st.nodes[max(st.nodes)] if st.nodes else 1, st.bytes_sent, st.bytes_received)

            # A gloo group of its own: the replication thread's collectives never pair
            # up with the saves' or the step agreement's.
            pg = group.td.new_group(backend="gloo")
            self.replicator = Replicator(group.td, pg, self.rank, self.world, peers, replicas, fast,
                                         durable.path, keep, on_stats=heard)  # fmt: skip

    @classmethod
    def setup(
        cls, group: RankGroup, durable: RunDir, fast: Path | None, *, keep: int, **kwargs: Any
    ) -> CrossNode | None:
        """Collective: a CrossNode when any rank has scratch, else None (``Collective`` saves then).

        ``fast`` is this rank's fast-tier dir (``<scratch>/ckpt``) or None.
        """
        host = node_name()  # the replica ring goes by node
        if fast is not None:
            try:
                RunDir(fast / sh.shard_name(group.rank)).ensure()
                # Tells the epilog where this node's shards go (read as untrusted input).
                write_tier_file(fast, durable.path, keep)
            except OSError as e:
                log.warning("cannot use scratch %s (%s)", fast, e)
                fast = None
        replicas = int(kwargs.pop("replicas", 0) or 0)
        gathered = group.all_gather((fast is not None, host, replicas))
        peers = [(has, h) for has, h, _ in gathered]
        if not any(has for has, _ in peers):
            return None
        # Replicas only when every rank asks for them and there is a peer node to hold them.
        replicas = min(r for _, _, r in gathered)
        if len({h for has, h in peers if has}) < 2:
            replicas = 0
        without = sorted({h for has, h in peers if not has})
        if fast is None:
            log.warning("rank %d on %s has no node-local scratch: its shards go straight to the durable "
                        "tier %s (slower saves); the other ranks use their scratch", group.rank, host,
                        durable.path)  # fmt: skip
        elif without and group.rank == 0:
            log.warning("no node-local scratch on %s: those ranks save straight to %s", ", ".join(without),
                        durable.path)  # fmt: skip
        err: BaseException | None = None
        if group.rank == 0:
            try:
                # One job writes a run dir; the other ranks assemble under .shards.lock.
                durable.lock()
            except OSError as e:  # LockHeld too: every rank must hear of it, not wait forever
                err = e
        failed = group.broadcast(None if err is None else str(err))
        if err is not None:
            raise err
        if failed is not None:
            raise ShardError(f"rank 0 cannot write {durable.path}: {failed}")
        return cls(group, durable, fast, keep=keep, replicas=replicas, peers=peers, **kwargs)

    # -- saving (collective) ---------------------------------------------------
    def commit(self, step: int, write: WriteFn, **meta: Any) -> Path:
        """Every rank calls this for the same step; returns this rank's committed shard."""
        g = self.group
        save_id = g.broadcast(sh.new_save_id() if self.rank == 0 else None)
        extra = sh.shard_extra(
            self.rank, self.world, save_id, tier="scratch" if self.fast else "durable"
        )
        meta = {**meta, "world_size": self.world, "extra": {**meta.get("extra", {}), **extra}}
        err: BaseException | None = None
        path: Path | None = None
        try:
            if self.fast is not None:
                path = self.fast.commit(step, write, **meta)
            else:
                path = sh.write_staged_shard(
                    self.durable.path, step, save_id, self.rank, write, **meta
                )
            report: tuple[str, str] = ("ok", str(path))
        except BaseException as e:  # reported to every rank, then re-raised here
            err, report = e, ("error", f"rank {self.rank} on {socket.gethostname()}: {e}")
        reports = g.all_gather(report)
        failed = [msg for kind, msg in reports if kind == "error"]
        if err is not None:
            raise err
        assert path is not None
        if failed:
            # This shard belongs to a save that can never be complete: drop it
            # so that neither the drain nor the epilog copies it anywhere.
            if self.fast is not None:
                discard_checkpoint(path)
            raise ShardError(f"checkpoint step {step} not saved: " + "; ".join(failed))
        # Every rank's shard is committed on its node. Those on scratch still
        # have to reach the durable tier; the last one there assembles step-N.
        shard = None
        if self.fast is not None:
            shard = sh.LocalShard(step, save_id, self.rank, self.world, path, Manifest.read(path))
            self._drainer.submit(_Item(step, save_id, shard, time.time()))
        if self.replicator is not None:  # every rank, shard or not: the exchanges stay in step
            own = shard if self.fast is not None else None
            self.replicator.submit(step, save_id, own)
        return path

    @property
    def search_dirs(self) -> list[Path]:
        return [self.durable.path]

    def committed(self, step: int, path: Path) -> None:
        self.retain(protect=[path])

    def retain(self, protect: list[Path], *, before: float | None = None, later: bool = False) -> list[Path]:
        """Retention on this rank's fast-tier dir; shards not yet staged are kept
        (``before`` and ``later``: see ``apply_retention``)."""
        if self.fast is None:
            return []
        return apply_retention(self.fast.path, self.keep, protect=[*protect, *self.protected()],
                               before=before, later=later)  # fmt: skip

    def protected(self) -> set[Path]:
        keep = {i.shard.path for i in self._drainer.in_flight()}
        if self.replicator is not None:
            keep |= self.replicator.protected()
        return keep

    def replicated(self, timeout: float | None = None) -> bool:
        """Wait until the saves so far are on their peers' scratch (True at once without replicas)."""
        return self.replicator.wait(timeout) if self.replicator is not None else True

    # -- the drain ---------------------------------------------------------------
    def _stage(self, item: _Item) -> tuple[Path, Path | None]:
        staged = sh.stage_shard(item.shard, self.durable.path, keep=self.keep)
        done = sh.complete(self.durable.path, item.step, item.save_id, self.world, keep=self.keep, by="drain")
        try:  # as Tiers does after a copy (its _trim_fast says why)
            self.retain(protect=[], before=item.at, later=True)
        except OSError as e:  # the shard is staged: a failed delete must not undo it
            log.warning("shard of step %d staged, but retention on scratch failed: %s", item.step, e)
        return staged, done

    def _done(self, item: _Item, result: tuple[Path, Path | None]) -> None:
        # Called by the drainer with its lock held.
        staged, done = result
        log.info("shard %s of step %d is durable: %s%s", sh.shard_name(self.rank), item.step, staged,
                 f"; checkpoint committed: {done}" if done else "; waiting for other ranks' shards")  # fmt: skip
        if done is not None:
            self._durable.add(item.step)

    def _report_lag(self) -> None:
        if self._on_lag is not None:
            item = self._drainer.newest
            self._on_lag(time.time() - item.at if item is not None else 0.0)

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until this rank's newest shard is staged; True if it is.

        The checkpoint itself is committed once the slowest rank's shard is there.
        """
        return self._drainer.drain(timeout)

    def is_durable(self, step: int) -> bool:
        """True once checkpoint ``step`` is committed (every shard) on the durable tier."""
        with self._drainer.cv:
            if step in self._durable:
                return (step_dir(self.durable.path, step) / MANIFEST).is_file()
        return is_committed(self.durable.path, step)

    def take_error(self) -> BaseException | None:
        err = self._drainer.take_error()
        if err is None and self.replicator is not None:
            err = self.replicator.take_error()
        return err

    def agree(self, flag: bool) -> bool:
        return self.group.agree(flag)

    def close(self, timeout: float | None = None) -> bool:
        try:
            if self.replicator is not None:
                self.replicator.close(timeout)
            return self.drain(timeout)
        finally:
            if self.fast is not None:
                self.fast.unlock()
            self.durable.unlock()
            self.group.release()

    # -- resume (collective) -----------------------------------------------------
    def _own_shards(self) -> dict[tuple[int, str], sh.LocalShard]:
        """Shards of this rank it can read itself: its scratch first, then staging."""
        found: dict[tuple[int, str], sh.LocalShard] = {}
        sources = [sh.staged_shards(self.durable.path, self.rank)]
        if self.fast is not None:
            sources.insert(0, sh.local_shards(self.fast.path))
        for source in sources:
            for s in source:
                if s.world == self.world and s.rank == self.rank and not is_chunked(s.manifest):
                    found.setdefault((s.step, s.save_id), s)
        return found

    def load_latest(self, load: Load, skipped: list[Skipped] | None) -> tuple[Any, int, Path] | None:
        """(state, step, path) of the newest checkpoint every rank can load, or None."""
        g = self.group
        try:
            own = self._own_shards()
        except OSError as e:
            log.warning(
                "cannot list the shards of rank %d: %s; resuming from the durable tier",
                self.rank,
                e,
            )
            own = {}
        held = self._held()
        sets = g.all_gather((sorted((k[0], k[1], s.manifest.time) for k, s in own.items()),
                             sorted(held)))  # fmt: skip
        cands: list[tuple[str, int, str]] | str | None = None
        if self.rank == 0:
            try:
                cands = _candidates([o for o, _ in sets], self.durable.path, skipped, [h for _, h in sets])
            except OSError as e:  # the others wait on the broadcast: tell them
                cands = f"rank 0 cannot list {self.durable.path}: {e}"
        cands = g.broadcast(cands)
        if isinstance(cands, str) or cands is None:
            raise ShardError(f"resume failed: {cands}")
        for kind, step, ref in cands:
            status, state, path, err = self._load_part(kind, step, ref, own, load)
            bad = verdict(g, status, err)
            if not bad:
                assert path is not None
                return state, step, path
            note_skip(path or Path(ref), "; ".join(bad), skipped)
        return None

    def _holdings(self) -> list[sh.LocalShard]:
        """Every shard this rank can read: all ``rank-*`` dirs of this node's scratch (the ranks
        this node had in an earlier run too) and the peers' replicas on it."""
        if self._top is None:
            return []
        out: list[sh.LocalShard] = []
        try:
            for name in sorted(os.listdir(self._top)):
                if sh.rank_of(name) is not None:
                    out.extend(sh.local_shards(self._top / name))
            out.extend(replica_shards(self._top))
        except OSError as e:
            log.warning("cannot list the shards and replicas on %s: %s", self._top, e)
        return out

    def _held(self) -> list[tuple[int, str, int, int, float]]:
        self._by_key = {(s.step, s.save_id, s.rank): s for s in reversed(self._holdings())}
        return [(s.step, s.save_id, s.rank, s.world, s.manifest.time) for s in self._by_key.values()]

    def _from_replicas(self, step: int, ref: str) -> tuple[Status, Path | None, BaseException | None]:
        """*Collective.* Stage the shards of one save from the ranks that hold them (own or
        replica) and assemble it on the durable tier: (status, its path, the error if fatal)."""
        save_id, world, plan = json.loads(ref)
        mine = [int(r) for r, holder in plan.items() if holder == self.rank]
        status: Status = ("ok", "")
        for r in mine:
            shard = getattr(self, "_by_key", {}).get((step, save_id, r))
            if shard is None:
                status = ("corrupt", f"rank {self.rank}: shard {r} of step {step} is gone")
                break
            try:
                sh.stage_shard(shard, self.durable.path, keep=self.keep)
            except (OSError, CheckpointCorrupt) as e:
                status = ("corrupt", f"rank {self.rank}: cannot stage shard {r} of step {step}: {e}")
                break
        bad = [why for kind, why in self.group.all_gather(status) if kind != "ok"]
        done: str | None = None
        if not bad and self.rank == 0:
            try:
                path = sh.complete(self.durable.path, step, save_id, world, keep=self.keep, by="resume")
                done = path.name if path is not None else None  # a name: each rank its own path
                if done is None:
                    bad = [f"step {step}: shards missing after staging"]
            except (OSError, CheckpointCorrupt) as e:
                bad = [f"cannot assemble step {step}: {e}"]
        got = self.group.broadcast((done, bad))
        done, bad = got
        if bad or done is None:
            return ("corrupt", "; ".join(bad)), None, None
        log.info("step %d assembled from the shards and replicas on the surviving nodes: %s", step, done)
        return ("ok", ""), self.durable.path / done, None

    def _load_part(self, kind: str, step: int, ref: str, own: dict[tuple[int, str], sh.LocalShard],
                   load: Load) -> tuple[Status, Any, Path | None, BaseException | None]:  # fmt: skip
        """Load this rank's part of one candidate: status, state, path, the error if fatal."""
        if kind == "replicas":
            status, where, err = self._from_replicas(step, ref)
            if where is None:
                return status, None, None, err
            ref = where.name
        if kind == "shards":
            shard = own.get((step, ref))
            # Each rank holds only its own shard's manifest: the ranks tell each other which
            # shards hold pickles, so that all refuse alike before any reads.
            pickled = [r for r, p in enumerate(self.group.all_gather(
                shard is not None and bool(pickled_parts(shard.manifest)))) if p]  # fmt: skip
            if shard is None:
                return ("corrupt", f"rank {self.rank}: no shard of step {step} save {ref}"), None, None, None

            def read() -> Any:
                if pickled and not load.trusted:
                    raise unsafe(f"step {step} (the shard of rank {pickled[0]})")
                return load(shard.path, shard.manifest)

            status, state, err = attempt(self.rank, read)
            return status, state, shard.path, err
        path = self.durable.path / ref  # a name in the run dir, which each rank reaches by its own path
        status, got, err = attempt(self.rank, lambda: load_part(path, self.rank, load))
        return status, got[0] if got is not None else None, path, err


def _candidates(sets: list[list[tuple[int, str, float]]], durable: Path, skipped: list[Skipped] | None,
                held: list[list[tuple[int, str, int, int, float]]] | None = None) -> list[tuple[str, int, str]]:  # fmt: skip
    """Newest first: committed checkpoints, saves every rank holds a shard of, and
    saves whose shards the ranks hold between them (own or replica, any world size).

    A save only some ranks hold (a node died, a node's scratch is gone) is no
    candidate unless replicas make up for it. At equal steps the newer save
    wins; the same save on both tiers is read from the shards, which may be on
    fast scratch; a save already committed on the durable tier is not
    assembled again from replicas.
    """
    common = set.intersection(*({(s, sid) for s, sid, _ in per_rank} for per_rank in sets))
    when: dict[tuple[int, str], float] = {}
    for per_rank in sets:
        for s, sid, t in per_rank:
            if (s, sid) in common:
                when[(s, sid)] = max(when.get((s, sid), 0.0), t)
    ranked: list[tuple[int, float, int, str, str]] = [
        (s, when[(s, sid)], 1, "shards", sid) for s, sid in common
    ]
    assembled: set[tuple[int, str]] = set()
    for cand in iter_valid([durable], full=False, skipped=skipped):
        ranked.append((cand.step, cand.manifest.time, 0, "durable", cand.path.name))
        assembled.add((cand.step, str(cand.manifest.extra.get("save_id"))))
    for (s, sid, world), (plan, t) in _whole_sets(held or [], durable).items():
        if (s, sid) not in common and (s, sid) not in assembled:
            ranked.append((s, t, -1, "replicas", json.dumps([sid, world, plan])))
    ranked.sort(key=lambda c: (c[0], c[1], c[2]), reverse=True)
    return [(kind, step, ref) for step, _, _, kind, ref in ranked]


def _whole_sets(held: list[list[tuple[int, str, int, int, float]]],
                durable: Path) -> dict[tuple[int, str, int], tuple[dict[str, int], float]]:  # fmt: skip
    """(step, save_id, world) -> ({shard rank: the rank that stages it}, time) for every save
    whose shards are all held by some rank, on its scratch or in the durable staging dirs."""
    holders: dict[tuple[int, str, int], dict[str, int]] = {}
    when: dict[tuple[int, str, int], float] = {}
    for me, shards in enumerate(held):
        for step, sid, r, world, t in shards:
            key = (step, sid, world)
            holders.setdefault(key, {}).setdefault(str(r), me)
            when[key] = max(when.get(key, 0.0), t)
    for shard in sh.staged_shards(durable):
        key = (shard.step, shard.save_id, shard.world)
        if key in holders:
            holders[key].setdefault(str(shard.rank), -1)  # staged already: nobody copies it
    return {k: (plan, when[k]) for k, plan in holders.items()
            if set(plan) == {str(r) for r in range(k[2])}}  # fmt: skip

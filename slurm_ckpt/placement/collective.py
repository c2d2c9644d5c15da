"""``Collective``: several ranks saving one sharded checkpoint into one shared run dir.

Every save is collective (every rank calls ``save`` for the same step) and
produces ONE checkpoint::

    step-000000120/MANIFEST.json
    step-000000120/rank-00000/state.json, tensors-….safetensors
    step-000000120/rank-00001/…

1. rank 0 takes the run-dir lock and creates the temp dir (``store.commit``),
   then broadcasts its name (a name in the run dir, which each rank reaches
   by its own path: nodes may mount the shared filesystem at other places);
2. every rank writes its shard into ``rank-NNNNN/``, fsyncs each file and the
   shard dir, and sends its file records to rank 0;
3. rank 0 writes the manifest listing every rank's files, and renames.

The manifest is written only after every rank has reported, so discovery can
never return a checkpoint that lacks a shard; a rank that failed makes the
whole step fail on every rank, with the rank named. No retries: one rank
retrying alone would desynchronise the others.

Resume: rank 0 picks the newest candidate, every rank loads its own shard and
checks its checksums, and the ranks agree before anyone uses it; if any rank's
shard fails, all move to the next older checkpoint together. A checkpoint
without shards (written by one process) is loaded whole by every rank, and so
is a chunked one (DTensor states, ``store.manifest.is_chunked``), whose ranks
each read their parts of every shard, at any world size.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import CheckpointCorrupt, ConfigError, ShardError, UnsafeLoad
from ..ranks import RankGroup
from ..store import RunDir, Skipped, iter_valid, note_skip
from ..store.commit import WriteFn
from ..store.fsutil import fsync_dir
from ..store.load import pickled_parts, unsafe
from ..store.manifest import Manifest, is_chunked
from ..store.shards import prefixed, shard_manifest, shard_name
from ..store.tensorfile import FileRecord
from ..store.tiers import Tiers
from ..store.verify import is_committed
from .base import Load

__all__ = ["Collective"]


class Collective:
    """Several ranks, one shared run dir: every save and resume is collective."""

    tiers: Tiers | None = None

    def __init__(self, run_dir: RunDir, group: RankGroup, keep: int) -> None:
        self.run_dir, self.group, self.keep = run_dir, group, keep

    @property
    def search_dirs(self) -> list[Path]:
        return [self.run_dir.path]

    # -- saving (collective) ---------------------------------------------------
    def commit(self, step: int, write: WriteFn, **meta: Any) -> Path:
        meta["world_size"] = self.group.world
        if self.group.rank == 0:
            return self._commit_main(step, write, meta)
        return self._commit_other(step, write)

    def _commit_main(self, step: int, write: WriteFn, meta: dict[str, Any]) -> Path:
        g = self.group
        announced = gathered = False

        def write_all(tmp: Path) -> tuple[dict[str, FileRecord], dict[str, Any]]:
            nonlocal announced, gathered
            # Names, not paths: each rank reaches the run dir by its own path (its own mount).
            g.broadcast(("ok", tmp.name))
            announced = True
            own, err = _write_shard(tmp, 0, write)
            reports = g.all_gather(own)
            gathered = True
            failed = [r[1] for r in reports if r[0] == "error"]
            if err is not None:
                raise err
            if failed:
                raise ShardError(f"checkpoint step {step} not committed: " + "; ".join(failed))
            files: dict[str, FileRecord] = {}
            tensors: dict[str, Any] = {}
            for _, f, t in reports:
                files.update(f)
                tensors.update(t)
            # Only now, with every shard fsynced and reported, may the manifest
            # that makes the checkpoint visible be written.
            return files, tensors

        try:
            path = self.run_dir.commit(step, write_all, **meta)
        except BaseException as e:
            if not announced or gathered:  # the other ranks are waiting for an outcome
                g.broadcast(("error", f"rank 0: {e}"))
            raise
        g.broadcast(("ok", path.name))
        return path

    def _commit_other(self, step: int, write: WriteFn) -> Path:
        g = self.group
        kind, where = g.broadcast(None)
        if kind != "ok":
            raise ShardError(f"checkpoint step {step} failed before rank {g.rank} could write: {where}")
        own, err = _write_shard(self.run_dir.path / where, g.rank, write)
        g.all_gather(own)
        kind, result = g.broadcast(None)
        if err is not None:
            raise err
        if kind != "ok":
            raise ShardError(f"checkpoint step {step} not committed: {result}")
        return self.run_dir.path / result

    def committed(self, step: int, path: Path) -> None:
        # One rank deletes; two would race on the same directories.
        if self.group.rank == 0:
            self.run_dir.retain(self.keep, protect=[path])

    def is_durable(self, step: int) -> bool:
        return is_committed(self.run_dir.path, step)

    def drain(self, timeout: float | None = None) -> bool:
        return True

    def take_error(self) -> BaseException | None:
        return None

    def agree(self, flag: bool) -> bool:
        return self.group.agree(flag)

    # -- resume (collective) -----------------------------------------------------
    def load_latest(self, load: Load, skipped: list[Skipped] | None) -> tuple[Any, int, Path] | None:
        """(state, step, path) of the newest checkpoint every rank can load, or None.

        Rank 0 walks the candidates; every rank loads its own shard of each
        and verifies its checksums.
        """
        g = self.group
        cands = iter_valid(self.search_dirs, full=False, skipped=skipped, parse=False) if g.rank == 0 else None
        while True:
            cand = next(cands, None) if cands is not None else None
            where = g.broadcast(None if cand is None else cand.path.name)
            if where is None:
                return None
            path = self.run_dir.path / where
            status, state, man, err = _load_shard(path, g.rank, load)
            bad = verdict(g, status, err)
            if not bad:
                assert man is not None
                return state, man.step, path
            note_skip(path, "; ".join(bad), skipped)

    def close(self, timeout: float | None = None) -> bool:
        try:
            self.run_dir.unlock()
        finally:
            self.group.release()
        return True


def _write_shard(
    tmp: Path, rank: int, write: WriteFn
) -> tuple[tuple[Any, ...], BaseException | None]:
    """Write this rank's shard under ``tmp``; (report for rank 0, local error)."""
    try:
        sub = tmp / shard_name(rank)
        sub.mkdir()
        files, tensors = write(sub)
        fsync_dir(sub)  # the shard's file names must survive a crash too
    except BaseException as e:  # reported to rank 0, then re-raised here
        return ("error", f"rank {rank}: {e}"), e
    return ("ok", *prefixed(rank, files, tensors)), None


def load_part(path: Path, rank: int, load: Load) -> tuple[Any, Manifest]:
    """Load ``rank``'s part of the committed checkpoint ``path``: its shard, or the
    whole checkpoint when it has no shards. Returns (state, the checkpoint's manifest).

    :class:`ConfigError` when the checkpoint has shards but none for ``rank``;
    :class:`UnsafeLoad` when any part of it holds pickled objects and ``load``
    is not trusted.
    """
    man = Manifest.read(path)
    if not load.trusted and pickled_parts(man):
        # Every rank, before any reads: one rank's pickles refuse the load on all of them
        # alike, with nothing read into another rank's into= tensors.
        raise unsafe(path)
    part = None if is_chunked(man) else shard_manifest(man, rank)
    state = load(path, man) if part is None else load(path / shard_name(rank), part)
    return state, man


Status = tuple[str, str]
"""("ok" | "corrupt" | "fatal", why): one rank's outcome of loading its part of a candidate."""


def attempt(rank: int, fn: Callable[[], Any]) -> tuple[Status, Any, BaseException | None]:
    """Run one rank's part of a collective load: (status, result, the error if fatal).

    Every error comes back instead of being raised, so that the rank still
    takes part in :func:`verdict`: a rank that left early would leave the
    others waiting for it. A damaged or unreadable checkpoint is ``corrupt``
    (an older one may load); anything else (bad ``into=``, pickles without
    ``trusted=True``, a world size the checkpoint cannot serve) is ``fatal``.
    """
    try:
        return ("ok", ""), fn(), None
    except CheckpointCorrupt as e:
        return ("corrupt", f"rank {rank}: {e}"), None, None
    except (ConfigError, UnsafeLoad) as e:
        return ("fatal", f"rank {rank}: {e}"), None, e
    except OSError as e:
        return ("corrupt", f"rank {rank}: {e}"), None, None
    except Exception as e:
        return ("fatal", f"rank {rank}: {type(e).__name__}: {e}"), None, e


def verdict(group: RankGroup, status: Status, err: BaseException | None) -> list[str]:
    """Every rank's outcome for one candidate: the corrupt reasons (empty when all loaded).

    When any rank's outcome is fatal every rank raises: that rank its own
    error, the others a :class:`ConfigError` naming it.
    """
    try:
        return group.load_verdict(status)
    except ConfigError:
        if err is not None:
            raise err from None
        raise


def _load_shard(path: Path, rank: int, load: Load) -> tuple[Status, Any, Manifest | None, BaseException | None]:
    status, got, err = attempt(rank, lambda: load_part(path, rank, load))
    state, man = got if got is not None else (None, None)
    return status, state, man, err

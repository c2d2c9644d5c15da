"""Rank awareness and sharded multi-rank checkpoints.

Rank: from ``torch.distributed`` when a process group is initialised, else
``SLURM_PROCID`` / ``SLURM_NTASKS``. Without a process group ranks cannot
coordinate, so each process saves on its own (save from one rank only:
``if ckpt.rank == 0``).

With a process group of more than one rank, a save is *collective* (every rank
calls ``save`` for the same step) and produces ONE checkpoint::

    step-000000120/MANIFEST.json
    step-000000120/rank-00000/state.json, tensors-….safetensors
    step-000000120/rank-00001/…

1. rank 0 takes the run-dir lock and creates the temp dir (``store.commit``),
   then broadcasts its name;
2. every rank writes its shard into ``rank-NNNNN/``, fsyncs each file and the
   shard dir, and sends its file records to rank 0;
3. rank 0 writes the manifest listing every rank's files, and renames.

The manifest is written only after every rank has reported, so discovery can
never return a checkpoint that lacks a shard; a rank that failed makes the
whole step fail on every rank, with the rank named. The coordination runs on
its own gloo group, so it works beside NCCL and from the background thread of
``save_async`` without interleaving with the training's collectives.

Resume: rank 0 picks the newest candidate, every rank loads its own shard and
checks its checksums, and the ranks agree before anyone uses it; if any rank's
shard fails, all move to the next older checkpoint together. A checkpoint
without shards (written by one process) is loaded whole by every rank.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import CheckpointCorrupt, ConfigError, ShardError
from .store import RunDir, Skipped, iter_valid, note_skip
from .store.commit import WriteFn
from .store.fsutil import fsync_dir
from .store.manifest import Manifest
from .store.shards import prefixed, shard_manifest, shard_name
from .store.tensorfile import FileRecord

__all__ = ["RankInfo", "ShardedRunDir", "rank_info"]


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    source: str
    """"torch.distributed", "slurm" or "single"."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _torch_dist() -> Any:
    """torch.distributed if the program already imported it and initialised a group."""
    td = sys.modules.get("torch.distributed")  # never import torch just to ask
    if td is not None and td.is_available() and td.is_initialized():
        return td
    return None


def rank_info() -> RankInfo:
    """This process's global rank and the world size."""
    td = _torch_dist()
    if td is not None:
        return RankInfo(td.get_rank(), td.get_world_size(), "torch.distributed")
    try:
        rank = int(os.environ.get("SLURM_PROCID", "0"))
        world = int(os.environ.get("SLURM_NTASKS", "1"))
    except ValueError:
        rank, world = 0, 1
    return RankInfo(rank, world, "slurm" if "SLURM_PROCID" in os.environ else "single")


class _Group:
    """Object collectives on a dedicated gloo group."""

    def __init__(self, td: Any) -> None:
        self.td = td
        self.rank, self.world = td.get_rank(), td.get_world_size()
        self.pg = td.new_group(backend="gloo")
        # The step-boundary agreement runs on the training thread while a
        # save_async commit may be running collectives on its own thread: two
        # threads on one group can pair up different calls on different ranks
        # and hang, so each gets a group of its own.
        self.pg_step = td.new_group(backend="gloo")

    def release(self) -> None:
        """Drop this object's references to its groups (at Checkpointer.close()).

        ``destroy_process_group()`` can only tear a group down once nothing
        holds it. A group kept alive past it by a Checkpointer still in scope
        dies during interpreter finalization instead, where a gloo worker that
        frees a finished collective's tensors needs the GIL and aborts the
        process (exit 134, "terminate called without an active exception")
        after training has finished.
        """
        self.pg = self.pg_step = None

    def _pg(self, step: bool) -> Any:
        pg = self.pg_step if step else self.pg
        if pg is None:
            raise ConfigError("this Checkpointer is closed; create a new one to save or load again")
        return pg

    def broadcast(self, obj: Any) -> Any:
        box = [obj]
        self.td.broadcast_object_list(box, src=0, group=self._pg(False))
        return box[0]

    def load_verdict(self, status: tuple[str, str]) -> list[str]:
        """Every rank's ("ok"|"corrupt"|"fatal", why) for one resume candidate.

        Raises on a fatal one (nothing older would help); else returns the
        corrupt reasons, empty when every rank loaded its part.
        """
        statuses = self.all_gather(status)
        fatal = [why for kind, why in statuses if kind == "fatal"]
        if fatal:
            raise ConfigError("; ".join(fatal))
        return [why for kind, why in statuses if kind == "corrupt"]

    def all_gather(self, obj: Any, *, step: bool = False) -> list[Any]:
        out: list[Any] = [None] * self.world
        self.td.all_gather_object(out, obj, group=self._pg(step))
        return out


class ShardedRunDir:
    """A :class:`RunDir` whose commit is collective when a process group is up.

    Checkpointer code calls ``commit``/``retain``/``lock`` as on a plain RunDir;
    with one process they pass straight through.
    """

    def __init__(self, inner: RunDir, *, enabled: bool | None = None) -> None:
        self.inner = inner
        self.enabled = enabled
        self._group: _Group | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    @property
    def path(self) -> Path:
        return self.inner.path

    def unlock(self) -> None:
        self.inner.unlock()

    def release_group(self) -> None:
        if self._group is not None:
            self._group.release()

    def agree(self, flag: bool) -> bool:
        """True on every rank if ``flag`` is True on any (one collective); ``flag`` alone otherwise.

        Slurm signals each rank at a slightly different moment; without this
        rank 0 could start a collective save while rank 1 runs another step.
        """
        g = self.group()
        return flag if g is None else any(g.all_gather(bool(flag), step=True))

    def group(self) -> _Group | None:
        """The coordination group, created on first use; None when not sharded.

        Creating it is itself collective, so it happens in a call every rank
        makes (the constructor, a save or a load), on the calling thread.
        """
        if self.enabled is False:
            return None
        td = _torch_dist()
        if td is None or td.get_world_size() < 2:
            if self.enabled:
                raise ConfigError("sharded checkpoints need an initialised torch.distributed group")
            return None
        if self._group is None:
            self._group = _Group(td)
        return self._group

    @property
    def rank(self) -> int:
        return self._group.rank if self._group else rank_info().rank

    def lock(self) -> None:
        if self.rank == 0:
            self.inner.lock()

    def retain(self, keep: int, **kwargs: Any) -> list[Path]:
        # One rank deletes; two would race on the same directories.
        return self.inner.retain(keep, **kwargs) if self.rank == 0 else []

    def commit(self, step: int, write: WriteFn, **meta: Any) -> Path:
        g = self.group()
        if g is None:
            return self.inner.commit(step, write, **meta)
        meta["world_size"] = g.world
        if g.rank == 0:
            return self._commit_main(g, step, write, meta)
        return self._commit_other(g, step, write)

    def _commit_main(self, g: _Group, step: int, write: WriteFn, meta: dict[str, Any]) -> Path:
        announced = gathered = False

        def write_all(tmp: Path) -> tuple[dict[str, FileRecord], dict[str, Any]]:
            nonlocal announced, gathered
            g.broadcast(("ok", str(tmp)))
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
            path = self.inner.commit(step, write_all, **meta)
        except BaseException as e:
            if not announced or gathered:  # the other ranks are waiting for an outcome
                g.broadcast(("error", f"rank 0: {e}"))
            raise
        g.broadcast(("ok", str(path)))
        return path

    def _commit_other(self, g: _Group, step: int, write: WriteFn) -> Path:
        kind, where = g.broadcast(None)
        if kind != "ok":
            raise ShardError(f"checkpoint step {step} failed before rank {g.rank} could write: {where}")
        own, err = _write_shard(Path(where), g.rank, write)
        g.all_gather(own)
        kind, result = g.broadcast(None)
        if err is not None:
            raise err
        if kind != "ok":
            raise ShardError(f"checkpoint step {step} not committed: {result}")
        return Path(result)

    def load_latest(
        self,
        search_dirs: Iterable[Path],
        load: Callable[[Path, Manifest], Any],
        skipped: list[Skipped] | None = None,
    ) -> tuple[Any, int, Path] | None:
        """(state, step, path) of the newest checkpoint every rank can load, or None.

        Collective: every rank calls it. ``load(dir, manifest)`` reads one
        checkpoint (or shard) and verifies its checksums.
        """
        g = self.group()
        assert g is not None, "load_latest is for sharded runs; use the plain path otherwise"
        cands = iter_valid(search_dirs, full=False, skipped=skipped) if g.rank == 0 else None
        while True:
            cand = next(cands, None) if cands is not None else None
            where = g.broadcast(None if cand is None else str(cand.path))
            if where is None:
                return None
            path = Path(where)
            status, state, man = _load_shard(path, g.rank, load)
            bad = g.load_verdict(status)
            if not bad:
                assert man is not None
                return state, man.step, path
            note_skip(path, "; ".join(bad), skipped)


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


def _load_shard(
    path: Path, rank: int, load: Callable[[Path, Manifest], Any]
) -> tuple[tuple[str, str], Any, Manifest | None]:
    try:
        man = Manifest.read(path)
        part = shard_manifest(man, rank)
        state = load(path, man) if part is None else load(path / shard_name(rank), part)
        return ("ok", ""), state, man
    except ConfigError as e:
        return ("fatal", f"rank {rank}: {e}"), None, None
    except (CheckpointCorrupt, OSError) as e:
        return ("corrupt", f"rank {rank}: {e}"), None, None

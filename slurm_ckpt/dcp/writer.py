"""``StorageWriter``: DCP's save plugin, committing with slurm-ckpt's protocol.

DCP drives a save in four calls; each does its part of our commit:

1. ``prepare_global_plan`` (coordinator): take the run dir's writer lock (which
   also clears temp dirs left by dead writers), create a ``.tmp-step-N-...``
   staging dir, and tell every rank its name and its file's name;
2. ``write_data`` (every rank): write the rank's chunks into one
   safetensors-layout file in the staging dir with the engine's parallel
   ``O_DIRECT`` writer, fsync it, and report each chunk's place and block crcs;
3. ``finish`` (coordinator, only once every rank reported success): commit
   the staging dir, which already holds the fsynced files, with
   :func:`~slurm_ckpt.store.commit.commit` (``into=``): the manifest last,
   fsync, rename to ``step-N``, fsync the run dir; then retention.

With node-local scratch (``scratch``, else ``$SLURM_CKPT_SCRATCH``, as the
Checkpointer decides) shared by every rank, the staging dir and the commit
are on the fast tier, ``<scratch>/ckpt``, and the coordinator hands the
committed checkpoint to the Checkpointer's own one-process placement
(:class:`~slurm_ckpt.placement.Local`, ``store/tiers.py``): retention on
scratch, and the background drain that copies it to the run dir, verified,
committed there with the same protocol. Ranks on several nodes (no scratch
dir they all see) commit to the run dir, as without scratch.

A rank that fails or dies before step 3 leaves only the staging dir, which
discovery never reads and the next writer removes; ``step-N`` appears whole or
not at all, and the previous checkpoint stays the newest.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import socket
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import storage as _dcp_storage
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.futures import Future

from .._env import job_id
from ..config import Config, load_config
from ..errors import ConfigError, storage_error
from ..placement import Local, after_commit, scratch_tier, surface_drain_error
from ..store import RunDir
from ..store.commit import commit
from ..store.fsutil import remove_tree
from ..store.layout import step_dir, tmp_dir_for
from ..store.manifest import MANIFEST
from ..store.tensorfile import FileRecord
from ..store.verify import is_committed
from ..store.writer import write_small_files
from .chunks import write_chunks
from .index import LAYOUT, Stored, index_entries, planner_extra
from .plan import data_file_name, dtensor_layout, plan_file_of

__all__ = ["StorageWriter", "data_file_name", "parse_checkpoint_id"]

log = logging.getLogger("slurm_ckpt")

_STEP_NAME = re.compile(r"^step-(\d+)$")


def parse_checkpoint_id(checkpoint_id: str | os.PathLike[str]) -> tuple[Path, int] | None:
    """``(run dir, step)`` for a checkpoint id ending in ``step-N`` (padded or not), else None."""
    path = Path(checkpoint_id)
    m = _STEP_NAME.match(path.name)
    return (path.parent, int(m.group(1))) if m else None


@dataclass(frozen=True)
class _Target:
    """What the coordinator tells each rank: where to write, and under which name.

    Names, not paths: each rank reaches the run dir (or the fast tier) by its own
    path, as nodes may mount the shared filesystem at other places.
    """

    on_fast: bool
    """The staging dir is in the fast tier every rank named, else in the run dir."""
    staging: str
    file: str


@dataclass(frozen=True)
class _Written:
    """One item's report to the coordinator (``WriteResult.storage_data``)."""

    stored: Stored
    record: FileRecord
    """The whole file's size and crc32 (the same object for every item of one file)."""
    layout: dict[str, Any] | None
    """``placements`` and ``mesh`` when the item came from a DTensor."""


@dataclass(frozen=True)
class _Scratch:
    """What each rank tells the coordinator in its local plan: its host and its fast tier."""

    host: str
    fast: str | None


@dataclass
class _Pending:
    run: RunDir
    """Where the checkpoint is committed: the fast tier, else the run dir (locked)."""
    staging: Path
    step: int
    local: Local
    """The run dir's placement: retention, and with scratch the drain to the run dir."""


class StorageWriter(_dcp_storage.StorageWriter):
    """Saves through ``torch.distributed.checkpoint`` into a slurm-ckpt run dir.

    >>> import torch.distributed.checkpoint as dcp
    >>> from slurm_ckpt.dcp import StorageWriter
    >>> dcp.save(state, storage_writer=StorageWriter("/ckpt/run", step=100))
    >>> # or name the checkpoint, as torchtitan does:
    >>> dcp.save(state, checkpoint_id="/ckpt/run/step-100", storage_writer=StorageWriter())

    The checkpoint is ``<run_dir>/step-000000100``: committed with fsyncs, the
    manifest last and an atomic rename; every file and every block of each
    stored chunk checksummed (``index.py``); written with the engine's ``O_DIRECT``
    writer. ``keep`` checkpoints are kept (default: the config's
    ``storage.keep``). ``dcp.async_save`` works with it too; with
    ``async_checkpointer_type=AsyncCheckpointerType.PROCESS`` its future is done
    once the checkpoint is in the run dir (the copy from scratch included).

    With node-local scratch (``scratch``, else ``$SLURM_CKPT_SCRATCH``: an
    existing writable dir; ``scratch=False`` for none) that every rank shares,
    a save commits to ``<scratch>/ckpt`` and returns; a background thread
    copies it to the run dir, as ``Checkpointer.save`` does (``store/tiers.py``).
    :meth:`drain` waits for that copy and :meth:`close` (at the end of
    training) drains and lets go of both dirs. A failed copy is raised at the
    next save (or logged, with ``storage.on_async_error: warn``); the
    checkpoint stays on scratch, for the next drain or the epilog's stage-out.
    :class:`StorageReader` looks in both tiers.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str] | None = None,
        *,
        step: int | None = None,
        keep: int | None = None,
        config: Config | None = None,
        lock_timeout: float | None = 0,
        files: Mapping[str, bytes] | None = None,
        extra: Mapping[str, Any] | None = None,
        scratch: str | os.PathLike[str] | bool | None = None,
        overwrite: bool = True,
        _extensions: Sequence[Any] | None = None,
    ) -> None:
        """``files`` (small files the coordinator adds, by name) and ``extra`` (manifest
        fields) let :mod:`slurm_ckpt.sharded` store the state's plain values beside DCP's.

        ``overwrite`` and ``_extensions`` mean what they do for DCP's ``FileSystemWriter``:
        with ``overwrite=False`` a save of a step that is already committed (in the run
        dir or on scratch) fails before anything is written; stream extensions
        (``ZStandard``) are refused when the save is planned, because chunks are stored
        as they are, so that each rank can read and verify only its own blocks.
        """
        super().__init__()
        self.config = config or load_config()
        self.run_dir = Path(run_dir).absolute() if run_dir is not None else None
        self.step = step
        self.keep = self.config.storage.keep if keep is None else keep
        if self.keep < 1:
            raise ConfigError("keep must be at least 1")
        self.lock_timeout = lock_timeout
        self.files = dict(files or {})
        self.extra = dict(extra or {})
        if any(n.startswith("dcp-") or n == MANIFEST or "/" in n for n in self.files):
            raise ValueError(f"file names {sorted(self.files)} clash with the checkpoint's own")
        self.scratch: str | Path | bool | None = scratch if isinstance(scratch, bool | None) else Path(scratch)
        self.overwrite = overwrite
        self.extensions = tuple(_extensions or ())
        self.rank = 0
        self.is_coordinator = True
        self.save_id = uuid.uuid4().hex
        self.last_committed: Path | None = None
        self._pending: _Pending | None = None
        self._local: Local | None = None
        """The coordinator's tiers (its drain thread), made at its first save to scratch."""
        self._fast: tuple[Path, Path | None] | None = None
        """(run dir, its fast tier or None), decided once per run dir."""
        self._durable_when_done = False
        """finish() waits for the drain (a copy made for another process: ``__getstate__``)."""

    def __getstate__(self) -> dict[str, Any]:
        # dcp.async_save with a process executor sends the writer to a subprocess:
        # a save in progress (its lock) stays with the process that holds it.
        state = self.__dict__.copy()
        # So do the tiers and their drain thread: the subprocess makes its own.
        state["_pending"] = state["_local"] = None
        # The subprocess gets a new copy for every save, and nothing there would
        # wait for its drain (close() in the trainer's process cannot see it), so a
        # copy's save ends only once the checkpoint is in the run dir.
        state["_durable_when_done"] = True
        return state

    # -------------------------------------------------------------- DCP's calls

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            parsed = parse_checkpoint_id(checkpoint_id)
            if parsed is None:
                raise ConfigError(
                    f"checkpoint_id {str(checkpoint_id)!r} does not end in step-N: name the "
                    "checkpoint <run dir>/step-<number>, or pass StorageWriter(run_dir, step=N)"
                )
            self.run_dir, self.step = parsed[0].absolute(), parsed[1]
        self.save_id = uuid.uuid4().hex

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if not kwargs.get("use_collectives", True):
            raise ConfigError("slurm_ckpt.dcp commits one checkpoint for all ranks: call dcp.save with use_collectives=True")
        if self.run_dir is None or self.step is None:
            raise ConfigError(
                "no checkpoint to write: pass StorageWriter(run_dir, step=N), or "
                "checkpoint_id='<run dir>/step-N' to dcp.save"
            )
        if self.step < 0:
            raise ConfigError(f"step must be >= 0, got {self.step}")
        if self.extensions:
            names = ", ".join(type(e).__name__ for e in self.extensions)
            raise ConfigError(f"slurm_ckpt.dcp stores chunks as they are, for each rank to read and verify only "
                              f"its own blocks, so it cannot apply DCP's stream extension {names}: leave out _extensions")
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank") or 0)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        fast = self._fast_tier()
        return dataclasses.replace(plan, storage_data=_Scratch(socket.gethostname(), None if fast is None else str(fast)))

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        assert self.run_dir is not None and self.step is not None
        self._abandon()  # a save of ours that failed before its commit
        local = self._placement(_shared_fast(plans))
        surface_drain_error(local, self.config.storage)
        # One writer per run dir; taking the lock also removes dead writers' temp dirs.
        run = local.tiers.fast if local.tiers is not None else local.run_dir
        run.lock()
        if not self.overwrite:
            there = [d for d in dict.fromkeys([run.path, self.run_dir]) if step_dir(d, self.step).exists()]
            if there:
                run.unlock()
                raise ConfigError(f"Checkpoint already exists: step {self.step} in {there[0]}, and overwrite=False; "
                                  "save another step, or pass overwrite=True to replace it")  # fmt: skip
        staging = tmp_dir_for(run.path, step_dir(run.path, self.step).name)
        try:
            staging.mkdir(mode=0o755)
        except OSError as e:
            run.unlock()
            raise storage_error(e, "cannot create the staging dir", staging) from e
        self._pending = _Pending(run, staging, self.step, local)
        on_fast = local.tiers is not None
        return [dataclasses.replace(p, storage_data=_Target(on_fast, staging.name, data_file_name(i)))
                for i, p in enumerate(plans)]  # fmt: skip

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[_dcp_storage.WriteResult]]:
        target: _Target = plan.storage_data
        base = self._fast_tier() if target.on_fast else self.run_dir
        assert base is not None
        try:
            results = self._write_file(base / target.staging / target.file, target.file, plan.items, planner)
        except BaseException:
            # DCP calls no writer method after a failed write: let go of the run dir now.
            # (When another rank fails, the coordinator lets go at its next save or close().)
            if self.is_coordinator:
                self._abandon()
            raise
        fut: Future[list[_dcp_storage.WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[_dcp_storage.WriteResult]]) -> None:
        from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION

        pending = self._pending
        if pending is None:
            raise RuntimeError("finish() without prepare_global_plan(): DCP called the writer out of order")
        metadata.version = CURRENT_DCP_VERSION
        stored: dict[Any, Stored] = {}
        files: dict[str, FileRecord] = {}
        layouts: dict[str, dict[str, Any]] = {}
        for per_rank in results:
            for wr in per_rank:
                w: _Written = wr.storage_data
                stored[wr.index] = w.stored
                files[w.stored.file] = w.record
                if w.layout:
                    layouts[wr.index.fqn] = w.layout
        metadata.storage_data = stored
        metadata.storage_meta = self.storage_meta()
        tensors = index_entries(metadata, stored, layouts)
        extra = {**self.extra, "layout": LAYOUT,
                 "dcp": {**planner_extra(metadata.planner_data, metadata.version), "save_id": self.save_id}}  # fmt: skip

        def add_small_files(staging: Path) -> tuple[dict[str, FileRecord], dict[str, Any]]:
            # Every rank fsynced its own file there already; commit() fsyncs the
            # dir itself before it renames it into place.
            return {**files, **write_small_files(staging, self.files)}, tensors

        try:
            path = commit(pending.run.path, pending.step, add_small_files, into=pending.staging,
                          world_size=len(results), nbytes=sum(r.size for r in files.values()),
                          job_id=job_id(), extra=extra)  # fmt: skip
            self.last_committed = path
            after_commit(pending.local, pending.step, path)  # retention; with scratch, the drain
        finally:
            self._abandon()
        if self._durable_when_done and self._local is not None:
            local = self._local
            self.close()
            surface_drain_error(local, self.config.storage)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return "://" not in str(checkpoint_id) and parse_checkpoint_id(checkpoint_id) is not None

    def storage_meta(self) -> StorageMeta | None:
        where = step_dir(self.run_dir, self.step) if self.run_dir is not None and self.step is not None else None
        return StorageMeta(checkpoint_id=str(where) if where else None, save_id=self.save_id)

    @property
    def checkpoint_id(self) -> str | None:
        meta = self.storage_meta()
        return None if meta is None else meta.checkpoint_id  # type: ignore[return-value]

    # -------------------------------------------------------------- our parts

    def drain(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds for the newest checkpoint to reach the run dir.

        True if it did (at once without scratch). Never raises for a failed copy:
        the checkpoint stays on scratch, and the error is raised at the next save.
        """
        return self._local.drain(timeout) if self._local is not None else True

    def is_durable(self, step: int) -> bool:
        """True once checkpoint ``step`` is committed in the run dir (the durable tier)."""
        if self._local is not None:  # the run dir of the last save
            return self._local.is_durable(step)
        return self.run_dir is not None and is_committed(self.run_dir, step)

    def close(self, timeout: float | None = None) -> bool:
        """Give up a save that failed before its commit (its staging dir and the lock);
        with scratch, wait up to ``timeout`` for the drain, then let go of both tiers.

        Returns what :meth:`drain` does. The writer may save again afterwards.
        """
        self._abandon()
        local, self._local = self._local, None
        return local.close(timeout) if local is not None else True

    def _fast_tier(self) -> Path | None:
        """This rank's fast tier for the run dir (``placement.scratch_tier``), decided once per run dir."""
        assert self.run_dir is not None
        if self._fast is None or self._fast[0] != self.run_dir:
            self._fast = (self.run_dir, scratch_tier(self.run_dir, self.scratch))
        return self._fast[1]

    def _placement(self, fast: Path | None) -> Local:
        """The coordinator's placement of the run dir (a Checkpointer's one-process one),
        with ``fast`` as its fast tier, or none."""
        assert self.run_dir is not None
        local = self._local
        if local is not None and (local.run_dir.path != self.run_dir
                                  or (local.tiers.fast.path if local.tiers is not None else None) != fast):  # fmt: skip
            # Another run dir (checkpoint_id=...) or another scratch; or the scratch dir
            # could not be set up last time (logged), and is tried again.
            self.close()
            local = None
        if local is None:
            local = Local.setup(RunDir(self.run_dir, lock_timeout=self.lock_timeout), fast,
                                storage=self.config.storage, keep=self.keep, lock_timeout=self.lock_timeout)  # fmt: skip
        self._local = local
        return local

    def _abandon(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            remove_tree(pending.staging)
            pending.run.unlock()

    def _write_file(self, path: Path, name: str, items: list[WriteItem],
                    planner: SavePlanner) -> list[_dcp_storage.WriteResult]:  # fmt: skip
        """Write this rank's items into one file; one ``WriteResult`` per item."""
        if not items:
            return []
        plan = plan_file_of(items, planner)
        record, stored = write_chunks(path, name, plan.image, plan.entries, self.config.engine)
        layouts = _layouts(planner)
        out = []
        for e, item, where in zip(plan.entries, plan.items, stored, strict=True):
            layout = layouts.get(item.index.fqn) if item.type != WriteItemType.BYTE_IO else None
            out.append(_dcp_storage.WriteResult(index=item.index, size_in_bytes=e.nbytes,
                                                storage_data=_Written(where, record, layout)))  # fmt: skip
        return out


def _shared_fast(plans: list[SavePlan]) -> Path | None:
    """The fast tier to commit to: the one every rank named, on one host; else None."""
    seen = {p.storage_data for p in plans}
    if len(seen) == 1:
        (one,) = seen
        return Path(one.fast) if isinstance(one, _Scratch) and one.fast is not None else None
    if any(isinstance(s, _Scratch) and s.fast for s in seen):
        log.warning("the ranks of this dcp.save are on several nodes or name different scratch dirs: their "
                    "files go into one checkpoint dir, which node-local scratch is not; saving to the run "
                    "dir only (Checkpointer.save uses each node's scratch)")  # fmt: skip
    return None


def _layouts(planner: SavePlanner) -> dict[str, dict[str, Any]]:
    """``placements`` and ``mesh`` of the DTensors in the planner's state dict, by key.

    Read from the default planner's (flattened) ``state_dict``; a planner
    without one leaves them out: the chunks alone define the layout on disk.
    """
    state = getattr(planner, "state_dict", None)
    if not isinstance(state, dict):
        return {}
    return {fqn: layout for fqn, obj in state.items() if (layout := dtensor_layout(obj)) is not None}

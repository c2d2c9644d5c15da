"""``StorageReader``: DCP's load plugin, reading only what each rank needs, verified.

DCP's planner matches the tensors a rank asks for against the chunks in the
checkpoint and hands the reader, per piece, the stored chunk and the
hypercube of it to copy. This reader turns each into byte runs of one file
(``ranged.runs``) and reads just the blocks those runs touch, each checked
against its crc32 from the manifest before use (``ranged.RangeReader``).

Given a run dir, it loads the newest checkpoint that passes the quick check
(manifest, sizes, headers), in the run dir or in the fast tier in front of it
(``<scratch>/ckpt``, where :class:`~slurm_ckpt.dcp.StorageWriter` and the
Checkpointer commit first when the job has node-local scratch); a damaged block found while reading raises
:class:`~slurm_ckpt.CheckpointCorrupt` naming the file, and
:func:`slurm_ckpt.sharded.load` then moves every rank to the next older one.
All ranks must resolve the same checkpoint; if they do not (one was committed
while they looked), the load fails rather than mix two.
"""

from __future__ import annotations

import io
import logging
import os
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import storage as _dcp_storage
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from .._env import scratch_dir
from ..config import Config, load_config
from ..errors import CheckpointCorrupt, ConfigError, NoCheckpoint
from ..store import Skipped, find_latest, verify_checkpoint
from ..store.layout import step_dir
from ..store.manifest import Manifest
from ..store.tiers import read_dirs
from .index import Stored, is_dcp, metadata_of
from .plain import Refused, Value, plain_metadata, state_values
from .ranged import RangeReader, runs
from .writer import parse_checkpoint_id

__all__ = ["StorageReader", "resolve"]

log = logging.getLogger("slurm_ckpt")


def resolve(path: Path, search: Sequence[Path] = ()) -> tuple[Path, Manifest]:
    """The checkpoint ``path`` names (a ``step-N`` dir, padded or not) or, for a run dir,
    its newest one that passes the quick check (``search`` adds more run dirs, e.g. scratch)."""
    parsed = parse_checkpoint_id(path)
    if parsed is not None:
        exact = step_dir(parsed[0], parsed[1])
        if exact.is_dir() or not path.is_dir():
            return exact, verify_checkpoint(exact, full=False)
    skipped: list[Skipped] = []
    cand = find_latest([*search, path], full=False, skipped=skipped)
    if cand is None:
        why = "".join(f"; skipped {s.path.name}: {s.reason}" for s in skipped)
        raise NoCheckpoint(f"no valid checkpoint in {' or '.join(map(str, [*search, path]))}{why}")
    for s in skipped:  # a newer one passed over is worth a warning, as discovery gives everywhere
        log.warning("skipping %s: %s", s.path, s.reason)
    return cand.path, cand.manifest


class StorageReader(_dcp_storage.StorageReader):
    """Loads through ``torch.distributed.checkpoint`` from a slurm-ckpt checkpoint.

    >>> dcp.load(state, storage_reader=StorageReader("/ckpt/run"))            # the newest valid one
    >>> dcp.load(state, storage_reader=StorageReader("/ckpt/run/step-000000100"))

    A run dir is searched together with its fast tier, ``<scratch>/ckpt``
    (``scratch``, else ``$SLURM_CKPT_SCRATCH``; False for none), and any run
    dirs in ``search``: the newest valid checkpoint of all wins, the fast
    tier's on equal steps.

    At any world size: each rank reads only the blocks holding its part of
    each tensor, and verifies each block's crc32 before using it.
    ``bytes_read`` and ``bytes_needed`` count this rank's bytes read and the
    least it could have read, for the last load; ``reads`` the same by key.

    It also reads what ``Checkpointer.save`` wrote (``plain.py``): tensors
    under DCP's flattened keys (``model.0.weight``), plain values from
    ``state.json`` as DCP byte items (``optim.param_groups``), values that were
    pickled (``allow_pickle``) only with ``trusted=True``.

    As with DCP's ``FileSystemReader``, the ``storage_meta`` of the metadata it
    reads names the checkpoint by the path the reader was given (``checkpoint``
    is the dir it resolved) and carries the writer's ``save_id`` and this
    load's ``load_id``. ``_extension_registry`` is accepted for code written for
    ``FileSystemReader`` and unused: :class:`StorageWriter` applies no stream
    extensions.
    """

    by_stored_key = False
    """True where the caller asks for tensors by their stored keys, which no two
    share (``slurm_ckpt.sharded``'s loads): a flattened name that two places of
    the state share, which a ``dcp.load`` asking for it is refused, means one."""

    def __init__(self, path: str | os.PathLike[str] | None = None, *, search: Sequence[str | os.PathLike[str]] = (),
                 config: Config | None = None, trusted: bool = False,
                 scratch: str | os.PathLike[str] | bool | None = None, _extension_registry: Any = None) -> None:  # fmt: skip
        super().__init__()
        self.trusted = trusted
        self.path = Path(path).absolute() if path is not None else None
        self._given = path
        """The path as the caller named it, for ``storage_meta``."""
        self.search = [Path(p).absolute() for p in search]
        self.scratch: str | Path | bool | None = scratch if isinstance(scratch, bool | None) else Path(scratch)
        self.config = config or load_config()
        self.checkpoint: Path | None = None
        """The checkpoint dir the last ``read_metadata`` resolved."""
        self.manifest: Manifest | None = None
        self.bytes_read = 0
        self.bytes_needed = 0
        self.reads: dict[str, tuple[int, int]] = {}
        self.load_id = uuid.uuid4().hex
        self._storage: dict[Any, Stored] = {}
        self._metadata: Metadata | None = None
        self._values: dict[str, Value] = {}
        """Byte items served from memory: the plain values of ``state.json``."""

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.path = Path(checkpoint_id).absolute()
            self._given = checkpoint_id
        self.checkpoint = self.manifest = None
        self.load_id = uuid.uuid4().hex

    @property
    def checkpoint_id(self) -> str | None:
        return str(self.path) if self.path is not None else None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            # DCP asks for rank-local metadata only after the global one failed: ours is
            # global, so the first error (kept by DCP in its message) is the one to read.
            raise ConfigError("slurm_ckpt.dcp checkpoints have no rank-local metadata")
        if self.path is None:
            raise ConfigError("no checkpoint to read: pass StorageReader(run dir or step dir), or checkpoint_id to dcp.load")
        ckpt, man = resolve(self.path, self._search_dirs(self.path))
        if is_dcp(man):
            metadata = metadata_of(man, str(ckpt))
            values = state_values(ckpt, man, trusted=self.trusted)
            for fqn in values.keys() - metadata.state_dict_metadata.keys():
                metadata.state_dict_metadata[fqn] = BytesStorageMetadata()
            # A value can share a tensor's name where two places flatten to one: a load
            # asking for that name is refused (Refused), else it asks for the tensor.
            self._values = {k: v for k, v in values.items() if isinstance(v, Refused)
                            or isinstance(metadata.state_dict_metadata.get(k), BytesStorageMetadata)}  # fmt: skip
        else:
            metadata, self._values = plain_metadata(ckpt, man, trusted=self.trusted)
        self.checkpoint, self.manifest, self._metadata = ckpt, man, metadata
        self._storage = metadata.storage_data
        written = man.extra.get("dcp")
        save_id = written.get("save_id") if isinstance(written, dict) else None
        metadata.storage_meta = StorageMeta(checkpoint_id=self._given, save_id=save_id, load_id=self.load_id)
        return metadata

    def _search_dirs(self, path: Path) -> list[Path]:
        """``search`` and, for a run dir, the fast tier in front of it when it exists."""
        if self.scratch is False or parse_checkpoint_id(path) is not None:
            return self.search
        # Readable is enough: read_dirs takes the fast tier when it exists.
        base = scratch_dir() if self.scratch is None or self.scratch is True else Path(self.scratch)
        tiers = read_dirs(path, base)[:-1]  # read_dirs ends with the run dir itself
        return [*self.search, *(d for d in tiers if d not in self.search)]

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._storage = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        import dataclasses

        for req in plan.items:  # before anything is read into the caller's state
            value = self._values.get(req.storage_index.fqn)
            if isinstance(value, Refused) and not (self.by_stored_key and req.type != LoadItemType.BYTE_IO):
                raise ConfigError(value.why)
        man = self.manifest
        # The checkpoint's name and commit, not its path: ranks on other nodes may reach
        # the same run dir by other paths (their own mounts of a network filesystem).
        name = self.checkpoint.name if self.checkpoint is not None else None
        return dataclasses.replace(plan, storage_data=(name, man.step if man else None,
                                                       man.time if man else None))  # fmt: skip

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        seen = {p.storage_data for p in plans}
        if len(seen) > 1:
            raise ConfigError(
                "the ranks resolved different checkpoints (" + ", ".join(sorted(str(s[0]) for s in seen)) + "): "
                "one was committed while they looked; name the checkpoint dir, or load with slurm_ckpt.sharded.load"
            )
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        assert self.checkpoint is not None and self.manifest is not None, "read_metadata() first"
        cfg = self.config.engine
        from ..engine import default_threads

        with RangeReader(self.checkpoint, self.manifest.files, threads=cfg.threads or default_threads()) as rr:
            jobs: list[Callable[[], None]] = []
            done: list[Callable[[], None]] = []
            self.reads = {}
            for req in plan.items:
                if req.type == LoadItemType.BYTE_IO and req.storage_index.fqn in self._values:
                    done.append(_value_job(req, self._values[req.storage_index.fqn], planner))
                    continue
                where = self._storage[req.storage_index]
                if req.type == LoadItemType.BYTE_IO:
                    jobs.append(_bytes_job(rr, where, req, planner, done))
                else:
                    jobs.append(_tensor_job(rr, where, req, planner, self._chunk_sizes(req), done, self.reads))
            rr.run_all(jobs)
            # The planner's own bookkeeping runs here, on the caller's thread.
            for finish in done:
                finish()
            self.bytes_read, self.bytes_needed = rr.bytes_read, rr.bytes_needed
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _chunk_sizes(self, req: ReadItem) -> tuple[torch.dtype, list[int]]:
        assert self._metadata is not None
        md = self._metadata.state_dict_metadata[req.storage_index.fqn]
        assert isinstance(md, TensorStorageMetadata)
        for ch in md.chunks:
            if list(ch.offsets) == list(req.storage_index.offset or ()):
                return md.properties.dtype, list(ch.sizes)
        raise CheckpointCorrupt(f"{self.checkpoint}: no chunk of {req.storage_index.fqn} at "
                                f"{list(req.storage_index.offset or ())}", self.checkpoint)  # fmt: skip

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return "://" not in str(checkpoint_id) and Path(checkpoint_id).is_dir()


def _value_job(req: ReadItem, value: Value, planner: LoadPlanner) -> Callable[[], None]:
    def finish() -> None:
        planner.load_bytes(req, io.BytesIO(value()))

    return finish


def _bytes_job(rr: RangeReader, where: Stored, req: ReadItem, planner: LoadPlanner,
               done: list[Callable[[], None]]) -> Callable[[], None]:  # fmt: skip
    def job() -> None:
        data = rr.read_bytes(where)
        done.append(lambda: planner.load_bytes(req, io.BytesIO(data)))

    return job


def _tensor_job(rr: RangeReader, where: Stored, req: ReadItem, planner: LoadPlanner, stored: tuple[torch.dtype, list[int]],
                done: list[Callable[[], None]], reads: dict[str, tuple[int, int]]) -> Callable[[], None]:  # fmt: skip
    dtype, sizes = stored
    target = planner.resolve_tensor(req).detach()
    lengths = list(req.lengths)
    if list(target.shape) != lengths:
        raise AssertionError(f"read of {req.storage_index.fqn}: target shape {list(target.shape)} is not {lengths}")

    def job() -> None:
        want = runs(sizes, list(req.storage_offsets), lengths, dtype.itemsize)
        # Bytes go straight into the target when it can take them (same dtype, CPU);
        # else through a tensor of the stored dtype, converted by copy_.
        direct = target.dtype == dtype and target.device.type == "cpu"
        dest = target if direct else torch.empty(lengths, dtype=dtype)
        n = rr.read_into(where, want, dest, sizes=sizes, offsets=list(req.storage_offsets))
        if not direct:
            target.copy_(dest)

        def finish() -> None:
            key = req.storage_index.fqn
            r, w = reads.get(key, (0, 0))
            reads[key] = (r + n, w + sum(e - b for b, e in want))
            planner.commit_tensor(req, target)

        done.append(finish)

    return job

"""``save``, ``save_async`` and ``load`` of :mod:`slurm_ckpt.sharded`, which documents them.

Internal: import them from ``slurm_ckpt.sharded``; this module may change.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from ..config import Config
from ..errors import CheckpointCorrupt
from ..store import iter_valid, note_skip
from ..store.layout import step_dir
from ..store.manifest import MANIFEST
from ..store.verify import Skipped
from .loader import Loaded, load_one
from .parts import Ranks, prepare, split

__all__ = ["load", "save", "save_async"]


def _writer(state: Any, run_dir: str | os.PathLike[str], step: int, *, allow_pickle: bool, keep: int | None,
            config: Config | None, process_group: Any, lock_timeout: float | None) -> tuple[dict[str, Any], Any]:  # fmt: skip
    """DCP's flat state and our writer for one save; a collective (digests and trees are gathered)."""
    from ..dcp import StorageWriter

    ranks = Ranks(process_group)
    prep = prepare(state, ranks, allow_pickle=allow_pickle)
    # One tier: these calls return the run dir's step-N, and hold no drain between calls
    # (Checkpointer.save puts DTensor states on scratch first, with its drain).
    writer = StorageWriter(run_dir, step=step, keep=keep, config=config, lock_timeout=lock_timeout,
                           files=prep.files if ranks.rank == 0 else None, extra={"sharded": 1},
                           scratch=False)  # fmt: skip
    return prep.flat, writer


def save(
    state: Any,
    run_dir: str | os.PathLike[str],
    step: int,
    *,
    allow_pickle: bool = False,
    keep: int | None = None,
    config: Config | None = None,
    process_group: Any = None,
    lock_timeout: float | None = 0,
) -> Path:
    """Save ``state`` as checkpoint ``step`` of ``run_dir``; every rank calls it, and
    each writes only its own shards. Returns once the checkpoint is committed.

    ``process_group``: the group of the ranks that save (default: the default
    group; a gloo group of their own keeps these collectives apart from NCCL's).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    flat, writer = _writer(state, run_dir, step, allow_pickle=allow_pickle, keep=keep, config=config,
                           process_group=process_group, lock_timeout=lock_timeout)  # fmt: skip
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(flat, storage_writer=writer, process_group=process_group,
                 planner=DefaultSavePlanner(flatten_state_dict=False))  # fmt: skip
    return step_dir(Path(run_dir).absolute(), step)


def save_async(
    state: Any,
    run_dir: str | os.PathLike[str],
    step: int,
    *,
    allow_pickle: bool = False,
    keep: int | None = None,
    config: Config | None = None,
    process_group: Any = None,
    lock_timeout: float | None = 0,
) -> Future[Path]:
    """:func:`save` in the background (``dcp.async_save``): returns once the state is
    copied; the future's result is the committed checkpoint's path.

    Give it a process group that training does not use: its collectives run on a thread.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    flat, writer = _writer(state, run_dir, step, allow_pickle=allow_pickle, keep=keep, config=config,
                           process_group=process_group, lock_timeout=lock_timeout)  # fmt: skip
    where = step_dir(Path(run_dir).absolute(), step)
    out: Future[Path] = Future()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        inner = dcp.async_save(flat, storage_writer=writer, process_group=process_group,
                               planner=DefaultSavePlanner(flatten_state_dict=False))  # fmt: skip
    upload = inner.upload_completion if hasattr(inner, "upload_completion") else inner

    def done(f: Any) -> None:
        err = f.exception()
        if err is None:
            out.set_result(where)
        else:
            out.set_exception(err)

    upload.add_done_callback(done)
    return out


def load(
    path: str | os.PathLike[str],
    *,
    into: Any = None,
    process_group: Any = None,
    trusted: bool = False,
    search: Sequence[str | os.PathLike[str]] = (),
    config: Config | None = None,
    skipped: list[Skipped] | None = None,
) -> Loaded | None:
    """Load the newest checkpoint every rank can read from run dir ``path`` (or the
    checkpoint ``path`` names), at this world size; None if there is none.

    Collective. ``into``: a state shaped like the saved one whose tensors are
    filled in place (see the module's docstring). A checkpoint with a damaged
    block on any rank is skipped by all ranks together, and the next older one
    loaded (into the same tensors). ``search``: more run dirs (a scratch tier).
    """
    from ..dcp.writer import parse_checkpoint_id

    ranks = Ranks(process_group)
    root = Path(path).absolute()
    exact = parse_checkpoint_id(root)
    if exact is not None and not (root / MANIFEST).exists() and step_dir(*exact).is_dir():
        root = step_dir(*exact)
    one = (root / MANIFEST).exists()
    dirs = [*(Path(d).absolute() for d in search), root]
    cands = None
    if ranks.rank == 0:
        found = iter_valid(dirs, full=False, skipped=skipped)
        # An index into dirs and a name, not a path: each rank reaches the run dir by its
        # own path (nodes may mount the shared filesystem at other places).
        cands = iter([(-1, "")]) if one else ((dirs.index(c.path.parent), c.path.name) for c in found)
    targets = split(into, allow_pickle=True, stored=False) if into is not None else None
    while True:
        where = ranks.broadcast(next(cands, None) if cands is not None else None)
        if where is None:
            return None
        ckpt = root if one else dirs[where[0]] / where[1]
        got, why = load_one(ckpt, None, targets, ranks, trusted=trusted, config=config)
        if got is not None:
            return got
        note_skip(ckpt, why, skipped)
        if one:
            raise CheckpointCorrupt(f"{ckpt}: {why}", ckpt)

"""Sharded states: DTensors, plain tensors and plain values in one checkpoint, loadable at any world size.

A state here is what ``Checkpointer.save`` takes (nested dicts, lists and
tuples of tensors and plain values) where tensors may be ``DTensor`` s, as
``get_state_dict`` returns them for an FSDP2 model and its optimizer::

    from slurm_ckpt import sharded
    msd, osd = get_state_dict(model, opt)
    sharded.save({"model": msd, "optim": osd, "step": step}, run_dir, step)     # every rank

    msd, osd = get_state_dict(model, opt)           # at the new world size
    got = sharded.load(run_dir, into={"model": msd, "optim": osd})
    set_state_dict(model, opt, model_state_dict=got.state["model"], optim_state_dict=got.state["optim"])

Every rank calls both (they are collective). The tensors go through DCP with
:class:`slurm_ckpt.dcp.StorageWriter`: each rank writes only its own shards,
and one checkpoint is committed for all. What is saved, and what comes back:

* a **DTensor** is one global tensor; a load reshards it to whatever the
  ``into=`` tensor at the same place is (any mesh, any placement), each rank
  reading only the blocks that hold its part;
* a **plain tensor** that is the same on every rank (a replicated buffer, an
  optimizer's ``step``) is stored once; one that differs between ranks (an
  RNG state) is stored per rank, and each rank gets its own back;
* **everything else** goes to ``state.json`` through the codec (never pickle,
  unless ``allow_pickle``), once if it is the same on every rank, else per rank.

A load at another world size gives a rank that did not exist at save time
rank 0's per-rank values, and says so in a warning: there is no right answer
for them (an RNG state of a rank that did not exist), and most trainers
reseed or recompute them.

Without ``into=``, a load returns every tensor whole (a plain CPU tensor of
the global shape), on every rank: the state as one process would have it,
for evaluation, export, or a world of one. With ``into=``, tensors found at
the same place in ``into`` are filled in place (what ``set_state_dict``
expects), others come back whole, and values come from the checkpoint.
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

__all__ = ["Loaded", "load", "save", "save_async"]


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
    cands = None
    if ranks.rank == 0:
        cands = iter([root]) if one else (c.path for c in iter_valid([*map(Path, search), root], full=False, skipped=skipped))
    targets = split(into, allow_pickle=True, stored=False) if into is not None else None
    while True:
        where = ranks.broadcast(str(next(cands, None) or "") if cands is not None else None)
        if not where:
            return None
        ckpt = Path(where)
        got, why = load_one(ckpt, None, targets, ranks, trusted=trusted, config=config)
        if got is not None:
            return got
        note_skip(ckpt, why, skipped)
        if one:
            raise CheckpointCorrupt(f"{ckpt}: {why}", ckpt)

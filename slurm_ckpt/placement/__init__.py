"""Where a Checkpointer's saves go and where resume looks: one object per layout.

==============  ===========================================================
``Local``       one process: the run dir, or node-local scratch first and a
                background copy to the run dir (``local.py``, ``store/tiers.py``)
``Collective``  several ranks sharing one run dir (``collective.py``)
``CrossNode``   several ranks, each with its own node's scratch (``crossnode.py``)
==============  ===========================================================

:func:`choose` picks one at start-up and the Checkpointer talks to it only
through :class:`Placement` (``base.py``), so the save and resume paths read
the same for all three.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from .._env import scratch_dir
from ..config import StorageConfig
from ..ranks import open_group
from ..store import RunDir
from ..store.layout import fast_dir
from ..store.tiers import usable_scratch
from .base import Load, Placement, after_commit, surface_drain_error
from .collective import Collective
from .crossnode import CrossNode
from .local import Local

__all__ = ["Collective", "CrossNode", "Load", "Local", "Placement", "after_commit", "choose", "scratch_tier",
           "surface_drain_error"]

log = logging.getLogger("slurm_ckpt")


def choose(
    run_dir: RunDir,
    *,
    storage: StorageConfig,
    keep: int,
    distributed: bool | None = None,
    scratch: str | Path | bool | None = None,
    lock_timeout: float | None = 0,
    on_lag: Callable[[float], None] | None = None,
    on_stall: Callable[[bool], None] | None = None,
    replicas: int = 0,
    on_replicas: Callable[[int, int, int], None] | None = None,
) -> Placement:
    """The placement for this process's saves into ``run_dir``.

    *Collective* when ``torch.distributed`` is initialised: every rank calls it.

    * ``distributed`` (see :func:`~slurm_ckpt.ranks.open_group`): ranks of an
      initialised ``torch.distributed`` save collectively unless it is False;
    * ``scratch``: node-local scratch, else ``$SLURM_CKPT_SCRATCH``; False for none.

    One process: :class:`Local`, with tiers when scratch is usable. Several
    ranks: :class:`CrossNode` when any rank has usable scratch, else
    :class:`Collective`. ``on_lag`` hears the stage-out lag in seconds, ``on_stall``
    whether the durable tier's I/O is stuck past ``storage.hang_timeout`` (one process).
    ``replicas``: peer replicas of each scratch shard (``CrossNode``, ``replicas.py``);
    ``on_replicas`` hears (nodes holding the newest step, bytes sent, bytes received)
    after each replication.
    """
    group = open_group(distributed)
    fast = scratch_tier(run_dir.path, scratch)
    if group is None:
        return Local.setup(run_dir, fast, storage=storage, keep=keep, lock_timeout=lock_timeout,
                           on_lag=on_lag, on_stall=on_stall)  # fmt: skip
    # Every rank takes part in setup (a collective), with or without scratch.
    crossnode = CrossNode.setup(group, run_dir, fast, keep=keep, lock_timeout=lock_timeout,
                                on_lag=on_lag, drain=storage.drain, replicas=replicas,
                                on_replicas=on_replicas)  # fmt: skip
    return crossnode if crossnode is not None else Collective(run_dir, group, keep)


def scratch_tier(run_dir: Path, scratch: str | Path | bool | None) -> Path | None:
    """The fast tier in front of ``run_dir``: ``<scratch>/ckpt`` when a usable scratch dir is
    named (``scratch``, else ``$SLURM_CKPT_SCRATCH``; False for none) and it is not the run dir itself."""
    if scratch is False:
        return None
    named = scratch_dir() if scratch is None or scratch is True else Path(scratch)
    base = usable_scratch(named)
    if base is None:
        if named is not None:
            log.warning("scratch %s is not a writable directory; saving to %s only", named, run_dir)
        return None
    fast = fast_dir(base).absolute()
    return None if fast == run_dir else fast

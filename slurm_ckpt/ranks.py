"""Ranks: who this process is among the job's processes, and how they agree.

Rank: from ``torch.distributed`` when a process group is initialised, else
``SLURM_PROCID`` / ``SLURM_NTASKS``. Without a process group ranks cannot
coordinate, so each process saves on its own (save from one rank only:
``if ckpt.rank == 0``).

With a process group of more than one rank, :func:`open_group` gives a
:class:`RankGroup`: object collectives on gloo groups of their own, so they
work beside NCCL and from the background thread of ``save_async`` without
interleaving with the training's collectives. The multi-rank placements
(``placement/collective.py``, ``placement/crossnode.py``) coordinate through it.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from ._env import task_rank
from .errors import ConfigError

__all__ = ["RankGroup", "RankInfo", "open_group", "rank_info"]


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
    rank, world, in_task = task_rank()
    return RankInfo(rank, world, "slurm" if in_task else "single")


def open_group(enabled: bool | None = None) -> RankGroup | None:
    """The coordination group of a multi-rank run, or None when each process is on its own.

    Collective: every rank calls it, on the thread that will use the group
    first. ``enabled=False`` gives None; ``True`` requires an initialised
    ``torch.distributed`` of two ranks or more (:class:`ConfigError` otherwise);
    ``None`` uses one when there is one.
    """
    if enabled is False:
        return None
    td = _torch_dist()
    if td is None or td.get_world_size() < 2:
        if enabled:
            raise ConfigError("sharded checkpoints need an initialised torch.distributed group")
        return None
    return RankGroup(td)


class RankGroup:
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

    def all_gather(self, obj: Any, *, step: bool = False) -> list[Any]:
        out: list[Any] = [None] * self.world
        self.td.all_gather_object(out, obj, group=self._pg(step))
        return out

    def agree(self, flag: bool) -> bool:
        """True on every rank if ``flag`` is True on any (one collective).

        Slurm signals each rank at a slightly different moment; without this
        rank 0 could start a collective save while rank 1 runs another step.
        """
        return any(self.all_gather(bool(flag), step=True))

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

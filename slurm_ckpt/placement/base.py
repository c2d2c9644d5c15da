"""``Placement``: the interface between the Checkpointer and where its checkpoints live."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from ..config import StorageConfig
    from ..ranks import RankGroup
    from ..store import Skipped
    from ..store.commit import WriteFn
    from ..store.tiers import Tiers

__all__ = ["Load", "Placement", "after_commit", "surface_drain_error"]

log = logging.getLogger("slurm_ckpt")


class Load(Protocol):
    """``load(checkpoint dir, manifest)``: read one checkpoint (or one rank's shard
    of it, with the shard's own manifest), verifying its checksums."""

    trusted: bool
    """Pickled objects may be loaded; a multi-rank load checks every rank's parts before any reads."""

    def __call__(self, ckpt: Path, man: Any, /) -> Any: ...


class Placement(Protocol):
    """Where one rank's saves go and where its resume looks.

    The Checkpointer makes one at start-up (:func:`~slurm_ckpt.placement.choose`)
    and uses nothing else, so a new layout (a DCP storage backend, DTensor
    states saved by their owners) plugs in as one more class. The calls marked
    *collective* are made by every rank of a multi-rank placement, in the same
    order; in a one-process placement they are plain calls.

    The Checkpointer serialises saves: ``commit`` and ``committed`` run on one
    thread at a time (the caller's, or a ``save_async`` thread), while
    ``is_durable``, ``drain`` and ``take_error`` may be called from the
    training thread meanwhile.
    """

    @property
    def tiers(self) -> Tiers | None:
        """The scratch and durable tiers of a one-process writer; None in any other placement."""

    @property
    def search_dirs(self) -> list[Path]:
        """Run dirs that discovery looks in, fastest tier first."""

    @property
    def group(self) -> RankGroup | None:
        """The ranks that save and resume together; None for one process.

        A save or load of DTensor states runs its own collectives (planning,
        DCP's load) on it, between the placement's.
        """

    def commit(self, step: int, write: WriteFn, **meta: Any) -> Path:
        """*Collective.* Commit checkpoint ``step`` with the store's protocol; return its path.

        ``write`` writes this rank's data into the dir it is given; ``meta``
        goes into the manifest. Returns once the checkpoint (or this rank's
        shard of it) is committed where the placement saves first; raises if
        it is not, on every rank when any rank failed.
        """

    def committed(self, step: int, path: Path) -> None:
        """After a commit: retention, and queueing the copy to the durable tier."""

    def is_durable(self, step: int) -> bool:
        """True once checkpoint ``step`` is committed on the durable tier."""

    def drain(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds for the newest checkpoint to reach the durable tier.

        Returns True if it did. Never raises for a failed copy (see :meth:`take_error`).
        """

    def take_error(self) -> BaseException | None:
        """The last background copy's error, once; None if there was none since the last call."""

    def agree(self, flag: bool) -> bool:
        """*Collective.* True on every rank if ``flag`` is True on any (``flag`` with one rank)."""

    def load_latest(self, load: Load, skipped: list[Skipped] | None) -> tuple[Any, int, Path] | None:
        """*Collective.* (state, step, path) of the newest checkpoint that loads, or None.

        A checkpoint that fails to load (on any rank) is noted in ``skipped``
        (or logged) and the next older one is tried.
        """

    def close(self, timeout: float | None = None) -> bool:
        """Drain (up to ``timeout``), then release the locks and any rank group.

        Returns what :meth:`drain` does.
        """


def after_commit(placement: Placement, step: int, path: Path) -> None:
    """``placement.committed(step, path)``: retention, and the copy to the durable tier queued.

    A failed retention is logged, not raised: the checkpoint is committed, and
    failing to delete older ones must not turn it into a failed save.
    """
    try:
        placement.committed(step, path)
    except OSError as e:
        log.warning("checkpoint %d committed, but retention failed: %s", step, e)


def surface_drain_error(placement: Placement, storage: StorageConfig, *, stopping: bool = False) -> None:
    """A failed copy to the durable tier: raised, or logged per ``storage.on_async_error``.

    Only logged while ``stopping`` (a checkpoint-and-stop was requested): the
    emergency save to scratch matters more, and the epilog stages it out.
    """
    err = placement.take_error()
    if err is None:
        return
    if storage.on_async_error == "warn" or stopping:
        log.warning("copying a checkpoint to the durable tier failed: %s; it stays on scratch "
                    "and training goes on", err)  # fmt: skip
        return
    raise err

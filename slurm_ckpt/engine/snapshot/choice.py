"""Which snapshot a save uses: one pure function.

Kept free of memory probes, CUDA and processes so every rule is tested
directly: the engine gathers the facts of a save (:class:`Facts`), and
:func:`choose_mode` alone decides from them.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...config import SNAPSHOTS

__all__ = ["Facts", "choose_mode"]

@dataclass(frozen=True)
class Facts:
    """What one save's choice depends on, gathered by the engine before it chooses."""

    nbytes: int
    """The state's tensor bytes."""
    cuda: bool = False
    """The state holds a CUDA tensor."""
    staging: int = 0
    """Bytes of the staging buffer kept from earlier saves."""
    available: int = 1 << 62
    """Bytes the process can still allocate (the job's cgroup limit included)."""
    can_fork: bool = True
    """The platform has ``fork()``."""
    overlap_ok: bool = True
    """No ``overlap`` save of this engine has caught a tensor changed while it was copied."""


def choose_mode(requested: str, facts: Facts) -> str:
    """The mode a save asking for ``requested`` uses: ``sync``, ``copy``, ``fork`` or ``overlap``.

    ``auto`` captures the state before ``save_async`` returns: ``copy``,
    unless growing the staging buffer would not fit in memory, then ``fork``.
    CUDA tensors are always staged, so ``fork`` and ``overlap`` become
    ``copy`` with them (a child cannot read device memory; the overlap guard
    watches CPU tensors only). Once ``overlap`` has caught a change, the
    engine's later saves ``copy``.
    """
    if requested != "sync" and requested not in SNAPSHOTS:
        raise ValueError(f"unknown snapshot mode {requested!r}; use one of {', '.join(SNAPSHOTS)}")
    if requested == "auto":
        return "copy" if facts.cuda or not facts.can_fork or _staging_fits(facts) else "fork"
    if requested == "fork" and facts.cuda:
        return "copy"
    if requested == "overlap" and (facts.cuda or not facts.overlap_ok):
        return "copy"
    return requested


def _staging_fits(facts: Facts) -> bool:
    """Whether the staging buffer, grown to the state's size, fits in memory (with a quarter to spare)."""
    grow = facts.nbytes - facts.staging
    return grow <= 0 or grow * 5 // 4 <= facts.available

"""Signals that reach ``slurm-ckpt run`` while it is still starting up.

Slurm may signal a job step at its first instant: a time limit checked just as
a late-starting job launches, a preemption. Until the wrapper's trap is in
place, the default action of USR1 or TERM would end the wrapper with no
checkpoint and no requeue. So the command line calls :func:`hold` before its
heavier imports, and the trap takes over what arrived (:func:`take_over`);
if ``run`` fails before it has a trap, :func:`release` gives every signal its
handler back and raises what came.
"""

from __future__ import annotations

import signal
from types import FrameType
from typing import Any

__all__ = ["HELD", "hold", "release", "take_over"]

HELD = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM)
"""The signals ``sbatch --signal`` and preemption send to a step."""

_pending: list[int] = []
_before: dict[signal.Signals, Any] = {}


def _record(signum: int, frame: FrameType | None) -> None:
    _pending.append(signum)


def hold() -> None:
    """Record :data:`HELD` signals from now on instead of dying of them.

    They are unblocked too: one that came while the launcher had it blocked
    is pending, and is recorded now rather than never seen.
    """
    for sig in HELD:
        _before.setdefault(sig, signal.signal(sig, _record))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, HELD)


def take_over(handlers: dict[signal.Signals, Any]) -> list[int]:
    """Stop holding, once the trap's own handlers are installed.

    ``handlers`` maps each signal the trap handles to the handler it replaced
    (what the trap restores when it ends); where that was :func:`hold`'s, it
    becomes the one from before :func:`hold`. Returns the held signals the trap
    handles, in the order they came. A held signal the trap does not handle
    gets its earlier handler back and is raised again, as if it came now.
    """
    # Blocked while the handlers change hands: one that comes meanwhile waits
    # for the handler it ends up with, instead of landing in a list nobody reads.
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, HELD)
    try:
        for sig, old in handlers.items():
            if old is _record:
                handlers[sig] = _before.get(sig, signal.SIG_DFL)
        others = [sig for sig in _before if sig not in handlers]
        for sig in others:
            signal.signal(sig, _before[sig])
        _before.clear()
        came, _pending[:] = list(_pending), []
        for signum in came:
            if signum in others:
                signal.raise_signal(signum)  # pending until the mask is restored
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    return [s for s in came if s in handlers]


def release() -> None:
    """Stop holding without a trap (``run`` failed before it had one): every held
    signal gets its earlier handler back, and what came is raised again."""
    take_over({})

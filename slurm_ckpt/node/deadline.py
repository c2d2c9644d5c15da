"""A hook's time budget, shared out among its steps."""

from __future__ import annotations

import time

__all__ = ["Deadline"]


class Deadline:
    """Seconds left of a hook's time budget (monotonic clock)."""

    def __init__(self, seconds: float) -> None:
        self.start = time.monotonic()
        self.end = self.start + seconds

    def left(self, reserve: float = 0.0) -> float:
        """Seconds left, keeping ``reserve`` for what must still run after."""
        return max(0.0, self.end - time.monotonic() - reserve)

    def part(self, fraction: float, reserve: float = 0.0) -> Deadline:
        """A deadline for one step: ``fraction`` of what is left, keeping ``reserve``.

        Steps run one after another each take a part of one deadline, so the
        time a step does not use goes to the next, and no step gets it all.
        """
        return Deadline(fraction * self.left(reserve))

    def elapsed_ms(self) -> float:
        return (time.monotonic() - self.start) * 1000

"""The guard of the opt-in ``overlap`` snapshot: what it does to keep a background copy consistent.

``overlap`` returns from ``save_async`` before the large tensors are copied,
and copies them while the trainer runs its next forward and backward pass,
which read parameters and optimizer state but do not change them. Two things
keep later changes out of the checkpoint without the trainer's help:

* **The optimizer waits.** A global ``torch.optim`` step pre-hook blocks every
  ``optimizer.step()`` until the copies in flight are done. That is where a
  training loop changes its state.
* **Anything else is caught.** Every in-place torch op on a tensor bumps its
  version counter, the one autograd uses to refuse a backward pass through a
  changed tensor. The counters of the tensors left to copy are read when
  ``save_async`` returns and again after the copy; if one moved, the copy may
  hold a mix of old and new values and the save fails instead of committing.

Both rest on torch's own notion of an in-place change, so they share its
blind spots: writes through ``.data``, a NumPy view or a raw pointer, and
native kernels that update buffers without a bump (batch norm's running
statistics). And torch bumps the counter when an op ends: an op still running
when the copy ends is not seen, and its new values may be in the copy. The
engine copies small tensors before ``save_async`` returns, which covers such
buffers. That is why ``overlap`` is opt-in: code that changes large tensors
other than through ``optimizer.step()`` must call ``fence()`` first, and the
default (``copy``, ``fork``) captures the state before returning instead.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import Any

__all__ = ["SMALL", "changed", "hold", "release", "trackable", "versions", "wait_all"]

SMALL = 1 << 20
"""Tensors under this many bytes are copied before ``save_async`` returns.

Buffers that kernels change without a version bump (batch norm's running mean
and variance, one float per channel) are far below it; together the small
tensors of a model are a sliver of its bytes, so copying them at once costs
little stall.
"""

_lock = threading.Lock()
_pending: set[threading.Event] = set()
_hook: Any = None


def trackable(t: Any) -> bool:
    """Whether in-place changes to ``t`` show in its version counter.

    Inference tensors have none; one detached from them reports a counter
    that never moves, so ``is_inference()`` decides, not ``_version`` raising.
    """
    try:
        return not t.is_inference() and isinstance(t._version, int)
    except (AttributeError, RuntimeError):
        return False


def versions(tensors: Sequence[Any]) -> list[int]:
    return [int(t._version) for t in tensors]


def changed(keys: Sequence[str], tensors: Sequence[Any], before: Sequence[int]) -> list[str]:
    """Keys of the tensors whose version moved since ``before``."""
    return [k for k, t, v in zip(keys, tensors, before, strict=True) if int(t._version) != v]


def hold(captured: threading.Event) -> None:
    """Make every ``optimizer.step()`` wait until ``captured`` is set."""
    _install()
    with _lock:
        _pending.add(captured)


def release(captured: threading.Event) -> None:
    with _lock:
        _pending.discard(captured)


def wait_all(*_: Any) -> None:
    """Block until every copy in flight is done (the step pre-hook)."""
    with _lock:
        pending = list(_pending)
    for ev in pending:
        ev.wait()


def _install() -> None:
    global _hook
    with _lock:
        if _hook is not None:
            return
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _hook = register_optimizer_step_pre_hook(wait_all)


def _forget_in_child() -> None:
    # A forked child has none of the parent's copying threads: their events
    # would never be set there, and an optimizer step in the child would hang.
    global _lock
    _lock = threading.Lock()
    _pending.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)

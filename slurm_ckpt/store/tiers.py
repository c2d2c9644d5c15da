"""Two tiers: commit to fast node-local scratch, then drain to durable shared storage.

The contract other parts rely on:

* **fast tier** = ``$SLURM_CKPT_SCRATCH/ckpt``, used when ``SLURM_CKPT_SCRATCH``
  names an existing writable directory (the prolog makes it); **durable tier**
  = the Checkpointer's run dir. No scratch: one tier, as before.
* ``$SLURM_CKPT_SCRATCH/ckpt/TIER.json`` = ``{"durable": "<absolute run dir>"}``
  (written tmp + fsync + rename) tells the root epilog where to stage out to.
  The epilog treats it as untrusted and acts with the job user's rights.
* A save commits to the fast tier (synchronous, durable on scratch). One
  background thread then copies it to the durable tier with
  :func:`~slurm_ckpt.store.transfer.copy_checkpoint`, which verifies every byte
  against the manifest and commits with the same protocol. One copy at a time;
  checkpoints saved while one is copying are skipped in favour of the newest.
* Retention runs per tier. On scratch it never deletes the newest checkpoint
  until it is durable, nor the one being copied.
* A failed copy (read-only or full durable storage) is logged and kept for the
  Checkpointer to surface per ``storage.on_async_error``; the scratch copy stays
  for the next drain or the epilog's stage-out.
* A copy that the durable storage leaves hanging past ``stall_after``
  (``storage.hang_timeout``) is stalled: ``drain()`` and ``close()`` stop
  waiting for it, and saves go on committing to scratch.
* Discovery looks at both tiers, newest valid first; on equal steps the fast
  tier comes first.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import storage_error
from .drainer import Drainer
from .fsutil import fsync_dir, write_file_durably
from .layout import TIER_FILE, fast_dir
from .manifest import MANIFEST
from .retry import RetryPolicy, prune_for_space, pruned_once, retry_call
from .transfer import copy_checkpoint
from .verify import find_latest, is_committed

if TYPE_CHECKING:
    from . import RunDir

__all__ = ["Tiers", "read_dirs", "usable_scratch"]

log = logging.getLogger("slurm_ckpt")

def usable_scratch(scratch: Path | None) -> Path | None:
    """``scratch`` if it is an existing directory this process can write, else None."""
    if scratch is None or not scratch.is_dir() or not os.access(scratch, os.W_OK | os.X_OK):
        return None
    return scratch


def read_dirs(durable: Path, scratch: Path | None) -> list[Path]:
    """Run dirs that discovery searches, fastest first (for readers such as the CLI).

    The fast tier is included when it exists, even if this process cannot write it.
    """
    if scratch is not None:
        fast = fast_dir(scratch)
        if fast.is_dir() and not _same_dir(fast, durable):
            return [fast, durable]
    return [durable]


def _same_dir(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.abspath(a) == os.path.abspath(b)


def write_tier_file(fast: Path, durable: Path, keep: int) -> None:
    """Write ``TIER.json`` atomically: the epilog must never read half of it.

    It names the durable run dir the epilog stages out to, and the job's
    ``storage.keep``, with which the stage-out applies retention there and
    makes room in it when it is full, as the job's own drain does.
    """
    tmp = fast / f".{TIER_FILE}.{os.getpid()}.tmp"
    data = json.dumps({"durable": str(durable.absolute()), "keep": keep}).encode()
    try:
        tmp.unlink(missing_ok=True)
        write_file_durably(tmp, data)
        os.rename(tmp, fast / TIER_FILE)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise storage_error(e, "cannot write the tier file", fast / TIER_FILE) from e
    fsync_dir(fast)


@dataclass(frozen=True)
class _Item:
    step: int
    path: Path
    at: float
    """When it was committed to the fast tier (for the stage-out lag)."""


class Tiers:
    """The fast and the durable run dir of one writer, and the drain between them."""

    def __init__(
        self,
        fast: RunDir,
        durable: RunDir,
        *,
        keep: int,
        policy: RetryPolicy | None = None,
        on_lag: Callable[[float], None] | None = None,
        drain: bool = True,
        stall_after: float | None = None,
        on_stall: Callable[[bool], None] | None = None,
    ) -> None:
        self.fast, self.durable, self.keep = fast, durable, keep
        self._policy = policy or RetryPolicy()
        self._on_lag = on_lag
        self._durable: dict[int, Path] = {}
        self._undurable_since: list[float] = []
        """Commit times of checkpoints newer than the newest durable one (stage-out lag)."""
        self._closed = False
        self._fast_guard = threading.Lock()
        """Held while trimming scratch and while close() gives up its lock: no trim follows the close."""
        self._drainer: Drainer[_Item] = Drainer(
            self._copy,
            name="slurm-ckpt-drain",
            describe=lambda item: f"copying checkpoint {item.step} ({item.path}) to the durable "
            f"tier {self.durable.path}",
            enabled=drain,
            on_done=self._done,
            on_change=self._report_lag,
            stall_after=stall_after,
            on_stall=on_stall,
        )

    def __repr__(self) -> str:
        return f"Tiers(fast={str(self.fast.path)!r}, durable={str(self.durable.path)!r})"

    @property
    def search_dirs(self) -> list[Path]:
        return [self.fast.path, self.durable.path]

    def activate(self) -> None:
        """Create the fast run dir, write ``TIER.json``, and queue any scratch
        checkpoint newer than the durable tier (left by an earlier run on this node)."""
        self.fast.ensure()
        write_tier_file(self.fast.path, self.durable.path, self.keep)
        try:
            fast = find_latest([self.fast.path], full=False)
            durable = find_latest([self.durable.path], full=False)
        except OSError as e:
            log.warning("cannot compare tiers %s: %s", self, e)
            return
        if fast is not None and (durable is None or fast.step > durable.step):
            log.info(
                "checkpoint %d is only on scratch; copying it to %s", fast.step, self.durable.path
            )
            self.submit(fast.step, fast.path)

    def submit(self, step: int, path: Path) -> None:
        """Queue a checkpoint just committed to the fast tier for the durable tier."""
        item = _Item(step, path, time.time())
        with self._drainer.cv:
            self._durable.pop(step, None)
            self._undurable_since.append(item.at)
            self._drainer.submit(item)

    def protected(self) -> set[Path]:
        """Fast-tier checkpoints that retention must keep: not durable yet, or being copied."""
        return {i.path for i in self._drainer.in_flight()}

    def is_durable(self, step: int) -> bool:
        """True once checkpoint ``step`` is committed on the durable tier."""
        with self._drainer.cv:
            if step in self._durable:
                # Still there? Retention on the durable tier may have removed it since.
                return (self._durable[step] / MANIFEST).is_file()
            if any(i.step == step for i in self._drainer.in_flight()):
                return False
        return is_committed(self.durable.path, step)

    @property
    def durable_step(self) -> int | None:
        """The newest step this writer has made durable, or None."""
        with self._drainer.cv:
            return max(self._durable, default=None)

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until the copying is done; True if the newest checkpoint is durable.

        False when ``timeout`` (seconds) passed first or the copy failed; the
        checkpoint is then still on scratch, where the epilog stages it out.
        """
        return self._drainer.drain(timeout)

    @property
    def copying(self) -> bool:
        """True while the drain runs, stalled or not (the durable lock is in use)."""
        return self._drainer.busy

    def take_error(self) -> BaseException | None:
        """The last copy error, once; None if there was none since the last call."""
        return self._drainer.take_error()

    def close(self, timeout: float | None = None) -> bool:
        """Drain, then release the fast run dir's lock. Returns what :meth:`drain` does.

        The durable run dir's lock is its owner's to release, within
        ``storage.hang_timeout``: the release is a call to the storage too. A
        copy still running (past ``timeout``, or stalled) leaves scratch alone
        when it ends: once its lock is given up, scratch is the stage-out's.
        """
        try:
            return self.drain(timeout)
        finally:
            with self._fast_guard:
                self._closed = True
                self.fast.unlock()

    def _done(self, item: _Item, dst: Path) -> None:
        # Called by the drainer with its lock held.
        log.info("checkpoint %d is durable: %s", item.step, dst)
        self._durable[item.step] = dst
        self._undurable_since = [t for t in self._undurable_since if t > item.at]

    def _copy(self, item: _Item) -> Path:
        src = item.path
        what = f"copying {src} to {self.durable.path}"
        self.durable.lock()
        dst = pruned_once(lambda: retry_call(lambda: copy_checkpoint(src, self.durable.path), self._policy, what),
                          lambda: prune_for_space(self.durable.path, self.keep), what)  # fmt: skip
        self.durable.retain(self.keep, protect=[dst])
        self._trim_fast(item)
        return dst

    def _trim_fast(self, item: _Item) -> None:
        # A save's retention keeps the checkpoint being copied, so the fast tier
        # holds more than ``keep`` until the drain has copied a newer one: trim
        # it then, not only at the next save (scratch is the job's reserved
        # space). Checkpoints committed after ``item`` are spared: one may not
        # have been handed to the drain yet.
        with self._fast_guard:
            if self._closed:
                return
            try:
                self.fast.retain(self.keep, protect=self.protected(), before=item.at)
            except OSError as e:  # the copy is done: a failed delete must not undo it
                log.warning("checkpoint %d copied, but retention on %s failed: %s", item.step, self.fast.path, e)

    def _report_lag(self) -> None:
        # Called with the lock held.
        if self._on_lag is not None:
            since = self._undurable_since
            self._on_lag(time.time() - since[0] if since else 0.0)

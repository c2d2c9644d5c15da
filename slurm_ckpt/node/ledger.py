"""The node's scratch ledger: who holds how much node-local scratch.

One JSON file under a file lock, next to the scratch it accounts for. The
prolog reserves, the epilog releases; the sum of reservations never exceeds the
scratch filesystem's size minus the configured headroom.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import filelock

from ..config import format_size
from ..errors import LockHeld, storage_error

__all__ = ["Grant", "Ledger"]

log = logging.getLogger("slurm_ckpt.node")

LEDGER = "ledger.json"


@dataclass(frozen=True)
class Grant:
    """What a job asked for and what it got (0: no scratch)."""

    asked: int
    size: int
    warning: str | None = None


class Ledger:
    """Reservations of one scratch filesystem.

    ``capacity`` is the filesystem's size; ``headroom`` of it is never handed out.
    """

    def __init__(self, state_dir: Path, capacity: int, headroom: int = 0, lock_timeout: float = 10.0):
        self.path = state_dir / LEDGER
        self.capacity = capacity
        self.headroom = headroom
        self._lock = filelock.FileLock(str(state_dir / "ledger.lock"), timeout=lock_timeout, mode=0o600)

    @contextmanager
    def _locked(self) -> Iterator[dict[str, dict[str, Any]]]:
        try:
            with self._lock:
                entries = self._read()
                before = json.dumps(entries, sort_keys=True)
                yield entries
                if json.dumps(entries, sort_keys=True) != before:
                    self._write(entries)
        except filelock.Timeout:
            raise LockHeld(f"{self._lock.lock_file}: the scratch ledger stayed locked; "
                           "is a hook stuck? (see the hook log)") from None  # fmt: skip

    def _read(self) -> dict[str, dict[str, Any]]:
        try:
            data = json.loads(self.path.read_bytes())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            # Unreadable ledger: keep it for the admin and start over rather
            # than fail every job on this node.
            aside = self.path.with_name(f"{LEDGER}.corrupt-{int(time.time())}")
            log.error("scratch ledger %s unreadable (%s); moved to %s", self.path, e, aside)
            os.replace(self.path, aside)
            return {}
        if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
            return {}
        return data

    def _write(self, entries: dict[str, dict[str, Any]]) -> None:
        tmp = self.path.with_name(f".{LEDGER}.{os.getpid()}")
        try:
            # 0600: the state dir can be traversed by all, and this names every job's user.
            with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600), "w") as f:
                json.dump(entries, f, indent=1, sort_keys=True)
                f.flush()
                # fsync + rename: a power cut leaves the old or the new ledger, never half.
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except OSError as e:
            raise storage_error(e, "cannot write the scratch ledger", self.path) from e

    def entries(self) -> dict[str, dict[str, Any]]:
        """A snapshot of all reservations, by job id."""
        with self._locked() as entries:
            return {k: dict(v) for k, v in entries.items()}

    def reserve(self, job_id: str, asked: int, *, uid: int, policy: str, min_size: int,
                alive: Callable[[str, dict[str, Any]], bool] | None = None) -> Grant:  # fmt: skip
        """Reserve ``asked`` bytes for ``job_id``, or less under ``policy``.

        A job that already holds a reservation (requeued onto the same node,
        or a prolog run twice) keeps it. ``alive(job_id, entry) -> bool`` lets
        the caller drop entries whose scratch no longer exists (a node that
        crashed before its epilog).
        """
        with self._locked() as entries:
            if job_id in entries:
                return Grant(asked, int(entries[job_id]["size"]))
            if alive is not None:
                for stale in [j for j, e in entries.items() if not alive(j, e)]:
                    log.warning("dropping stale scratch reservation of job %s", stale)
                    del entries[stale]
            held = sum(int(e["size"]) for e in entries.values())
            free = max(0, self.capacity - self.headroom - held)
            size, warning = asked, None
            if asked > free:
                size = free if policy == "shrink" and free >= min_size else 0
                got = f"reserved {format_size(size)} instead" if size else "no node-local scratch"
                warning = (
                    f"this job asked for {format_size(asked)} of node-local scratch, but only "
                    f"{format_size(free)} of {format_size(self.capacity)} is free for reservation "
                    f"on this node ({len(entries)} other job(s) hold {format_size(held)}); "
                    f"{got}. Checkpoints still go to the durable run dir."
                )
            if size:
                entries[job_id] = {"size": size, "asked": asked, "uid": uid, "since": time.time()}
            return Grant(asked, size, warning)

    def set_kept(self, job_id: str, reason: str) -> None:
        """Mark a reservation whose scratch the epilog had to keep (the only copy)."""
        with self._locked() as entries:
            if job_id in entries:
                entries[job_id]["kept"] = reason

    def release(self, job_id: str) -> int:
        """Forget ``job_id``'s reservation; return its size (0 if it had none)."""
        with self._locked() as entries:
            entry = entries.pop(job_id, None)
            return int(entry["size"]) if entry else 0

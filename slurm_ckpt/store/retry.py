"""Surviving storage faults: bounded retries, pruning on a full disk, falling back a tier.

Retries wrap the *whole* commit, never a single syscall. A failed ``fsync``
must not be retried in place: after it the kernel may have dropped the dirty
pages and a second ``fsync`` can report success for data that is gone (the
"fsyncgate" lesson). A commit attempt that fails removes its temp dir, so the
next attempt writes every byte again into a fresh one.

Which errors are transient is configurable (``storage.retry_errnos``). EIO is
added on network and FUSE filesystems, where it usually means a server hiccup;
on a local disk it means a dying device, and retrying only hides that.
"""

from __future__ import annotations

import errno
import logging
import os
import random
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from ..errors import ConfigError, NoSpace, SlurmCkptError, StorageError, storage_error
from ..fsinfo import mount_for
from .retention import apply_retention, reaped, remove_stale_tmp

if TYPE_CHECKING:
    from ..config import StorageConfig
    from .commit import WriteFn

__all__ = [
    "RetryPolicy",
    "Target",
    "commit_resilient",
    "prune_for_space",
    "pruned_once",
    "retry_call",
]

log = logging.getLogger("slurm_ckpt")

T = TypeVar("T")


class Target(Protocol):
    """What a save commits into: a ``RunDir`` (or a wrapper of one)."""

    @property
    def path(self) -> Path: ...

    def commit(self, step: int, write: WriteFn, **meta: Any) -> Path: ...


def _errno_of(name: str) -> int:
    code = getattr(errno, name.strip().upper(), None)
    if not isinstance(code, int):
        raise ConfigError(f"storage.retry_errnos: {name!r} is not an errno name (e.g. ESTALE, EIO)")
    return code


@dataclass(frozen=True)
class RetryPolicy:
    """How many times, how long apart, and for which errnos a commit is retried."""

    retries: int = 3
    backoff: float = 0.5
    errnos: frozenset[int] = frozenset({errno.ESTALE, errno.EAGAIN, errno.EINTR})
    max_backoff: float = 30.0

    @classmethod
    def for_path(cls, storage: StorageConfig, path: str | os.PathLike[str]) -> RetryPolicy:
        """The configured policy, with EIO added when ``path`` is on a network or FUSE fs."""
        codes = {_errno_of(n) for n in storage.retry_errnos}
        m = mount_for(path)
        if m is not None and m.is_network:
            codes.add(errno.EIO)
        return cls(max(0, storage.retries), max(0.0, storage.retry_backoff), frozenset(codes))

    def transient(self, exc: BaseException) -> bool:
        return isinstance(exc, OSError) and exc.errno in self.errnos

    def delay(self, attempt: int) -> float:
        """Seconds before retry ``attempt`` (1-based): doubling, capped, with +-25% jitter
        so that many ranks hit by the same server hiccup do not retry in lockstep."""
        base = min(self.max_backoff, self.backoff * 2 ** (attempt - 1))
        return base * random.uniform(0.75, 1.25)


def retry_call(
    fn: Callable[[], T],
    policy: RetryPolicy,
    what: str,
    *,
    path: str | os.PathLike[str] | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """Call ``fn``; on a transient OSError wait and call again, at most ``policy.retries`` times.

    The last error is raised as a typed :class:`StorageError`; non-transient
    errors are raised at once. ``path`` names the place for errors that carry
    none (``close()`` reporting a write-back error, for one).
    """
    attempt = 0
    while True:
        try:
            return fn()
        except OSError as e:
            if isinstance(e, SlurmCkptError) and not isinstance(e, StorageError):
                raise  # already typed and not an I/O fault: LockHeld is a TimeoutError, so an OSError
            if not policy.transient(e) or attempt >= policy.retries:
                if attempt and policy.transient(e):
                    log.error("%s: still failing after %d retries: %s", what, attempt, e)
                raise storage_error(e, what, e.filename or path) from e
            attempt += 1
            wait = policy.delay(attempt)
            log.warning("%s: transient %s (%s); retry %d/%d in %.2fs", what,
                        errno.errorcode.get(e.errno or 0, e.errno), e, attempt, policy.retries, wait)  # fmt: skip
            sleep(wait)


def prune_for_space(run_dir: Path, keep: int, *, protect: Collection[Path] = ()) -> list[Path]:
    """Make room for one more checkpoint, the way retention would after it commits.

    Keeps ``keep - 1`` valid checkpoints (at least one: the newest valid is
    never deleted) plus ``protect`` (e.g. one a drain is copying), and removes
    temp dirs of dead writers.
    """
    reaped()  # space that earlier retention is still freeing comes first
    removed = remove_stale_tmp(run_dir)
    removed += apply_retention(run_dir, max(1, keep - 1), protect=protect)
    return removed


def pruned_once(fn: Callable[[], T], prune: Callable[[], list[Path]], what: str) -> T:
    """``fn()``; if the disk is full (:class:`NoSpace`), ``prune()`` and, if that
    freed anything, ``fn()`` once more. The one policy of every writer that can
    make room: a commit, the tier drain, the shard drain, the epilog's stage-out.
    """
    try:
        return fn()
    except NoSpace as e:
        removed = prune()
        if not removed:
            raise
        log.warning("%s: %s; pruned %s and retrying once", what, os.strerror(e.errno or 0),
                    ", ".join(p.name for p in removed))  # fmt: skip
        return fn()


def commit_resilient(
    run_dirs: Sequence[Target],
    step: int,
    write: WriteFn,
    *,
    keep: int,
    policies: Iterable[RetryPolicy] | None = None,
    protect: Callable[[], Collection[Path]] = tuple,
    sleep: Callable[[float], None] = time.sleep,
    **meta: Any,
) -> Path:
    """Commit ``step`` to the first run dir that takes it; return the committed path.

    In each dir: transient errors are retried per its policy; on ENOSPC/EDQUOT
    older checkpoints are pruned per retention and the commit is retried once.
    When a dir still fails with a storage error, the next dir (the other tier)
    is tried. The error of the first dir is raised if every dir fails, with the
    others' errors logged. ``protect()`` names checkpoints pruning must spare.
    """
    if not run_dirs:
        raise ValueError("commit_resilient needs at least one run dir")
    pols = list(policies) if policies is not None else [RetryPolicy() for _ in run_dirs]
    first: StorageError | None = None
    for i, (rd, pol) in enumerate(zip(run_dirs, pols, strict=True)):
        try:
            return _commit_one(rd, step, write, keep, pol, protect, sleep, meta)
        except StorageError as e:
            first = first or e
            if i + 1 < len(run_dirs):
                log.warning("checkpoint %d could not be written to %s (%s); falling back to %s",
                            step, rd.path, e, run_dirs[i + 1].path)  # fmt: skip
            else:
                if e is not first:
                    log.error("checkpoint %d failed on every tier; last: %s", step, e)
                raise first from (e if e is not first else None)
    raise AssertionError("unreachable")


def _commit_one(
    rd: Target, step: int, write: WriteFn, keep: int, pol: RetryPolicy,
    protect: Callable[[], Collection[Path]], sleep: Callable[[float], None], meta: dict[str, Any],
) -> Path:  # fmt: skip
    what = f"saving checkpoint {step} in {rd.path}"
    return pruned_once(
        lambda: retry_call(lambda: rd.commit(step, write, **meta), pol, what, path=rd.path, sleep=sleep),
        lambda: prune_for_space(rd.path, keep, protect=[p for p in protect() if p.parent == rd.path]),
        what,
    )

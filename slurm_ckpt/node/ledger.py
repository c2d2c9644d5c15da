"""The node's scratch ledger: who holds how much node-local scratch.

One JSON file under a lock, in the root-owned state dir next to the scratch it
accounts for. The prolog reserves, the epilog releases; the sum of
reservations never exceeds the scratch filesystem's size minus the configured
headroom.

Keys are job ids, and ``grave/<name>`` for a reservation that outlived its
job: a tree or image in the graveyard, held until it is really gone (with
``kept``, a kept scratch set aside because its job id came back for another
job, held until ``scratch.keep_failed``). Every file here is opened relative
to the state dir's fd with ``O_NOFOLLOW``, and the dir itself must be owned
by us and writable by no one else.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import stat
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import format_size
from ..errors import LockHeld, StorageError, storage_error

__all__ = ["GRAVE", "LEAK", "Dropper", "Grant", "Ledger", "kept_oldest_first"]

log = logging.getLogger("slurm_ckpt.node")

LEDGER = "ledger.json"
LOCK = "ledger.lock"
GRAVE = "grave/"
"""Key prefix of a reservation held by a graveyard entry."""
LEAK = "leak/"
"""Key prefix of space a loop device holds that no reservation names (``<device>:<inode>``)."""
_MAX_LEDGER = 64 * 1024**2
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK

Entries = dict[str, dict[str, Any]]
Dropper = Callable[[str, dict[str, Any]], "str | None"]


def _account_leaks(entries: Entries, leaked: Mapping[str, int]) -> None:
    for key in [k for k in entries if k.startswith(LEAK) and k[len(LEAK):] not in leaked]:
        log.info("leaked scratch %s is gone; its %s are free again", key, format_size(int(entries.pop(key)["size"])))
    for name, size in leaked.items():
        if LEAK + name not in entries:
            log.warning("loop device %s holds %s of scratch that no reservation names (an image unlinked while "
                        "still mounted somewhere); counted as taken until it lets go", name.split(":")[0],
                        format_size(size))  # fmt: skip
            entries[LEAK + name] = {"size": size, "since": time.time()}


def kept_oldest_first(entries: Entries, uid: int | None = None) -> list[str]:
    """Keys of kept scratch (of ``uid``, if given), the longest kept first."""
    kept = [k for k, e in entries.items() if e.get("kept") and (uid is None or e.get("uid") == uid)]
    return sorted(kept, key=lambda k: float(entries[k].get("kept_since", 0)))


@dataclass(frozen=True)
class Grant:
    """What a job asked for and what it got (0: no scratch)."""

    asked: int
    size: int
    warning: str | None = None


class Ledger:
    """Reservations of one scratch filesystem.

    ``capacity`` is the filesystem's size; ``headroom`` of it is never handed out.
    ``snapshot`` holds the entries as the last call read or wrote them.
    """

    def __init__(self, state_dir: Path, capacity: int, headroom: int = 0, lock_timeout: float = 10.0):
        self.state_dir = state_dir
        self.path = state_dir / LEDGER
        self.capacity = capacity
        self.headroom = headroom
        self.lock_timeout = lock_timeout
        self.snapshot: Entries = {}

    def _open_dir(self) -> int:
        try:
            fd = os.open(self.state_dir, _DIR)
        except OSError as e:
            raise storage_error(e, "cannot open the scratch state dir", self.state_dir) from e
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or st.st_mode & 0o022:
            os.close(fd)
            raise StorageError(errno.EPERM, f"the scratch state dir is owned by uid {st.st_uid}, mode "
                               f"{stat.S_IMODE(st.st_mode):o}: it must be root's and writable by no one "
                               "else; remove it and let the next hook make it again", self.state_dir)  # fmt: skip
        return fd

    @contextmanager
    def _locked(self) -> Iterator[Entries]:
        dir_fd = self._open_dir()
        try:
            lock_fd = self._lock(dir_fd)
            try:
                entries = self._read(dir_fd)
                before = json.dumps(entries, sort_keys=True)
                yield entries
                if json.dumps(entries, sort_keys=True) != before:
                    self._write(dir_fd, entries)
                self.snapshot = {k: dict(v) for k, v in entries.items()}
            finally:
                os.close(lock_fd)  # closing the fd drops the flock
        finally:
            os.close(dir_fd)

    def _lock(self, dir_fd: int) -> int:
        try:
            fd = os.open(LOCK, os.O_RDWR | os.O_CREAT | _FILE, 0o600, dir_fd=dir_fd)
        except OSError as e:
            raise storage_error(e, "cannot open the scratch ledger lock", self.state_dir / LOCK) from e
        end = time.monotonic() + self.lock_timeout
        pause = 0.005
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return fd
            except BlockingIOError:
                if time.monotonic() >= end:
                    os.close(fd)
                    raise LockHeld(f"{self.state_dir / LOCK}: the scratch ledger stayed locked; "
                                   "is a hook stuck? (see the hook log)") from None  # fmt: skip
                time.sleep(pause)  # polling, as flock has no timeout
                pause = min(pause * 2, 0.05)
            except OSError as e:
                os.close(fd)
                raise storage_error(e, "cannot lock the scratch ledger", self.state_dir / LOCK) from e

    def _read(self, dir_fd: int) -> Entries:
        try:
            fd = os.open(LEDGER, os.O_RDONLY | _FILE, dir_fd=dir_fd)
        except FileNotFoundError:
            return {}
        except OSError as e:
            return self._set_aside(dir_fd, e)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size > _MAX_LEDGER:
                return self._set_aside(dir_fd, f"not a regular file under {format_size(_MAX_LEDGER)}")
            with os.fdopen(os.dup(fd), "rb") as f:
                data = json.loads(f.read(_MAX_LEDGER + 1))
        except (OSError, ValueError) as e:
            return self._set_aside(dir_fd, e)
        finally:
            os.close(fd)
        if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
            return {}
        return data

    def _set_aside(self, dir_fd: int, why: object) -> Entries:
        # Unreadable ledger: keep it for the admin and start over rather than
        # fail every job on this node.
        aside = f"{LEDGER}.corrupt-{int(time.time())}"
        log.error("scratch ledger %s unreadable (%s); moved to %s", self.path, why, aside)
        try:
            os.replace(LEDGER, aside, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except OSError as e:
            raise storage_error(e, "cannot move the unreadable scratch ledger aside", self.path) from e
        return {}

    def _write(self, dir_fd: int, entries: Entries) -> None:
        tmp = f".{LEDGER}.{os.getpid()}"
        try:
            # A temp file of a dead hook that had our pid: ours to replace.
            with suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=dir_fd)
            # 0600: the state dir can be traversed by all, and this names every job's user.
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _FILE, 0o600, dir_fd=dir_fd)
            with os.fdopen(fd, "w") as f:
                json.dump(entries, f, indent=1, sort_keys=True)
                f.flush()
                # fsync + rename: a power cut leaves the old or the new ledger, never half.
                os.fsync(f.fileno())
            os.replace(tmp, LEDGER, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except OSError as e:
            raise storage_error(e, "cannot write the scratch ledger", self.path) from e

    def entries(self) -> Entries:
        """A snapshot of all reservations, by key."""
        with self._locked() as entries:
            return {k: dict(v) for k, v in entries.items()}

    def reserve(self, job_id: str, asked: int, *, uid: int, policy: str, min_size: int,
                restarts: int = 0, alive: Callable[[str, dict[str, Any]], bool] | None = None,
                set_aside: Callable[[str, dict[str, Any]], str | None] | None = None,
                drop: Dropper | None = None, leaked: Mapping[str, int] | None = None,
                replicas: int = 0) -> Grant:  # fmt: skip
        """Reserve ``asked`` bytes for ``job_id``, or less under ``policy``.

        A job that already holds a reservation (requeued onto the same node,
        or a prolog run twice) keeps it. A *kept* reservation is the job's only
        if it was kept for this uid at this restart count (the epilog after a
        requeue sees the count the next run will have); otherwise the job id
        was reused, and ``set_aside(job_id, entry) -> name`` moves the old
        scratch out of the way: its reservation lives on as ``grave/<name>``.
        ``alive(key, entry) -> bool`` lets the caller drop entries whose
        scratch no longer exists (a node that crashed before its epilog).
        ``leaked`` (``{name: bytes}``, from :func:`loopfs.leaked`) replaces the
        ``leak/`` entries: space no reservation names but a loop device still
        holds, counted as taken until it is gone.
        When the rest is too little, ``drop(key, entry)`` removes kept
        scratch of other jobs, the oldest first, until it is enough (see
        :meth:`drop_kept` for what it returns). ``replicas``: ``asked`` holds room for the
        job's own shards and that many peers' replicas; the entry records it, and the
        bytes set aside for replicas (``replica_bytes``, of the size granted).
        """
        with self._locked() as entries:
            old = entries.get(job_id)
            if old is not None and old.get("kept") and set_aside is not None and \
                    (old.get("uid"), old.get("restarts")) != (uid, restarts):  # fmt: skip
                name = set_aside(job_id, old)
                if name is not None:
                    entries[GRAVE + name] = dict(old, job=job_id)
                    del entries[job_id]
                    old = None
            if old is not None:
                if old.pop("kept", None) is not None:  # adopted by its job's next run
                    old.pop("kept_since", None)
                return Grant(asked, int(old["size"]))
            if leaked is not None:
                _account_leaks(entries, leaked)
            if alive is not None:
                for stale in [k for k, e in entries.items() if not alive(k, e) and not k.startswith(LEAK)]:
                    log.warning("dropping stale scratch reservation %s", stale)
                    del entries[stale]
            held = sum(int(e["size"]) for e in entries.values())
            free = max(0, self.capacity - self.headroom - held)
            if asked > free and drop is not None:
                # Kept scratch yields to a job that needs the room, the oldest first.
                for key in kept_oldest_first(entries):
                    if free >= asked:
                        break
                    free += self._drop(entries, key, drop, f"job {job_id} needs the room")
            size, warning = asked, None
            if asked > free:
                size = free if policy == "shrink" and free >= min_size else 0
                got = f"reserved {format_size(size)} instead" if size else "no node-local scratch"
                warning = (
                    f"this job asked for {format_size(asked)} of node-local scratch, but only "
                    f"{format_size(free)} of {format_size(self.capacity)} is free for reservation "
                    f"on this node ({len(entries)} other reservation(s) hold {format_size(held)}); "
                    f"{got}. Checkpoints still go to the durable run dir."
                )
            if size:
                entries[job_id] = {"size": size, "asked": asked, "uid": uid, "since": time.time()}
                if replicas:
                    entries[job_id] |= {"replicas": replicas, "replica_bytes": size * replicas // (1 + replicas)}
            return Grant(asked, size, warning)

    def set_kept(self, job_id: str, reason: str, restarts: int, keep_for: float | None = None) -> None:
        """Mark a reservation whose scratch the epilog had to keep (the only copy), for
        ``keep_for`` seconds (else ``scratch.keep_failed``).

        The clock starts at the first keep; a rerun of the epilog that fails
        again does not restart it.
        """
        with self._locked() as entries:
            if job_id in entries:
                e = entries[job_id]
                e["kept"] = reason
                e["restarts"] = restarts
                if keep_for is not None:
                    e["keep_for"] = min(float(keep_for), float(e.get("keep_for", keep_for)))
                e.setdefault("kept_since", time.time())

    def drop_kept(self, pick: Callable[[Entries], list[str]], drop: Dropper, why: str) -> int:
        """Drop the kept scratch ``pick(entries)`` names, in its order; return the bytes freed.

        ``drop(key, entry)`` removes one (under this ledger's lock, so no
        hook adopts it meanwhile) and returns None once its space is free,
        or the name of the grave that still holds it (a busy image, a tree
        too big to remove now), which keeps the reservation until the reaper
        has removed it.
        """
        with self._locked() as entries:
            return sum(self._drop(entries, key, drop, why) for key in pick(entries) if key in entries)

    @staticmethod
    def _drop(entries: Entries, key: str, drop: Dropper, why: str) -> int:
        entry = entries.pop(key)
        since = time.strftime("%Y-%m-%d %H:%M", time.localtime(float(entry.get("kept_since", 0))))
        log.warning("dropping kept scratch %s (uid %s, %s, kept since %s because %s): %s", key, entry.get("uid"),
                    format_size(int(entry["size"])), since, str(entry.get("kept"))[:300], why)  # fmt: skip
        try:
            grave = drop(key, entry)
        except OSError as e:
            log.error("cannot drop kept scratch %s: %s", key, e)
            entries[key] = entry
            return 0
        if grave is None:
            return int(entry["size"])
        rest = {k: v for k, v in entry.items() if k not in ("kept", "kept_since", "keep_for")}
        entries[GRAVE + grave] = dict(rest, job=entry.get("job", key), since=time.time())
        return 0

    def bury(self, job_id: str, grave: str, **extra: Any) -> None:
        """Hand ``job_id``'s reservation to the graveyard entry ``grave`` (held until it is gone)."""
        with self._locked() as entries:
            e = entries.pop(job_id, None)
            if e is not None:
                entries[GRAVE + grave] = dict(e, job=job_id, since=time.time(), **extra)

    def hold(self, key: str, entry: dict[str, Any]) -> None:
        """Record ``entry`` under ``key`` (a graveyard entry found without one)."""
        with self._locked() as entries:
            entries[key] = entry

    def release(self, key: str) -> int:
        """Forget the reservation under ``key`` (a job id); return its size (0 if none)."""
        with self._locked() as entries:
            entry = entries.pop(key, None)
            return int(entry["size"]) if entry else 0


"""The exceptions slurm-ckpt raises.

Every error subclasses :class:`SlurmCkptError` and also the built-in it means,
so ``except OSError`` in a user's code still catches a full disk::

    SlurmCkptError(Exception)
     ├── ConfigError(ValueError)          bad YAML, key, type or size
     ├── CheckpointCorrupt(ValueError)    a checkpoint failed verification
     ├── NoCheckpoint(LookupError)        nothing valid to resume from
     ├── UnsafeLoad(PermissionError)      pickle found, trusted loading not enabled
     ├── UnsupportedValue(TypeError)      a state value we cannot store safely
     ├── SnapshotChanged(RuntimeError)    a tensor changed while a save still read it
     ├── LockHeld(TimeoutError)           another writer owns the run dir
     ├── StorageError(OSError)            an I/O call failed; carries path and errno
     │    ├── NoSpace                     ENOSPC / EDQUOT
     │    └── StorageHung(TimeoutError)   the storage did not answer within storage.hang_timeout
     ├── SlurmError(RuntimeError)         a Slurm command failed
     └── ShardError(RuntimeError)         another rank failed its part of a sharded save

Each message says what to do about it. Mapping errors to exit codes happens in
``cli.py`` only.
"""

from __future__ import annotations

import errno as _errno
import os

__all__ = [
    "CheckpointCorrupt",
    "ConfigError",
    "LockHeld",
    "NoCheckpoint",
    "NoSpace",
    "ShardError",
    "SlurmCkptError",
    "SlurmError",
    "SnapshotChanged",
    "StorageError",
    "StorageHung",
    "UnsafeLoad",
    "UnsupportedValue",
    "storage_error",
]


class SlurmCkptError(Exception):
    """Base class of every slurm-ckpt error."""


class ConfigError(SlurmCkptError, ValueError):
    """The configuration (YAML, env or flag) is invalid."""


class CheckpointCorrupt(SlurmCkptError, ValueError):
    """A checkpoint does not verify. ``path`` names the bad file."""

    def __init__(self, message: str, path: str | os.PathLike[str] | None = None) -> None:
        super().__init__(message)
        self.path = None if path is None else os.fspath(path)

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.args[0], self.path))


class NoCheckpoint(SlurmCkptError, LookupError):
    """No valid checkpoint exists in the searched run dirs."""


class UnsafeLoad(SlurmCkptError, PermissionError):
    """The checkpoint holds pickled objects and trusted loading was not enabled."""


class UnsupportedValue(SlurmCkptError, TypeError):
    """A state holds a value with no safe encoding (and pickling was not allowed)."""


class SnapshotChanged(SlurmCkptError, RuntimeError):
    """A tensor changed while a save was still reading it (the opt-in ``overlap``
    snapshot, or a sharded DCP save's writer); nothing was committed."""


class LockHeld(SlurmCkptError, TimeoutError):
    """Another writer holds the run dir lock."""


_HINTS = {
    _errno.ENOSPC: "the filesystem is full: free space, lower storage.keep, or point "
    "SLURM_CKPT_DIR at a larger filesystem",
    _errno.EDQUOT: "your quota is exhausted: check `quota -s` (a project quota: `xfs_quota -c "
    "'quota -p ID'`), lower storage.keep, or ask for more quota",
    _errno.EROFS: "the filesystem is read-only (often a remount after errors): tell your "
    "admins; checkpoints can go to scratch meanwhile",
    _errno.EIO: "the storage returned an I/O error: retry later and run `slurm-ckpt doctor`",
    _errno.ESTALE: "stale NFS file handle: the directory changed on the server; retry",
    _errno.EACCES: "permission denied: check the owner and mode of the run dir",
    _errno.ETIMEDOUT: "the file server timed out (a 'soft' NFS mount gives up like this): check "
    "the server and run `slurm-ckpt doctor`",
    _errno.ENOTCONN: "the filesystem lost its server or daemon (network or FUSE mount): remount it; "
    "checkpoints can go to scratch meanwhile",
    _errno.ENOLCK: "the filesystem cannot lock files (NFSv3 without lockd, Lustre without -o flock): "
    "run `slurm-ckpt doctor` on the run dir",
}


def _quota_hint(path: str | os.PathLike[str] | None) -> str | None:
    """The EDQUOT hint for the filesystem holding ``path``: each keeps its quotas its own way."""
    if path is None:
        return None
    from .fsinfo import CEPH_FS, GLUSTER_FS, mount_for  # stdlib only; read on EDQUOT alone

    m = mount_for(path)
    if m is None:
        return None
    rest = "lower storage.keep, delete old checkpoints, or ask for more quota"
    if m.fstype in CEPH_FS:
        return ("a CephFS directory quota is exhausted: `slurm-ckpt doctor` on the run dir finds it "
                "(the ceph.quota.max_bytes / max_files xattrs of the run dir or a parent, "
                "`getfattr -n ceph.quota.max_bytes DIR`); " + rest)  # fmt: skip
    if m.fstype in GLUSTER_FS:
        return ("a GlusterFS directory quota is exhausted: `df -h` on the run dir shows it, admins "
                "`gluster volume quota VOLUME list`; " + rest)  # fmt: skip
    if m.fstype == "lustre":
        return f"your Lustre quota is exhausted: check `lfs quota -h -u $USER {m.mount_point}`; " + rest
    return None


class StorageError(SlurmCkptError, OSError):
    """An I/O operation on checkpoint storage failed.

    Carries ``errno``, ``filename`` (the path) and ``hint`` (what to do).
    """

    def __init__(self, err: int, message: str, path: str | os.PathLike[str] | None = None, hint: str | None = None):
        hint = hint or (_quota_hint(path) if err == _errno.EDQUOT else None)
        self.hint = hint or _HINTS.get(err, "run `slurm-ckpt doctor` on the run dir")
        super().__init__(err, f"{message}: {os.strerror(err)}; {self.hint}")
        self.filename = None if path is None else os.fspath(path)

    def __str__(self) -> str:
        where = f" [{self.filename}]" if self.filename else ""
        return f"{self.strerror}{where}"

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild_storage_error, (type(self), self.errno, self.strerror, self.filename, self.hint))


def _rebuild_storage_error(
    cls: type[StorageError], err: int, message: str, path: str | None, hint: str | None = None
) -> StorageError:
    obj = cls.__new__(cls)
    OSError.__init__(obj, err, message)
    obj.hint = _HINTS.get(err, "") if hint is None else hint
    obj.filename = path
    return obj


class NoSpace(StorageError):
    """ENOSPC or EDQUOT: the filesystem or the quota is full."""


class StorageHung(StorageError, TimeoutError):
    """The durable storage gave no answer for ``storage.hang_timeout`` seconds.

    The call still hangs in a worker that the caller no longer waits for; the
    save it belonged to is not committed (the previous checkpoint stays the
    newest valid one; one given up during its final rename may still appear,
    whole, when the storage returns) and training can go on.
    """

    def __init__(self, path: str | os.PathLike[str], seconds: float, what: str = "saving a checkpoint") -> None:
        super().__init__(
            _errno.ETIMEDOUT,
            f"{what}: no answer from the storage in {seconds:g}s (storage.hang_timeout)",
            path,
            hint="the file server is hung or unreachable: run `slurm-ckpt doctor` on the run dir; set "
            "SLURM_CKPT_SCRATCH (node-local scratch) so saves commit there and are copied when it is back, "
            "or raise storage.hang_timeout for storage that is slow but alive",
        )


class SlurmError(SlurmCkptError, RuntimeError):
    """A Slurm command or API call failed."""


class ShardError(SlurmCkptError, RuntimeError):
    """A multi-rank save, or a framework's multi-process save or resume, failed on some rank;
    the message names the rank, and its error where that rank could send it."""


def storage_error(exc: OSError, what: str, path: str | os.PathLike[str] | None = None) -> StorageError:
    """Wrap an ``OSError`` from the filesystem into our typed error, keeping errno."""
    if isinstance(exc, StorageError):
        return exc
    err = exc.errno or _errno.EIO
    cls = NoSpace if err in (_errno.ENOSPC, _errno.EDQUOT) else StorageError
    return cls(err, what, path if path is not None else exc.filename)

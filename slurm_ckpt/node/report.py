"""The prolog's report for one job: its scratch, I/O cgroup, warnings and check figures.

Written by the prolog to ``<scratch.base>/.slurm-ckpt/job_<id>.json``, in the
root-only state dir. Root owns it (mode 0600): a file the user owned could be
made writable with ``chmod u+w`` and filled without limit, outside quota and
loop image, or hardlinked elsewhere. A POSIX ACL entry lets the job's user
read it and nothing more; where the filesystem has no ACLs, a read-only
(0444) copy, still root's, goes into the job's own scratch instead
(:data:`SCRATCH_COPY`). The TaskProlog, running as the user, reads it and
turns it into ``export``/``print`` lines for the task. The epilog deletes it.
"""

from __future__ import annotations

import json
import os
import stat
import struct
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..config import job_dir_name
from .escape import escape

__all__ = ["SCRATCH_COPY", "JobReport", "report_path", "task_prolog_lines"]

SCRATCH_COPY = ".slurm-ckpt-job.json"
"""Name of the report's read-only copy in the job's scratch (only where ACLs are missing)."""
_MAX_REPORT = 1024**2
_ACL_XATTR = "system.posix_acl_access"
_ACL_UNDEFINED_ID = 0xFFFFFFFF
_ACL_USER_OBJ, _ACL_USER, _ACL_GROUP_OBJ, _ACL_MASK, _ACL_OTHER = 0x01, 0x02, 0x04, 0x10, 0x20


def _report_name(job_id: str) -> str:
    return f"{job_dir_name(job_id)}.json"


def report_path(state_dir: Path, job_id: str) -> Path:
    return state_dir / _report_name(job_id)


@dataclass
class JobReport:
    job_id: str
    scratch: str | None = None
    size: int = 0
    asked: int = 0
    enforce: str = "none"
    io_cgroup: str | None = None
    replicas: int = 0
    warnings: list[str] = field(default_factory=list)
    checks: dict[str, Any] = field(default_factory=dict)
    time: float = field(default_factory=time.time)

    def write(self, state_fd: int, uid: int, job_fd: int | None = None) -> str:
        """Write atomically into the state dir: root's, and readable by ``uid`` only.

        Where the filesystem refuses the ACL, a root-owned 0444 copy goes into
        the job dir ``job_fd`` (when there is one). Returns how the user reads
        it: ``"acl"``, ``"copy"``, or ``""`` (not at all).
        """
        data = json.dumps(asdict(self), indent=1).encode()
        if _write_root_file(state_fd, _report_name(self.job_id), data, 0o600, reader=uid):
            return "acl"
        if job_fd is None:
            return ""
        try:
            _write_root_file(job_fd, SCRATCH_COPY, data, 0o444)
        except OSError:  # e.g. a directory the user put at that name
            return ""
        return "copy"

    @classmethod
    def read(cls, path: Path) -> JobReport | None:
        """The report at ``path``, or None; a link, FIFO or oversized file is no report."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size > _MAX_REPORT:
                return None
            with os.fdopen(os.dup(fd), "rb") as f:
                return cls(**json.loads(f.read(_MAX_REPORT + 1)))
        except (OSError, ValueError, TypeError):
            return None
        finally:
            os.close(fd)


def _user_read_acl(uid: int) -> bytes:
    """A POSIX access ACL (the kernel's xattr form): owner rw, ``uid`` r, no one else."""
    entries = [(_ACL_USER_OBJ, 6, _ACL_UNDEFINED_ID), (_ACL_USER, 4, uid), (_ACL_GROUP_OBJ, 0, _ACL_UNDEFINED_ID),
               (_ACL_MASK, 4, _ACL_UNDEFINED_ID), (_ACL_OTHER, 0, _ACL_UNDEFINED_ID)]  # fmt: skip
    return struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *e) for e in entries)


def _write_root_file(dir_fd: int, name: str, data: bytes, mode: int, reader: int | None = None) -> bool:
    """Replace ``name`` in ``dir_fd`` with a root-owned file of ``data``; give ``reader`` read access.

    Returns False when ``reader`` could not be given access (no ACL support).
    The temp name is random and created with O_EXCL, the rename never follows
    a link at ``name``: ``dir_fd`` may be the job's own dir.
    """
    tmp = f".{name}.{os.urandom(6).hex()}"  # not secrets: it imports hashlib, on every hook's path
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    granted = not reader
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fchmod(fd, mode)
        if reader:
            try:
                # After the chmod: a chmod would reset the ACL's mask to the mode's group bits.
                os.setxattr(fd, _ACL_XATTR, _user_read_acl(reader))
                granted = True
            except OSError:
                granted = False
        os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        os.unlink(tmp, dir_fd=dir_fd)
        raise
    finally:
        os.close(fd)
    return granted


def _line(text: str) -> str:
    # One line each: slurmstepd reads the TaskProlog's output line by line, and a
    # newline smuggled in through a job field must not become an `export`.
    return escape(text).strip()


def task_prolog_lines(report: JobReport | None, first_task: bool) -> list[str]:
    """``export NAME=value`` and ``print ...`` lines for slurmstepd.

    Warnings are printed by the first task of each node only, so an 8-task
    step does not repeat them eight times.
    """
    if report is None:
        return []
    out = []
    if report.scratch:
        out.append(f"export SLURM_CKPT_SCRATCH={_line(report.scratch)}")
    if report.scratch and report.replicas:
        out.append(f"export SLURM_CKPT_SCRATCH_REPLICAS={int(report.replicas)}")
    if report.io_cgroup:
        out.append(f"export SLURM_CKPT_IO_CGROUP={_line(report.io_cgroup)}")
    if first_task:
        out += [f"print slurm-ckpt: warning: {_line(w)}" for w in report.warnings]
    return out

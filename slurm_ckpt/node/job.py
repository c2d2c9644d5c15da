"""The job a hook runs for, read from the environment slurmd gives the hooks.

Everything here except the numeric ids is user input (``--comment`` is free
text), so each field is validated before any of it names a path, and nothing
from it ever reaches a shell.
"""

from __future__ import annotations

import os
import pwd
import re
from collections.abc import Mapping
from dataclasses import dataclass

from ..config import format_size, job_dir_name, parse_size
from ..errors import ConfigError, SlurmCkptError

__all__ = ["InvalidJob", "Job", "comment_size"]

_DIGITS = re.compile(r"^[0-9]{1,18}$")
# A token in --comment: "ckpt_scratch=40G" among other words, e.g. "run7 ckpt_scratch=40G".
_TOKEN = re.compile(r"(?:^|[\s,;])(?P<key>ckpt_[a-z]+)=(?P<value>[^\s,;]*)")
_MAX_COMMENT = 4096


class InvalidJob(SlurmCkptError, ValueError):
    """A job field from the hook environment is missing or not what Slurm would send."""


def _digits(env: Mapping[str, str], key: str) -> str:
    value = env.get(key, "")
    if not _DIGITS.match(value):
        raise InvalidJob(f"{key}={value!r} is not a number; not a Slurm hook environment?")
    return value


@dataclass(frozen=True)
class Job:
    """Validated identity of the job: id, owner and the few free-text fields we read."""

    job_id: str
    uid: int
    gid: int
    user: str
    home: str
    partition: str
    comment: str
    restart_count: int

    @property
    def dir_name(self) -> str:
        """``job_<id>``: the only name the hooks ever create under the scratch base."""
        return job_dir_name(self.job_id)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Job:
        """Read SLURM_JOB_ID/UID/GID/USER/PARTITION/COMMENT/RESTART_COUNT.

        The uid must exist in the passwd database and, when SLURM_JOB_USER is
        set, name that user: a job id like ``../../etc`` or a user like
        ``x;rm -rf /`` is rejected here.
        """
        env = os.environ if env is None else env
        job_id = _digits(env, "SLURM_JOB_ID")
        uid = int(_digits(env, "SLURM_JOB_UID"))
        try:
            pw = pwd.getpwuid(uid)
        except KeyError:
            raise InvalidJob(f"SLURM_JOB_UID={uid} is not a known user on this node") from None
        user = env.get("SLURM_JOB_USER", pw.pw_name)
        if user != pw.pw_name:
            raise InvalidJob(f"SLURM_JOB_USER={user!r} does not match uid {uid} ({pw.pw_name})")
        gid_s = env.get("SLURM_JOB_GID", "")
        gid = int(gid_s) if _DIGITS.match(gid_s) else pw.pw_gid
        restarts = env.get("SLURM_JOB_RESTART_COUNT", "0")
        return cls(
            job_id=job_id, uid=uid, gid=gid, user=pw.pw_name, home=pw.pw_dir,
            partition=env.get("SLURM_JOB_PARTITION", "")[:256],
            comment=env.get("SLURM_JOB_COMMENT", "")[:_MAX_COMMENT],
            restart_count=int(restarts) if _DIGITS.match(restarts) else 0,
        )  # fmt: skip


def comment_size(job: Job, key: str, warnings: list[str]) -> int | None:
    """The size in a ``<key>=40G`` token of the job's ``--comment``, or None.

    A malformed, negative or absurd value adds a warning for the job and counts
    as absent, so a typo never fails the job or the node.
    """
    found = [m.group("value") for m in _TOKEN.finditer(job.comment) if m.group("key") == key]
    if not found:
        return None
    raw = found[-1]
    try:
        size = parse_size(raw)
    except (ConfigError, OverflowError, ValueError):
        warnings.append(f"--comment {key}={raw!r} is not a size like 40G; ignored")
        return None
    if size <= 0:
        warnings.append(f"--comment {key}={raw!r} is not a positive size; ignored")
        return None
    if size > 2**62:
        warnings.append(f"--comment {key}={raw!r} is beyond any disk ({format_size(size)}); ignored")
        return None
    return size


_MAX_REPLICAS = 64


def comment_replicas(job: Job, default: int, warnings: list[str]) -> int:
    """Peer replicas the job asks for with ``--comment ckpt_replicas=N``, else ``default``
    (``scratch.replicas``). A malformed value adds a warning and counts as absent."""
    found = [m.group("value") for m in _TOKEN.finditer(job.comment) if m.group("key") == "ckpt_replicas"]
    if not found:
        return default
    raw = found[-1]
    if not raw.isdigit() or int(raw) > _MAX_REPLICAS:
        warnings.append(f"--comment ckpt_replicas={raw!r} is not a count from 0 to {_MAX_REPLICAS}; "
                        f"{default} used")  # fmt: skip
        return default
    return int(raw)

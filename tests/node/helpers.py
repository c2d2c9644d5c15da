"""Helpers for the node hook tests: run as a real user, build a config."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from slurm_ckpt.config import Config, ScratchConfig, StorageConfig

PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def sh(*argv: str, check: bool = True, **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, check=check, timeout=60,
                          env={"PATH": PATH, "LC_ALL": "C"}, **kw)  # fmt: skip


def need_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root (mounts, users, chown)")


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int

    def run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` as this user (real and effective ids, no supplementary groups)."""
        return subprocess.run(argv, capture_output=True, text=True, check=check, timeout=60,
                              user=self.uid, group=self.gid, extra_groups=[], cwd="/",
                              env={"PATH": PATH, "LC_ALL": "C"})  # fmt: skip

    def env(self, job_id: str, **extra: str) -> dict[str, str]:
        """The environment slurmd gives a prolog for a job of this user."""
        return {"SLURM_JOB_ID": job_id, "SLURM_JOB_UID": str(self.uid), "SLURM_JOB_GID": str(self.gid),
                "SLURM_JOB_USER": self.name, "SLURM_JOB_PARTITION": "gpu", **extra}  # fmt: skip


def make_cfg(base: Path, root: Path | None = None, **scratch: Any) -> Config:
    """A config with scratch at ``base`` and durable run dirs under ``root``."""
    sc = dataclasses.replace(ScratchConfig(base=str(base), default_size=64 * 2**20,  # type: ignore[arg-type]
                                           min_size=2**20), **scratch)  # type: ignore[arg-type]
    st = StorageConfig(root=str(root) if root else "")
    return dataclasses.replace(Config(), scratch=sc, storage=st).validate()


def write_ckpt(run_dir: Path, step: int, nbytes: int = 4096, owner: User | None = None) -> Path:
    """Commit a real checkpoint with the store (no torch needed), owned by ``owner``.

    The test user cannot run this interpreter (it lives under root's home), so
    root writes it and hands it over, as if the job had written it.
    """
    from slurm_ckpt.store import RunDir
    from slurm_ckpt.store.codec import encode_state
    from slurm_ckpt.store.writer import write_state

    enc = encode_state({"blob": os.urandom(nbytes), "step": step})
    rd = RunDir(run_dir)
    try:
        path = rd.commit(step, lambda tmp: write_state(tmp, enc), nbytes=enc.nbytes)
    finally:
        rd.unlock()
    if owner is not None:
        sh("chown", "-R", f"{owner.uid}:{owner.gid}", str(run_dir))
    return path


def owned_tree(path: Path, user: User) -> None:
    """Make ``path`` (and parents up to an existing one) a dir owned by ``user``."""
    path.mkdir(parents=True, exist_ok=True)
    os.chown(path, user.uid, user.gid)


@contextlib.contextmanager
def fuse_of(user: User, path: Path, *, hung: bool) -> Iterator[None]:
    """A FUSE mount on ``path`` that ``user`` owns, with no daemon behind it.

    Root's stat of it fails with EACCES either way: it is not mounted
    allow_other. ``hung=True``: the device stays open and nothing ever
    answers, so every call the user makes there waits, as on a hung NFS
    server (a fatal signal still ends it). ``hung=False``: the device is
    closed at once, as when the job's FUSE daemon died with the job; the
    mount stays. Unmounted lazily afterwards.
    """
    fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
    try:
        sh("mount", "-i", "-t", "fuse", "-o", f"fd={fd},rootmode=40000,user_id={user.uid},group_id={user.gid}",
           f"fuse-of-{user.name}", str(path), pass_fds=(fd,))  # fmt: skip
        if not hung:
            os.close(fd)
            fd = -1
        yield
    finally:
        if fd >= 0:
            os.close(fd)
        sh("umount", "-l", str(path), check=False)

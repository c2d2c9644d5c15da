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
from tests import machine

PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def sh(*argv: str, check: bool = True, **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, check=check, timeout=60,
                          env={"PATH": PATH, "LC_ALL": "C"}, **kw)  # fmt: skip


def need_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root (mounts, users, chown)")


def use_bfq(device: tuple[int, int]) -> bool:
    """Put ``device`` (a test's own loop device) under BFQ where the kernel offers it.

    Writing the name loads the bfq module if there is one; a kernel without BFQ
    answers EINVAL, and the device keeps its scheduler. Returns whether BFQ is on.
    """
    sched = Path(f"/sys/dev/block/{device[0]}:{device[1]}/queue/scheduler")
    with contextlib.suppress(OSError):
        sched.write_text("bfq")
    return "[bfq]" in sched.read_text()


def bfq_group_weights(blkio: Path) -> bool:
    """Whether this kernel gives v1 blkio groups a ``blkio.bfq.weight`` (BFQ group scheduling).

    Probed on a scratch group of its own, since the root group never has the file.
    """
    probe = blkio / f"sckt-probe-{os.getpid()}"
    probe.mkdir()
    try:
        return (probe / "blkio.bfq.weight").exists()
    finally:
        probe.rmdir()


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int

    def run(
        self, *argv: str, check: bool = True, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` as this user (real and effective ids, no supplementary groups)."""
        return subprocess.run(argv, capture_output=True, text=True, check=check, timeout=60,
                              user=self.uid, group=self.gid, extra_groups=[], cwd="/",
                              env={"PATH": PATH, "LC_ALL": "C", **(env or {})})  # fmt: skip

    def task_prolog(self, job_id: str, base: Path) -> list[str]:
        """The lines ``slurm-ckpt node taskprolog`` prints when it runs as this user, as slurmstepd runs it."""
        import sys

        bin_ = str(Path(sys.executable).with_name("slurm-ckpt"))
        env = {"SLURM_JOB_ID": job_id, "SLURM_CKPT_CONFIG": "/dev/null", "SLURM_CKPT_SCRATCH_BASE": str(base)}
        return self.run(bin_, "node", "taskprolog", env=env).stdout.splitlines()

    def env(self, job_id: str, **extra: str) -> dict[str, str]:
        """The environment slurmd gives a prolog for a job of this user."""
        return {"SLURM_JOB_ID": job_id, "SLURM_JOB_UID": str(self.uid), "SLURM_JOB_GID": str(self.gid),
                "SLURM_JOB_USER": self.name, "SLURM_JOB_PARTITION": "gpu", **extra}  # fmt: skip


def make_cfg(base: Path, root: Path | None = None, stage_out_roots: tuple[Path, ...] = (), **scratch: Any) -> Config:
    """A config with scratch at ``base`` and durable run dirs under ``root`` (and ``stage_out_roots``)."""
    sc = dataclasses.replace(ScratchConfig(base=str(base), default_size=64 * 2**20,  # type: ignore[arg-type]
                                           min_size=2**20), **scratch)  # type: ignore[arg-type]
    st = StorageConfig(root=str(root) if root else "", stage_out_roots=tuple(map(str, stage_out_roots)))
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
    machine.need(machine.fuse())
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


def craft_ckpt(run_dir: Path, step: int, files: dict[str, bytes | int], owner: User | None = None,
               **meta: Any) -> Path:  # fmt: skip
    """Commit checkpoint ``step`` of hand-made files: bytes, or an int for a sparse file of
    that many zero bytes (a hole, no blocks). Names may hold anything a user's could."""
    import zlib

    from slurm_ckpt.store.commit import commit
    from slurm_ckpt.store.tensorfile import FileRecord

    def write(tmp: Path) -> tuple[dict[str, FileRecord], dict[str, Any]]:
        recs = {}
        for name, data in files.items():
            with open(tmp / name, "wb") as f:
                if isinstance(data, int):
                    f.truncate(data)
                    crc, left, zeros = 0, data, bytes(2**20)
                    while left:
                        crc = zlib.crc32(zeros[: min(left, len(zeros))], crc)
                        left -= min(left, len(zeros))
                    recs[name] = FileRecord(data, f"{crc:08x}")
                else:
                    f.write(data)
                    recs[name] = FileRecord(len(data), f"{zlib.crc32(data):08x}")
        return recs, {}

    run_dir.mkdir(parents=True, exist_ok=True)
    path = commit(run_dir, step, write, **meta)
    if owner is not None:
        sh("chown", "-R", f"{owner.uid}:{owner.gid}", str(run_dir))
    return path


def raw_manifest(doc: dict[str, Any]) -> bytes:
    """A manifest document with a valid self-checksum, whatever its fields say."""
    import json
    import zlib

    body = json.dumps(doc, indent=1).encode()[:-2]  # without the closing "\n}"
    return body + b',\n "manifest_crc32": "%08x"\n}\n' % zlib.crc32(body + b"\n}")


def write_config(path: Path, base: Path, root: Path, **sections: dict[str, Any]) -> Path:
    """A site config file for the CLI hooks: scratch at ``base``, storage under ``root``."""
    import yaml

    doc: dict[str, dict[str, Any]] = {
        "scratch": {"base": str(base), "default_size": "64M", "min_size": "1M"},
        "storage": {"root": str(root)},
    }
    for name, keys in sections.items():
        doc.setdefault(name, {}).update(keys)
    path.write_text(yaml.safe_dump(doc))
    return path


def run_hook(hook: str, env: dict[str, str], config: Path, log: Path) -> int:
    """``slurm-ckpt node <hook>`` as the shims run it: root, from /, stdout and stderr appended to ``log``."""
    import sys

    with open(log, "ab") as f:
        return subprocess.run([str(Path(sys.executable).with_name("slurm-ckpt")), "node", hook], cwd="/",
                              env={**env, "SLURM_CKPT_CONFIG": str(config)}, stdout=f, stderr=f,
                              timeout=120).returncode  # fmt: skip


_FUSERMOUNT = r"""
import array, os, socket, subprocess, sys
parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
env = {"PATH": "/usr/bin:/bin", "_FUSE_COMMFD": str(child.fileno())}
p = subprocess.run(["fusermount3", "-o", "nonempty,fsname=" + sys.argv[2], "--", sys.argv[1]], env=env,
                   pass_fds=(child.fileno(),), capture_output=True, text=True)
if p.returncode:
    sys.exit("fusermount3: " + p.stderr)
fds = array.array("i")
_, anc, _, _ = parent.recvmsg(1, socket.CMSG_LEN(fds.itemsize))
print("mounted")
"""


@contextlib.contextmanager
def dead_fuse_of(user: User, path: Path) -> Iterator[str]:
    """A FUSE mount of ``user`` on ``path`` whose daemon is gone, as a job's FUSE daemon is once
    the job ended; the mount stays. Yields how it was made.

    Made by the user themselves through the setuid fusermount3 where ordinary users may open
    /dev/fuse (the usual mode 0666); where the node keeps /dev/fuse root's alone, no user
    can mount FUSE, and root makes the same mount fusermount3 would (``user_id`` the user's).
    """
    if os.stat("/dev/fuse").st_mode & 0o006 == 0o006:
        p = user.run("/usr/bin/python3", "-c", _FUSERMOUNT, str(path), f"fuse-of-{user.name}", check=False)
        assert p.returncode == 0 and p.stdout.strip() == "mounted", p.stderr
        try:
            yield "fusermount3 as the user"
        finally:
            sh("umount", "-l", str(path), check=False)
    else:
        with fuse_of(user, path, hung=False):
            yield "root, for the user (/dev/fuse is root's alone here)"


def remove_tree(path: Path) -> None:
    """Unmount everything below ``path`` (innermost first; lazily if busy), then remove it.

    Never walks a tree through a mount: a kept loop image or a user's FUSE
    mount left below would have its files deleted. Mount points come from
    mountinfo, unescaped (a name with a space is written there as ``\\040``);
    if any is still mounted after that, the tree is left and this raises.
    """
    import shutil

    from slurm_ckpt.node.mounts import table

    def below() -> list[str]:
        return [m.point for m in table() if m.point.startswith(str(path) + "/")]

    for point in reversed(below()):
        if sh("umount", "--no-canonicalize", point, check=False).returncode:
            sh("umount", "--no-canonicalize", "-l", point, check=False)
    left = below()
    if left:
        raise RuntimeError(f"not removing {path}: still mounted below it: {left}")
    shutil.rmtree(path, ignore_errors=True)


def install_hooks(dest: Path, config: Path, bin_: Path) -> Path:
    """The shims installed into ``dest`` with scripts/install-hooks.sh, as the README says; the log in ``dest``."""
    repo = Path(__file__).resolve().parents[2]
    sh("bash", str(repo / "scripts" / "install-hooks.sh"), "--dest", str(dest), "--bin", str(bin_),
       "--config", str(config), "--log", str(dest / "hooks.log"))  # fmt: skip
    return dest


def run_shim(shim: Path, env: dict[str, str]) -> int:
    """A shim as slurmd runs it: root, ``env -i`` but for the job's variables, no PATH."""
    return subprocess.run([str(shim)], env=env, capture_output=True, timeout=120, cwd="/").returncode

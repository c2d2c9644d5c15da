"""The storage lab from tests: real GlusterFS and CephFS servers, each mounted twice.

``scripts/storage-lab.sh`` starts and stops them; this wraps it for the
session fixture and gives tests the ways to make a server sick: stop and
continue, kill and restart, a queueing discipline (netem, tbf) on the link.

A process blocked on a hung FUSE mount cannot be killed until its call
returns. A test that stops servers therefore hands their continuation to a
watchdog process first (:meth:`Lab.hung`): if the test itself then blocks, or
kills a stuck child and waits for it, the watchdog still brings the servers
back and the test ends.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = ["LAB_DIR", "SCRIPT", "Lab", "lab_missing"]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "storage-lab.sh"
LAB_DIR = Path(os.environ.get("STORAGE_LAB_DIR", "/tmp/slurm-ckpt-storage-lab"))
NETNS = Path("/run/netns/sclab-srv")
_NEEDS = ("glusterd", "gluster", "glusterfs", "ceph-mon", "ceph-mgr", "ceph-osd", "ceph-mds",
          "ceph", "ceph-fuse", "monmaptool", "nsenter", "tc")  # fmt: skip


def lab_missing() -> str | None:
    """Why the lab cannot run here, or None."""
    if sys.platform != "linux" or os.geteuid() != 0:
        return "the storage lab needs root on Linux (FUSE mounts, a network namespace)"
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse: the lab's clients are FUSE clients"
    missing = [c for c in _NEEDS if shutil.which(c) is None]
    if missing:
        return f"missing {', '.join(missing)}: run scripts/install-system-deps.sh"
    if NETNS.exists():
        return f"{NETNS} exists: another storage lab is up (scripts/storage-lab.sh down ends it)"
    return None


def _run(*args: str, timeout: float = 120) -> str:
    res = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                         timeout=timeout, env={**os.environ, "STORAGE_LAB_DIR": str(LAB_DIR)})  # fmt: skip
    if res.returncode != 0:
        raise RuntimeError(f"storage-lab.sh {' '.join(args)} failed ({res.returncode}): {res.stderr}")
    return res.stdout


@dataclass(frozen=True)
class Lab:
    """The running lab: two mounts of each filesystem."""

    root: Path

    def mount(self, fs: str, node: str = "a") -> Path:
        """``fs`` is ``gluster`` or ``ceph``, ``node`` ``a`` or ``b``."""
        return self.root / "mnt" / f"{fs}-{node}"

    def stop(self, server: str) -> None:
        _run("stop", server)

    def cont(self, server: str) -> None:
        _run("cont", server)

    def kill(self, server: str) -> None:
        _run("kill", server)

    def restart(self, server: str) -> None:
        _run("restart", server)

    def pids(self, program: str) -> set[int]:
        """The lab's running processes of ``program`` (``ceph-mds``, ``glusterfsd``)."""
        lines = _run("status").splitlines()
        return {int(w[1]) for w in (ln.split() for ln in lines) if w[0] == "process:" and w[2:] == [program]}

    def gluster(self, *args: str) -> str:
        """Run the gluster CLI against the lab's glusterd (``volume quota ...``)."""
        return subprocess.run(["gluster", "--mode=script", f"--glusterd-sock={self.root}/gluster/glusterd.socket",
                               *args], capture_output=True, text=True, check=True, timeout=60).stdout  # fmt: skip

    volume = "sclab"

    def shape(self, qdisc: str) -> None:
        """``qdisc`` (``netem delay 20ms``, ``tbf rate ...``) on the link both ways; ``off`` clears it."""
        _run("shape", qdisc)

    @staticmethod
    def has_qdisc(kind: str) -> bool:
        """Whether this kernel has the ``kind`` queueing discipline (netem is often left out)."""
        res = subprocess.run(["tc", "qdisc", "add", "dev", "lo", "root", kind], capture_output=True)
        if res.returncode == 0:
            subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], capture_output=True)
        return b"unknown" not in res.stderr

    @contextlib.contextmanager
    def hung(self, server: str, bound: float) -> Iterator[None]:
        """``server`` stopped inside the block; continued at its end, and by a
        watchdog process after ``bound`` seconds whatever the test is doing."""
        watchdog = subprocess.Popen(
            ["bash", "-c", 'sleep "$1"; exec bash "$2" cont "$3"', "watchdog", str(bound), str(SCRIPT), server],
            env={**os.environ, "STORAGE_LAB_DIR": str(self.root)},
            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            self.stop(server)
            yield
        finally:
            self.cont(server)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(watchdog.pid, signal.SIGKILL)
            watchdog.wait()


    @contextlib.contextmanager
    def killed(self, server: str, bound: float) -> Iterator[None]:
        """A watchdog that restarts ``server`` (``ceph-osd.1``, ``gluster-b2``,
        ``ceph-mds``) ``bound`` seconds from now, whatever the test is doing; the
        block may kill it (:meth:`kill`) at any moment. Restarted at the end."""
        watchdog = subprocess.Popen(
            ["bash", "-c", 'sleep "$1"; exec bash "$2" restart "$3"', "watchdog", str(bound), str(SCRIPT), server],
            env={**os.environ, "STORAGE_LAB_DIR": str(self.root)},
            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            yield
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(watchdog.pid, signal.SIGKILL)
            watchdog.wait()
            self.restart(server)


def up() -> Lab:
    _run("up", "all", timeout=300)
    return Lab(LAB_DIR)


def down() -> None:
    _run("down", timeout=120)

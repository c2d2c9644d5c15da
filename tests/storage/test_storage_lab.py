"""The lab itself: two mounts that see each other's writes, servers that can hang, a link that can slow."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.storage.lab import Lab

pytestmark = pytest.mark.root

_WRITE = "import os,sys; fd=os.open(sys.argv[1], os.O_WRONLY|os.O_CREAT, 0o644); os.write(fd, b'x' * 65536); os.fsync(fd)"


def test_second_mount_sees_first(netfs: tuple[Path, Path]) -> None:
    a, b = netfs
    (a / "f").write_bytes(b"through a")
    assert (b / "f").read_bytes() == b"through a"


@pytest.mark.parametrize(("fs", "server"), [("gluster", "gluster"), ("ceph", "ceph-osd")])
def test_stopped_servers_block_a_write_until_continued(lab: Lab, fs: str, server: str) -> None:
    path = lab.mount(fs, "a") / f"hung-{os.getpid()}"
    with lab.hung(server, bound=60):
        child = subprocess.Popen([sys.executable, "-c", _WRITE, str(path)])
        with pytest.raises(subprocess.TimeoutExpired):
            child.wait(timeout=2)
    assert child.wait(timeout=60) == 0
    assert path.stat().st_size == 65536
    path.unlink()


def _creates(d: Path, n: int = 5) -> float:
    t0 = time.monotonic()
    for i in range(n):
        # A new name each time: a cached answer would not cross the link.
        (d / f"shape-{os.getpid()}-{time.monotonic_ns()}-{i}").touch()
    return time.monotonic() - t0


def test_netem_delays_the_link(lab: Lab) -> None:
    if not lab.has_qdisc("netem"):
        pytest.skip("this kernel has no sch_netem (CONFIG_NET_SCH_NETEM): no added latency")
    d = lab.mount("ceph", "b")
    base = _creates(d)
    lab.shape("netem delay 50ms")
    try:
        slow = _creates(d)
    finally:
        lab.shape("off")
    assert slow >= 0.5 > base  # five creates, each at least one 100 ms round trip


def test_tbf_limits_the_rate(lab: Lab) -> None:
    path = lab.mount("gluster", "a") / f"rate-{os.getpid()}"
    lab.shape("tbf rate 8mbit burst 32kb latency 2s")
    try:
        t0 = time.monotonic()
        subprocess.run([sys.executable, "-c", _WRITE.replace("65536", "(1 << 20)"), str(path)], check=True, timeout=120)
        slow = time.monotonic() - t0
    finally:
        lab.shape("off")
        path.unlink(missing_ok=True)
    # 1 MiB to each of two bricks through 8 Mbit/s: at least 2 s.
    assert slow >= 2.0

"""``slurm-ckpt doctor`` against real sick storage: a full tmpfs, a read-only mount,
a device throttled by a real cgroup v1 blkio limit, and a healthy directory."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.faultfs.fixtures import make_loopfs, make_tmpfs  # noqa: F401 - fixtures
from tests.faultfs.mounts import fill_up

pytestmark = pytest.mark.root

GOOD_CONF = """\
ClusterName=test
SlurmctldHost=localhost
JobRequeue=1
Prolog=/usr/lib/slurm-ckpt/prolog
Epilog=/usr/lib/slurm-ckpt/epilog
PrologFlags=Alloc
KillWait=60
UnkillableStepTimeout=300
NodeName=localhost CPUs=2 State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES State=UP
"""


def doctor(path: Path, *args: str, prefix: list[str] | None = None) -> tuple[int, dict[str, Any]]:
    cmd = [*(prefix or []), sys.executable, "-c", "from slurm_ckpt.cli import main; main()", "doctor", str(path), "--json",
           "--probe-size", "8M", "--probe-seconds", "3", *args]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "SLURM_CONF": "/nonexistent"})  # fmt: skip
    try:
        return r.returncode, json.loads(r.stdout)
    except ValueError:
        raise AssertionError(f"doctor printed no JSON (rc {r.returncode}): {r.stdout}{r.stderr}") from None


def finding(doc: dict[str, Any], check: str) -> dict[str, Any]:
    hits = [f for f in doc["findings"] if f["check"] == check]
    assert hits, f"no {check} finding in {doc}"
    return hits[0]


def test_healthy_dir_exits_0(tmp_path: Path) -> None:
    conf = tmp_path / "slurm.conf"
    conf.write_text(GOOD_CONF)
    run = tmp_path / "run"
    run.mkdir()
    rc, doc = doctor(run, "--slurm-conf", str(conf), "--ckpt-size", "10M", "--lead-time", "120")
    assert rc == 0 and doc["worst"] in ("ok", "info"), json.dumps(doc, indent=1)
    probe = finding(doc, "probe")
    assert probe["severity"] == "ok" and probe["data"]["bandwidth_bytes_per_s"] > 1e6
    assert finding(doc, "timing")["severity"] == "ok"
    assert not (run / ".slurm-ckpt-doctor").exists() and os.listdir(run) == []  # probe cleaned up


def test_full_tmpfs_is_an_error(make_tmpfs: Callable[..., Path]) -> None:  # noqa: F811
    d = make_tmpfs("4M")
    fill_up(d)
    rc, doc = doctor(d)
    assert rc == 7 and doc["worst"] == "error"
    space = finding(doc, "space")
    assert space["severity"] == "error" and space["data"]["free_bytes"] == 0
    probe = finding(doc, "probe")
    assert probe["severity"] == "error" and probe["data"]["errno"] == "ENOSPC"
    assert "free space" in probe["recommendation"]
    assert [n for n in os.listdir(d) if n.startswith(".slurm-ckpt-doctor")] == []


def test_read_only_mount_is_an_error(make_tmpfs: Callable[..., Path]) -> None:  # noqa: F811
    d = make_tmpfs("16M", options="ro")
    rc, doc = doctor(d)
    assert rc == 7
    mount = finding(doc, "mount")
    assert mount["severity"] == "error" and "read-only" in mount["message"]
    probe = finding(doc, "probe")
    assert probe["data"]["errno"] == "EROFS" and "read-only" in probe["recommendation"]


@contextlib.contextmanager
def blkio_cgroup(name: str, dev: str, write_bps: int) -> Iterator[Path]:
    base = Path("/sys/fs/cgroup/blkio")
    if not (base / "blkio.throttle.write_bps_device").exists():
        pytest.skip("no cgroup v1 blkio throttle here")
    cg = base / name
    cg.mkdir()
    try:
        (cg / "blkio.throttle.write_bps_device").write_text(f"{dev} {write_bps}\n")
        yield cg
    finally:
        # Only this test's processes were in it, and they have exited.
        for pid in (cg / "cgroup.procs").read_text().split():
            (base / "cgroup.procs").write_text(pid)
        cg.rmdir()


def test_throttled_cgroup_is_found_and_measured(make_loopfs: Callable[..., Path]) -> None:  # noqa: F811
    d = make_loopfs(64)
    dev = f"{os.major(os.stat(d).st_dev)}:{os.minor(os.stat(d).st_dev)}"
    with blkio_cgroup(f"slurm-ckpt-doctor-{os.getpid()}", dev, 4_000_000) as cg:
        # The doctor joins the cgroup before it starts: exactly how a throttled job runs.
        join = ["sh", "-c", f'echo $$ > {cg}/cgroup.procs && exec "$@"', "sh"]
        rc, doc = doctor(d, "--ckpt-size", "1G", "--lead-time", "120", prefix=join)
    assert rc == 7
    cgf = finding(doc, "cgroup")
    assert cgf["severity"] == "error" and cgf["data"]["limits"] == {"wbps": 4_000_000}
    assert cgf["data"]["device"] == dev and "throttled to 4 MB/s" in cgf["message"]
    # The probe really ran under the limit: its bandwidth is the throttle's, not the disk's.
    bw = finding(doc, "probe")["data"]["bandwidth_bytes_per_s"]
    assert 1e6 < bw < 6e6, bw
    timing = finding(doc, "timing")
    assert timing["severity"] == "error" and "your 1.1 GB checkpoint needs" in timing["message"]


def test_doctor_says_which_io_controls_this_kernel_has(make_loopfs: Callable[..., Path]) -> None:  # noqa: F811
    """On a kernel without BFQ the doctor says there are no per-job weights and what the prolog
    does instead; with BFQ on the device it names the weight file. Either way, throttles."""
    d = make_loopfs(64)
    dev = f"{os.major(os.stat(d).st_dev)}:{os.minor(os.stat(d).st_dev)}"
    if not Path("/sys/fs/cgroup/blkio/blkio.throttle.write_bps_device").exists():
        pytest.skip("no cgroup v1 blkio throttle here")
    bfq_on = "[bfq]" in Path(f"/sys/dev/block/{dev}/queue/scheduler").read_text()
    _, doc = doctor(d)
    ctl = finding(doc, "io-controls")
    assert ctl["data"] == {"device": dev, "throttles": "blkio.throttle.*",
                           "weights": "blkio.bfq.weight" if bfq_on else ""}  # fmt: skip
    if not bfq_on:
        assert ctl["severity"] == "info" and "jobs run unweighted" in ctl["message"]

"""I/O control: the v1 blkio cgroup is real here; v2 runs on a fixture tree (this kernel's
v2 mount has no io controller, so its io files cannot exist here)."""

from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from slurm_ckpt.config import IOConfig, IOLimits
from slurm_ckpt.fsinfo import block_device, cgroup_mount, mount_of
from slurm_ckpt.node import run_epilog, run_prolog, task_prolog
from slurm_ckpt.node.cgroup import V1_PARENT, apply_v2, remove_v1, setup_v1
from tests.node.helpers import User, bfq_group_weights, make_cfg, owned_tree, use_bfq

MiB = 2**20


@pytest.fixture
def blkio() -> Path:
    m = cgroup_mount("blkio")
    if m is None or os.geteuid() != 0:
        pytest.skip("needs root and a cgroup v1 blkio hierarchy")
    return Path(m.mount_point)


@pytest.fixture
def job_dir(blkio: Path) -> Iterator[str]:
    name = f"job_t{secrets.token_hex(3)}"
    yield name
    cg = blkio / V1_PARENT / name
    if cg.exists():
        for pid in (cg / "cgroup.procs").read_text().split():
            (blkio / "cgroup.procs").write_text(pid)
        cg.rmdir()
    with contextlib.suppress(OSError):  # the shared parent, unless a real job uses it
        (blkio / V1_PARENT).rmdir()


def timed_dd(user: User, target: Path, count: int, cgroup: Path | None) -> float:
    """Seconds an O_DIRECT dd of ``count`` MiB takes as ``user``, inside ``cgroup`` if given."""
    join = f'echo $$ > "{cgroup}/cgroup.procs" && ' if cgroup else ""
    t0 = time.monotonic()
    user.run("sh", "-c", f'{join}exec dd if=/dev/zero of="{target}" bs=1M count={count} oflag=direct')
    return time.monotonic() - t0


def test_v1_write_throttle_holds_an_o_direct_writer_to_the_limit(
    loop_fs: Callable[..., Path], user: User, blkio: Path, job_dir: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Throttles live in the block layer's cgroup code and act under any scheduler; the
    weight is set where the kernel has BFQ group scheduling, and logged as unset elsewhere."""
    base = loop_fs("ext4", "256M")
    mount = mount_of(base)
    assert mount is not None
    dev = block_device(mount)
    assert dev is not None and dev[0] == 7  # the loop device itself, which throttles (checked)
    bfq = use_bfq(dev)  # our own loop device; the system disk's scheduler is left alone
    weights = bfq_group_weights(blkio)
    limit = 4 * MiB
    with caplog.at_level("INFO", logger="slurm_ckpt.node"):
        cg = setup_v1(blkio, job_dir, user.uid, user.gid, IOLimits(weight=300, write_bps=limit), dev)
    assert (cg / "blkio.throttle.write_bps_device").read_text().split() == [f"{dev[0]}:{dev[1]}", str(limit)]
    if weights:
        assert (cg / "blkio.bfq.weight").read_text().split()[-1] == "300"
    else:
        assert not (cg / "blkio.bfq.weight").exists()
        assert "weight not set" in caplog.text
    print(f"\nscheduler: {'bfq' if bfq else 'not bfq (this kernel has none)'}; "
          f"BFQ group weights: {'yes' if weights else 'no'}")  # fmt: skip
    owned_tree(base / "w", user)
    free = timed_dd(user, base / "w" / "free", 12, None)
    throttled = timed_dd(user, base / "w" / "limited", 12, cg)
    rate = 12 * MiB / throttled
    print(f"\nO_DIRECT write: {rate / MiB:.2f} MiB/s in the cgroup (limit 4 MiB/s); "
          f"unthrottled/throttled time ratio {free / throttled:.3f}")  # fmt: skip
    assert 0.8 * limit <= rate <= 1.2 * limit
    # Delegated for joining only: the user cannot raise its own limit.
    p = user.run("sh", "-c", f'echo "{dev[0]}:{dev[1]} 0" > "{cg}/blkio.throttle.write_bps_device"', check=False)
    assert p.returncode != 0 and "Permission denied" in p.stderr
    p = user.run("mkdir", str(cg / "escape"), check=False)
    assert p.returncode != 0


def test_join_io_cgroup_and_removal_with_a_straggler(blkio: Path, user: User, job_dir: str) -> None:
    cg = setup_v1(blkio, job_dir, user.uid, user.gid, IOLimits(weight=200), None)
    code = ("from slurm_ckpt.node import join_io_cgroup; assert join_io_cgroup(); "
            "print(open('/proc/self/cgroup').read())")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], env={"SLURM_CKPT_IO_CGROUP": str(cg)},
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert f"blkio:/{V1_PARENT}/{job_dir}" in out
    assert not subprocess.run([sys.executable, "-c", "from slurm_ckpt.node import join_io_cgroup; "
                               "raise SystemExit(join_io_cgroup())"], env={}).returncode  # fmt: skip
    straggler = subprocess.Popen(["sleep", "60"])
    try:
        (cg / "cgroup.procs").write_text(str(straggler.pid))
        remove_v1(blkio, job_dir)
        assert not cg.exists()
        assert f"{straggler.pid}" in (blkio / "cgroup.procs").read_text().split()
    finally:
        straggler.kill()
        straggler.wait()
    remove_v1(blkio, job_dir)  # twice is harmless


def test_prolog_sets_up_epilog_removes_the_v1_cgroup(pub_tmp: Path, user: User, blkio: Path,
                                                     capfd: pytest.CaptureFixture[str]) -> None:
    import dataclasses

    io = IOConfig(default=IOLimits(write_bps=100 * MiB),
                  partitions={"gpu": IOLimits(weight=500, read_iops=1000)})  # fmt: skip
    cfg = dataclasses.replace(make_cfg(pub_tmp / "scratch"), io=io)
    job = f"9{secrets.randbelow(10**6)}"
    report = run_prolog(user.env(job), cfg)  # partition "gpu"
    log = capfd.readouterr().err  # the hook log
    try:
        assert report is not None and report.io_cgroup == str(blkio / V1_PARENT / f"job_{job}")
        cg = Path(report.io_cgroup)
        if bfq_group_weights(blkio):
            assert (cg / "blkio.bfq.weight").read_text().split()[-1] == "500"
            assert os.stat(cg / "blkio.bfq.weight").st_uid == 0
        else:  # the job runs unweighted, and the log says why
            assert not (cg / "blkio.bfq.weight").exists()
            assert "blkio.bfq.weight absent" in log
        assert os.stat(cg / "cgroup.procs").st_uid == user.uid and os.stat(cg / "tasks").st_uid == user.uid
        assert os.stat(cg / "blkio.throttle.read_iops_device").st_uid == 0
        lines = task_prolog({"SLURM_JOB_ID": job, "SLURM_CKPT_SCRATCH_BASE": str(pub_tmp / "scratch"),
                             "SLURM_CKPT_CONFIG": "/dev/null"})  # fmt: skip
        assert f"export SLURM_CKPT_IO_CGROUP={cg}" in lines
    finally:
        run_epilog(user.env(job), cfg)
        with contextlib.suppress(OSError):
            (blkio / V1_PARENT).rmdir()
    assert not (blkio / V1_PARENT / f"job_{job}").exists()


def v2_tree(root: Path) -> None:
    """What a v2 hierarchy under Slurm 22.05 looks like before the job cgroup exists."""
    scope = root / "system.slice" / "slurmstepd.scope"
    scope.mkdir(parents=True)
    (root / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    for d in (root, root / "system.slice", scope):
        (d / "cgroup.subtree_control").write_text("cpu memory\n")


def appear(job: Path) -> None:
    """Make the job cgroup appear at once with its io files, as the kernel would."""
    tmp = job.with_name(".new")
    tmp.mkdir()
    for name in ("io.bfq.weight", "io.weight", "io.max"):
        (tmp / name).write_text("")
    tmp.rename(job)


def test_v2_waits_for_the_job_cgroup_then_writes_io_files(tmp_path: Path) -> None:
    v2_tree(tmp_path)
    rel = "system.slice/slurmstepd.scope/job_42"
    limits = IOLimits(weight=300, write_bps=4 * MiB, read_iops=500)
    result: list[bool] = []
    t = threading.Thread(target=lambda: result.append(apply_v2(tmp_path, rel, limits, (259, 0), 30)))
    t.start()
    appear(tmp_path / rel)  # Slurm creates it after the prolog has returned
    t.join(30)
    assert result == [True]
    job = tmp_path / rel
    assert (job / "io.bfq.weight").read_text() == "default 300"
    assert (job / "io.weight").read_text() == ""  # BFQ's file wins when both exist
    assert (job / "io.max").read_text() == "259:0 rbps=max wbps=4194304 riops=500 wiops=max"
    for d in ("", "system.slice", "system.slice/slurmstepd.scope"):
        assert (tmp_path / d / "cgroup.subtree_control").read_text().startswith("+io")
    assert apply_v2(tmp_path, "system.slice/slurmstepd.scope/job_43", limits, None, 0.2) is False


def test_prolog_starts_the_detached_v2_helper(pub_tmp: Path, user: User, tmp_path: Path) -> None:
    import dataclasses

    v2_tree(tmp_path)
    io = IOConfig(default=IOLimits(weight=700), cgroup_root=str(tmp_path), v2_wait=30)
    cfg = dataclasses.replace(make_cfg(pub_tmp / "scratch"), io=io)
    report = run_prolog(user.env("77"), cfg)
    assert report is not None and report.io_cgroup is None  # nothing to join on v2
    appear(tmp_path / "system.slice/slurmstepd.scope/job_77")
    weight = tmp_path / "system.slice/slurmstepd.scope/job_77/io.bfq.weight"
    deadline = time.monotonic() + 30
    while weight.read_text() != "default 700":
        assert time.monotonic() < deadline, "the v2 helper never wrote the weight"
        time.sleep(0.05)
    run_epilog(user.env("77"), cfg)


@pytest.fixture
def memory_v1() -> Path:
    """The real cgroup v1 hierarchy holding the memory controller."""
    m = cgroup_mount("memory")
    if m is None or m.fstype != "cgroup" or os.geteuid() != 0:
        pytest.skip("needs root and a cgroup v1 memory hierarchy")
    return Path(m.mount_point)


def test_no_io_cgroup_in_a_hierarchy_that_holds_memory(pub_tmp: Path, user: User, memory_v1: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    """blkio mounted together with memory (here: the memory hierarchy named as the I/O cgroup
    root): the job's user must get no group there, it would leave Slurm's memory limit."""
    import dataclasses

    io = IOConfig(default=IOLimits(weight=300), cgroup_root=str(memory_v1))
    cfg = dataclasses.replace(make_cfg(pub_tmp / "scratch"), io=io)
    job = f"8{secrets.randbelow(10**6)}"
    made = memory_v1 / V1_PARENT / f"job_{job}"
    try:
        report = run_prolog(user.env(job), cfg)
        assert report is not None and report.io_cgroup is None
        assert not made.exists()
        assert "blkio shares its cgroup hierarchy with memory" in capsys.readouterr().err
    finally:
        run_epilog(user.env(job), cfg)
        for d in (made, made.parent):
            with contextlib.suppress(OSError):
                d.rmdir()


def test_joining_refuses_a_hierarchy_that_holds_memory(memory_v1: Path) -> None:
    cg = memory_v1 / f"sckt-{secrets.token_hex(3)}"
    cg.mkdir()
    try:
        code = ("from slurm_ckpt.node import join_io_cgroup; print(join_io_cgroup()); "
                "print(open('/proc/self/cgroup').read())")  # fmt: skip
        out = subprocess.run([sys.executable, "-c", code], env={"SLURM_CKPT_IO_CGROUP": str(cg)},
                             capture_output=True, text=True, check=True)  # fmt: skip
        assert out.stdout.startswith("False\n") and f"memory:/{cg.name}" not in out.stdout
        assert "its hierarchy also holds memory" in out.stderr
    finally:
        cg.rmdir()


@pytest.mark.parametrize("via", ["cwd", "PYTHONPATH"])
def test_the_v2_helper_never_imports_from_slurmds_cwd(pub_tmp: Path, user: User, tmp_path: Path, via: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """``python -m`` puts the working directory first on sys.path: a ``slurm_ckpt`` planted in
    slurmd's working directory would run as root, instead of the real helper. (PYTHONPATH in
    the hook's environment is the other way in that an isolated interpreter ignores.)"""
    import dataclasses

    planted, pwned = pub_tmp / "slurmd-cwd", pub_tmp / "pwned"
    for mod in ("slurm_ckpt/__init__.py", "slurm_ckpt/node/__init__.py", "slurm_ckpt/node/cgroup.py"):
        (planted / mod).parent.mkdir(parents=True, exist_ok=True)
        (planted / mod).write_text(f"open({str(pwned)!r}, 'w').write('ran as root')\n")
    v2_tree(tmp_path)
    io = IOConfig(default=IOLimits(weight=600), cgroup_root=str(tmp_path), v2_wait=30)
    cfg = dataclasses.replace(make_cfg(pub_tmp / "scratch"), io=io)
    if via == "cwd":
        monkeypatch.chdir(planted)  # the prolog runs in slurmd's working directory
    else:
        monkeypatch.setenv("PYTHONPATH", str(planted))
    run_prolog(user.env("78"), cfg)
    appear(tmp_path / "system.slice/slurmstepd.scope/job_78")
    weight = tmp_path / "system.slice/slurmstepd.scope/job_78/io.bfq.weight"
    deadline = time.monotonic() + 30
    while weight.read_text() != "default 600" and not pwned.exists():
        assert time.monotonic() < deadline, "no v2 helper ran at all"
        time.sleep(0.05)
    assert not pwned.exists() and weight.read_text() == "default 600"
    run_epilog(user.env("78"), cfg)

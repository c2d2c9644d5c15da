"""Per-job I/O control with cgroups.

Slurm 22.05 manages no io/blkio controller and creates the job's cgroup only
after the prolog, so slurm-ckpt brings its own:

* **cgroup v1** (``blkio``): the prolog makes ``<blkio>/slurm-ckpt/job_<id>``,
  writes ``blkio.throttle.*`` and ``blkio.bfq.weight`` there, and hands its
  ``cgroup.procs``/``tasks`` to the job's user. The wrapper joins it with
  :func:`join_io_cgroup` (the TaskProlog exports its path as
  ``SLURM_CKPT_IO_CGROUP``). The user cannot change the limits or make child
  groups: only the two membership files are theirs.
* **cgroup v2**: a helper waits for Slurm's ``job_<id>`` cgroup, enables the
  io controller on its ancestors, and writes ``io.bfq.weight`` (or
  ``io.weight``) and ``io.max``.

Weights act only under the BFQ scheduler (or iocost on v2); throttles and
``io.max`` act under any scheduler.

On v1 a process joins a group in every controller of that hierarchy at once.
Where blkio shares a hierarchy with memory or devices (or another controller
Slurm confines or tracks jobs with), joining the slurm-ckpt group would take
the job out of Slurm's own group there: out of its memory limit, its GPU
device list. Such a hierarchy is refused, by the prolog and by the join.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from ..config import IOLimits
from ..fsinfo import Mount, mount_of

__all__ = [
    "CONFINING",
    "V1_PARENT",
    "apply_v2",
    "join_io_cgroup",
    "remove_v1",
    "setup_v1",
    "shared_controllers",
    "v1_throttle_lines",
    "v2_max_line",
]

log = logging.getLogger("slurm_ckpt.node")

V1_PARENT = "slurm-ckpt"
ENV_VAR = "SLURM_CKPT_IO_CGROUP"
CONFINING = frozenset({"memory", "devices", "cpuset", "freezer", "pids", "cpu", "cpuacct"})
"""v1 controllers Slurm confines or tracks a job with: never in the hierarchy we move processes in."""


def shared_controllers(path: str | os.PathLike[str], mounts: list[Mount] | None = None) -> list[str]:
    """The confining controllers in the v1 hierarchy holding ``path``, sorted ([]: none, or not v1)."""
    m = mount_of(path, mounts)
    if m is None or m.fstype != "cgroup":
        return []
    return sorted(CONFINING & m.options.keys())


def v1_throttle_lines(limits: IOLimits, device: tuple[int, int]) -> dict[str, str]:
    """``blkio.throttle.*`` file -> line for the limits that are set."""
    dev = f"{device[0]}:{device[1]}"
    pairs = {"read_bps_device": limits.read_bps, "write_bps_device": limits.write_bps,
             "read_iops_device": limits.read_iops, "write_iops_device": limits.write_iops}  # fmt: skip
    return {f"blkio.throttle.{k}": f"{dev} {int(v)}" for k, v in pairs.items() if v}


def v2_max_line(limits: IOLimits, device: tuple[int, int]) -> str | None:
    """The ``io.max`` line, or None when no limit is set."""
    vals = {"rbps": limits.read_bps, "wbps": limits.write_bps,
            "riops": limits.read_iops, "wiops": limits.write_iops}  # fmt: skip
    if not any(vals.values()):
        return None
    return f"{device[0]}:{device[1]} " + " ".join(f"{k}={int(v) or 'max'}" for k, v in vals.items())


def _write(path: Path, line: str) -> None:
    # cgroupfs takes one value per write(2); a short write would be a kernel bug.
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def setup_v1(blkio_root: Path, job_dir: str, uid: int, gid: int, limits: IOLimits,
             device: tuple[int, int] | None) -> Path:  # fmt: skip
    """Create the job's blkio cgroup with its limits, delegated to ``uid``; return its path.

    Raises ``PermissionError`` (nothing made) where the hierarchy holds a confining controller.
    """
    if shared := shared_controllers(blkio_root):
        raise PermissionError(errno.EPERM, f"blkio shares its cgroup hierarchy with {', '.join(shared)}: "
                              "a job joining it would leave Slurm's groups there; mount blkio on its own",
                              str(blkio_root))  # fmt: skip
    cg = blkio_root / V1_PARENT / job_dir
    cg.mkdir(parents=True, exist_ok=True)
    if device is not None:
        for name, line in v1_throttle_lines(limits, device).items():
            _write(cg / name, line)
    elif any((limits.read_bps, limits.write_bps, limits.read_iops, limits.write_iops)):
        log.info("no block device for the scratch filesystem: throttles not set")
    if limits.weight:
        if (cg / "blkio.bfq.weight").exists():
            _write(cg / "blkio.bfq.weight", str(limits.weight))
        else:
            log.info("blkio.bfq.weight absent (kernel without BFQ group scheduling): weight not set")
    for name in ("cgroup.procs", "tasks"):
        os.chown(cg / name, uid, gid)
    return cg


def remove_v1(blkio_root: Path, job_dir: str) -> None:
    """Remove the job's blkio cgroup; stragglers are moved to the root group first. Idempotent."""
    cg = blkio_root / V1_PARENT / job_dir
    try:
        cg.rmdir()
        return
    except FileNotFoundError:
        return
    except OSError as e:
        if e.errno != errno.EBUSY:
            raise
    for pid in (cg / "cgroup.procs").read_text().split():
        with contextlib.suppress(OSError):  # it may have exited meanwhile
            _write(blkio_root / "cgroup.procs", pid)
    cg.rmdir()


def apply_v2(root: Path, rel: str, limits: IOLimits, device: tuple[int, int] | None,
             wait: float) -> bool:  # fmt: skip
    """Wait up to ``wait`` s for ``root/rel`` (Slurm's job cgroup) and set its io files.

    Returns False if the cgroup never appeared (the job ended first).
    """
    target = root / rel
    deadline = time.monotonic() + wait
    delay = 0.01
    while not target.is_dir():
        if time.monotonic() >= deadline:
            log.warning("%s did not appear within %.0fs: io limits not set", target, wait)
            return False
        time.sleep(delay)  # polling a kernel-made dir: there is no event to wait on in v2 here
        delay = min(delay * 2, 0.5)
    # The io files of a cgroup exist only if its parent enables the controller,
    # so enable it from the root down to the job's parent.
    parts = Path(rel).parts
    for i in range(len(parts)):
        ctl = root.joinpath(*parts[:i]) / "cgroup.subtree_control"
        if "io" not in ctl.read_text().split():
            _write(ctl, "+io")
    if limits.weight:
        for name in ("io.bfq.weight", "io.weight"):
            if (target / name).exists():
                _write(target / name, f"default {limits.weight}")
                break
    if device is not None and (line := v2_max_line(limits, device)):
        _write(target / "io.max", line)
    return True


def join_io_cgroup(pid: int | None = None, env: Mapping[str, str] | None = None) -> bool:
    """Move ``pid`` (default: this process) into the job's slurm-ckpt I/O cgroup.

    The wrapper calls this before starting the training command, so the
    trainer and its children inherit the limits. Returns False, and logs why,
    when there is no such cgroup (v2, I/O control off, or not under the hooks).
    """
    env = os.environ if env is None else env
    path = env.get(ENV_VAR, "")
    if not path:
        return False
    try:
        if shared := shared_controllers(path):
            log.warning("not joining the I/O cgroup %s: its hierarchy also holds %s, and joining would take "
                        "this job out of Slurm's groups there", path, ", ".join(shared))  # fmt: skip
            return False
        _write(Path(path) / "cgroup.procs", str(pid or os.getpid()))
    except OSError as e:
        log.warning("cannot join the I/O cgroup %s: %s", path, e.strerror)
        return False
    return True


def _main(argv: list[str]) -> int:
    """``python -m slurm_ckpt.node.cgroup ARGS_JSON``: the prolog's detached v2 helper."""
    from .hook import setup_logging

    a = json.loads(argv[0])
    setup_logging("io-v2", Path(a["rel"]).name)
    device = (int(a["device"][0]), int(a["device"][1])) if a["device"] else None
    ok = apply_v2(Path(a["root"]), a["rel"], IOLimits(**a["limits"]), device, float(a["wait"]))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))

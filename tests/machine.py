"""What this machine offers the tests, probed once per session.

Machines of one kind differ in kernel (BFQ or not, loop devices, FUSE, network
namespaces), so a test that needs such a feature asks here and skips with the
reason where it is missing, instead of failing on the machine. Each probe
returns ``None`` where the feature works, else the reason it does not.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess

import pytest

__all__ = ["fuse", "loop_devices", "need", "netns_links", "root"]

_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def need(reason: str | None) -> None:
    """Skip the calling test with ``reason``, unless it is None (the feature works)."""
    if reason is not None:
        pytest.skip(reason)


def _fails(*argv: str) -> str | None:
    """None if ``argv`` exits 0, else its first line of stderr (or its exit status)."""
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=30,
                           env={"PATH": _PATH, "LC_ALL": "C"})  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as e:
        return str(e)
    if p.returncode == 0:
        return None
    return (p.stderr.strip().splitlines() or [f"exit {p.returncode}"])[0]


def root() -> str | None:
    return None if os.geteuid() == 0 else "needs root (mounts, devices, namespaces)"


@functools.cache
def loop_devices() -> str | None:
    """Loop devices can be had: ``/dev/loop-control`` answers with a free one."""
    if (why := root()) is not None:
        return why
    if not os.path.exists("/dev/loop-control"):
        return "no loop devices on this kernel (/dev/loop-control is missing)"
    if (err := _fails("losetup", "--find")) is not None:
        return f"no free loop device: losetup --find: {err}"
    return None


@functools.cache
def fuse() -> str | None:
    """A FUSE filesystem can be mounted: ``/dev/fuse`` opens and fusermount3 is installed."""
    if (why := root()) is not None:
        return why
    if not shutil.which("fusermount3", path=_PATH):
        return "fusermount3 is missing (fuse3; scripts/install-system-deps.sh installs it)"
    try:
        os.close(os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC))
    except OSError as e:
        return f"no FUSE on this kernel: /dev/fuse: {e.strerror}"
    return None


@functools.cache
def netns_links() -> str | None:
    """Network namespaces with veth pairs and a bridge, as the multi-node cluster builds.

    Tried inside a namespace of its own, which takes the links with it when it ends.
    """
    if (why := root()) is not None:
        return why
    err = _fails("unshare", "--net", "sh", "-c",
                 "ip link add sckp0 type veth peer name sckp1 && ip link add sckpbr type bridge")  # fmt: skip
    return None if err is None else f"no network namespaces with veth and bridge links here: {err}"

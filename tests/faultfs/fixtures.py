"""pytest fixtures over :mod:`tests.faultfs.mounts`.

Use them from a conftest or a test module::

    from tests.faultfs.fixtures import fault_dir, faultfs, make_loopfs, make_tmpfs  # noqa: F401

``faultfs`` is mounted once per session (mounting costs ~0.5 s); ``fault_dir``
gives each test its own directory inside it, with all rules cleared before and
after the test.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests import machine

from .control import FaultFS
from .mounts import loopfs, mount_faultfs, tmpfs

__all__ = ["fault_dir", "faultfs", "make_loopfs", "make_tmpfs", "need_root"]


def need_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to mount filesystems")


@pytest.fixture(scope="session")
def faultfs() -> Iterator[FaultFS]:
    machine.need(machine.fuse())
    # A short base path: the control socket's name must fit in sun_path (108 bytes).
    base = Path(tempfile.mkdtemp(prefix="faultfs-"))
    try:
        with mount_faultfs(base / "root", base / "mnt", base / "ctl.sock") as fs:
            yield fs
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def fault_dir(faultfs: FaultFS, request: pytest.FixtureRequest) -> Iterator[Path]:
    """A fresh directory inside the fault fs (``faultfs.mnt / <test name>``), rules cleared."""
    faultfs.clear()
    d = faultfs.mnt / request.node.name.replace("/", "_")[:80]
    shutil.rmtree(faultfs.root / d.name, ignore_errors=True)
    d.mkdir()
    try:
        yield d
    finally:
        faultfs.clear()
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def make_tmpfs(tmp_path: Path) -> Iterator[Callable[..., Path]]:
    """``make_tmpfs("1M", options="ro")`` mounts a real tmpfs; all unmounted at teardown."""
    need_root()
    stack = contextlib.ExitStack()
    n = 0

    def make(size: str | int = "1M", *, options: str = "") -> Path:
        nonlocal n
        n += 1
        return stack.enter_context(tmpfs(tmp_path / f"tmpfs{n}", size, options=options))

    with stack:
        yield make


@pytest.fixture
def make_loopfs(tmp_path: Path) -> Iterator[Callable[..., Path]]:
    """``make_loopfs(64, fstype="ext4")`` mounts a real loop filesystem; unmounted at teardown."""
    machine.need(machine.loop_devices())
    stack = contextlib.ExitStack()
    n = 0

    def make(size_mib: int = 64, *, fstype: str = "ext4", options: str = "") -> Path:
        nonlocal n
        n += 1
        return stack.enter_context(loopfs(tmp_path / f"loop{n}", size_mib, fstype=fstype, options=options))

    with stack:
        yield make

"""Test-only storage that fails for real: a fault-injecting FUSE fs, tiny tmpfs, loop filesystems.

Fixtures live in :mod:`tests.faultfs.fixtures`; import them into a conftest or a
test module. Everything here needs root (mounts) and /dev/fuse.
"""

from __future__ import annotations

from .control import FaultFS
from .mounts import fill_up, is_mounted, loopfs, mount_faultfs, tmpfs

__all__ = ["FaultFS", "fill_up", "is_mounted", "loopfs", "mount_faultfs", "tmpfs"]

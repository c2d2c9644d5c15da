"""Filesystem facts, read in one place: the mount table, block devices, project ids and quotas.

The store, the node hooks and ``doctor`` all ask here. Nothing in this
package imports torch or the rest of slurm-ckpt, so the hooks can use it
without slowing their start.
"""

from __future__ import annotations

from .mounts import NETWORK_FS, Mount, block_device, cgroup_mount, mount_for, mount_of, read_mounts
from .quota import (
    Quota,
    QuotaUsage,
    get_project,
    get_quota,
    parse_quota_lines,
    project_id,
    set_project,
    user_quota,
)

__all__ = [
    "NETWORK_FS",
    "Mount",
    "Quota",
    "QuotaUsage",
    "block_device",
    "cgroup_mount",
    "get_project",
    "get_quota",
    "mount_for",
    "mount_of",
    "parse_quota_lines",
    "project_id",
    "read_mounts",
    "set_project",
    "user_quota",
]

"""Filesystem facts, read in one place: the mount table, block devices, project ids and quotas.

The store, the node hooks and ``doctor`` all ask here. Nothing in this
package imports torch or the rest of slurm-ckpt, so the hooks can use it
without slowing their start.
"""

from __future__ import annotations

from .mounts import (
    CEPH_FS,
    DIRECT_IO_SLOW,
    GLUSTER_FS,
    NETWORK_FS,
    Mount,
    block_device,
    cgroup_mount,
    direct_io_pays,
    mount_for,
    mount_named,
    mount_of,
    read_mounts,
)
from .quota import (
    DirQuota,
    Quota,
    QuotaUsage,
    ceph_quotas,
    free_inodes,
    get_project,
    get_quota,
    parse_quota_lines,
    project_id,
    set_project,
    user_quota,
)

__all__ = [
    "CEPH_FS",
    "DIRECT_IO_SLOW",
    "GLUSTER_FS",
    "NETWORK_FS",
    "DirQuota",
    "Mount",
    "Quota",
    "QuotaUsage",
    "block_device",
    "ceph_quotas",
    "cgroup_mount",
    "direct_io_pays",
    "free_inodes",
    "get_project",
    "get_quota",
    "mount_for",
    "mount_named",
    "mount_of",
    "parse_quota_lines",
    "project_id",
    "read_mounts",
    "set_project",
    "user_quota",
]

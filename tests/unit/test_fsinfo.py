"""The one mount-table parser, on crafted mountinfo and sysfs trees.

The real /proc/self/mountinfo and /sys are used by the node and doctor tests;
here the files are written by hand to pin the parsing: octal escapes,
superblock and per-mount options together, the longest mount point winning,
and a partition mapped to its whole disk.
"""

from __future__ import annotations

from pathlib import Path

from slurm_ckpt.fsinfo import Mount, block_device, cgroup_mount, mount_for, read_mounts


def test_mountinfo_escapes_options_and_the_longest_mount_point(tmp_path: Path) -> None:
    inner = tmp_path / "é b"  # mountinfo writes the space as \040, the é as UTF-8
    (inner / "run").mkdir(parents=True)
    escaped = str(inner).replace(" ", "\\040")
    mi = tmp_path / "mountinfo"
    mi.write_text(
        "22 1 254:0 / / rw,relatime - ext4 /dev/vda rw\n"
        f"80 22 0:52 / {escaped} ro,noatime shared:40 - nfs fs1:/export\\040x rw,vers=4.2,soft\n"
        "81 22 0:30 / /sys/fs/cgroup/blkio rw - cgroup cgroup rw,blkio\n"
        "82 22 0:31 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n"
        "garbage line\n"
    )
    mounts = read_mounts(str(mi))
    assert [m.mount_point for m in mounts] == ["/", str(inner), "/sys/fs/cgroup/blkio", "/sys/fs/cgroup/unified"]
    m = mount_for(inner / "run" / "not-yet" / "step-1", str(mi))  # the nearest existing parent counts
    assert m is not None and m.mount_point == str(inner) and m.source == "fs1:/export x"
    assert m.dev == (0, 52) and m.device == "0:52"
    assert m.options["vers"] == "4.2" and "soft" in m.options and m.read_only and m.is_network
    root = mount_for(tmp_path, str(mi))
    assert root is not None and root.mount_point == "/" and not root.is_network
    blkio, unified = cgroup_mount("blkio", mounts), cgroup_mount("unified", mounts)
    assert blkio is not None and blkio.mount_point == "/sys/fs/cgroup/blkio"
    assert unified is not None and unified.fstype == "cgroup2"
    assert mount_for(tmp_path, str(tmp_path / "missing")) is None


def test_block_device_maps_a_partition_to_its_disk(tmp_path: Path) -> None:
    sysfs = tmp_path / "sys"
    disk = sysfs / "devices/virtual/block/vdz"
    part = disk / "vdz1"
    part.mkdir(parents=True)
    (disk / "dev").write_text("252:0\n")
    (part / "partition").write_text("1\n")
    (sysfs / "dev/block").mkdir(parents=True)
    (sysfs / "dev/block/252:1").symlink_to(part)
    (sysfs / "dev/block/252:0").symlink_to(disk)
    on_part = Mount("/scratch", "xfs", "/dev/vdz1", (252, 1), {"rw": ""})
    assert block_device(on_part, sysfs) == (252, 0)  # throttles apply to whole disks
    assert block_device(Mount("/d", "xfs", "/dev/vdz", (252, 0)), sysfs) == (252, 0)
    assert block_device(Mount("/x", "xfs", "/dev/sdq", (8, 16)), sysfs) is None  # not listed by the kernel
    assert block_device(Mount("/t", "tmpfs", "tmpfs", (0, 40)), sysfs) is None  # no block device

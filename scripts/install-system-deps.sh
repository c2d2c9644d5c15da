#!/usr/bin/env bash
# Installs the Debian packages the test suite drives for real: Slurm and munge,
# XFS with project quotas, FUSE, and Prometheus with node_exporter; and gcc,
# which builds the staging copy's C loop that the suite checks is in use; and
# GlusterFS and Ceph, whose servers scripts/storage-lab.sh starts on demand.
# Idempotent: skips apt entirely when everything is already present.
set -euo pipefail
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export DEBIAN_FRONTEND=noninteractive

die() { echo "install-system-deps: $*" >&2; exit 1; }

packages=(slurm-wlm munge xfsprogs quota fuse3 libfuse3-dev pkg-config
          prometheus prometheus-node-exporter iproute2 util-linux procps
          psmisc acl e2fsprogs gcc libc6-dev
          glusterfs-server glusterfs-client ceph ceph-mds ceph-fuse)

missing=()
for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
[ "$(id -u)" -eq 0 ] || die "run as root to install: ${missing[*]}"

apt-get update -qq || die "apt-get update failed"
# Debian's prometheus, slurm, gluster and ceph packages start their services
# on install; the tests start their own private instances instead.
printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d
chmod +x /usr/sbin/policy-rc.d
trap 'rm -f /usr/sbin/policy-rc.d' EXIT
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null \
    || die "apt-get install failed for: ${missing[*]}"

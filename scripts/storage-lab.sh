#!/usr/bin/env bash
# storage-lab.sh: a GlusterFS and a CephFS on this one host, each mounted twice
# through its FUSE client (two "nodes"), for tests, the bench and site admins.
#
#   storage-lab.sh up [gluster|ceph|all]     start servers, create, mount
#   storage-lab.sh down                      unmount, stop, remove everything
#   storage-lab.sh status                    what runs, what is mounted
#   storage-lab.sh stop|cont gluster|ceph-osd|ceph-mds|ceph-mon
#                                            SIGSTOP / SIGCONT those servers
#   storage-lab.sh kill|restart gluster|ceph-osd|ceph-mds
#                                            SIGKILL them / start them again
#   storage-lab.sh kill|restart gluster-b1|gluster-b2|ceph-osd.0|ceph-osd.1
#                                            one brick or OSD only (the other keeps a replica)
#   storage-lab.sh shape 'netem delay 20ms loss 1%' | shape 'tbf rate 50mbit burst 64kb latency 1s' | shape off
#                                            slow the link between clients and servers
#
# The servers run in their own network namespace, reached only through one
# veth pair from this host: nothing listens outside this machine, and a qdisc on
# that veth (netem, tbf) slows or drops every client's traffic. Everything else lives under
# $STORAGE_LAB_DIR. Mounts: $STORAGE_LAB_DIR/mnt/{gluster,ceph}-{a,b}.
# Exit codes: 0 ok, 1 a step failed, 2 usage, 3 packages or FUSE missing.
set -uo pipefail
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin

LAB=${STORAGE_LAB_DIR:-/tmp/slurm-ckpt-storage-lab}
NS=${STORAGE_LAB_NETNS:-sclab-srv}
HOST_IF=sclab0
NS_IF=sclab1
HOST_IP=10.231.0.1
SRV_IP=10.231.0.2
VOL=sclab
FS=sclabfs
OSDS=2
OSD_SIZE=${STORAGE_LAB_OSD_SIZE:-8G}
GLUSTERD=${GLUSTERD:-glusterd}
GLUSTER=${GLUSTER:-gluster}
GLUSTERFS=${GLUSTERFS:-glusterfs}
CEPH=${CEPH:-ceph}
CEPH_FUSE=${CEPH_FUSE:-ceph-fuse}
WAIT=${STORAGE_LAB_WAIT:-60}

die() {
    local code=$1
    shift
    echo "storage-lab: $*" >&2
    exit "$code"
}

log() { echo "storage-lab: $*" >&2; }

in_ns() { nsenter --net="/run/netns/$NS" "$@"; }

# Poll COMMAND until it succeeds, for at most $WAIT seconds.
wait_for() {
    local what=$1 i
    shift
    for ((i = 0; i < WAIT * 10; i++)); do
        "$@" >/dev/null 2>&1 && return 0
        sleep 0.1
    done
    die 1 "timed out after ${WAIT}s waiting for $what"
}

need() {
    local missing=() c
    for c in "$@"; do command -v "$c" >/dev/null || missing+=("$c"); done
    [ ${#missing[@]} -eq 0 ] || die 3 "missing ${missing[*]}: run scripts/install-system-deps.sh"
    [ -c /dev/fuse ] || die 3 "no /dev/fuse: the clients are FUSE clients"
}

# --- network -----------------------------------------------------------------

net_up() {
    [ -e "/run/netns/$NS" ] && return 0
    ip netns add "$NS" || die 1 "cannot create network namespace $NS"
    ip link add "$HOST_IF" type veth peer name "$NS_IF" netns "$NS" || die 1 "cannot create veth $HOST_IF"
    ip addr add "$HOST_IP/30" dev "$HOST_IF"
    ip link set "$HOST_IF" up
    in_ns ip link set lo up
    in_ns ip addr add "$SRV_IP/30" dev "$NS_IF"
    in_ns ip link set "$NS_IF" up
}

net_down() {
    ip link del "$HOST_IF" 2>/dev/null
    [ -e "/run/netns/$NS" ] && ip netns del "$NS"
    return 0
}

shape() {
    # One queueing discipline on both ends of the veth: the way there and back.
    [ -e "/run/netns/$NS" ] || die 1 "the lab is not up"
    local side ifc run
    for side in host ns; do
        ifc=$HOST_IF run=()
        [ "$side" = ns ] && ifc=$NS_IF run=(nsenter --net="/run/netns/$NS")
        "${run[@]}" tc qdisc del dev "$ifc" root 2>/dev/null
        [ "$1" = off ] && continue
        # shellcheck disable=SC2086  # the qdisc spec is words by design
        "${run[@]}" tc qdisc add dev "$ifc" root $1 \
            || die 3 "tc qdisc add dev $ifc root $1 failed (is that qdisc in this kernel?)"
    done
}

# --- unmounting and signalling ------------------------------------------------

unmount_all() {
    local m
    # From the mount table, not `mountpoint`: its stat fails (or hangs) on a
    # mount whose client lost its servers, and such a mount must go too.
    for m in $(awk -v dir="$LAB/mnt/" 'index($2, dir) == 1 { print $2 }' /proc/mounts); do
        # Lazy: a mount whose servers are gone must not hold the teardown.
        umount -l "$m" 2>/dev/null || fusermount3 -uz "$m" 2>/dev/null || true
    done
}

lab_pids() {
    # glusterd starts the self-heal and quota daemons with paths of their own.
    pgrep -f -- "$LAB|--volfile-id shd/$VOL |--volfile-id gluster/quotad " 2>/dev/null
}

pids_of() {
    # The lab's processes running the given program.
    local prog=$1 p
    for p in $(lab_pids); do
        [ "$(cat "/proc/$p/comm" 2>/dev/null)" = "$prog" ] && echo "$p"
    done
}

signal_all() {
    local sig=$1 p
    shift
    for prog in "$@"; do
        for p in $(pids_of "$prog"); do kill "-$sig" "$p" 2>/dev/null; done
    done
    return 0
}

brick_pids() { pids_of glusterfsd; }

one_pid() {
    # The one lab process of program $1 whose command line has the word $2.
    local p
    for p in $(pids_of "$1"); do
        tr '\0' '\n' <"/proc/$p/cmdline" 2>/dev/null | grep -q -x -F -- "$2" && echo "$p"
    done
    return 0
}

kill_one() {
    local p
    case $1 in
    gluster-b[12]) p=$(one_pid glusterfsd "$LAB/gluster/${1#gluster-}") ;;
    ceph-osd.[0-9]*) p=$(one_pid ceph-osd "${1#ceph-osd.}") ;;
    *) die 2 "kill: unknown server $1" ;;
    esac
    [ -n "$p" ] || die 1 "$1 is not running"
    kill -KILL $p
    wait_dead $p
}

wait_dead() {
    # Until the killed processes are gone: a restart right after must not find them.
    local p i
    for p in "$@"; do
        for ((i = 0; i < 100; i++)); do
            [ -e "/proc/$p" ] || break
            sleep 0.05
        done
    done
}

kill_all() {
    local t=$1 ps
    ps=$(pids_of "$t")
    signal_all KILL "$t"
    # shellcheck disable=SC2086
    wait_dead $ps
}

# --- GlusterFS -----------------------------------------------------------------

gl() { "$GLUSTER" --mode=script --glusterd-sock="$LAB/gluster/glusterd.socket" "$@"; }

bricks_rejoined() {
    # Both bricks up, with as many clients (the mounts, the self-heal daemon) each.
    local counts
    counts=$(gl volume status "$VOL" clients | awk '/Clients connected/ { print $4 }' | sort -u)
    [ "$(gl volume status "$VOL" clients | grep -c 'Clients connected')" -eq 2 ] \
        && [ "$(echo "$counts" | wc -l)" -eq 1 ] && [ "${counts:-0}" -gt 0 ]
}

gluster_up() {
    need "$GLUSTERD" "$GLUSTER" "$GLUSTERFS"
    local g=$LAB/gluster
    mkdir -p "$g/state" "$g/log" "$g/b1" "$g/b2" "$LAB/mnt/gluster-a" "$LAB/mnt/gluster-b"
    cat >"$g/glusterd.vol" <<EOF
volume management
    type mgmt/glusterd
    option working-directory $g/state
    option transport-type socket
    option transport.socket.bind-address $SRV_IP
    option transport.socket.listen-port 24007
    option glusterd-sockfile $g/glusterd.socket
    option ping-timeout 0
    option event-threads 1
end-volume
EOF
    in_ns "$GLUSTERD" -f "$g/glusterd.vol" -p "$g/glusterd.pid" -l "$g/log/glusterd.log" \
        || die 1 "glusterd did not start; see $g/log/glusterd.log"
    wait_for glusterd gl volume list
    if ! gl volume info "$VOL" >/dev/null 2>&1; then
        gl volume create "$VOL" replica 2 "$SRV_IP:$g/b1" "$SRV_IP:$g/b2" force >/dev/null \
            || die 1 "gluster volume create failed"
    fi
    gl volume start "$VOL" force >/dev/null || die 1 "gluster volume start failed"
    local m
    for m in a b; do
        mountpoint -q "$LAB/mnt/gluster-$m" && continue
        "$GLUSTERFS" --volfile-server="$SRV_IP" --volfile-id="$VOL" \
            --log-file="$g/log/client-$m.log" "$LAB/mnt/gluster-$m" \
            || die 1 "cannot mount the gluster volume at $LAB/mnt/gluster-$m"
        wait_for "gluster mount $m" mountpoint -q "$LAB/mnt/gluster-$m"
    done
}

gluster_down() {
    [ -d "$LAB/gluster" ] || return 0
    local p socks=()
    # Bricks and the self-heal daemon keep their sockets in the system's run dir.
    for p in $(pids_of glusterfsd) $(pids_of glusterfs); do
        socks+=($(tr '\0' '\n' <"/proc/$p/cmdline" | grep -A1 -x -- -S | grep -v -x -- -S))
    done
    signal_all CONT glusterd glusterfsd glusterfs
    signal_all KILL glusterfsd glusterfs glusterd
    rm -f "${socks[@]}"
    rm -rf "/var/run/gluster/vols/$VOL" "/var/run/gluster/shd/$VOL"
    # The quota daemon's socket has a fixed name; it is ours when no other glusterd runs.
    pgrep -x glusterd >/dev/null || rm -f /var/run/gluster/quotad.socket
}

# --- Ceph ------------------------------------------------------------------------

ce() { "$CEPH" -c "$LAB/ceph/ceph.conf" --connect-timeout 10 "$@"; }

ceph_conf() {
    local c=$LAB/ceph
    cat >"$c/ceph.conf" <<EOF
[global]
fsid = $1
mon_host = v2:$SRV_IP:3300
public_network = $SRV_IP/32
auth_cluster_required = none
auth_service_required = none
auth_client_required = none
run_dir = $c/run
admin_socket = $c/run/\$name.\$pid.asok
pid_file = $c/run/\$name.pid
log_file = $c/log/\$name.log
osd_pool_default_size = 2
osd_pool_default_min_size = 1
osd_pool_default_pg_autoscale_mode = off
osd_crush_chooseleaf_type = 0
mon_allow_pool_delete = true
mon_warn_on_pool_no_redundancy = false
# Start-up in seconds: each close of a BlueStore block file otherwise waits
# 250 ms for the aio poller, and each monitor proposal 1 s.
bdev_aio_poll_ms = 25
paxos_propose_interval = 0.2
mgr_stats_period = 1
mgr_initial_modules =
osd_memory_target = 1073741824
[mon]
mon_data = $c/mon-\$id
[mgr]
mgr_data = $c/mgr-\$id
[osd]
osd_data = $c/osd-\$id
osd_objectstore = bluestore
bluestore_block_create = true
bluestore_block_size = $(numfmt --from=iec "$OSD_SIZE")
[mds]
mds_data = $c/mds-\$id
EOF
}

ceph_up() {
    need ceph-mon ceph-mgr ceph-osd ceph-mds "$CEPH" "$CEPH_FUSE" monmaptool
    local c=$LAB/ceph conf=$LAB/ceph/ceph.conf
    mkdir -p "$c/run" "$c/log" "$LAB/mnt/ceph-a" "$LAB/mnt/ceph-b"
    if [ ! -d "$c/mon-a/store.db" ]; then
        local fsid
        fsid=$(cat /proc/sys/kernel/random/uuid)
        ceph_conf "$fsid"
        monmaptool --create --fsid "$fsid" --addv a "[v2:$SRV_IP:3300]" "$c/monmap" >/dev/null \
            || die 1 "monmaptool failed"
        in_ns ceph-mon -c "$conf" --mkfs -i a --monmap "$c/monmap" || die 1 "ceph-mon --mkfs failed"
    fi
    in_ns ceph-mon -c "$conf" -i a || die 1 "ceph-mon did not start; see $c/log"
    mkdir -p "$c/mgr-x"
    in_ns ceph-mgr -c "$conf" -i x || die 1 "ceph-mgr did not start; see $c/log"
    local i uuid pids=()
    for ((i = 0; i < OSDS; i++)); do
        if [ ! -f "$c/osd-$i/fsid" ]; then
            uuid=$(cat /proc/sys/kernel/random/uuid)
            [ "$(ce osd new "$uuid")" = "$i" ] || die 1 "ceph osd new did not give id $i"
            mkdir -p "$c/osd-$i"
            # The mkfs steps run in parallel: each takes a few seconds alone.
            in_ns ceph-osd -c "$conf" -i "$i" --mkfs --osd-uuid "$uuid" >"$c/log/mkfs-$i.log" 2>&1 &
            pids+=($!)
        fi
    done
    for i in "${pids[@]}"; do wait "$i" || die 1 "ceph-osd --mkfs failed; see $c/log"; done
    for ((i = 0; i < OSDS; i++)); do
        in_ns ceph-osd -c "$conf" -i "$i" 2>/dev/null || die 1 "ceph-osd $i did not start; see $c/log"
    done
    mkdir -p "$c/mds-a"
    in_ns ceph-mds -c "$conf" -i a >/dev/null || die 1 "ceph-mds did not start; see $c/log"
    if ! ce fs ls 2>/dev/null | grep -q "name: $FS"; then
        ce osd pool create "${FS}_meta" 8 >/dev/null 2>&1 || die 1 "cannot create the metadata pool"
        ce osd pool create "${FS}_data" 16 >/dev/null 2>&1 || die 1 "cannot create the data pool"
        ce fs new "$FS" "${FS}_meta" "${FS}_data" >/dev/null 2>&1 || die 1 "ceph fs new failed"
    fi
    wait_for "an active MDS" sh -c "'$CEPH' -c '$conf' mds stat | grep -q 'up:active'"
    local m
    for m in a b; do
        mountpoint -q "$LAB/mnt/ceph-$m" && continue
        "$CEPH_FUSE" -c "$conf" -n client.admin --pid-file "$c/run/client-$m.pid" \
            --log-file "$c/log/client-$m.log" "$LAB/mnt/ceph-$m" >/dev/null 2>&1 \
            || die 1 "ceph-fuse could not mount $LAB/mnt/ceph-$m; see $c/log"
    done
}

ceph_down() {
    [ -d "$LAB/ceph" ] || return 0
    signal_all CONT ceph-mon ceph-mgr ceph-osd ceph-mds ceph-fuse
    signal_all KILL ceph-fuse ceph-mds ceph-osd ceph-mgr ceph-mon
}

# --- commands ----------------------------------------------------------------------

wait_gone() {
    local i
    for ((i = 0; i < 100; i++)); do
        [ -z "$(lab_pids)" ] && return 0
        sleep 0.1
    done
    log "processes still running: $(lab_pids | tr '\n' ' ')"
    return 1
}

cmd_up() {
    local what=${1:-all}
    [ "$(id -u)" -eq 0 ] || die 3 "run as root: the lab mounts FUSE filesystems and makes a network namespace"
    mkdir -p "$LAB/mnt" || die 1 "cannot create $LAB"
    net_up
    case $what in
    gluster) gluster_up ;;
    ceph) ceph_up ;;
    all) gluster_up && ceph_up ;;
    *) die 2 "up: unknown part $what (gluster, ceph or all)" ;;
    esac
    cmd_status
}

cmd_down() {
    unmount_all
    gluster_down
    ceph_down
    wait_gone
    unmount_all
    net_down
    rm -rf "$LAB"
    [ -e "$LAB" ] && die 1 "cannot remove $LAB"
    return 0
}

cmd_status() {
    local m
    echo "lab: $LAB"
    echo "netns: $([ -e "/run/netns/$NS" ] && echo "$NS ($SRV_IP)" || echo none)"
    for m in "$LAB"/mnt/*; do
        [ -d "$m" ] || continue
        if mountpoint -q "$m"; then echo "mounted: $m"; else echo "not mounted: $m"; fi
    done
    for m in $(lab_pids); do echo "process: $m $(cat "/proc/$m/comm" 2>/dev/null)"; done
}

targets() {
    case $1 in
    gluster) echo glusterfsd ;;
    ceph-osd | ceph-mds | ceph-mon | ceph-mgr) echo "$1" ;;
    *) die 2 "unknown server $1 (gluster, ceph-osd, ceph-mds, ceph-mon, ceph-mgr)" ;;
    esac
}

cmd_restart() {
    local conf=$LAB/ceph/ceph.conf i
    case $1 in
    gluster | gluster-b[12])
        gl volume start "$VOL" force >/dev/null || die 1 "gluster volume start force failed"
        # Back only once every client has reconnected to the restarted bricks: what a
        # client writes before that lands on the other brick only.
        wait_for "the clients to reconnect to the bricks" bricks_rejoined
        ;;
    ceph-osd | ceph-osd.[0-9]*)
        for ((i = 0; i < OSDS; i++)); do
            [ -n "$(pgrep -f -- "ceph-osd -c $conf -i $i\$")" ] || in_ns ceph-osd -c "$conf" -i "$i" \
                || die 1 "ceph-osd $i did not start"
        done
        ;;
    ceph-mds) [ -n "$(pids_of ceph-mds)" ] || in_ns ceph-mds -c "$conf" -i a >/dev/null || die 1 "ceph-mds did not start" ;;
    *) die 2 "restart: gluster, gluster-bN, ceph-osd, ceph-osd.N or ceph-mds" ;;
    esac
}

case ${1:-} in
up) cmd_up "${2:-all}" ;;
down) cmd_down ;;
status) cmd_status ;;
stop) signal_all STOP "$(targets "${2:-}")" ;;
cont) signal_all CONT "$(targets "${2:-}")" ;;
kill)
    case ${2:-} in
    gluster-* | ceph-osd.*) kill_one "$2" ;;
    *) kill_all "$(targets "${2:-}")" ;;
    esac
    ;;
restart) cmd_restart "${2:-}" ;;
shape) [ $# -eq 2 ] || die 2 "shape 'netem delay 20ms' or shape off"; shape "$2" ;;
*) die 2 "usage: storage-lab.sh up [gluster|ceph|all] | down | status | stop|cont|kill|restart SERVER | shape QDISC|off" ;;
esac

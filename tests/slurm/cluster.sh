#!/usr/bin/env bash
# slurm-ckpt test cluster: a private, real Slurm 22.05 cluster on this machine.
#
#   cluster.sh up [--nodes N] [--set Key=Value]... [--extra-conf FILE]
#                 [--scratch-size SIZE] [--owner PID]
#   cluster.sh down [--force]  stop everything, remove namespaces, links, state
#                            (--force: even a cluster that a running test owns)
#   cluster.sh status        daemons, nodes, jobs
#   cluster.sh env           `eval "$(cluster.sh env)"` to use sbatch/scontrol by hand
#   cluster.sh reconfigure [--set Key=Value]... [--extra-conf FILE]
#   cluster.sh exec NODE -- CMD...   run CMD in NODE's network/UTS/mount namespaces
#
# One node (default): slurmd runs in the host network as `hostname -s`.
# N >= 2 nodes: node1..nodeN, each slurmd in its own network namespace (veth on
# a bridge), UTS namespace (hostname nodeI) and mount namespace. Every node,
# the one-node case included, has its own tmpfs at $ROOT/scratch (node-local
# scratch) and sees the same $ROOT/shared (durable storage).
#
# Only one cluster runs on a machine at a time (ports, namespace names): `up`
# waits for an exclusive flock on $LOCK and hands it to a small holder process
# that keeps it until `down`. With --owner PID the holder tears the cluster
# down by itself once PID is gone, so a killed test run leaves nothing behind;
# without, after SLURM_CKPT_CLUSTER_IDLE_TIMEOUT (1800) idle seconds.
set -euo pipefail
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
ROOT=${SLURM_CKPT_CLUSTER_ROOT:-/tmp/slurm-ckpt-cluster}
LOCK=${SLURM_CKPT_CLUSTER_LOCK:-/run/lock/slurm-ckpt-cluster.lock}
LOCK_TIMEOUT=${SLURM_CKPT_CLUSTER_LOCK_TIMEOUT:-1800}
START_TIMEOUT=${SLURM_CKPT_CLUSTER_START_TIMEOUT:-90}
IDLE_TIMEOUT=${SLURM_CKPT_CLUSTER_IDLE_TIMEOUT:-1800}   # a cluster started by hand
CTLD_PORT=${SLURM_CKPT_CLUSTER_PORT:-16817}
SLURMD_PORT=$((CTLD_PORT + 1))
NET=${SLURM_CKPT_CLUSTER_NET:-10.77.0}   # /24: bridge .1, nodeI .(10+I)
# All of the above and these two must differ for a second cluster on the same
# machine (with its own LOCK); the default is one cluster, serialized by LOCK.
BRIDGE=${SLURM_CKPT_CLUSTER_BRIDGE:-sckbr0}
NS_PREFIX=${SLURM_CKPT_CLUSTER_NETNS:-slurm-ckpt-node}
VETH=${SLURM_CKPT_CLUSTER_VETH:-sckv}   # host end of node i's link: ${VETH}i
HOLDER_TAG=slurm-ckpt-cluster-holder
CONF=$ROOT/etc/slurm.conf

SCONTROL=${SCONTROL:-scontrol}
SINFO=${SINFO:-sinfo}

die() { echo "cluster.sh: $*" >&2; exit 1; }
log() { echo "cluster.sh: $*" >&2; }

# Tails of every daemon log, so a failed start says why.
logs_tail() {
    local f
    for f in "$ROOT"/log/*.log "$ROOT"/munge/munged.log; do
        [ -s "$f" ] || continue
        echo "----- tail of $f" >&2
        tail -n 25 "$f" >&2
    done
}
die_logs() { logs_tail; die "$*"; }

nodes_of() {   # node names of the cluster in $ROOT, from its recorded size
    local n
    n=$(cat "$ROOT/nodes" 2>/dev/null || echo 0)
    if [ "$n" -eq 1 ]; then hostname -s
    elif [ "$n" -gt 1 ]; then seq -f "node%g" 1 "$n"
    fi
}

pid_alive() { [ -n "${1:-}" ] && kill -0 "$1" 2>/dev/null; }
pidfile() { cat "$1" 2>/dev/null || true; }

# Stop some of our daemons: TERM to all at once, then KILL after a deadline.
# A pid file can outlive its process (a killed run, a reboot), so each pid
# must still name a process whose command line contains its tag ("PID:TAG").
stop_pids() {
    local pt pid tag pids=() i
    for pt in "$@"; do
        pid=${pt%%:*}; tag=${pt#*:}
        pid_alive "$pid" || continue
        tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null | grep -q -- "$tag" || continue
        pids+=("$pid")
    done
    [ ${#pids[@]} -gt 0 ] || return 0
    kill -TERM "${pids[@]}" 2>/dev/null || true
    for i in $(seq 100); do any_alive "${pids[@]}" || return 0; sleep 0.1; done
    kill -KILL "${pids[@]}" 2>/dev/null || true
    for i in $(seq 50); do any_alive "${pids[@]}" || return 0; sleep 0.1; done
    log "still alive after SIGKILL: ${pids[*]}"
}
any_alive() { local p; for p in "$@"; do pid_alive "$p" && return 0; done; return 1; }

# Every process in one of our nodes' mount namespaces: slurmd, slurmstepd and
# all job processes, including ones that escaped into new sessions.
ns_pids() {   # $1: "mnt:[INODE]" as readlink prints it
    local inode=${1//[^0-9]/}
    stat -L -c '%i %n' /proc/[0-9]*/ns/mnt 2>/dev/null \
        | awk -v i="$inode" '$1 == i { split($2, p, "/"); print p[3] }'
    return 0
}

cmd_down() {
    [ -d "$ROOT" ] || { remove_network; return 0; }
    local node pid ns owner
    # A test run's cluster is its own: a `down` typed in another shell must not
    # pull it from under the run's jobs.
    owner=$(pidfile "$ROOT/run/owner")
    if [ "${1:-}" != --force ] && [ -n "$owner" ] && [ "$owner" != "$PPID" ] && pid_alive "$owner"; then
        die "the cluster belongs to a running test (pid $owner: $(tr '\0' ' ' < "/proc/$owner/cmdline" | cut -c1-120)); it goes down when that ends, or use 'down --force'"
    fi
    # Jobs first, while slurmctld can still tell slurmd to end them cleanly.
    if pid_alive "$(pidfile "$ROOT/run/slurmctld.pid")"; then
        local ids
        ids=$(SLURM_CONF=$CONF timeout 10 squeue -h -o %A 2>/dev/null || true)
        # shellcheck disable=SC2086
        [ -z "$ids" ] || SLURM_CONF=$CONF timeout 10 scancel --quiet $ids 2>/dev/null || true
    fi
    local daemons=()
    for node in $(nodes_of); do
        daemons+=("$(pidfile "$ROOT/run/slurmd-$node.pid"):slurmd")
    done
    # munged too: the cluster's private instance, nothing else talks to it.
    stop_pids "${daemons[@]}" "$(pidfile "$ROOT/run/slurmctld.pid"):slurmctld" \
        "$(pidfile "$ROOT/munge/munged.pid"):munged"
    for ns in "$ROOT"/run/*.mntns; do
        [ -f "$ns" ] || continue
        ns=$(cat "$ns")
        # Never the host's own namespace: that would be every process here.
        [ "$ns" != "$(readlink /proc/1/ns/mnt)" ] && [ "$ns" != "$(readlink /proc/self/ns/mnt)" ] || continue
        for pid in $(ns_pids "$ns"); do kill -KILL "$pid" 2>/dev/null || true; done
        for _ in $(seq 50); do [ -z "$(ns_pids "$ns")" ] && break; sleep 0.1; done
        [ -z "$(ns_pids "$ns")" ] || log "processes left in $ns: $(ns_pids "$ns" | tr '\n' ' ')"
    done
    remove_network
    # The holder last: it keeps the lock until everything above is gone.
    pid=$(pidfile "$ROOT/run/holder.pid")
    rm -rf "$ROOT"
    if [ -n "$pid" ] && [ "$pid" != "${HOLDER_SELF:-}" ]; then stop_pids "$pid:$HOLDER_TAG"; fi
}

remove_network() {
    local ns pids
    for ns in $(ip netns list 2>/dev/null | awk '{print $1}'); do
        case $ns in
            "$NS_PREFIX"*)
                # Normally none are left; after a lost $ROOT these are our slurmds and jobs.
                pids=$(ip netns pids "$ns" 2>/dev/null || true)
                # shellcheck disable=SC2086
                [ -z "$pids" ] || kill -KILL $pids 2>/dev/null || true
                ip netns del "$ns" 2>/dev/null || true ;;
        esac
    done
    # The kernel frees a deleted namespace (and the veth ends in it) lazily;
    # delete our host ends now so an `up` right after finds the names free.
    local link
    for link in $(ip -o link show 2>/dev/null | awk -F': ' '{split($2, a, "@"); print a[1]}'); do
        case $link in "$VETH"[0-9]*) ip link del "$link" 2>/dev/null || true ;; esac
    done
    ip link del "$BRIDGE" 2>/dev/null || true
}

port_taken() { ss -Htln "( sport = :$1 )" | grep -q .; }

# The default ports may be taken on a machine that runs its own Slurm or other
# services: move up to a free pair, unless the caller chose the ports.
pick_ports() {
    local p=$CTLD_PORT
    while port_taken "$p" || port_taken "$((p + 1))"; do
        [ -z "${SLURM_CKPT_CLUSTER_PORT:-}" ] \
            || die "port $p or $((p + 1)) is in use: set SLURM_CKPT_CLUSTER_PORT to the first of two free ports"
        p=$((p + 2))
        [ "$p" -lt $((CTLD_PORT + 200)) ] || die "no two free ports in $CTLD_PORT-$p: set SLURM_CKPT_CLUSTER_PORT"
    done
    [ "$p" -eq "$CTLD_PORT" ] || log "ports $CTLD_PORT/$SLURMD_PORT are taken: using $p/$((p + 1))"
    CTLD_PORT=$p
    SLURMD_PORT=$((p + 1))
}

write_conf() {
    local nodes=$1 hostctl addr name i
    hostctl=$(hostname -s)
    if [ "$nodes" -eq 1 ]; then addr=127.0.0.1; else addr=$NET.1; fi
    mkdir -p "$ROOT/etc"
    cat > "$CONF" <<EOF
# Generated by tests/slurm/cluster.sh; per-test settings go in extra.conf
# (included last: a key set there wins, Slurm logs "latest value used").
ClusterName=slurmckpt
SlurmctldHost=$hostctl($addr)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$ROOT/munge/munge.socket
CredType=cred/munge
StateSaveLocation=$ROOT/state
SlurmdSpoolDir=$ROOT/spool/%n
SlurmctldPidFile=$ROOT/run/slurmctld.pid
SlurmdPidFile=$ROOT/run/slurmd-%n.pid
SlurmctldLogFile=$ROOT/log/slurmctld.log
SlurmdLogFile=$ROOT/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
PlugStackConfig=$ROOT/etc/plugstack.conf
# No cgroup plugins: the job processes must be visible to the tests as plain
# processes, and cgroup v1 blkio is left to slurm-ckpt's own hooks.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
# Finished jobs (state, exit code, restarts) are also written here, because
# scontrol forgets a job MinJobAge seconds after it ends.
JobCompType=jobcomp/filetxt
JobCompLoc=$ROOT/log/jobcomp.txt
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# Node sizes below are declared, not probed: the VM has 2 cores.
SlurmdParameters=config_overrides
ReturnToService=2
JobRequeue=1
# Short so tests see SIGKILL 5 s after SIGTERM, not the default 30 s.
KillWait=5
MinJobAge=60
InactiveLimit=0
MessageTimeout=10
SlurmdTimeout=30
SlurmctldTimeout=30
PrologEpilogTimeout=60
EOF
    if [ "$nodes" -eq 1 ]; then
        echo "NodeName=$hostctl NodeAddr=127.0.0.1 CPUs=8 RealMemory=8000 TmpDisk=1000 State=UNKNOWN" >> "$CONF"
    else
        for i in $(seq "$nodes"); do
            name=node$i
            echo "NodeName=$name NodeAddr=$NET.$((10 + i)) CPUs=4 RealMemory=4000 TmpDisk=1000 State=UNKNOWN" >> "$CONF"
        done
    fi
    cat >> "$CONF" <<EOF
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
include $ROOT/etc/extra.conf
EOF
    : > "$ROOT/etc/plugstack.conf"
}

# extra.conf from --set/--extra-conf; "Key=Value" lines, later ones win.
write_extra() {
    local out=$ROOT/etc/extra.conf.new kv
    echo "# per-test settings (cluster.sh --set/--extra-conf, or the pytest fixture)" > "$out"
    [ -n "$EXTRA_FILE" ] && cat "$EXTRA_FILE" >> "$out"
    for kv in "${SETS[@]}"; do
        case $kv in *=*) ;; *) die "--set wants Key=Value, got '$kv'" ;; esac
        printf '%s\n' "$kv" >> "$out"
    done
    mv "$out" "$ROOT/etc/extra.conf"
}

start_munge() {
    local d=$ROOT/munge i
    id munge >/dev/null 2>&1 || die "no 'munge' user: is the munge package installed?"
    mkdir -p "$d"
    # A private key: the cluster must not depend on (or disturb) a site munge.
    head -c 1024 /dev/urandom > "$d/munge.key"
    chown -R munge:munge "$d"
    chmod 0755 "$d"; chmod 0400 "$d/munge.key"
    runuser -u munge -- munged --socket="$d/munge.socket" --key-file="$d/munge.key" \
        --pid-file="$d/munged.pid" --log-file="$d/munged.log" --seed-file="$d/munged.seed" 9>&- \
        || die_logs "munged did not start"
    for i in $(seq 100); do [ -S "$d/munge.socket" ] && return 0; sleep 0.1; done
    die_logs "munged socket $d/munge.socket did not appear"
}

# Per node: a private mount namespace with a tmpfs as node-local scratch and,
# for several nodes, an /etc/hosts that names every node (gloo and srun
# resolve hostnames). Slave propagation lets mounts made on the host later
# (a loop XFS, say) still reach the node.
node_boot_script() {
    local name=$1
    cat <<EOF
set -e
mount -t tmpfs -o size=$SCRATCH_SIZE,mode=0755 slurm-ckpt-scratch-$name "$ROOT/scratch"
[ -f "$ROOT/etc/hosts" ] && mount --bind "$ROOT/etc/hosts" /etc/hosts
readlink /proc/self/ns/mnt > "$ROOT/run/$name.mntns"
exec slurmd -f "$CONF" -N $name
EOF
}

start_nodes() {
    local nodes=$1 i name ns
    mkdir -p "$ROOT/scratch"
    if [ "$nodes" -eq 1 ]; then
        name=$(hostname -s)
        SLURM_CONF=$CONF unshare --mount --propagation slave sh -c "$(node_boot_script "$name")" 9>&- \
            || die_logs "slurmd on $name did not start"
        return 0
    fi
    ! ip -4 -o addr show | grep -q " $NET\.[0-9]*/" \
        || die "$NET.0/24 is already in use on this machine: set SLURM_CKPT_CLUSTER_NET to a free /24 (e.g. 10.78.0)"
    ip link add "$BRIDGE" type bridge
    ip addr add "$NET.1/24" dev "$BRIDGE"
    ip link set "$BRIDGE" up
    { grep -v -E '\bnode[0-9]+\b' /etc/hosts || true
      for i in $(seq "$nodes"); do echo "$NET.$((10 + i)) node$i"; done; } > "$ROOT/etc/hosts"
    for i in $(seq "$nodes"); do
        name=node$i; ns=$NS_PREFIX$i
        ip netns add "$ns"
        ip link add "$VETH$i" type veth peer name eth0 netns "$ns"
        ip link set "$VETH$i" master "$BRIDGE" up
        ip -n "$ns" addr add "$NET.$((10 + i))/24" dev eth0
        ip -n "$ns" link set eth0 up
        ip -n "$ns" link set lo up
        # nsenter, not `ip netns exec`: the latter remounts /sys and slurmd
        # 22.05 then finds no cgroup filesystem.
        SLURM_CONF=$CONF nsenter --net="/run/netns/$ns" unshare --uts --mount --propagation slave \
            sh -c "hostname $name; $(node_boot_script "$name")" 9>&- \
            || die_logs "slurmd on $name did not start"
    done
}

wait_ready() {
    local deadline=$((SECONDS + START_TIMEOUT)) want states
    want=$(nodes_of | wc -l)
    until SLURM_CONF=$CONF timeout 5 "$SCONTROL" ping 2>/dev/null | grep -q "is UP"; do
        [ $SECONDS -lt $deadline ] || die_logs "slurmctld did not answer 'scontrol ping' within ${START_TIMEOUT}s"
        sleep 0.2
    done
    while :; do
        states=$(SLURM_CONF=$CONF timeout 5 "$SINFO" -h -N -o '%N %t' 2>/dev/null || true)
        [ "$(echo "$states" | grep -c -E ' idle$' || true)" -eq "$want" ] && return 0
        [ $SECONDS -lt $deadline ] || die_logs "nodes not idle within ${START_TIMEOUT}s: $(echo "$states" | tr '\n' ';')"
        sleep 0.2
    done
}

# Keeps the lock (fd 9) for the cluster's lifetime, then tears the cluster
# down: with an owner, once the owner is gone; without one (started by hand),
# once it has been idle (no job queued, slurmctld.log unchanged) for
# $IDLE_TIMEOUT seconds, so a forgotten cluster does not block every other
# test run on the machine.
start_holder() {
    local owner=$1
    # shellcheck disable=SC2016
    setsid bash -c 'echo $$ > "$3/run/holder.pid"
        owner=$1 script=$2 root=$3 idle=$4 last=$(date +%s)
        while :; do
            sleep 2 9>&-
            if [ -n "$owner" ]; then kill -0 "$owner" 2>/dev/null || break; continue; fi
            now=$(date +%s)
            busy=$(SLURM_CONF="$root/etc/slurm.conf" timeout 10 squeue -h -o %A 2>/dev/null | head -1)
            logged=$(stat -c %Y "$root/log/slurmctld.log" 2>/dev/null || echo 0)
            if [ -n "$busy" ] || [ $((now - logged)) -lt 10 ]; then last=$now; fi
            [ $((now - last)) -lt "$idle" ] || break
        done
        HOLDER_SELF=$$ SLURM_CKPT_CLUSTER_ROOT="$root" bash "$script" down --force >/dev/null 2>&1' \
        "$HOLDER_TAG" "$owner" "$HERE/cluster.sh" "$ROOT" "$IDLE_TIMEOUT" </dev/null >/dev/null 2>&1 &
    local i
    for i in $(seq 50); do [ -s "$ROOT/run/holder.pid" ] && return 0; sleep 0.1; done
    die "lock holder did not start"
}

cmd_up() {
    local nodes=1 owner=""
    SETS=(); EXTRA_FILE=""; SCRATCH_SIZE=256m
    while [ $# -gt 0 ]; do
        case $1 in
            --nodes) nodes=$2; shift 2 ;;
            --set) SETS+=("$2"); shift 2 ;;
            --extra-conf) EXTRA_FILE=$2; shift 2 ;;
            --scratch-size) SCRATCH_SIZE=$2; shift 2 ;;
            --owner) owner=$2; shift 2 ;;
            *) die "up: unknown option '$1'" ;;
        esac
    done
    case $nodes in ''|*[!0-9]*|0) die "--nodes wants a positive integer" ;; esac
    [ "$(id -u)" -eq 0 ] || die "run as root (daemons, namespaces, mounts)"
    command -v slurmctld >/dev/null && command -v munged >/dev/null \
        || bash "$REPO/scripts/install-system-deps.sh" \
        || die "Slurm/munge missing and scripts/install-system-deps.sh failed"

    exec 9>>"$LOCK"
    if ! flock -n 9; then
        log "waiting up to ${LOCK_TIMEOUT}s for the cluster lock $LOCK (held by: $(tr "\n" " " < "$LOCK.info" 2>/dev/null || echo "?"))"
        flock -w "$LOCK_TIMEOUT" 9 || die "another slurm-ckpt test cluster holds $LOCK; run 'cluster.sh down' if it is stale"
    fi
    # We hold the lock, so anything left over is stale (a killed run): clear it.
    local prev
    prev=$(sed -n 's/^root=//p' "$LOCK.info" 2>/dev/null || true)
    [ -n "$prev" ] && [ "$prev" != "$ROOT" ] && SLURM_CKPT_CLUSTER_ROOT=$prev cmd_down --force
    cmd_down --force
    printf 'root=%s\nby=pid %s (%s)\n' "$ROOT" "${owner:-$$}" "$(date -Is)" > "$LOCK.info"

    mkdir -p "$(dirname "$ROOT")"
    runuser -u munge -- test -x "$(dirname "$ROOT")" \
        || die "the munge user cannot reach $ROOT: put the cluster root where every user may traverse (not under a 0700 dir)"
    mkdir -p "$ROOT"/{etc,state,spool,run,log,shared}
    chmod 0755 "$ROOT"
    echo "$nodes" > "$ROOT/nodes"
    [ -z "$owner" ] || echo "$owner" > "$ROOT/run/owner"
    # A trap, so a failed start leaves no daemon or namespace behind.
    trap 'rc=$?; [ $rc -eq 0 ] || { logs_tail; cmd_down --force; }; exit $rc' EXIT
    pick_ports
    write_conf "$nodes"
    write_extra
    start_munge
    SLURM_CONF=$CONF slurmctld -f "$CONF" 9>&- || die_logs "slurmctld did not start"
    start_nodes "$nodes"
    wait_ready
    start_holder "$owner"
    trap - EXIT
    log "up: $nodes node(s) [$(nodes_of | tr '\n' ' ')] in $ROOT; eval \"\$($HERE/cluster.sh env)\""
}

cmd_reconfigure() {
    SETS=(); EXTRA_FILE=""
    while [ $# -gt 0 ]; do
        case $1 in
            --set) SETS+=("$2"); shift 2 ;;
            --extra-conf) EXTRA_FILE=$2; shift 2 ;;
            *) die "reconfigure: unknown option '$1'" ;;
        esac
    done
    [ -f "$CONF" ] || die "no cluster in $ROOT"
    write_extra
    SLURM_CONF=$CONF "$SCONTROL" reconfigure || die_logs "scontrol reconfigure failed"
    wait_ready
}

cmd_env() {
    [ -f "$CONF" ] || die "no cluster in $ROOT; run 'cluster.sh up' first"
    echo "export SLURM_CONF=$CONF"
    echo "export SLURM_CKPT_CLUSTER_ROOT=$ROOT"
    echo "export SLURM_CKPT_CLUSTER_SHARED=$ROOT/shared"
    echo "export SLURM_CKPT_CLUSTER_SCRATCH=$ROOT/scratch"
}

cmd_status() {
    [ -f "$CONF" ] || { echo "down (no cluster in $ROOT)"; return 3; }
    local node
    echo "root: $ROOT  nodes: $(nodes_of | tr '\n' ' ')"
    echo "munged:    $(pid_alive "$(pidfile "$ROOT/munge/munged.pid")" && echo up || echo DOWN)"
    echo "slurmctld: $(pid_alive "$(pidfile "$ROOT/run/slurmctld.pid")" && echo up || echo DOWN)"
    for node in $(nodes_of); do
        echo "slurmd $node: $(pid_alive "$(pidfile "$ROOT/run/slurmd-$node.pid")" && echo up || echo DOWN)"
    done
    SLURM_CONF=$CONF timeout 5 "$SINFO" -N -o '%N %t %c' || true
    SLURM_CONF=$CONF timeout 5 squeue || true
}

cmd_exec() {
    local node=$1 pid; shift
    [ "${1:-}" = "--" ] && shift
    pid=$(pidfile "$ROOT/run/slurmd-$node.pid")
    pid_alive "$pid" || die "no running slurmd for node '$node'"
    if [ "$(nodes_of | wc -l)" -eq 1 ]; then
        exec nsenter --target "$pid" --mount -- "$@"
    fi
    exec nsenter --target "$pid" --net --uts --mount -- "$@"
}

case ${1:-} in
    up) shift; cmd_up "$@" ;;
    down) shift; cmd_down "$@" ;;
    status) shift; cmd_status ;;
    env) shift; cmd_env ;;
    reconfigure) shift; cmd_reconfigure "$@" ;;
    exec) shift; cmd_exec "$@" ;;
    *) sed -n '2,/^set -euo/p' "$0" | sed -n 's/^# \{0,1\}//p'; exit 2 ;;
esac

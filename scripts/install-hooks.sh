#!/usr/bin/env bash
# Install the slurm-ckpt node hooks on this node. Run as root on every compute node.
#
#   scripts/install-hooks.sh [--dest DIR] [--bin PATH] [--config FILE] [--log FILE]
#
# Copies the prolog, epilog and TaskProlog shims into DIR (default
# /etc/slurm/slurm-ckpt) and writes DIR/hooks.env, which tells the shims where
# the slurm-ckpt executable is (Slurm runs hooks with no PATH), which config
# file to use and where to log. Then prints the slurm.conf lines to add.
set -euo pipefail
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin:${PATH:-}

die() { echo "install-hooks: $*" >&2; exit 1; }

dest=/etc/slurm/slurm-ckpt
bin=""
config=/etc/slurm-ckpt/config.yaml
log=/var/log/slurm-ckpt/hooks.log
while [ $# -gt 0 ]; do
    case $1 in
        --dest) dest=${2:?}; shift 2 ;;
        --bin) bin=${2:?}; shift 2 ;;
        --config) config=${2:?}; shift 2 ;;
        --log) log=${2:?}; shift 2 ;;
        *) die "unknown option $1 (see the header of $0)" ;;
    esac
done
[ "$(id -u)" -eq 0 ] || die "run as root: the hooks and their settings must be root-owned"
[ -n "$bin" ] || bin=$(command -v slurm-ckpt) || die "slurm-ckpt is not on PATH: pass --bin /path/to/slurm-ckpt"
case $bin in /*) ;; *) die "--bin must be an absolute path, not $bin" ;; esac
"$bin" --version >/dev/null || die "$bin does not run"
[ -e "$config" ] || echo "install-hooks: note: $config does not exist yet; the built-in defaults apply until it does" >&2

here=$(cd "$(dirname "$0")/.." && pwd)
install -d -m 0755 "$dest" "${log%/*}"
install -m 0755 "$here/prolog/slurm-ckpt-prolog" "$here/prolog/slurm-ckpt-taskprolog" \
    "$here/epilog/slurm-ckpt-epilog" "$dest/"
# The shims source this file only while it is root-owned and not group/world-writable.
tmp=$(mktemp "$dest/.hooks.env.XXXXXX")
printf 'SLURM_CKPT_BIN=%q\nSLURM_CKPT_CONFIG=%q\nSLURM_CKPT_HOOK_LOG=%q\n' "$bin" "$config" "$log" > "$tmp"
chmod 0644 "$tmp"
mv -f "$tmp" "$dest/hooks.env"

# The TaskProlog runs as the job's user: it needs an executable users can run.
if id nobody >/dev/null 2>&1 && ! runuser -u nobody -- "$bin" --version >/dev/null 2>&1; then
    echo "install-hooks: warning: ordinary users cannot run $bin; the TaskProlog will then" \
        "export nothing (install slurm-ckpt where users can read it)" >&2
fi
echo "installed the slurm-ckpt hooks in $dest; add to slurm.conf:"
sed "s|/etc/slurm/slurm-ckpt/|$dest/|" "$here/templates/slurm.conf.snippet"

#!/usr/bin/env bash
# A real one-node SLURM on this machine, for the tests of scripts/slurm/ (and for trying the
# batch scripts by hand before a cluster is at hand).
#
#   sudo bash scripts/slurm/local_cluster.sh          # install if missing, configure, start
#   sudo bash scripts/slurm/local_cluster.sh stop     # stop the daemons
#
# With root, installs Debian's slurmctld, slurmd, slurm-client and munge where missing, writes a
# one-node configuration (this host, all its CPUs, no GPUs, no cgroups) into /etc/slurm, and
# starts munged, slurmctld and slurmd. Exits 0 once `sinfo` reports the node idle; otherwise
# prints why on stderr and exits 1 (the tests then skip with that reason). Running it again
# with the daemons up changes nothing.
set -uo pipefail

source "$(dirname "${BASH_SOURCE[0]}")/cluster_common.sh"
STATE=${SLURM_LOCAL_STATE:-/var/tmp/megatron_smp_slurm}

# The daemons by their pid files, not by name: other SLURM daemons on this machine (such as
# local_two_node_cluster.sh's) are not ours.
MUNGED_PID=/run/munge/munged.pid
running() { local pid; pid=$(cat "$1" 2>/dev/null) && [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; }
stop() {
  local file
  for file in "$STATE/slurmd.pid" "$STATE/slurmctld.pid" "$MUNGED_PID"; do
    running "$file" && kill "$(cat "$file")" 2>/dev/null
  done
  return 0
}
if [ "${1:-}" = "stop" ]; then stop; exit 0; fi

host=$(hostname -s)
conf() {  # the one-node configuration, on stdout
  local cpus
  cpus=$(hw_cpus)
  [ -n "$cpus" ] || cpus=$(nproc --all)
  # Leave the OS 1 GiB; slurmd refuses a node whose configured memory exceeds what it sees.
  local mem_mb=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024 ))
  cat <<EOF
# Written by megatron_smp scripts/slurm/local_cluster.sh: one node, CPU only.
ClusterName=megatron_smp_local
SlurmctldHost=$host
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/d
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$STATE/slurmctld.log
SlurmdLogFile=$STATE/slurmd.log
EOF
  common_conf cred_expire=5
  cat <<EOF
NodeName=$host CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN
PartitionName=cpu Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
}

node_idle() { sinfo -h -o '%t' 2>/dev/null | grep -qE '^(idle|mix|alloc)'; }
node_cpus() { sinfo -h -o '%c' 2>/dev/null | head -1; }
if command -v sinfo >/dev/null && node_idle; then
  if [ "$(id -u)" != 0 ]; then exit 0; fi
  if [ "$(node_cpus)" = "$(hw_cpus)" ]; then
    # Up: bring an older configuration of this script's up to date (SchedulerParameters and
    # the like take effect on reconfigure; the node's CPUs and memory are unchanged).
    wanted=$(conf)
    if [ "$wanted" != "$(cat /etc/slurm/slurm.conf 2>/dev/null)" ]; then
      printf '%s\n' "$wanted" > /etc/slurm/slurm.conf && scontrol reconfigure >/dev/null 2>&1 \
        || say "could not reconfigure the running SLURM with the new /etc/slurm/slurm.conf"
    fi
    exit 0
  fi
  say "the running SLURM's node has $(node_cpus) CPUs, the hardware $(hw_cpus): restarting it"
  stop; sleep 1
fi
if [ "$(id -u)" != 0 ]; then
  say "needs root to install and start SLURM (run it with sudo)"; exit 1
fi
install_slurm || exit 1

mkdir -p "$STATE/ctld" "$STATE/d" /etc/slurm /run/munge /var/log/munge /var/lib/munge
conf > /etc/slurm/slurm.conf
if [ ! -s /etc/munge/munge.key ]; then
  dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null
fi
chown -R munge:munge /etc/munge /run/munge /var/log/munge /var/lib/munge 2>/dev/null
chmod 0400 /etc/munge/munge.key

running "$MUNGED_PID" || runuser -u munge -- /usr/sbin/munged --force 2>/dev/null \
  || /usr/sbin/munged --force
running "$STATE/slurmctld.pid" || slurmctld
running "$STATE/slurmd.pid" || slurmd
for second in $(seq 1 30); do
  if node_idle; then
    scontrol update nodename="$host" state=resume >/dev/null 2>&1
    exit 0
  fi
  # (the daemons write their pid files a moment after they start)
  if [ "$second" -gt 2 ] \
      && { ! running "$STATE/slurmctld.pid" || ! running "$STATE/slurmd.pid"; }; then
    say "a SLURM daemon exited at start; logs in $STATE"; exit 1
  fi
  state=$(sinfo -h -o '%t' 2>/dev/null)
  case "$state" in
    down*|drain*) scontrol update nodename="$host" state=resume >/dev/null 2>&1 ;;
  esac
  sleep 1
done
say "the node did not come up (sinfo: '$(sinfo -h 2>&1 | head -1)'); logs in $STATE"
exit 1

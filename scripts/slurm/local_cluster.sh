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

say() { echo "local_cluster: $*" >&2; }
STATE=${SLURM_LOCAL_STATE:-/var/tmp/megatron_smp_slurm}

stop() {
  pkill -x slurmd 2>/dev/null; pkill -x slurmctld 2>/dev/null; pkill -x munged 2>/dev/null
  return 0
}
if [ "${1:-}" = "stop" ]; then stop; exit 0; fi

conf() {  # the one-node configuration, on stdout
  local host cpus
  host=$(hostname -s)
  # The hardware as slurmd sees it (`nproc` follows OMP_NUM_THREADS, which the test runner
  # sets to 1: a node configured below its hardware holds every 2-CPU job pending for ever).
  cpus=$(hw_cpus)
  [ -n "$cpus" ] || cpus=$(nproc --all)
  # Leave the OS 1 GiB; slurmd refuses a node whose configured memory exceeds what it sees.
  local mem_mb=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024 ))
  cat <<EOF
# Written by megatron_smp scripts/slurm/local_cluster.sh: one node, CPU only.
ClusterName=megatron_smp_local
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# A requeued job waits until its credential expires before it starts again (default 120 s).
AuthInfo=cred_expire=5
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/d
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$STATE/slurmctld.log
SlurmdLogFile=$STATE/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
# Seconds between SIGTERM and SIGKILL when a job is cancelled or requeued: the time a run
# with --exit-signal-handler has to save.
KillWait=60
# A requeued job may start again at once (the default holds it for a minute or more).
MinJobAge=10
# A requeued job becomes eligible cred_expire + 1 s after the requeue; nothing but the
# periodic scheduling passes (60 s and 30 s by default) looks at it then: every second here.
SchedulerParameters=sched_interval=1,bf_interval=1
NodeName=$host CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN
PartitionName=cpu Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
}

node_idle() { sinfo -h -o '%t' 2>/dev/null | grep -qE '^(idle|mix|alloc)'; }
node_cpus() { sinfo -h -o '%c' 2>/dev/null | head -1; }
hw_cpus() { slurmd -C 2>/dev/null | sed -n 's/.*CPUs=\([0-9]*\).*/\1/p' | head -1; }
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
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null \
    || ! command -v sbatch >/dev/null || ! command -v munged >/dev/null; then
  if ! command -v apt-get >/dev/null; then
    say "SLURM is not installed and there is no apt-get to install it"; exit 1
  fi
  say "installing slurmctld slurmd slurm-client munge (Debian packages)"
  export DEBIAN_FRONTEND=noninteractive
  if ! { apt-get update -qq && apt-get install -y -qq slurmctld slurmd slurm-client munge; } \
      >"${TMPDIR:-/tmp}/megatron_smp_slurm_install.log" 2>&1; then
    say "apt-get install failed: see ${TMPDIR:-/tmp}/megatron_smp_slurm_install.log"; exit 1
  fi
fi

mkdir -p "$STATE/ctld" "$STATE/d" /etc/slurm /run/munge /var/log/munge /var/lib/munge
conf > /etc/slurm/slurm.conf
if [ ! -s /etc/munge/munge.key ]; then
  dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null
fi
chown -R munge:munge /etc/munge /run/munge /var/log/munge /var/lib/munge 2>/dev/null
chmod 0400 /etc/munge/munge.key

pgrep -x munged >/dev/null || runuser -u munge -- /usr/sbin/munged --force 2>/dev/null \
  || /usr/sbin/munged --force
pgrep -x slurmctld >/dev/null || slurmctld
pgrep -x slurmd >/dev/null || slurmd
for _ in $(seq 1 30); do
  if node_idle; then
    scontrol update nodename="$host" state=resume >/dev/null 2>&1
    exit 0
  fi
  if ! pgrep -x slurmctld >/dev/null || ! pgrep -x slurmd >/dev/null; then
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

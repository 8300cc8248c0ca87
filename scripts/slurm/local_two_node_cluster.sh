#!/usr/bin/env bash
# A real two-node SLURM on this machine: each node is a Linux network namespace with its own
# address, host name and slurmd, joined to the other by a veth pair; slurmctld runs on node 1
# (the head node). For the multi-node tests of scripts/slurm/ and for trying the batch scripts
# on two nodes by hand.
#
#   sudo bash scripts/slurm/local_two_node_cluster.sh            # install if missing, start
#   sudo bash scripts/slurm/local_two_node_cluster.sh on 1 CMD..  # run CMD on node 1 (or 2)
#   sudo -E bash scripts/slurm/local_two_node_cluster.sh on 1 sbatch --nodes 2 ...  # a job
#                                    (-E: the job gets your environment: DATA_PATH, ...)
#   sudo bash scripts/slurm/local_two_node_cluster.sh lose 2     # node 2 dies (link, processes)
#   sudo bash scripts/slurm/local_two_node_cluster.sh replace 2  # a new node 2 joins (slurmd)
#   sudo bash scripts/slurm/local_two_node_cluster.sh stop       # tear everything down
#
# What a cluster has, built from what one machine has:
#   nodes      namespaces $PREFIX-n1, $PREFIX-n2 (also their host names and SLURM node names)
#              at $NET.1 and $NET.2 (default 198.18.40.0/24, the benchmarking range of
#              RFC 2544, which exists only inside this machine); nothing in this machine's own
#              network changes, and no node can reach anything but the other node
#   /etc/hosts each node's own (/etc/netns/<node>/hosts, which `ip netns exec` shows as
#              /etc/hosts): this machine's entries and both nodes'
#   munge      one munged (own key and socket under $STATE) that both nodes' daemons use
#   storage    the same file system: the clone, the data and the checkpoint directories are
#              where they are on this machine, as a cluster's shared storage
#   SLURM      slurmctld and slurmd on node 1, slurmd on node 2, configuration $STATE/slurm.conf
#              (clients need SLURM_CONF=$STATE/slurm.conf and run on a node: `on 1 ...`)
# It leaves any other SLURM on this machine (scripts/slurm/local_cluster.sh) alone, and `stop`
# removes all it made: daemons (by their pid), processes in the namespaces, the namespaces and
# their veth pair, /etc/netns/<node>, $STATE.
#
# Exits 0 once both nodes are idle; 2 (with the reason) where network namespaces are not
# permitted (not root, no `ip`/`unshare`, or the kernel refuses): the tests skip then; 1 on any
# other failure, after tearing down what it started.
set -uo pipefail

SAY_AS=local_two_node_cluster
source "$(dirname "${BASH_SOURCE[0]}")/cluster_common.sh"
PREFIX=${SLURM_TWO_NODE_PREFIX:-msmp}
NET=${SLURM_TWO_NODE_NET:-198.18.40}
STATE=${SLURM_TWO_NODE_STATE:-/var/tmp/megatron_smp_slurm_two_node}
CONF=$STATE/slurm.conf
MUNGE_SOCKET=$STATE/munge/munge.socket

node() { echo "$PREFIX-n$1"; }

# on N CMD...: CMD on node N (its network, /etc/hosts and host name), as a login there would.
# Not `ip netns exec`: that remounts /sys, which hides /sys/fs/cgroup from slurmd.
on() {
  local name
  name=$(node "$1"); shift
  SLURM_CONF=$CONF nsenter --net="/run/netns/$name" unshare --mount --uts sh -c \
    'mount --bind "/etc/netns/$0/hosts" /etc/hosts && hostname "$0" && exec "$@"' "$name" "$@"
}

nodes_idle() {  # both nodes idle or running jobs
  [ "$(on 1 sinfo -h -N -o '%t' 2>/dev/null | grep -cE '^(idle|mix|alloc)')" = 2 ]
}

kill_pidfile() {
  local pid
  pid=$(cat "$1" 2>/dev/null) || return 0
  [ -n "$pid" ] && kill -9 "$pid" 2>/dev/null
  rm -f "$1"
}

# lose N: node N dies as when it loses power: its link goes down first (the others see
# silence, not the connection resets of processes that exit), then every process on it
# (slurmd, job steps, workers) is SIGKILLed. Its namespace stays, for a replacement.
lose() {
  local name
  name=$(node "$1")
  ip -n "$name" link set "$PREFIX-v$1" down 2>/dev/null
  kill_node_processes "$1"
}

kill_node_processes() {
  local name pids
  name=$(node "$1")
  for _ in $(seq 1 20); do
    pids=$(ip netns pids "$name" 2>/dev/null)
    [ -z "$pids" ] && return 0
    kill -9 $pids 2>/dev/null
    sleep 0.1
  done
  say "processes still on $name after 20 rounds of SIGKILL: $pids"; return 1
}

# replace N: a new node N joins where the lost one was (link up, slurmd started).
replace() {
  ip -n "$(node "$1")" link set "$PREFIX-v$1" up && start_daemons "$1" && wait_idle 60
}

stop() {
  kill_pidfile "$STATE/slurmctld.pid"
  for n in 1 2; do
    kill_pidfile "$STATE/$(node $n).pid"
    ip netns list 2>/dev/null | grep -qw "$(node $n)" && kill_node_processes "$n"
  done
  kill_pidfile "$STATE/munge/munged.pid"
  for n in 1 2; do
    ip netns del "$(node $n)" 2>/dev/null  # the veth pair goes with its namespaces
    rm -rf "/etc/netns/$(node $n)"
  done
  rmdir /etc/netns 2>/dev/null
  rm -rf "$STATE"
  return 0
}

# start_daemons N: slurmd of node N (on node 1 slurmctld too), in the node's namespace with the
# node's host name (they keep both when they daemonize).
start_daemons() {
  if [ "$1" = 1 ]; then
    on 1 sh -c "slurmctld -f '$CONF' && slurmd -f '$CONF'"
  else
    on "$1" slurmd -f "$CONF"
  fi
}

conf() {
  cat <<EOF
# Written by megatron_smp scripts/slurm/local_two_node_cluster.sh: two nodes, CPU only.
ClusterName=megatron_smp_two_node
SlurmctldHost=$(node 1)($NET.1)
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/%n
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/%n.pid
SlurmctldLogFile=$STATE/slurmctld.log
SlurmdLogFile=$STATE/%n.log
# A node whose slurmd stops answering is DOWN after this many seconds and its jobs requeued
# (--requeue) or cancelled. Short, so that a lost node is noticed within a test; not
# shorter, so that a slurmd slow to answer on a loaded machine is not taken for lost.
SlurmdTimeout=10
EOF
  # KillWait 5: a job on a lost node starts again only once its processes on the surviving
  # node are gone, and workers blocked in a collective with the lost node's ranks never act
  # on SIGTERM (a run's save at SIGTERM takes about a second at the tests' sizes).
  common_conf "cred_expire=5,socket=$MUNGE_SOCKET" 5
  # Both nodes share this machine's CPUs; slurmd refuses a node configured above what it sees.
  cat <<EOF
NodeName=$(node 1) NodeAddr=$NET.1 CPUs=${1:-$(nproc --all)} RealMemory=1024 State=UNKNOWN
NodeName=$(node 2) NodeAddr=$NET.2 CPUs=${1:-$(nproc --all)} RealMemory=1024 State=UNKNOWN
PartitionName=cpu Nodes=$(node 1),$(node 2) Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
}

# wait_idle SECONDS: until both nodes are idle (resuming any that registered DOWN/DRAINED).
wait_idle() {
  for _ in $(seq 1 "$1"); do
    nodes_idle && return 0
    for n in 1 2; do
      case "$(on 1 sinfo -h -n "$(node $n)" -o '%t' 2>/dev/null)" in
        down*|drain*) on 1 scontrol update nodename="$(node $n)" state=resume >/dev/null 2>&1 ;;
      esac
    done
    sleep 1
  done
  say "sinfo: '$(on 1 sinfo -h -N 2>&1 | tr '\n' ';')'"
  return 1
}

case "${1:-start}" in
  stop) stop; exit 0 ;;
  on) shift; on "$@"; exit $? ;;
  lose) lose "$2"; exit $? ;;
  replace) replace "$2"; exit $? ;;
  start) ;;
  *) say "unknown command '$1' (start, stop, on N CMD..., lose N, replace N)"; exit 1 ;;
esac

if [ "$(id -u)" != 0 ]; then
  say "network namespaces not permitted: needs root (run it with sudo)"; exit 2
fi
if ! command -v ip >/dev/null && command -v apt-get >/dev/null; then
  say "installing iproute2 (Debian package) for ip netns"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2 >/dev/null 2>&1 \
    || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2; } \
      >/dev/null 2>&1
fi
for tool in ip unshare nsenter; do
  command -v "$tool" >/dev/null || { say "network namespaces not permitted: no '$tool'"; exit 2; }
done
# Up with this script's configuration: nothing to do. Otherwise start afresh.
if [ -f "$CONF" ] && [ "$(conf "$(hw_cpus)")" = "$(cat "$CONF")" ] && nodes_idle; then exit 0; fi
stop  # what a failed or killed start left behind, or an older configuration

if ! err=$(ip netns add "$(node 1)" 2>&1); then
  say "network namespaces not permitted here: ip netns add: $err"; stop; exit 2
fi
if ! err=$(unshare --uts true 2>&1); then
  say "network namespaces not permitted here: unshare --uts: $err"; stop; exit 2
fi
install_slurm || { stop; exit 1; }
# On failure the daemons' logs are kept (stop removes $STATE).
LOGS=${TMPDIR:-/tmp}/megatron_smp_slurm_two_node_logs
fail() {
  rm -rf "$LOGS" && mkdir -p "$LOGS" && cp "$STATE"/*.log "$STATE"/munge/*.log "$LOGS"/ 2>/dev/null
  say "$* (logs in $LOGS)"; stop; exit 1
}

if ip -4 -o addr show 2>/dev/null | grep -q " $NET\."; then
  fail "$NET.0/24 is in use on this machine: choose another with SLURM_TWO_NODE_NET"
fi
ip netns add "$(node 2)" || fail "ip netns add $(node 2) failed"
ip link add "$PREFIX-v1" type veth peer name "$PREFIX-v2" || fail "ip link add veth failed"
for n in 1 2; do
  ip link set "$PREFIX-v$n" netns "$(node $n)" \
    && ip -n "$(node $n)" addr add "$NET.$n/24" dev "$PREFIX-v$n" \
    && ip -n "$(node $n)" link set "$PREFIX-v$n" up \
    && ip -n "$(node $n)" link set lo up || fail "could not configure $(node $n)'s network"
  mkdir -p "/etc/netns/$(node $n)"
  { cat /etc/hosts; echo "$NET.1 $(node 1)"; echo "$NET.2 $(node 2)"; } \
    > "/etc/netns/$(node $n)/hosts"
done

mkdir -p "$STATE/ctld" "$STATE/munge" "$STATE/$(node 1)" "$STATE/$(node 2)"
chmod 0711 "$STATE/munge"  # the socket's directory: searchable by the jobs' users
dd if=/dev/urandom bs=1 count=1024 of="$STATE/munge/munge.key" 2>/dev/null
chmod 0400 "$STATE/munge/munge.key"
/usr/sbin/munged --force --socket="$MUNGE_SOCKET" --key-file="$STATE/munge/munge.key" \
  --pid-file="$STATE/munge/munged.pid" --log-file="$STATE/munge/munged.log" \
  --seed-file="$STATE/munge/munged.seed" 2>"$STATE/munge/start.err" \
  || fail "munged did not start: $(cat "$STATE/munge/start.err")"

conf "$(hw_cpus)" > "$CONF"
start_daemons 1 || fail "slurmctld/slurmd did not start on $(node 1)"
start_daemons 2 || fail "slurmd did not start on $(node 2)"
wait_idle 60 || fail "the nodes did not come up"

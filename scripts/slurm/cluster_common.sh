# Sourced by scripts/slurm/local_cluster.sh (one node) and local_two_node_cluster.sh (two nodes
# in network namespaces): installing SLURM and munge, and the slurm.conf lines both share.

say() { echo "${SAY_AS:-local_cluster}: $*" >&2; }

# The CPUs as slurmd sees them (`nproc` follows OMP_NUM_THREADS, which the test runner sets to
# 1: a node configured below its hardware holds every 2-CPU job pending for ever).
hw_cpus() { slurmd -C 2>/dev/null | sed -n 's/.*CPUs=\([0-9]*\).*/\1/p' | head -1; }

# install_slurm: Debian's slurmctld, slurmd, slurm-client and munge where missing; 1 (with the
# reason on stderr) where that cannot be done.
install_slurm() {
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null \
      && command -v sbatch >/dev/null && command -v munged >/dev/null; then
    return 0
  fi
  if ! command -v apt-get >/dev/null; then
    say "SLURM is not installed and there is no apt-get to install it"; return 1
  fi
  say "installing slurmctld slurmd slurm-client munge (Debian packages)"
  export DEBIAN_FRONTEND=noninteractive
  if ! { apt-get update -qq && apt-get install -y -qq slurmctld slurmd slurm-client munge; } \
      >"${TMPDIR:-/tmp}/megatron_smp_slurm_install.log" 2>&1; then
    say "apt-get install failed: see ${TMPDIR:-/tmp}/megatron_smp_slurm_install.log"; return 1
  fi
}

# common_conf AUTHINFO [KILLWAIT]: the slurm.conf lines that do not depend on the nodes.
common_conf() {
  cat <<EOC
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# A requeued job waits until its credential expires before it starts again (default 120 s).
AuthInfo=$1
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
# Seconds between SIGTERM and SIGKILL when a job is cancelled or requeued: the time a run
# with --exit-signal-handler has to save.
KillWait=${2:-60}
# A requeued job may start again at once (the default holds it for a minute or more).
MinJobAge=10
# A requeued job becomes eligible cred_expire + 1 s after the requeue; nothing but the
# periodic scheduling passes (60 s and 30 s by default) looks at it then: every second here.
SchedulerParameters=sched_interval=1,bf_interval=1
EOC
}

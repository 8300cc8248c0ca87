# Sourced by the batch jobs in scripts/slurm/ (inside the job): finds the clone, sets the
# rendezvous, and runs the training step so that a preempted run is requeued.
#
# The caller sets `repo`, the clone (see the batch scripts).
cd "$repo"
if [ -z "${MASTER_ADDR:-}" ]; then
  # The first node, at the address SLURM itself reaches it at (its NodeAddr): on the node, its
  # own name may resolve to a loopback address (Debian's 127.0.1.1) that no other node reaches.
  MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
  _node_addr=$(scontrol show node "$MASTER_ADDR" 2>/dev/null \
    | sed -n 's/.*NodeAddr=\([^ ]*\).*/\1/p')
  MASTER_ADDR=${_node_addr:-$MASTER_ADDR}
  unset _node_addr
fi
export MASTER_ADDR
# One port per job, so two jobs sharing a node do not meet in one rendezvous.
export MASTER_PORT=${MASTER_PORT:-$(( 20000 + SLURM_JOB_ID % 20000 ))}
export NNODES=$SLURM_NNODES
echo "job $SLURM_JOB_ID attempt ${SLURM_RESTART_COUNT:-0} on $SLURM_JOB_NODELIST, clone $repo," \
  "rendezvous $MASTER_ADDR:$MASTER_PORT"

# run_step CMD...: srun CMD; if the run stopped early to be continued (it prints Megatron's
# "exiting program after receiving SIGTERM" when --exit-signal-handler saw SLURM's --signal
# before the time limit or a `scancel --signal=TERM`, or "exiting program after N minutes" for
# --exit-duration-in-mins), requeue the job: it resumes from the checkpoint that exit saved
# (REQUEUE=0: don't). --exit-interval is a deliberate stop and is not requeued. `scontrol requeue` by hand needs nothing here: SLURM sends
# SIGTERM, waits KillWait seconds while the run saves, and requeues the job itself.
# A hang (--enable-ft-package's watchdog ends every rank with exit code 75) is requeued too,
# once torchrun's own restarts (MAX_RESTARTS, within the allocation) are spent: the run failed
# with 75 -- srun's status under LAUNCHER=srun, the first failure of torchrun's summary under
# torchrun -- and the job resumes from the last checkpoint. At most MAX_HANG_REQUEUES (default
# 3) times per job (SLURM_RESTART_COUNT counts every requeue), so a hang that recurs at once
# does not hold the allocation for ever.
HANG_EXIT_CODE=75
run_step() {
  local attempt_log rc last_exit
  attempt_log=$(mktemp)
  set +e
  # tee ignores SIGTERM: on a requeue or cancel SLURM signals this shell too, and the run's
  # last lines (its save, "exiting program ...") must still reach the job's output.
  srun --kill-on-bad-exit=1 "$@" 2>&1 | (trap '' TERM; exec tee "$attempt_log")
  rc=${PIPESTATUS[0]}
  set -e
  if [ "${REQUEUE:-1}" = 1 ] && grep -qE '^exiting program after (receiving|[0-9.]+ minutes)' "$attempt_log"; then
    echo "run stopped early ($(grep -m1 '^exiting program' "$attempt_log")): requeueing job $SLURM_JOB_ID"
    rm -f "$attempt_log"
    scontrol requeue "$SLURM_JOB_ID"
    return 0
  fi
  if [ "$rc" != 0 ]; then
    # torchrun's summary ends with its first observed failure ("exitcode  : 75 (pid: ...)").
    last_exit=$(grep -oE 'exitcode *: *-?[0-9]+' "$attempt_log" | tail -n 1 | grep -oE -- '-?[0-9]+$' || true)
    if [ "${REQUEUE:-1}" = 1 ] && { [ "$rc" = "$HANG_EXIT_CODE" ] || [ "$last_exit" = "$HANG_EXIT_CODE" ]; }; then
      if [ "${SLURM_RESTART_COUNT:-0}" -lt "${MAX_HANG_REQUEUES:-3}" ]; then
        echo "a rank hung (exit code $HANG_EXIT_CODE, the progress watchdog's): requeueing job" \
          "$SLURM_JOB_ID (requeue $(( ${SLURM_RESTART_COUNT:-0} + 1 )) of at most ${MAX_HANG_REQUEUES:-3})"
        rm -f "$attempt_log"
        scontrol requeue "$SLURM_JOB_ID"
        return 0
      fi
      echo "a rank hung (exit code $HANG_EXIT_CODE) after ${SLURM_RESTART_COUNT:-0} requeues" \
        "(MAX_HANG_REQUEUES=${MAX_HANG_REQUEUES:-3}): not requeueing job $SLURM_JOB_ID again"
    fi
  fi
  if grep -q 'RendezvousTimeoutError' "$attempt_log"; then
    echo "rendezvous timed out: not all $NNODES nodes joined $MASTER_ADDR:$MASTER_PORT within" \
      "RDZV_TIMEOUT=${RDZV_TIMEOUT:-600} s. A node slow to start, or one that cannot reach" \
      "that address (the 'rendezvous' line of each node above names its interface)."
  fi
  rm -f "$attempt_log"
  return "$rc"
}

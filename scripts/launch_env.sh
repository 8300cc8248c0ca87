# Sourced by the pretraining launchers (scripts/pretrain_*.sh) and the SLURM jobs: which Python
# runs, and how many processes each node starts. Every value can be set from outside:
#   PYTHON          the interpreter; default: the active virtual environment's python
#                   ($VIRTUAL_ENV), else this clone's .venv (scripts/setup_env.sh), else python3
#   GPUS_PER_NODE   default: SLURM's --gpus-per-node (SLURM_GPUS_PER_NODE, "gpu:8" -> 8) inside
#                   a job, else the GPUs nvidia-smi lists (0 where there is none)
#   NPROC_PER_NODE  processes per node; default GPUS_PER_NODE, or with no GPU the CPUs SLURM gave
#                   the task (SLURM_CPUS_PER_TASK), else 1: CPU processes use gloo, one thread each
#   LAUNCHER        torchrun (default: one launcher per node starts NPROC_PER_NODE processes) or
#                   srun (every SLURM task is one rank: scripts/slurm/pretrain_gpt_srun.sbatch)
# Several nodes (NNODES > 1, MASTER_ADDR the first node; the SLURM jobs set both):
#   GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME  default: the interface of this node's route to
#                   MASTER_ADDR (gloo and NCCL would otherwise bind what the host name resolves
#                   to, often a loopback address that the other nodes cannot reach)
#   NODE_ADDR       this node's address on that route: torchrun's --local-addr, the address the
#                   other nodes reach this one at when it hosts the workers' store
#   RDZV_TIMEOUT    seconds torchrun waits for all NNODES to join (default torchrun's, 600)
#   MAX_RESTARTS    torchrun --max-restarts: a failed worker on any node restarts the workers
#                   of every node, which resume from the last checkpoint (default 0)
# Sets LAUNCH=(python -m torch.distributed.run ...), or (python) for srun, for
# "${LAUNCH[@]}" script.py args.
_repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [ -z "${PYTHON:-}" ]; then
  if [ -n "${VIRTUAL_ENV:-}" ] && [ -x "$VIRTUAL_ENV/bin/python" ]; then
    PYTHON=$VIRTUAL_ENV/bin/python
  elif [ -x "$_repo/.venv/bin/python" ]; then
    PYTHON=$_repo/.venv/bin/python
  else
    PYTHON=$(command -v python3 || command -v python)
  fi
fi
if [ -z "${GPUS_PER_NODE:-}" ]; then
  if [ -n "${SLURM_GPUS_PER_NODE:-}" ]; then
    GPUS_PER_NODE=${SLURM_GPUS_PER_NODE##*:}
  elif command -v nvidia-smi >/dev/null 2>&1; then
    GPUS_PER_NODE=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  else
    GPUS_PER_NODE=0
  fi
fi
if [ -z "${NPROC_PER_NODE:-}" ]; then
  if [ "$GPUS_PER_NODE" -gt 0 ]; then
    NPROC_PER_NODE=$GPUS_PER_NODE
  else
    NPROC_PER_NODE=${SLURM_CPUS_PER_TASK:-1}
  fi
fi
if [ "$GPUS_PER_NODE" -eq 0 ]; then
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
fi
NNODES=${NNODES:-1}
if [ "$NNODES" -gt 1 ] && [ -n "${MASTER_ADDR:-}" ]; then
  _master_ip=$(getent ahostsv4 "$MASTER_ADDR" 2>/dev/null | awk 'NR == 1 {print $1}')
  _route=$(ip -o -4 route get "${_master_ip:-$MASTER_ADDR}" 2>/dev/null)
  _dev=$(sed -n 's/.* dev \([^ ]*\).*/\1/p' <<< "$_route")
  NODE_ADDR=${NODE_ADDR:-$(sed -n 's/.* src \([^ ]*\).*/\1/p' <<< "$_route")}
  if [ "$_dev" = lo ] && [ -n "$_master_ip" ]; then
    # MASTER_ADDR is this node: the route is the loopback; the interface holding the address.
    _dev=$(ip -o -4 addr show to "$_master_ip" 2>/dev/null | awk 'NR == 1 {print $2}')
  fi
  if [ -n "$_dev" ] && [ "$_dev" != lo ]; then
    export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-$_dev}
    export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-$_dev}
  fi
  echo "node $(hostname): rendezvous $MASTER_ADDR:${MASTER_PORT:-29500}" \
    "(${_master_ip:-unresolved})," \
    "this node ${NODE_ADDR:-unknown}, GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-unset}" \
    "NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-unset}" >&2
  if [ -z "${GLOO_SOCKET_IFNAME:-}" ]; then
    echo "launch_env: no route to MASTER_ADDR=$MASTER_ADDR found (ip route get): set" \
      "GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME to the interface the nodes reach each other on" >&2
  fi
  # Each rendezvous round's workers get a new store (rank 0 hosts it), not the one the agent
  # keeps for the job: the restart count that keys the shared store's attempts differs between
  # nodes when one node's workers fail and another's are restarted for it (parallel_state).
  export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}
  unset _master_ip _route _dev
fi
if [ "${LAUNCHER:-torchrun}" = srun ]; then
  # megatron_smp reads SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID and MASTER_ADDR / MASTER_PORT.
  LAUNCH=("$PYTHON")
  unset _repo
  return 0
elif [ "${LAUNCHER:-torchrun}" != torchrun ]; then
  echo "LAUNCHER must be torchrun or srun, got '$LAUNCHER'" >&2
  exit 2
fi
LAUNCH=("$PYTHON" -m torch.distributed.run --nproc-per-node "$NPROC_PER_NODE" --nnodes "$NNODES")
[ -n "${MAX_RESTARTS:-}" ] && LAUNCH+=(--max-restarts "$MAX_RESTARTS")
if [ -n "${MASTER_ADDR:-}" ]; then
  # Several nodes (or a SLURM job): rendezvous through the first node.
  LAUNCH+=(--rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:${MASTER_PORT:-29500}")
  [ -n "${NODE_ADDR:-}" ] && LAUNCH+=(--local-addr "$NODE_ADDR")
  [ -n "${RDZV_TIMEOUT:-}" ] && LAUNCH+=(--rdzv-conf "join_timeout=$RDZV_TIMEOUT")
else
  LAUNCH+=(--standalone)
fi
unset _repo

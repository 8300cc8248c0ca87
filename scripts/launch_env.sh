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
if [ -n "${MASTER_ADDR:-}" ]; then
  # Several nodes (or a SLURM job): rendezvous through the first node.
  LAUNCH+=(--rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:${MASTER_PORT:-29500}")
else
  LAUNCH+=(--standalone)
fi
unset _repo

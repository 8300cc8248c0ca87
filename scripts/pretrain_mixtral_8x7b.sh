#!/usr/bin/env bash
# Mixtral 8x7B shape: 8 experts, top-2. Default layout: 4 nodes of 8 GPUs, PP=4 x EP=8 (each
# GPU holds one expert of each of its 8 layers; attention and the router are replicated and
# data-parallel). tools/estimate_memory.py puts its largest rank at 30 GiB; on one node
# (NNODES=1 PP=1) each GPU would need 109 GiB, the expert Adam state alone 65 GiB (H200 only).
# Usage: DATA_PATH=... TOKENIZER_MODEL=tokenizer.model bash scripts/pretrain_mixtral_8x7b.sh
# Knobs: EP (expert-parallel size), TP (with --sequence-parallel), PP, DISPATCHER (alltoall|allgather).
set -euo pipefail
cd "$(dirname "$0")/.."
export NNODES=${NNODES:-4}
source scripts/launch_env.sh
CHECKPOINT_PATH=${CHECKPOINT_PATH:-checkpoints/mixtral_8x7b}
exec "${LAUNCH[@]}" pretrain_llama.py \
  --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 \
  --group-query-attention --num-query-groups 8 \
  --seq-length 4096 --max-position-embeddings 32768 --norm-epsilon 1e-5 --rotary-base 1000000 \
  --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 14336 \
  --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2 \
  --moe-token-dispatcher-type "${DISPATCHER:-alltoall}" --moe-grouped-gemm \
  --expert-model-parallel-size "${EP:-8}" \
  --tensor-model-parallel-size "${TP:-1}" --pipeline-model-parallel-size "${PP:-4}" \
  ${TP:+--sequence-parallel} \
  --micro-batch-size 1 --global-batch-size 256 \
  --lr 1.0e-4 --min-lr 1.0e-5 --lr-decay-style cosine --lr-warmup-iters 500 \
  --train-iters 100000 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 \
  --bf16 --use-distributed-optimizer --overlap-grad-reduce \
  --recompute-granularity full --recompute-method uniform --recompute-num-layers 1 \
  --data-path "${DATA_PATH:?set DATA_PATH}" --tokenizer-type SentencePieceTokenizer \
  --tokenizer-model "${TOKENIZER_MODEL:?set TOKENIZER_MODEL}" --split 969,30,1 \
  --log-interval 1 --eval-interval 1000 --eval-iters 10 \
  --save-interval 1000 --save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH" \
  --tensorboard-dir "$CHECKPOINT_PATH/tensorboard" "$@"

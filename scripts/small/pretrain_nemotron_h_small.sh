#!/usr/bin/env bash
# A small Nemotron-H-style hybrid on CPU (a few minutes on 2 cores): Megatron's
# --hybrid-layer-pattern with Mamba-2 (M), attention (*), squared-ReLU MLP (-) and
# sigmoid-routed MoE (E) layers, the | break putting 3 layers on each of 2 pipeline stages,
# mock data. Extra arguments go to pretrain_hybrid.py (e.g. --train-iters 50).
set -euo pipefail
cd "$(dirname "$0")/../.."
NPROC_PER_NODE=${NPROC_PER_NODE:-2}  # a CPU-sized run: 2 processes
source scripts/launch_env.sh
OUT=${OUT:-checkpoints/nemotron_h_small}
exec "${LAUNCH[@]}" pretrain_hybrid.py \
  --hybrid-layer-pattern "M-E|M*-" --pipeline-model-parallel-size 2 \
  --hidden-size 256 --ffn-hidden-size 512 --num-attention-heads 8 \
  --group-query-attention --num-query-groups 2 --position-embedding-type none --squared-relu \
  --mamba-num-heads 8 --mamba-head-dim 32 --mamba-num-groups 2 --mamba-state-dim 32 \
  --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 128 \
  --moe-router-score-function sigmoid --moe-router-enable-expert-bias \
  --moe-router-load-balancing-type none --moe-shared-expert-intermediate-size 256 \
  --normalization RMSNorm --disable-bias-linear --untie-embeddings-and-output-weights \
  --seq-length 256 --max-position-embeddings 256 \
  --micro-batch-size 2 --global-batch-size 8 \
  --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 5 --train-iters 40 \
  --mock-data --tokenizer-type NullTokenizer --vocab-size 1000 --distributed-backend gloo \
  --log-interval 10 --log-throughput --eval-interval 20 --eval-iters 2 \
  --tensorboard-dir "$OUT/tensorboard" "$@"

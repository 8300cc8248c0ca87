#!/usr/bin/env bash
# A small Qwen3-Next / Qwen3.5-style model on CPU (a few minutes on 2 cores): Gated DeltaNet on
# 3 of every 4 layers, gated full attention with per-head q/k norms and partial RoPE on the
# 4th, zero-centred norms, 8 experts top-2 with a gated shared expert, TP=2 with sequence
# parallelism, mock data. Extra arguments go to pretrain_gpt.py (e.g. --train-iters 50).
set -euo pipefail
cd "$(dirname "$0")/../.."
NPROC_PER_NODE=${NPROC_PER_NODE:-2}  # a CPU-sized run: 2 processes
source scripts/launch_env.sh
OUT=${OUT:-checkpoints/qwen3_next_small}
exec "${LAUNCH[@]}" pretrain_gpt.py \
  --num-layers 4 --hidden-size 256 --num-attention-heads 8 --kv-channels 64 \
  --group-query-attention --num-query-groups 2 --qk-layernorm --attention-output-gate \
  --experimental-attention-variant gated_delta_net --linear-attention-freq 4 \
  --linear-num-key-heads 2 --linear-num-value-heads 4 --linear-key-head-dim 32 \
  --linear-value-head-dim 32 \
  --normalization RMSNorm --apply-layernorm-1p --swiglu --ffn-hidden-size 512 \
  --position-embedding-type rope --rotary-percent 0.25 --disable-bias-linear \
  --untie-embeddings-and-output-weights --hidden-dropout 0.0 --attention-dropout 0.0 \
  --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 128 \
  --moe-shared-expert-intermediate-size 256 --moe-shared-expert-gate \
  --tensor-model-parallel-size 2 --sequence-parallel \
  --seq-length 256 --max-position-embeddings 256 \
  --micro-batch-size 2 --global-batch-size 8 \
  --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 5 --train-iters 40 \
  --mock-data --tokenizer-type NullTokenizer --vocab-size 1000 --distributed-backend gloo \
  --log-interval 10 --log-throughput --eval-interval 20 --eval-iters 2 \
  --tensorboard-dir "$OUT/tensorboard" "$@"

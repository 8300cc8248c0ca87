#!/usr/bin/env bash
# A small Gemma 3-style model on CPU, 2 processes (TP=2 + SP), mock data: every Gemma 3
# feature (5:1 sliding/full layers with their own RoPE bases, linear x8 RoPE scaling on the
# full layers as in the 4B-27B models, sandwich and (1 + w) norms, q/k norms, scaled
# embeddings, query_pre_attn_scalar 64, GeGLU, tied embeddings) at a size that trains in
# seconds. Extra arguments go to pretrain_gpt.py (e.g. --train-iters 50, or
# --tensor-model-parallel-size 1 --pipeline-model-parallel-size 2 instead of TP).
set -euo pipefail
cd "$(dirname "$0")/../.."
NPROC_PER_NODE=${NPROC_PER_NODE:-2}  # a CPU-sized run: 2 processes
source scripts/launch_env.sh
exec "${LAUNCH[@]}" pretrain_gpt.py \
  --num-layers 6 --hidden-size 128 --ffn-hidden-size 256 --num-attention-heads 4 \
  --kv-channels 48 --group-query-attention --num-query-groups 2 \
  --normalization RMSNorm --norm-epsilon 1e-6 --apply-layernorm-1p --qk-layernorm \
  --sandwich-norm --apply-embedding-scaling --geglu --disable-bias-linear \
  --position-embedding-type rope --rotary-base 1000000 \
  --rotary-seq-len-interpolation-factor 8 --local-rotary-base 10000 \
  --window-size 31,0 --window-attn-skip-freq 6 --softmax-scale 0.125 \
  --tensor-model-parallel-size "${TP:-2}" --sequence-parallel \
  --seq-length 128 --max-position-embeddings 128 --hidden-dropout 0 --attention-dropout 0 \
  --micro-batch-size 4 --global-batch-size 8 \
  --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 5 \
  --train-iters 40 --weight-decay 0.1 --clip-grad 1.0 \
  --mock-data --tokenizer-type NullTokenizer --vocab-size 1000 \
  --distributed-backend gloo --log-interval 5 --log-throughput \
  --eval-interval 1000 --eval-iters 1 "$@"

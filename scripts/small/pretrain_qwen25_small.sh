#!/usr/bin/env bash
# A small Qwen2.5-style model on CPU (a few minutes on 2 cores): GQA, q/k/v biases only, RMSNorm,
# SwiGLU, tied head (Qwen2.5 up to 3B; pretrain_gpt.py, since pretrain_llama.py unties), YaRN
# over an original context of 64 under a 256-token sequence, context parallelism 2, mock data.
# Extra arguments go to pretrain_gpt.py (e.g. --train-iters 50).
set -euo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=1
exec ${TORCHRUN:-.venv/bin/torchrun} --standalone --nproc-per-node 2 pretrain_gpt.py \
  --num-layers 4 --hidden-size 256 --ffn-hidden-size 704 --num-attention-heads 8 \
  --group-query-attention --num-query-groups 2 \
  --normalization RMSNorm --norm-epsilon 1e-6 --swiglu --disable-bias-linear --add-qkv-bias \
  --hidden-dropout 0 --attention-dropout 0 \
  --seq-length 256 --max-position-embeddings 1024 --rotary-base 1000000 \
  --position-embedding-type yarn --rotary-scaling-factor 4 \
  --yarn-original-max-position-embeddings 64 \
  --context-parallel-size 2 \
  --micro-batch-size 4 --global-batch-size 8 \
  --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 5 --train-iters 40 \
  --mock-data --tokenizer-type NullTokenizer --vocab-size 1000 --distributed-backend gloo \
  --log-interval 10 --log-throughput --eval-interval 20 --eval-iters 2 "$@"

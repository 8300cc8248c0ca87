#!/usr/bin/env bash
# A small Llama 3.1-style model on CPU (a few minutes on 2 cores): GQA, SwiGLU, Llama 3.1 RoPE
# scaling with an original context of 64 under a 256-token sequence, TP=2 with sequence
# parallelism, mock data. Extra arguments go to pretrain_llama.py (e.g. --train-iters 50).
set -euo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=1
exec ${TORCHRUN:-.venv/bin/torchrun} --standalone --nproc-per-node 2 pretrain_llama.py \
  --num-layers 4 --hidden-size 256 --ffn-hidden-size 704 --num-attention-heads 8 \
  --group-query-attention --num-query-groups 2 \
  --seq-length 256 --max-position-embeddings 1024 --rotary-base 500000 \
  --use-rope-scaling --rope-scaling-factor 8 --rope-scaling-original-max-position-embeddings 64 \
  --tensor-model-parallel-size 2 --sequence-parallel \
  --micro-batch-size 4 --global-batch-size 8 \
  --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 5 --train-iters 40 \
  --mock-data --tokenizer-type NullTokenizer --vocab-size 1000 --distributed-backend gloo \
  --log-interval 10 --log-throughput --eval-interval 20 --eval-iters 2 "$@"

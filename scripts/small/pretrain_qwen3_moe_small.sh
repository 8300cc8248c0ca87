#!/usr/bin/env bash
# A small Qwen3-MoE-style model on CPU (a few minutes on 2 cores): per-head query/key norms,
# head dim 48 (8 x 48 != 256), 8 experts top-2 renormalised in every layer with the
# load-balancing loss, expert parallelism 2 with all-to-all dispatch, mock data, per-layer
# router losses in TensorBoard. Extra arguments go to pretrain_llama.py (e.g. --train-iters 50).
set -euo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=1
OUT=${OUT:-checkpoints/qwen3_moe_small}
exec ${TORCHRUN:-.venv/bin/torchrun} --standalone --nproc-per-node 2 pretrain_llama.py \
  --num-layers 4 --hidden-size 256 --ffn-hidden-size 704 --num-attention-heads 8 \
  --kv-channels 48 --group-query-attention --num-query-groups 2 --qk-layernorm \
  --seq-length 256 --max-position-embeddings 1024 --norm-epsilon 1e-6 --rotary-base 1000000 \
  --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 128 \
  --moe-aux-loss-coeff 1e-3 --moe-token-dispatcher-type alltoall \
  --expert-model-parallel-size 2 \
  --micro-batch-size 4 --global-batch-size 8 \
  --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 5 --train-iters 40 \
  --mock-data --tokenizer-type NullTokenizer --vocab-size 1000 --distributed-backend gloo \
  --log-interval 10 --log-throughput --eval-interval 20 --eval-iters 2 \
  --moe-per-layer-logging --tensorboard-dir "$OUT/tensorboard" "$@"

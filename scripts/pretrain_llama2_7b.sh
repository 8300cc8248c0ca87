#!/usr/bin/env bash
# Llama-2 7B shape (TP=2 by default). Usage: DATA_PATH=... TOKENIZER_MODEL=tokenizer.model bash scripts/pretrain_llama2_7b.sh
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/launch_env.sh
CHECKPOINT_PATH=${CHECKPOINT_PATH:-checkpoints/llama2_7b}
exec "${LAUNCH[@]}" pretrain_llama.py \
  --num-layers 32 --hidden-size 4096 --ffn-hidden-size 11008 --num-attention-heads 32 \
  --seq-length 4096 --max-position-embeddings 4096 --norm-epsilon 1e-5 \
  --tensor-model-parallel-size "${TP:-2}" --pipeline-model-parallel-size "${PP:-1}" --sequence-parallel \
  --micro-batch-size 1 --global-batch-size 1024 \
  --lr 3.0e-4 --min-lr 3.0e-5 --lr-decay-style cosine --lr-warmup-iters 2000 \
  --train-iters 250000 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 \
  --bf16 --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather \
  --recompute-granularity selective \
  --data-path "${DATA_PATH:?set DATA_PATH}" --tokenizer-type SentencePieceTokenizer \
  --tokenizer-model "${TOKENIZER_MODEL:?set TOKENIZER_MODEL}" --split 969,30,1 \
  --log-interval 1 --eval-interval 1000 --eval-iters 10 \
  --save-interval 1000 --save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH" \
  --tensorboard-dir "$CHECKPOINT_PATH/tensorboard" "$@"

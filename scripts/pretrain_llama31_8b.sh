#!/usr/bin/env bash
# Llama 3.1 8B shape: GQA 32/8, SwiGLU 14336, RoPE base 500000 with Llama 3.1's scaling
# (factor 8, low/high-frequency factors 1/4, original context 8192), 128k vocabulary.
# Usage: DATA_PATH=... TOKENIZER_MODEL=meta-llama/Llama-3.1-8B bash scripts/pretrain_llama31_8b.sh
# (a local HF tokenizer directory). From an HF checkpoint: convert it first with
#   tools/checkpoint/convert.py --model-type llama --loader hf --saver megatron_smp ...
# and add --load DIR --finetune. Knobs: TP (with --sequence-parallel), PP, CP.
set -euo pipefail
cd "$(dirname "$0")/.."
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NNODES=${NNODES:-1}
CHECKPOINT_PATH=${CHECKPOINT_PATH:-checkpoints/llama31_8b}
exec ${TORCHRUN:-.venv/bin/torchrun} --nproc-per-node "$GPUS_PER_NODE" --nnodes "$NNODES" \
  ${MASTER_ADDR:+--rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:${MASTER_PORT:-29500}"} \
  pretrain_llama.py \
  --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 \
  --group-query-attention --num-query-groups 8 \
  --seq-length 8192 --max-position-embeddings 131072 --norm-epsilon 1e-5 \
  --rotary-base 500000 --use-rope-scaling --rope-scaling-factor 8 \
  --tensor-model-parallel-size "${TP:-2}" --pipeline-model-parallel-size "${PP:-1}" \
  --context-parallel-size "${CP:-1}" --sequence-parallel \
  --micro-batch-size 1 --global-batch-size 512 \
  --lr 3.0e-4 --min-lr 3.0e-5 --lr-decay-style cosine --lr-warmup-iters 2000 \
  --train-iters 250000 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 \
  --bf16 --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather \
  --recompute-granularity selective \
  --data-path "${DATA_PATH:?set DATA_PATH}" --tokenizer-type HuggingFaceTokenizer \
  --tokenizer-model "${TOKENIZER_MODEL:?set TOKENIZER_MODEL}" --split 969,30,1 \
  --log-interval 1 --log-throughput --eval-interval 1000 --eval-iters 10 \
  --save-interval 1000 --save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH" \
  --tensorboard-dir "$CHECKPOINT_PATH/tensorboard" "$@"

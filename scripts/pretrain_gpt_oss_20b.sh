#!/usr/bin/env bash
# gpt-oss-20b shape (openai/gpt-oss-20b's config.json): 24 layers, hidden 2880, 64 heads of 64
# with 8 query groups, attention sinks, sliding window 128 on every other layer (sliding
# first), YaRN x32 from 4096 positions, 32 experts top-4 of width 2880 with the clamped
# (+1) quick-GeGLU, biases everywhere, untied head. EP=8 on one node by default.
# Usage: DATA_PATH=... TOKENIZER_MODEL=openai/gpt-oss-20b bash scripts/pretrain_gpt_oss_20b.sh
# Fine-tune the published weights: convert them first (MXFP4 experts dequantized to bf16),
#   .venv/bin/python tools/checkpoint/convert.py --model-type gpt_oss --loader hf \
#       --saver megatron_smp --load-dir gpt-oss-20b --save-dir checkpoints/gpt_oss_20b
# then run this script with --finetune. Knobs: EP, TP (with --sequence-parallel), PP, CP.
set -euo pipefail
cd "$(dirname "$0")/.."
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NNODES=${NNODES:-1}
CHECKPOINT_PATH=${CHECKPOINT_PATH:-checkpoints/gpt_oss_20b}
exec ${TORCHRUN:-.venv/bin/torchrun} --nproc-per-node "$GPUS_PER_NODE" --nnodes "$NNODES" \
  ${MASTER_ADDR:+--rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:${MASTER_PORT:-29500}"} \
  pretrain_gpt.py \
  --num-layers 24 --hidden-size 2880 --ffn-hidden-size 2880 --num-attention-heads 64 \
  --kv-channels 64 --group-query-attention --num-query-groups 8 \
  --normalization RMSNorm --norm-epsilon 1e-5 --untie-embeddings-and-output-weights \
  --softmax-type learnable --window-size 127,0 --window-attn-skip-freq 2 \
  --position-embedding-type yarn --rotary-base 150000 --rotary-scaling-factor 32 \
  --yarn-original-max-position-embeddings 4096 --no-yarn-correction-range-round-to-int \
  --quick-geglu --glu-linear-offset 1.0 --activation-func-clamp-value 7.0 \
  --num-experts 32 --moe-router-topk 4 --moe-ffn-hidden-size 2880 \
  --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 0.9 \
  --moe-token-dispatcher-type alltoall --moe-grouped-gemm \
  --expert-model-parallel-size "${EP:-8}" \
  --tensor-model-parallel-size "${TP:-1}" --pipeline-model-parallel-size "${PP:-1}" \
  --context-parallel-size "${CP:-1}" ${TP:+--sequence-parallel} \
  --seq-length 4096 --max-position-embeddings 131072 \
  --hidden-dropout 0 --attention-dropout 0 \
  --micro-batch-size 1 --global-batch-size 128 \
  --lr 1.0e-5 --min-lr 1.0e-6 --lr-decay-style cosine --lr-warmup-iters 100 \
  --train-iters 10000 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 \
  --bf16 --use-distributed-optimizer --overlap-grad-reduce \
  --recompute-granularity full --recompute-method uniform --recompute-num-layers 1 \
  --data-path "${DATA_PATH:?set DATA_PATH}" --tokenizer-type HuggingFaceTokenizer \
  --tokenizer-model "${TOKENIZER_MODEL:?set TOKENIZER_MODEL}" --split 969,30,1 \
  --log-interval 1 --log-throughput --eval-interval 1000 --eval-iters 10 \
  --save-interval 1000 --save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH" \
  --tensorboard-dir "$CHECKPOINT_PATH/tensorboard" "$@"

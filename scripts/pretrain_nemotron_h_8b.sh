#!/usr/bin/env bash
# Nemotron-H-8B shape: 52 layers by Megatron's --hybrid-layer-pattern (24 Mamba-2, 4 attention,
# 24 squared-ReLU MLP layers), hidden 4096, Mamba-2 with 128 heads of 64 in 8 groups and state
# 128, 32 query heads over 8 groups without position embedding, MLP width 21504.
# TP=4 with sequence parallelism on one node by default (heads and Mamba groups split 4 ways).
# Usage: DATA_PATH=... TOKENIZER_MODEL=nvidia/Nemotron-H-8B-Base-8K bash scripts/pretrain_nemotron_h_8b.sh
# From an HF checkpoint: tools/checkpoint/convert.py --model-type nemotron_h --loader hf
# --saver megatron_smp ..., then --load DIR --finetune. Knobs: TP, PP.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/launch_env.sh
CHECKPOINT_PATH=${CHECKPOINT_PATH:-checkpoints/nemotron_h_8b}
exec "${LAUNCH[@]}" \
  pretrain_hybrid.py \
  --hybrid-layer-pattern "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-" \
  --hidden-size 4096 --ffn-hidden-size 21504 --num-attention-heads 32 --kv-channels 128 \
  --group-query-attention --num-query-groups 8 --position-embedding-type none --squared-relu \
  --mamba-num-heads 128 --mamba-head-dim 64 --mamba-num-groups 8 --mamba-state-dim 128 \
  --normalization RMSNorm --norm-epsilon 1e-5 --disable-bias-linear \
  --untie-embeddings-and-output-weights --hidden-dropout 0.0 --attention-dropout 0.0 \
  --seq-length 8192 --max-position-embeddings 8192 \
  --tensor-model-parallel-size "${TP:-4}" --sequence-parallel \
  --pipeline-model-parallel-size "${PP:-1}" \
  --micro-batch-size 1 --global-batch-size 768 \
  --lr 3.0e-4 --min-lr 3.0e-6 --lr-decay-style cosine --lr-warmup-iters 2000 \
  --train-iters 100000 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 \
  --bf16 --use-distributed-optimizer --overlap-grad-reduce \
  --data-path "${DATA_PATH:?set DATA_PATH}" --tokenizer-type HuggingFaceTokenizer \
  --tokenizer-model "${TOKENIZER_MODEL:?set TOKENIZER_MODEL}" --split 969,30,1 \
  --log-interval 1 --log-throughput --eval-interval 1000 --eval-iters 10 \
  --save-interval 1000 --save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH" \
  --tensorboard-dir "$CHECKPOINT_PATH/tensorboard" "$@"

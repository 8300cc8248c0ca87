#!/usr/bin/env bash
# Qwen3-30B-A3B shape: 48 layers, hidden 2048, 32 query heads of 128 channels over 4 groups
# (heads x head dim 4096 != hidden), per-head query/key RMSNorms (--qk-layernorm), 128 experts
# of width 768 in every layer, top-8 renormalised, load-balancing loss 1e-3, RoPE base 1e6.
# EP=8 on one node by default (16 experts per GPU).
# Usage: DATA_PATH=... TOKENIZER_MODEL=Qwen/Qwen3-30B-A3B bash scripts/pretrain_qwen3_moe_30b_a3b.sh
# From an HF checkpoint: tools/checkpoint/convert.py --model-type qwen3_moe --loader hf
# --saver megatron_smp ..., then --load DIR --finetune. Knobs: EP, TP (+SP), PP, CP,
# DISPATCHER (alltoall|allgather).
set -euo pipefail
cd "$(dirname "$0")/.."
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NNODES=${NNODES:-1}
CHECKPOINT_PATH=${CHECKPOINT_PATH:-checkpoints/qwen3_moe_30b_a3b}
exec ${TORCHRUN:-.venv/bin/torchrun} --nproc-per-node "$GPUS_PER_NODE" --nnodes "$NNODES" \
  ${MASTER_ADDR:+--rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:${MASTER_PORT:-29500}"} \
  pretrain_llama.py \
  --num-layers 48 --hidden-size 2048 --ffn-hidden-size 6144 --num-attention-heads 32 \
  --kv-channels 128 --group-query-attention --num-query-groups 4 --qk-layernorm \
  --seq-length 4096 --max-position-embeddings 40960 --norm-epsilon 1e-6 --rotary-base 1000000 \
  --num-experts 128 --moe-router-topk 8 --moe-ffn-hidden-size 768 \
  --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-3 \
  --moe-token-dispatcher-type "${DISPATCHER:-alltoall}" --moe-grouped-gemm \
  --expert-model-parallel-size "${EP:-8}" \
  --tensor-model-parallel-size "${TP:-1}" --pipeline-model-parallel-size "${PP:-1}" \
  --context-parallel-size "${CP:-1}" ${TP:+--sequence-parallel} \
  --micro-batch-size 1 --global-batch-size 256 \
  --lr 3.0e-4 --min-lr 3.0e-5 --lr-decay-style cosine --lr-warmup-iters 2000 \
  --train-iters 100000 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 \
  --bf16 --use-distributed-optimizer --overlap-grad-reduce \
  --recompute-granularity full --recompute-method uniform --recompute-num-layers 1 \
  --data-path "${DATA_PATH:?set DATA_PATH}" --tokenizer-type HuggingFaceTokenizer \
  --tokenizer-model "${TOKENIZER_MODEL:?set TOKENIZER_MODEL}" --split 969,30,1 \
  --log-interval 1 --log-throughput --eval-interval 1000 --eval-iters 10 \
  --save-interval 1000 --save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH" \
  --tensorboard-dir "$CHECKPOINT_PATH/tensorboard" "$@"

#!/usr/bin/env bash
# Qwen3-Next-80B-A3B shape (Qwen3.5 is the same stack): 48 layers, Gated DeltaNet (16 key heads
# of 128 serving 32 value heads of 128) on 3 of every 4 layers (--linear-attention-freq 4),
# gated full attention (--attention-output-gate, 16 query heads of 256 over 2 groups,
# per-head q/k norms, RoPE on a quarter of each head) on the 4th; zero-centred norms; 512
# experts of width 512, top-10 renormalised, and a sigmoid-gated shared expert in every layer.
# EP=8 on one node by default. Usage: DATA_PATH=... TOKENIZER_MODEL=Qwen/Qwen3-Next-80B-A3B-Instruct
# bash scripts/pretrain_qwen3_next_80b_a3b.sh. From an HF checkpoint: tools/checkpoint/convert.py
# --model-type qwen3_next (Qwen3.5: qwen3_5 / qwen3_5_moe) --loader hf --saver megatron_smp ...
# Knobs: EP, TP (+SP), PP.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/launch_env.sh
CHECKPOINT_PATH=${CHECKPOINT_PATH:-checkpoints/qwen3_next_80b_a3b}
exec "${LAUNCH[@]}" \
  pretrain_gpt.py \
  --num-layers 48 --hidden-size 2048 --num-attention-heads 16 --kv-channels 256 \
  --group-query-attention --num-query-groups 2 --qk-layernorm --attention-output-gate \
  --experimental-attention-variant gated_delta_net --linear-attention-freq 4 \
  --linear-num-key-heads 16 --linear-num-value-heads 32 --linear-key-head-dim 128 \
  --linear-value-head-dim 128 --linear-conv-kernel-dim 4 \
  --normalization RMSNorm --apply-layernorm-1p --norm-epsilon 1e-6 --swiglu \
  --ffn-hidden-size 5120 --position-embedding-type rope --rotary-percent 0.25 \
  --rotary-base 10000000 --disable-bias-linear --untie-embeddings-and-output-weights \
  --hidden-dropout 0.0 --attention-dropout 0.0 \
  --num-experts 512 --moe-router-topk 10 --moe-ffn-hidden-size 512 \
  --moe-shared-expert-intermediate-size 512 --moe-shared-expert-gate \
  --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-3 \
  --moe-token-dispatcher-type alltoall --expert-model-parallel-size "${EP:-8}" \
  --tensor-model-parallel-size "${TP:-1}" --pipeline-model-parallel-size "${PP:-1}" \
  ${TP:+--sequence-parallel} \
  --seq-length 4096 --max-position-embeddings 262144 \
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

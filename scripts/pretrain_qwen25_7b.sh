#!/usr/bin/env bash
# Qwen2.5-7B shape: GQA 28/4, q/k/v biases without an output bias (--add-qkv-bias
# --disable-bias-linear), SwiGLU 18944, RoPE base 1e6, untied head, 152k vocabulary. YARN=1
# adds Qwen's long-context YaRN (factor 4 over the original 32768 positions).
# Usage: DATA_PATH=... TOKENIZER_MODEL=Qwen/Qwen2.5-7B bash scripts/pretrain_qwen25_7b.sh
# (a local HF tokenizer directory). From an HF checkpoint: tools/checkpoint/convert.py
# --model-type qwen2 --loader hf --saver megatron_smp ..., then --load DIR --finetune.
# Knobs: TP (with --sequence-parallel), PP, CP, YARN.
set -euo pipefail
cd "$(dirname "$0")/.."
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NNODES=${NNODES:-1}
CHECKPOINT_PATH=${CHECKPOINT_PATH:-checkpoints/qwen25_7b}
ROPE=(--position-embedding-type rope)
if [ -n "${YARN:-}" ]; then
  ROPE=(--position-embedding-type yarn --rotary-scaling-factor 4
        --yarn-original-max-position-embeddings 32768)
fi
exec ${TORCHRUN:-.venv/bin/torchrun} --nproc-per-node "$GPUS_PER_NODE" --nnodes "$NNODES" \
  ${MASTER_ADDR:+--rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:${MASTER_PORT:-29500}"} \
  pretrain_llama.py \
  --num-layers 28 --hidden-size 3584 --ffn-hidden-size 18944 --num-attention-heads 28 \
  --group-query-attention --num-query-groups 4 --add-qkv-bias \
  --seq-length 4096 --max-position-embeddings 32768 --norm-epsilon 1e-6 \
  --rotary-base 1000000 "${ROPE[@]}" \
  --tensor-model-parallel-size "${TP:-4}" --pipeline-model-parallel-size "${PP:-1}" \
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

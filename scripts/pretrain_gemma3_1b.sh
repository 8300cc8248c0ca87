#!/usr/bin/env bash
# Gemma 3 1B shape (google/gemma-3-1b-pt's config.json): 26 layers, hidden 1152, 4 heads of 256
# with 1 query group, GeGLU 6912, sandwich and (1 + w) RMSNorms, q/k norms, embeddings times
# sqrt(1152), scores times 256**-0.5, sliding window 512 on five of every six layers (RoPE
# base 10k there, 1M on the full layers), vocabulary 262144, tied embeddings. One query group
# keeps TP at 1: data parallel with the distributed optimizer on one node by default.
# Usage: DATA_PATH=... TOKENIZER_MODEL=google/gemma-3-1b-pt bash scripts/pretrain_gemma3_1b.sh
# Fine-tune the published weights: convert them first,
#   .venv/bin/python tools/checkpoint/convert.py --model-type gemma3 --loader hf \
#       --saver megatron_smp --load-dir gemma-3-1b-pt --save-dir checkpoints/gemma3_1b
# then run this script with --finetune. Knobs: PP, CP. The 4B-27B models (multimodal; the
# same convert.py command reads their language model) add linear RoPE scaling on the full
# layers: --rotary-seq-len-interpolation-factor 8.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/launch_env.sh
CHECKPOINT_PATH=${CHECKPOINT_PATH:-checkpoints/gemma3_1b}
exec "${LAUNCH[@]}" \
  pretrain_gpt.py \
  --num-layers 26 --hidden-size 1152 --ffn-hidden-size 6912 --num-attention-heads 4 \
  --kv-channels 256 --group-query-attention --num-query-groups 1 \
  --normalization RMSNorm --norm-epsilon 1e-6 --apply-layernorm-1p --qk-layernorm \
  --sandwich-norm --apply-embedding-scaling --geglu --disable-bias-linear \
  --position-embedding-type rope --rotary-base 1000000 --local-rotary-base 10000 \
  --window-size 511,0 --window-attn-skip-freq 6 --softmax-scale 0.0625 \
  --pipeline-model-parallel-size "${PP:-1}" --context-parallel-size "${CP:-1}" \
  --seq-length 8192 --max-position-embeddings 32768 \
  --hidden-dropout 0 --attention-dropout 0 \
  --micro-batch-size 1 --global-batch-size 256 \
  --lr 1.0e-5 --min-lr 1.0e-6 --lr-decay-style cosine --lr-warmup-iters 100 \
  --train-iters 10000 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 \
  --bf16 --use-distributed-optimizer --overlap-grad-reduce \
  --recompute-granularity selective \
  --data-path "${DATA_PATH:?set DATA_PATH}" --tokenizer-type HuggingFaceTokenizer \
  --tokenizer-model "${TOKENIZER_MODEL:?set TOKENIZER_MODEL}" --split 969,30,1 \
  --log-interval 1 --log-throughput --eval-interval 1000 --eval-iters 10 \
  --save-interval 1000 --save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH" \
  --tensorboard-dir "$CHECKPOINT_PATH/tensorboard" "$@"

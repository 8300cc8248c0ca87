#!/usr/bin/env bash
# GPT-3 125M-shaped pretraining, written exactly as a Megatron-LM user would write it.
# Usage: GPUS_PER_NODE=8 DATA_PATH=my-corpus_text_document VOCAB=gpt2-vocab.json MERGES=gpt2-merges.txt \
#        bash scripts/pretrain_gpt_125m.sh
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/launch_env.sh
TP=${TP:-1}
PP=${PP:-1}
CHECKPOINT_PATH=${CHECKPOINT_PATH:-checkpoints/gpt_125m}

GPT_ARGS=(
  --num-layers 12 --hidden-size 768 --num-attention-heads 12
  --seq-length 2048 --max-position-embeddings 2048
  --micro-batch-size 4 --global-batch-size 256
  --lr 6.0e-4 --min-lr 6.0e-5 --lr-decay-style cosine --lr-warmup-fraction 0.01
  --train-iters 500000 --lr-decay-iters 430000
  --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0
  --init-method-std 0.02 --bf16
  --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
  --use-distributed-optimizer --overlap-grad-reduce --sequence-parallel
)
DATA_ARGS=(
  --data-path "${DATA_PATH:?set DATA_PATH to a preprocessed prefix}"
  --tokenizer-type GPT2BPETokenizer --vocab-file "${VOCAB:?}" --merge-file "${MERGES:?}"
  --split 949,50,1
)
OUTPUT_ARGS=(
  --log-interval 10 --eval-interval 1000 --eval-iters 10
  --save-interval 1000 --save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH"
  --tensorboard-dir "$CHECKPOINT_PATH/tensorboard"
)
exec "${LAUNCH[@]}" pretrain_gpt.py "${GPT_ARGS[@]}" "${DATA_ARGS[@]}" "${OUTPUT_ARGS[@]}" "$@"

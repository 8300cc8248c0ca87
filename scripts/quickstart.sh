#!/usr/bin/env bash
# From a fresh clone to a trained small GPT on real text, on CPU, in a few minutes:
#   1. install (scripts/setup_env.sh),
#   2. train a 4k SentencePiece tokenizer on the bundled King James Bible (data/corpus/),
#   3. preprocess it into a Megatron-LM indexed dataset under data/generated/,
#   4. pretrain a 4-layer GPT on 2 processes and print the validation loss as it falls.
# Extra arguments go to pretrain_gpt.py (e.g. --train-iters 50).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh

CORPUS=data/corpus/kjv.jsonl.gz
OUT=data/generated
TOKENIZER="$OUT/kjv_sp4k.model"
PREFIX="$OUT/kjv"
mkdir -p "$OUT"

if [ ! -f "$TOKENIZER" ]; then
  .venv/bin/python tools/train_tokenizer.py --input "$CORPUS" --json-keys text \
    --model-prefix "${TOKENIZER%.model}" --vocab-size 4000
fi
if [ ! -f "${PREFIX}_text_document.idx" ] || [ "$TOKENIZER" -nt "${PREFIX}_text_document.idx" ]; then
  .venv/bin/python tools/preprocess_data.py --input "$CORPUS" --json-keys text \
    --output-prefix "$PREFIX" --tokenizer-type SentencePieceTokenizer \
    --tokenizer-model "$TOKENIZER" --append-eod --workers 2 --log-interval 400
fi

export OMP_NUM_THREADS=1
exec .venv/bin/torchrun --standalone --nproc-per-node 2 pretrain_gpt.py \
  --num-layers 4 --hidden-size 192 --num-attention-heads 4 \
  --seq-length 128 --max-position-embeddings 128 \
  --micro-batch-size 8 --global-batch-size 16 \
  --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 30 \
  --train-iters 300 --weight-decay 0.1 --clip-grad 1.0 \
  --data-path "${PREFIX}_text_document" --split 949,50,1 \
  --tokenizer-type SentencePieceTokenizer --tokenizer-model "$TOKENIZER" \
  --distributed-backend gloo \
  --log-interval 25 --eval-interval 100 --eval-iters 10 "$@"

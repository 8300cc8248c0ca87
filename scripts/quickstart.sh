#!/usr/bin/env bash
# From a fresh clone to a trained small GPT on real text, on CPU, in a few minutes:
#   1. install (scripts/setup_env.sh),
#   2. train a 4k SentencePiece tokenizer on the bundled King James Bible (data/corpus/),
#   3. preprocess it into a Megatron-LM indexed dataset under data/generated/,
#   4. pretrain a 4-layer GPT on 2 processes and print the validation loss as it falls,
#   5. sample a few completions from the trained checkpoint (tools/generate.py).
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

CKPT="$OUT/quickstart_ckpt"
export OMP_NUM_THREADS=1
.venv/bin/torchrun --standalone --nproc-per-node 2 pretrain_gpt.py \
  --num-layers 4 --hidden-size 192 --num-attention-heads 4 \
  --seq-length 128 --max-position-embeddings 128 \
  --micro-batch-size 8 --global-batch-size 16 \
  --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 30 \
  --train-iters 300 --weight-decay 0.1 --clip-grad 1.0 \
  --data-path "${PREFIX}_text_document" --split 949,50,1 \
  --tokenizer-type SentencePieceTokenizer --tokenizer-model "$TOKENIZER" \
  --distributed-backend gloo \
  --log-interval 25 --eval-interval 100 --eval-iters 10 --save "$CKPT" "$@"

# What did it learn? A few completions from the checkpoint it just saved.
PROMPTS="$OUT/quickstart_prompts.jsonl"
printf '%s\n' '{"prompt": "In the beginning"}' '{"prompt": "And God said unto Moses,"}' \
  '{"prompt": "The LORD is my shepherd;"}' > "$PROMPTS"
.venv/bin/python tools/generate.py --load "$CKPT" --use-checkpoint-args \
  --tokenizer-type SentencePieceTokenizer --tokenizer-model "$TOKENIZER" \
  --input "$PROMPTS" --output "$OUT/quickstart_completions.jsonl" \
  --max-new-tokens 40 --temperature 0.7 --top-k 40
.venv/bin/python - "$OUT/quickstart_completions.jsonl" <<'PY'
import json, sys
print("\nCompletions from the model just trained (temperature 0.7, top-k 40):")
for line in open(sys.argv[1]):
    record = json.loads(line)
    print(f"\n  {record['prompt']}{record['completion']}")
PY

#!/usr/bin/env bash
# LoRA chat fine-tuning of a Hugging Face Llama directory on packed conversations:
#
#   HF_MODEL=path/to/llama-hf scripts/finetune_llama_lora.sh [more pretrain_llama.py flags]
#
# 1. tokenises CHAT_DATA (chat JSON lines; default the bundled data/chat/tiny_chat.jsonl) with
#    the model's tokenizer and its chat template, loss only on the assistant's tokens
#    (tools/preprocess_sft_data.py);
# 2. converts the HF model to a megatron_smp checkpoint (tools/checkpoint/convert.py), once;
# 3. trains LoRA adapters on packed conversations (--sft; 10% of the conversations held out
#    for the validation loss), resuming from OUT/lora when it already holds a checkpoint
#    (small: the adapters and their optimizer state over the base OUT/base);
# 4. exports OUT/peft_adapter (peft.PeftModel.from_pretrained(HF model, it)) and
#    OUT/hf_merged (the adapters merged: from_pretrained as it is);
# 5. asks the fine-tuned model the first questions of CHAT_DATA (greedy, through its chat
#    template: tools/generate.py on the merged weights) and prints its answers.
# Settings (environment): HF_MODEL (required), TOKENIZER (default HF_MODEL: its tokenizer
# files with a chat template), CHAT_DATA, OUT (default runs/finetune_llama_lora), SEQ_LENGTH
# (2048), LORA_RANK (16), LORA_ALPHA (32), TP (1), MICRO_BATCH (1), GLOBAL_BATCH (8),
# TRAIN_ITERS (200), LR (1e-4); processes per node as in scripts/launch_env.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/launch_env.sh
: "${HF_MODEL:?set HF_MODEL to a Hugging Face Llama directory}"
TOKENIZER=${TOKENIZER:-$HF_MODEL}
CHAT_DATA=${CHAT_DATA:-data/chat/tiny_chat.jsonl}
OUT=${OUT:-runs/finetune_llama_lora}
SEQ_LENGTH=${SEQ_LENGTH:-2048}
mkdir -p "$OUT/data"

"$PYTHON" tools/preprocess_sft_data.py --input "$CHAT_DATA" --output-prefix "$OUT/data/chat" \
  --tokenizer-model "$TOKENIZER" --seq-length "$SEQ_LENGTH"
if [ ! -f "$OUT/base/latest_checkpointed_iteration.txt" ]; then
  "$PYTHON" tools/checkpoint/convert.py --model-type llama --loader hf --saver megatron_smp \
    --load-dir "$HF_MODEL" --save-dir "$OUT/base"
fi
# The base from OUT/base; OUT/lora's small checkpoints (adapters, their optimizer state) are
# resumed when there, else the adapters start at B = 0.
LOAD=(--pretrained-checkpoint "$OUT/base" --load "$OUT/lora")

"${LAUNCH[@]}" pretrain_llama.py \
  --sft --data-path "$OUT/data/chat_text_document" --split 90,10,0 \
  --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER" \
  --seq-length "$SEQ_LENGTH" --use-checkpoint-args "${LOAD[@]}" \
  --lora-rank "${LORA_RANK:-16}" --lora-alpha "${LORA_ALPHA:-32}" \
  --tensor-model-parallel-size "${TP:-1}" \
  --micro-batch-size "${MICRO_BATCH:-1}" --global-batch-size "${GLOBAL_BATCH:-8}" \
  --train-iters "${TRAIN_ITERS:-200}" --lr "${LR:-1e-4}" --min-lr 0 --lr-decay-style cosine \
  --lr-warmup-iters 10 --clip-grad 1.0 --weight-decay 0 \
  --hidden-dropout 0 --attention-dropout 0 \
  --log-interval 10 --eval-interval 50 --eval-iters 5 \
  --save "$OUT/lora" --save-interval 50 "$@"

rm -rf "$OUT/hf_merged" "$OUT/peft_adapter"   # this script's exports: written anew each run
"$PYTHON" tools/checkpoint/convert.py --model-type llama --loader megatron_smp --saver hf \
  --load-dir "$OUT/lora" --save-dir "$OUT/hf_merged" --peft-dir "$OUT/peft_adapter"

# What did it learn? The merged model answers the first questions of the data (greedy).
rm -rf "$OUT/merged"
"$PYTHON" tools/checkpoint/convert.py --model-type llama --loader hf --saver megatron_smp \
  --load-dir "$OUT/hf_merged" --save-dir "$OUT/merged"
"$PYTHON" - "$CHAT_DATA" "$OUT/questions.jsonl" <<'PY'
import json, sys
with open(sys.argv[1]) as source, open(sys.argv[2], "w") as out:
    asked = 0
    for line in source:
        messages = json.loads(line).get("messages")
        if messages and messages[-1]["role"] == "assistant" and asked < 3:
            out.write(json.dumps({"messages": messages[:-1]}) + "\n")
            asked += 1
PY
"$PYTHON" tools/generate.py --load "$OUT/merged" --use-checkpoint-args \
  --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER" \
  --input "$OUT/questions.jsonl" --output "$OUT/answers.jsonl" --max-new-tokens 48
"$PYTHON" - "$OUT/answers.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    record = json.loads(line)
    print(f"\n  {record['messages'][-1]['content']}\n  -> {record['completion'].strip()}")
PY

#!/usr/bin/env bash
# Chat SFT, then DPO, then export, of a Hugging Face Llama directory:
#
#   [HF_MODEL=path/to/llama-hf] scripts/dpo_llama.sh [more train_dpo.py flags]
#
# 0. without HF_MODEL, writes a small random Llama with a ChatML tokenizer trained on the
#    bundled chats (tools/make_tiny_llama.py) to OUT/hf_base, once;
# 1. tokenises CHAT_DATA (default data/chat/tiny_chat.jsonl) for --sft and PREFERENCE_DATA
#    (default data/chat/tiny_preference.jsonl, 76 pairs in TRL's layouts) with --preference
#    (tools/preprocess_sft_data.py), loss on the assistant's / the responses' tokens only;
# 2. converts the HF model to a megatron_smp checkpoint (tools/checkpoint/convert.py), once;
# 3. SFT: full fine-tuning on packed conversations (pretrain_llama.py --sft) into OUT/sft;
# 4. DPO: LoRA adapters over the SFT model, the SFT model itself (adapters off) as the
#    reference, TRL's sigmoid loss (train_dpo.py), into OUT/dpo; the log line shows
#    rewards/accuracies, rewards/margins, ... (resumes OUT/dpo when it holds a checkpoint);
# 5. exports OUT/peft_adapter (peft.PeftModel.from_pretrained(the SFT model in HF form, it)),
#    OUT/hf_sft and OUT/hf_dpo (the adapters merged: from_pretrained as it is).
# Settings (environment): HF_MODEL, TOKENIZER (default HF_MODEL), CHAT_DATA,
# PREFERENCE_DATA, OUT (default runs/dpo_llama), SEQ_LENGTH (256), TP (1), MICRO_BATCH (4),
# GLOBAL_BATCH (8), SFT_ITERS (60), DPO_ITERS (60), DPO_BETA (0.1), DPO_LOSS (sigmoid),
# LORA_RANK (16), LORA_ALPHA (32); processes per node as in scripts/launch_env.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/launch_env.sh
OUT=${OUT:-runs/dpo_llama}
CHAT_DATA=${CHAT_DATA:-data/chat/tiny_chat.jsonl}
PREFERENCE_DATA=${PREFERENCE_DATA:-data/chat/tiny_preference.jsonl}
SEQ_LENGTH=${SEQ_LENGTH:-256}
mkdir -p "$OUT/data"
if [ -z "${HF_MODEL:-}" ]; then
  HF_MODEL="$OUT/hf_base"
  [ -f "$HF_MODEL/config.json" ] || "$PYTHON" tools/make_tiny_llama.py --output "$HF_MODEL" \
    --texts "$CHAT_DATA" "$PREFERENCE_DATA"
fi
TOKENIZER=${TOKENIZER:-$HF_MODEL}

"$PYTHON" tools/preprocess_sft_data.py --input "$CHAT_DATA" --output-prefix "$OUT/data/chat" \
  --tokenizer-model "$TOKENIZER" --seq-length "$SEQ_LENGTH"
"$PYTHON" tools/preprocess_sft_data.py --preference --input "$PREFERENCE_DATA" \
  --output-prefix "$OUT/data/pairs" --tokenizer-model "$TOKENIZER" --seq-length "$SEQ_LENGTH"
if [ ! -f "$OUT/base/latest_checkpointed_iteration.txt" ]; then
  "$PYTHON" tools/checkpoint/convert.py --model-type llama --loader hf --saver megatron_smp \
    --load-dir "$HF_MODEL" --save-dir "$OUT/base"
fi
COMMON=(--tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER"
        --seq-length "$SEQ_LENGTH" --use-checkpoint-args
        --tensor-model-parallel-size "${TP:-1}"
        --micro-batch-size "${MICRO_BATCH:-4}" --global-batch-size "${GLOBAL_BATCH:-8}"
        --hidden-dropout 0 --attention-dropout 0 --weight-decay 0 --clip-grad 1.0
        --log-interval 5 --eval-iters 2)

if [ ! -f "$OUT/sft/latest_checkpointed_iteration.txt" ]; then
  "${LAUNCH[@]}" pretrain_llama.py "${COMMON[@]}" \
    --sft --data-path "$OUT/data/chat_text_document" --split 90,10,0 \
    --load "$OUT/base" --finetune --save "$OUT/sft" --save-interval "${SFT_ITERS:-60}" \
    --train-iters "${SFT_ITERS:-60}" --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine \
    --lr-warmup-iters 5 --eval-interval "${SFT_ITERS:-60}"
fi

"${LAUNCH[@]}" train_dpo.py "${COMMON[@]}" \
  --data-path "$OUT/data/pairs_text_document" --split 90,10,0 \
  --pretrained-checkpoint "$OUT/sft" --load "$OUT/dpo" --save "$OUT/dpo" \
  --save-interval 20 --lora-rank "${LORA_RANK:-16}" --lora-alpha "${LORA_ALPHA:-32}" \
  --dpo-beta "${DPO_BETA:-0.1}" --dpo-loss-type "${DPO_LOSS:-sigmoid}" \
  --dpo-reference adapters-off \
  --train-iters "${DPO_ITERS:-60}" --lr 2e-3 --min-lr 2e-4 --lr-decay-style cosine \
  --lr-warmup-iters 5 --eval-interval 20 "$@"

rm -rf "$OUT/hf_sft" "$OUT/hf_dpo" "$OUT/peft_adapter"   # this script's exports, anew each run
"$PYTHON" tools/checkpoint/convert.py --model-type llama --loader megatron_smp --saver hf \
  --load-dir "$OUT/sft" --save-dir "$OUT/hf_sft"
"$PYTHON" tools/checkpoint/convert.py --model-type llama --loader megatron_smp --saver hf \
  --load-dir "$OUT/dpo" --save-dir "$OUT/hf_dpo" --peft-dir "$OUT/peft_adapter"

#!/usr/bin/env bash
# A model that fits a CPU learns two-digit addition by SFT, then GRPO raises its exact-match
# reward (train_rl.py with rollouts from the in-framework inference engine):
#
#   scripts/grpo_addition.sh [more train_rl.py flags]
#
# 1. writes a small random Llama (4 layers x 128) with a byte-level tokenizer (one token per
#    character) and a "plain" chat template (prompt, then the answer and <|endoftext|>)
#    (tools/make_tiny_llama.py) and converts it (tools/checkpoint/convert.py);
# 2. SFT on SFT_EXAMPLES synthetic sums "a+b=" -> "a+b\n" (megatron_smp.post_training.envs
#    .addition --format sft, tools/preprocess_sft_data.py, pretrain_llama.py --sft) for
#    SFT_ITERS iterations: a partly right starting point;
# 3. GRPO (train_rl.py, --langrl-env-config "$OUT/addition.yaml":
#    exact match on sums drawn with another seed) for RL_ITERS iterations, rollouts sampled at
#    temperature 1, then a greedy evaluation on held-out sums.
#
# The stated margin: the mean exact-match reward of the sampled rollouts over the first 5 GRPO
# steps is at most 0.35, and over the last 5 steps at least 0.15 higher; the greedy held-out
# exact match rises too. The script prints both at the end (and fails if the margin is missed).
# Settings (environment): OUT (default runs/grpo_addition), SFT_EXAMPLES (4000), SFT_ITERS (150),
# RL_ITERS (40), GROUP (8), PROMPTS (8); processes per node as in scripts/launch_env.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/launch_env.sh
OUT=${OUT:-runs/grpo_addition}
SFT_ITERS=${SFT_ITERS:-150}
RL_ITERS=${RL_ITERS:-40}
mkdir -p "$OUT/data"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

DIGITS=${DIGITS:-2}
"$PYTHON" -m megatron_smp.post_training.envs.addition --format sft --seed 0 --digits "$DIGITS" \
  --num-prompts "${SFT_EXAMPLES:-4000}" --output "$OUT/data/sft.jsonl"
# The shipped environment (envs/addition.yaml) at DIGITS digits.
sed "s/digits: 2/digits: $DIGITS/" megatron_smp/post_training/envs/addition.yaml \
  > "$OUT/addition.yaml"
if [ ! -f "$OUT/hf_base/config.json" ]; then
  "$PYTHON" tools/make_tiny_llama.py --output "$OUT/hf_base" --texts "$OUT/data/sft.jsonl" \
    --vocab-size 259 --chat-template plain
fi
"$PYTHON" tools/preprocess_sft_data.py --input "$OUT/data/sft.jsonl" \
  --output-prefix "$OUT/data/sft" --tokenizer-model "$OUT/hf_base" --seq-length 64
if [ ! -f "$OUT/base/latest_checkpointed_iteration.txt" ]; then
  "$PYTHON" tools/checkpoint/convert.py --model-type llama --loader hf --saver megatron_smp \
    --load-dir "$OUT/hf_base" --save-dir "$OUT/base"
fi
COMMON=(--tokenizer-type HuggingFaceTokenizer --tokenizer-model "$OUT/hf_base"
        --use-checkpoint-args --hidden-dropout 0 --attention-dropout 0 --weight-decay 0
        --clip-grad 1.0 --seed 1)

if [ ! -f "$OUT/sft/latest_checkpointed_iteration.txt" ]; then
  "${LAUNCH[@]}" pretrain_llama.py "${COMMON[@]}" --seq-length 64 \
    --sft --data-path "$OUT/data/sft_text_document" --split 100,0,0 --eval-iters 0 \
    --micro-batch-size 16 --global-batch-size 32 \
    --load "$OUT/base" --finetune --save "$OUT/sft" --save-interval "$SFT_ITERS" \
    --train-iters "$SFT_ITERS" --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine \
    --lr-warmup-iters 10 --log-interval 25
fi

rm -rf "$OUT/rl" "$OUT/rl_tensorboard"
"${LAUNCH[@]}" train_rl.py "${COMMON[@]}" --seq-length 16 \
  --load "$OUT/sft" --finetune --save "$OUT/rl" --save-interval "$RL_ITERS" \
  --tensorboard-dir "$OUT/rl_tensorboard" \
  --langrl-env-config "$OUT/addition.yaml" \
  --grpo-group-size "${GROUP:-8}" --grpo-prompts-per-step "${PROMPTS:-8}" \
  --micro-batch-size "${MICRO_BATCH:-32}" --inference-max-requests 256 --grpo-iterations 1 --grpo-kl-beta 0 \
  --grpo-clamp-eps-lower 0.2 --grpo-clamp-eps-upper 0.28 --grpo-loss-type dapo \
  --rl-default-temperature 1.0 --rl-max-completion-length 6 \
  --train-iters "$RL_ITERS" --lr 1e-3 --lr-decay-style constant --log-interval 1 \
  --eval-iters 25 --eval-interval "$RL_ITERS" "$@" | tee "$OUT/rl.log"

"$PYTHON" - "$OUT/rl.log" <<'PY'
import re, sys
rewards = [float(m.group(1)) for m in re.finditer(r"\| reward: ([0-9.E+-]+) \|", open(sys.argv[1]).read())]
valid = re.findall(r"validation reward at iteration (\d+) .*?\| reward: ([0-9.E+-]+) \|", open(sys.argv[1]).read())
first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
print("exact-match reward per GRPO step:", " ".join(f"{r:.3f}" for r in rewards))
print(f"first 5 steps {first:.3f} -> last 5 steps {last:.3f} (margin stated: first <= 0.35, "
      f"last >= first + 0.15)")
print("greedy held-out exact match:", ", ".join(f"iteration {i}: {float(v):.3f}" for i, v in valid))
sys.exit(0 if first <= 0.35 and last >= first + 0.15 else 1)
PY

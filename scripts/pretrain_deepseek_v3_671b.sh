#!/usr/bin/env bash
# DeepSeek-V3 (671B, 37B active) shape, Megatron-LM's flag set for it: 61 layers, hidden 7168;
# multi-latent attention (128 heads, q latent 1536, kv latent 512, 128 + 64 RoPE channels per
# q/k head, 128 value channels, latent norms via --qk-layernorm, YaRN x40 with mscale 1/1 from
# 4096 positions); 3 dense layers (SwiGLU 18432), then 58 MoE layers of 256 experts (width
# 2048) plus one shared expert, sigmoid routing top-8 within the 4 best of 8 groups, scores
# renormalised and scaled 2.5, aux-loss-free balancing (expert bias, rate 1e-3) and a small
# sequence-wise aux loss; one multi-token-prediction layer (loss x 0.1); untied head.
# --log-throughput counts 260.0 GFLOPs per token at seq 4096 (249.8 without the MTP layer;
# DeepSeek publishes 250).
# Full recompute: with 1F1B, stage 1 holds 15 micro-batches in flight, and
# tools/estimate_memory.py puts its peak at 153 GiB with selective recompute
# (mla_up_proj, layernorm), 33 GiB per GPU at most with full recompute.
# Default layout as DeepSeek trained it: PP=16 (3 + 14 x 4 + 2 layers), EP=64, on 128 nodes of
# 8 GPUs. Usage: NNODES=128 MASTER_ADDR=... DATA_PATH=... TOKENIZER_MODEL=deepseek-ai/DeepSeek-V3
# bash scripts/pretrain_deepseek_v3_671b.sh. Knobs: PP (with FIRST/LAST layer counts), EP, TP
# (+SP), CP. From the HF weights: tools/checkpoint/convert.py --model-type deepseek_v3
# --loader hf --saver megatron_smp ..., then --load DIR --finetune (HF has no MTP weights: the
# MTP layer starts fresh).
set -euo pipefail
cd "$(dirname "$0")/.."
export NNODES=${NNODES:-128}
source scripts/launch_env.sh
CHECKPOINT_PATH=${CHECKPOINT_PATH:-checkpoints/deepseek_v3_671b}
PP=${PP:-16}
PIPELINE=(--pipeline-model-parallel-size "$PP")
if [ "$PP" -gt 1 ]; then
  PIPELINE+=(--decoder-first-pipeline-num-layers "${FIRST:-3}"
             --decoder-last-pipeline-num-layers "${LAST:-2}")
fi
exec "${LAUNCH[@]}" \
  pretrain_gpt.py \
  --num-layers 61 --hidden-size 7168 --ffn-hidden-size 18432 --num-attention-heads 128 \
  --seq-length 4096 --max-position-embeddings 163840 \
  --normalization RMSNorm --norm-epsilon 1e-6 --swiglu --untie-embeddings-and-output-weights \
  --disable-bias-linear --make-vocab-size-divisible-by 3232 \
  --multi-latent-attention --qk-layernorm --q-lora-rank 1536 --kv-lora-rank 512 \
  --qk-head-dim 128 --qk-pos-emb-head-dim 64 --v-head-dim 128 --rotary-interleaved \
  --position-embedding-type rope --rotary-base 10000 \
  --rotary-scaling-factor 40 --mscale 1.0 --mscale-all-dim 1.0 \
  --num-experts 256 --moe-layer-freq "[0]*3+[1]*58" --moe-ffn-hidden-size 2048 \
  --moe-shared-expert-intermediate-size 2048 --moe-router-topk 8 \
  --moe-router-score-function sigmoid --moe-router-enable-expert-bias \
  --moe-router-bias-update-rate 1e-3 --moe-router-num-groups 8 --moe-router-group-topk 4 \
  --moe-router-topk-scaling-factor 2.5 --moe-router-dtype fp32 \
  --moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 1e-4 \
  --moe-token-dispatcher-type alltoall --moe-grouped-gemm \
  --mtp-num-layers 1 --mtp-loss-scaling-factor 0.1 \
  --expert-model-parallel-size "${EP:-64}" --tensor-model-parallel-size "${TP:-1}" \
  "${PIPELINE[@]}" --context-parallel-size "${CP:-1}" ${TP:+--sequence-parallel} \
  --micro-batch-size 1 --global-batch-size 1536 \
  --lr 2.2e-4 --min-lr 2.2e-5 --lr-decay-style cosine --lr-warmup-iters 2000 \
  --train-iters 500000 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 \
  --init-method-std 0.006 --attention-dropout 0.0 --hidden-dropout 0.0 \
  --bf16 --use-distributed-optimizer --overlap-grad-reduce \
  --recompute-granularity full --recompute-method uniform --recompute-num-layers 1 \
  --data-path "${DATA_PATH:?set DATA_PATH}" --tokenizer-type HuggingFaceTokenizer \
  --tokenizer-model "${TOKENIZER_MODEL:?set TOKENIZER_MODEL}" --split 969,30,1 \
  --log-interval 1 --log-throughput --eval-interval 1000 --eval-iters 10 \
  --save-interval 1000 --save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH" \
  --tensorboard-dir "$CHECKPOINT_PATH/tensorboard" "$@"

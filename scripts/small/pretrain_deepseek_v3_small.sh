#!/usr/bin/env bash
# A small DeepSeek-V3-style model on CPU (a minute or two on 2 cores): multi-latent attention
# with a q latent, latent norms and YaRN beyond the original context (128 of 256 positions), a
# dense first layer then 8 sigmoid-routed experts (top-4 within the 2 best of 4 groups, scaled,
# expert bias) plus a shared expert, one multi-token-prediction layer ("mtp_1 loss" in the log
# line), MLA's up-projections recomputed in backward, expert parallelism 2, mock data. Extra
# arguments go to pretrain_gpt.py (e.g. --train-iters 50).
set -euo pipefail
cd "$(dirname "$0")/../.."
NPROC_PER_NODE=${NPROC_PER_NODE:-2}  # a CPU-sized run: 2 processes
source scripts/launch_env.sh
OUT=${OUT:-checkpoints/deepseek_v3_small}
exec "${LAUNCH[@]}" pretrain_gpt.py \
  --num-layers 4 --hidden-size 256 --ffn-hidden-size 512 --num-attention-heads 8 \
  --seq-length 256 --max-position-embeddings 1024 \
  --normalization RMSNorm --norm-epsilon 1e-6 --swiglu --untie-embeddings-and-output-weights \
  --disable-bias-linear \
  --multi-latent-attention --qk-layernorm --q-lora-rank 96 --kv-lora-rank 64 \
  --qk-head-dim 32 --qk-pos-emb-head-dim 16 --v-head-dim 32 --rotary-interleaved \
  --position-embedding-type rope --rotary-scaling-factor 4 --mscale 1.0 --mscale-all-dim 1.0 \
  --yarn-original-max-position-embeddings 128 \
  --num-experts 8 --moe-layer-freq "[0]*1+[1]*3" --moe-ffn-hidden-size 128 \
  --moe-shared-expert-intermediate-size 128 --moe-router-topk 4 \
  --moe-router-score-function sigmoid --moe-router-enable-expert-bias \
  --moe-router-num-groups 4 --moe-router-group-topk 2 --moe-router-topk-scaling-factor 2.5 \
  --moe-router-dtype fp32 --moe-router-load-balancing-type seq_aux_loss \
  --moe-aux-loss-coeff 1e-4 --moe-token-dispatcher-type alltoall \
  --mtp-num-layers 1 --mtp-loss-scaling-factor 0.1 \
  --expert-model-parallel-size 2 \
  --recompute-granularity selective --recompute-modules mla_up_proj \
  --micro-batch-size 4 --global-batch-size 8 \
  --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 5 --train-iters 40 \
  --mock-data --tokenizer-type NullTokenizer --vocab-size 1000 --distributed-backend gloo \
  --log-interval 10 --log-throughput --eval-interval 20 --eval-iters 2 \
  --tensorboard-dir "$OUT/tensorboard" "$@"

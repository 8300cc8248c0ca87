#!/usr/bin/env bash
# A small gpt-oss-style model on CPU, 2 processes (EP=2), mock data: every gpt-oss feature
# (attention sinks, sliding/full layers, YaRN past the original context, biases, clamped +1
# quick-GeGLU experts, top-2 of 4) at a size that trains in seconds. Extra arguments go to
# pretrain_gpt.py (e.g. --train-iters 50, or --tensor-model-parallel-size 2
# --sequence-parallel instead of EP).
set -euo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec ${TORCHRUN:-.venv/bin/torchrun} --standalone --nproc-per-node 2 pretrain_gpt.py \
  --num-layers 4 --hidden-size 128 --ffn-hidden-size 128 --num-attention-heads 8 \
  --kv-channels 24 --group-query-attention --num-query-groups 2 \
  --normalization RMSNorm --untie-embeddings-and-output-weights \
  --softmax-type learnable --window-size 15,0 --window-attn-skip-freq 2 \
  --position-embedding-type yarn --rotary-base 150000 --rotary-scaling-factor 4 \
  --yarn-original-max-position-embeddings 32 --no-yarn-correction-range-round-to-int \
  --quick-geglu --glu-linear-offset 1.0 --activation-func-clamp-value 7.0 \
  --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 128 \
  --moe-aux-loss-coeff 0.01 --moe-token-dispatcher-type alltoall \
  --expert-model-parallel-size "${EP:-2}" \
  --seq-length 128 --max-position-embeddings 128 --hidden-dropout 0 --attention-dropout 0 \
  --micro-batch-size 4 --global-batch-size 8 \
  --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 5 \
  --train-iters 40 --weight-decay 0.1 --clip-grad 1.0 \
  --mock-data --tokenizer-type NullTokenizer --vocab-size 1000 \
  --distributed-backend gloo --log-interval 5 --log-throughput \
  --eval-interval 1000 --eval-iters 1 "$@"

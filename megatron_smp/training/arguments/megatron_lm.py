"""The rest of Megatron-LM main's parser (and megatron-core 0.19.2's and core_v0.16.1's):
every flag it declares that the flag table (flags.py) does not, sorted into

* `ALIASES`: Megatron-LM's other spellings of flags in the table (the same action);
* `IMPLEMENTED`: flags with their own meaning here (post-processed by `apply`);
* `IGNORED`: accepted and ignored, each group with the reason it changes neither results nor
  memory here (merged into flags.IGNORED_FLAGS, so the docs table lists them);
* `MEGATRON_ERRORS`: flags Megatron-LM itself rejects (its validate_args), with its message;
* `NEEDS_NVIDIA`: flags that need NVIDIA hardware or libraries (merged into
  flags.NEEDS_NVIDIA_FLAGS);
* `NOT_BUILT`: flags of models and subsystems megatron_smp does not build (merged into
  flags.NOT_SUPPORTED_YET_FLAGS), each group with what it belongs to.

Groups are written as one string of flags; in `IGNORED`, a flag ending in "=" takes one value
and one ending in "*" any number of values (the others are switches).
"""
from __future__ import annotations

import argparse
from typing import Any, Dict, List, Tuple

from megatron_smp.config import ConfigError


def _expand(groups: List[Tuple[str, str]]) -> Dict[str, str]:
    return {flag: reason for reason, flags in groups for flag in flags.split()}


# Megatron-LM main's other spelling -> the flag in the table it means. Main generates a
# `--disable-X` beside every `--no-X` of its config dataclasses, and spells some flags anew.
ALIASES: Dict[str, str] = {
    "--disable-log-loss-scale-to-tensorboard": "--no-log-loss-scale-to-tensorboard",
    "--disable-manual-gc-eval": "--no-manual-gc-eval",
    "--override-opt-param-scheduler": "--override-opt_param-scheduler",
    "--use-checkpoint-opt-param-scheduler": "--use-checkpoint-opt_param-scheduler",
    "--torch-fsdp2-no-reshard-after-forward": "--no-torch-fsdp2-reshard-after-forward",
    "--tokenizer-special-tokens": "--tiktoken-special-tokens",
    # core_v0.16.1's spellings.
    "--disable-ckpt-fully-parallel-save": "--no-ckpt-fully-parallel-save",
    "--muon-use-nesterov": "--muon-nesterov",
}
# Aliases whose flag is the negation of the table's (store_false on the same field).
NEGATED_ALIASES: Dict[str, str] = {
    "--tokenizer-hf-no-include-special-tokens": "--tokenizer-hf-include-special-tokens",
}

# Flags with a meaning of their own here: (flag, config section or None, field, kwargs).
IMPLEMENTED: List[Tuple[str, Any, str, Dict[str, Any]]] = [
    ("--exit-on-missing-checkpoint", "checkpoint", "exit_on_missing_checkpoint",
     dict(action="store_true",
          help="with --load: a --load directory without a checkpoint ends the run with an "
          "error instead of training from scratch")),
    ("--ckpt-step", "checkpoint", "ckpt_step",
     dict(type=int, metavar="ITERATION",
          help="with --load: load this iteration's checkpoint instead of the latest")),
    ("--no-weight-decay-cond-type", None, "no_weight_decay_cond_type",
     dict(help="Megatron-LM's deprecated spelling: apply_wd_to_qk_layernorm is "
          "--apply-wd-to-qk-layernorm; other values are an error")),
    ("--dataloader-type", None, "dataloader_type",
     dict(choices=["single", "cyclic", "external"],
          help="single: each sample once per pass, resumable from the consumed-sample count "
          "(Megatron's default and the sampler here); cyclic and external are an error")),
    ("--null-tokenizer-pad-id", None, "null_tokenizer_pad_id",
     dict(type=int, help="-1 only (Megatron-LM's default): the NullTokenizer has no pad token, "
          "so no token is masked as padding")),
    ("--no-initialization", None, "no_initialization",
     dict(action="store_true",
          help="with --load or --pretrained-checkpoint: the weights the checkpoint gives "
          "overwrite the drawn ones (Megatron leaves them uninitialised for it); without "
          "either an error")),
    ("--weight-decay-incr-style", "optimizer", "weight_decay_incr_style",
     dict(choices=["constant", "linear", "cosine"], default="constant",
          help="constant: --weight-decay throughout; linear or cosine: from "
          "--start-weight-decay to --end-weight-decay over the run (Megatron's schedule)")),
    ("--start-weight-decay", "optimizer", "start_weight_decay", dict(type=float)),
    ("--end-weight-decay", "optimizer", "end_weight_decay", dict(type=float)),
    ("--embedding-init-method-std", "model", "embedding_init_method_std",
     dict(type=float, help="the word and position embeddings (and, with --use-mup, an untied "
          "output layer) start at N(0, this); default --init-method-std")),
    ("--init-method-xavier-uniform", "model", "init_method_xavier_uniform",
     dict(action="store_true",
          help="weight matrices (and the embeddings, unless --embedding-init-method-std "
          "differs) start Xavier-uniform over their full shape (the vocabulary's tables over "
          "its unpadded rows) instead of N(0, --init-method-std)")),
    ("--check-for-spiky-loss", "training", "check_for_spiky_loss",
     dict(action="store_true",
          help="a loss at least 10x the largest of the first 100 is rejected: rerun in place "
          "under --rerun-mode validate_results, logged, and training goes on")),
    ("--check-for-large-grads", "training", "check_for_large_grads",
     dict(action="store_true",
          help="a bucket's local grad norm at least 10x the largest of the first 100 is "
          "rejected: rerun in place under --rerun-mode validate_results, logged, and training "
          "goes on")),
    ("--mtp-hybrid-override-pattern", None, "mtp_hybrid_override_pattern",
     dict(help="Megatron-LM's deprecated MTP pattern: with --mtp-num-layers N, appended to "
          "--hybrid-layer-pattern N times after its MTP separator '/'")),
]

# Accepted and ignored: (the reason it changes neither results nor memory here, flags).
_IGNORED_GROUPS: List[Tuple[str, str]] = [
    ("Megatron-LM main's config declares it and no code of Megatron-LM main reads it",
     "--apply-residual-connection-post-layernorm --onnx-safe= --dist-ckpt-save-pre-mcore-014"),
    ("Megatron-LM main's other spelling of --no-save-tokenizer-assets (checkpoints here never "
     "hold tokenizer files)", "--disable-save-tokenizer-assets"),
    ("Megatron-LM main's other spelling of --no-use-tokenizer-model-from-checkpoint-args "
     "(checkpoints here never supply a tokenizer model)",
     "--disable-use-tokenizer-model-from-checkpoint-args"),
    ("Megatron-LM deprecated it and ignores it (the checkpoint format is --ckpt-format's)",
     "--use-dist-ckpt --dist-ckpt-format="),
    ("Megatron-LM main: a deprecated no-op (its Multi-Storage Client is off by default)",
     "--disable-msc"),
    ("the auto-resume service of NVIDIA's ADLR cluster, which only exists there; a job here "
     "resumes from --load when relaunched", "--adlr-autoresume --adlr-autoresume-interval="),
    ("tags and switches of NVIDIA's internal one-logger telemetry; nothing is sent from here",
     "--app-tag-run-name= --app-tag-run-version= --no-one-logger --one-logger-async "
     "--one-logger-project= --one-logger-run-name="),
    ("the operating-system priority of Megatron's async checkpoint writer: when the same "
     "files are written, not which", "--async-ckpt-cpu-priority= --async-ckpt-io-priority="),
    ("how ranks share the work of reading or writing a distributed checkpoint (which process "
     "group, exchange algorithm, cache of the layout); here each rank reads and writes only "
     "its own chunks through DCP, and the files and tensors are the same",
     "--ckpt-fully-parallel-load-exchange-algo= --ckpt-fully-parallel-load-per-rank-objects "
     "--ckpt-fully-parallel-load-process-group= --ckpt-fully-parallel-save-process-group= "
     "--ckpt-pg-tensors-cache-create --ckpt-pg-tensors-cache-path= "
     "--distrib-optim-fully-reshardable-mem-efficient"),
    ("drops Transformer Engine's _extra_state entries from checkpoints; checkpoints here never "
     "hold them", "--ckpt-drop-redundant-extra-state"),
    ("a check of the checkpoint's shard coverage at load; the same tensors are loaded",
     "--disable-ckpt-load-validate-sharding-integrity "
     "--no-ckpt-load-validate-sharding-integrity"),
    ("communication scheduling choice (when each pipeline stage launches its grad reductions "
     "and param gathers, separate groups or streams for them, how they are bucketed and "
     "padded for NCCL's bandwidth): the same reduced grads and gathered params",
     "--disable-align-grad-reduce --no-align-grad-reduce --no-align-param-gather "
     "--create-all-gather-group --ddp-num-buckets= --ddp-pad-buckets-for-high-nccl-busbw "
     "--high-priority-a2a-comm-stream --high-priority-stream-groups* "
     "--no-overlap-p2p-communication --train-sync-interval="),
    ("NCCL's transport (user-buffer and symmetric-memory registration, SHARP, communicator "
     "tuning, the pipeline's NCCL/UCC backend): how NCCL moves the same bytes",
     "--use-nccl-ub --disable-symmetric-registration --fsdp-manual-registration "
     "--use-sharp --sharp-enabled-group= --nccl-communicator-config-path= "
     "--pipeline-model-parallel-comm-backend="),
    ("a Transformer Engine userbuffers overlap option, read only with --tp-comm-overlap "
     "(refused here: it needs Transformer Engine on CUDA GPUs)",
     "--disable-tp-comm-bulk-dgrad --disable-tp-comm-bulk-wgrad --disable-tp-comm-overlap-ag "
     "--disable-tp-comm-overlap-rs --disable-tp-comm-split-ag --disable-tp-comm-split-rs "
     "--no-tp-comm-bulk-dgrad --no-tp-comm-bulk-wgrad --no-tp-comm-overlap-ag "
     "--no-tp-comm-overlap-rs --no-tp-comm-split-ag --no-tp-comm-split-rs "
     "--tp-comm-overlap-rs-dgrad --tp-comm-bootstrap-backend="),
    ("kernel fusion choice (the fused kernel computes the same values as the unfused ops)",
     "--disable-jit-fuser --fused-residual-rmsnorm --mla-down-proj-fusion "
     "--no-gradient-reduce-div-fusion --use-fused-weighted-squared-relu "
     "--use-te-activation-func"),
    ("kernel choice (which GEMM or attention kernel runs the same computation: grouped GEMMs "
     "of one group, the FlashAttention generation, mamba_ssm's fused path); here one torch "
     "implementation", "--use-grouped-gemm-for-dense-mlp --use-grouped-gemm-for-shared-expert "
     "--flash-attention-version= --disable-mamba-mem-eff-path"),
    ("when weight grads are computed or activations released around the expert all-to-all "
     "overlap (--overlap-moe-expert-parallel-comm, itself a scheduling choice); the same grads",
     "--overlap-dispatch-backward-with-experts-wgrad --ep-overlap-early-attn-memory-release"),
    ("Megatron-FSDP's own buffer allocation and gather granularity; its sharding strategies "
     "run on FSDP2 here, which allocates and gathers per layer itself",
     "--fsdp-double-buffer --fsdp-db-use-persist-buf-on-alloc-fail "
     "--megatron-fsdp-max-pool-double-buffer --megatron-fsdp-enable-fine-grained-param-gather "
     "--megatron-fsdp-version= --suggested-communication-unit-size="),
    ("Megatron's embedding clones its sequence-parallel scattered output so that the full one "
     "can be freed; here the vocab-parallel embedding reduce-scatters straight into each "
     "rank's sequence shard, so there is no full output to clone",
     "--disable-clone-scatter-output-in-embedding --no-clone-scatter-output-in-embedding"),
    ("annotation for NVIDIA's Nsight profilers (NVTX ranges); the pytorch profiler trace here "
     "(--use-pytorch-profiler) always records shapes and Python call stacks",
     "--nvtx-ranges --record-shapes --pytorch-profiler-collect-shapes "
     "--pytorch-profiler-collect-callstack"),
    ("Megatron's per-phase timers, whose barrier this skips, are not printed here",
     "--no-barrier-with-level-1-timing"),
    ("how many threads build the dataset indices; the same indices",
     "--num-dataset-builder-threads="),
    ("the local rank that torch.distributed.launch passes; it is read from LOCAL_RANK, which "
     "every launcher sets", "--local-rank="),
    ("Megatron's gate for its experimental features (they raise without it); those built "
     "here need no gate",
     "--enable-experimental"),
    ("no CUDA graph is captured here (what the flag asks)",
     "--no-rl-training-cuda-graphs --no-rl-persist-cuda-graphs"),
    ("Megatron-LM declares it store_true with default True: giving it changes nothing",
     "--use-same-sampling-seed-across-dp-ranks"),
    ("read only by Megatron's --dataloader-type cyclic sampler (refused here)",
     "--no-data-sharding"),
    ("core_v0.16.1's other spelling of --no-async-tensor-model-parallel-allreduce (deprecated "
     "and ignored there too)", "--disable-async-tensor-model-parallel-allreduce"),
    ("core_v0.16.1: the HF tokenizer here is always the fast one (what this flag asks); the "
     "same ids", "--tokenizer-hf-use-fast"),
    ("core_v0.16.1: whether pipeline sends are split over the tensor-parallel ranks and "
     "gathered; the same activations arrive", "--no-scatter-gather-tensors-in-pipeline"),
    ("megatron-core 0.19: how Transformer Engine's FP8 params are dequantised while a "
     "checkpoint loads; there are no quantised params here (FP8 is refused)",
     "--no-stream-ckpt-dequant --disable-stream-ckpt-dequant"),
]
IGNORED: Dict[str, str] = {flag.rstrip("=*"): reason
                           for flag, reason in _expand(_IGNORED_GROUPS).items()}
# The number of values each ignored flag takes (None: a switch).
IGNORED_NARGS: Dict[str, Any] = {flag.rstrip("=*"): (None if flag[-1] not in "=*" else
                                                      1 if flag.endswith("=") else "*")
                                 for flag in _expand(_IGNORED_GROUPS)}

# Flags Megatron-LM's validate_args rejects itself: its message.
MEGATRON_ERRORS: Dict[str, str] = {
    "--batch-size": "--batch-size argument is no longer valid, use --micro-batch-size instead",
    "--warmup": "--warmup argument is no longer valid, use --lr-warmup-fraction instead",
    "--model-parallel-size": "--model-parallel-size is no longer valid, use "
                             "--tensor-model-parallel-size instead",
    "--checkpoint-activations": "--checkpoint-activations is no longer valid, use "
                                "--recompute-activations, or, for more control, "
                                "--recompute-granularity and --recompute-method.",
}

# Flags that need NVIDIA hardware or libraries: what each needs.
NEEDS_NVIDIA: Dict[str, str] = _expand([
    ("CUDA graphs (a CUDA device; Megatron-LM maps it to --cuda-graph-impl)",
     "--enable-cuda-graph --external-cuda-graph --optimizer-cuda-graph "
     "--decode-only-cuda-graphs --rl-persist-cuda-graphs "
     "--inference-dynamic-batching-cuda-graph-max-tokens --rl-reset-cuda-graphs "
     "--no-rl-reset-cuda-graphs"),
    ("CUDA streams and pinned host memory (Megatron-LM's activation offloading)",
     "--cpu-offloading-num-layers --cpu-offloading-retain-pinned-cpu-buffers "
     "--activation-offload-fraction --delay-offload-until-cuda-graph "
     "--delta-offload-bytes-across-pp-ranks --fine-grained-offloading-max-inflight-offloads "
     "--min-offloaded-tensor-size"),
    ("a custom torch build with torch.distributed.ring_exchange", "--use-ring-exchange-p2p"),
])

# Flags of models and subsystems megatron_smp does not build: what each belongs to.
NOT_BUILT: Dict[str, str] = _expand([
    ("BERT or T5 model (Megatron-LM's examples/bert and examples/t5: masked-LM data, binary "
     "head, encoder-decoder layers; the models built here are decoder-only)",
     "--bert-embedder-type --bert-load --bert-no-binary-head --output-bert-embeddings "
     "--mask-prob --mask-factor --mask-type --short-seq-prob --sample-rate --vocab-extra-ids "
     "--encoder-num-layers --encoder-seq-length --decoder-num-layers --decoder-seq-length "
     "--relative-attention-max-distance --relative-attention-num-buckets"),
    ("ICT / REALM / biencoder retrieval model (Megatron-LM's retriever models)",
     "--ict-head-size --ict-load --biencoder-projection-dim "
     "--biencoder-shared-query-context-model --block-data-path --embedding-path "
     "--evidence-data-path --titles-data-path --query-in-block-prob --use-one-sent-docs "
     "--indexer-batch-size --indexer-log-interval --retriever-report-topk-accuracies "
     "--retriever-score-scaling"),
    ("vision model (ViT / Swin classification, DINO: Megatron-LM's vision pretraining)",
     "--vision-pretraining --vision-pretraining-type --vision-backbone-type "
     "--swin-backbone-type --img-h --img-w --num-channels --patch-dim --num-classes "
     "--classes-fraction --data-per-class-fraction --iter-per-epoch --head-lr-mult "
     "--dino-bottleneck-size --dino-freeze-last-layer --dino-head-hidden-size "
     "--dino-local-crops-number --dino-local-img-size --dino-norm-last-layer "
     "--dino-teacher-temp --dino-warmup-teacher-temp --dino-warmup-teacher-temp-epochs"),
    ("multimodal model (multimodal RoPE sections)", "--mrope-section"),
    ("precision-aware optimizer (Transformer Engine's FusedAdam keeping optimizer state and "
     "main params in lower precision)",
     "--use-precision-aware-optimizer --exp-avg-dtype --exp-avg-sq-dtype --main-grads-dtype "
     "--main-params-dtype"),
    ("batch-invariant kernels (bitwise-equal results whatever the batch size)",
     "--batch-invariant-mode --batch-invariant-backend"),
    ("NVIDIA Kitchen extension (quantised attention)",
     "--use-kitchen-attention --kitchen-attention-backend"),
    ("output-layer GEMM in another dtype", "--output-logit-dtype"),
    ("option of Megatron-LM's inference engine in its training scripts (static and dynamic "
     "batching, speculative decoding, its text-generation server); the inference tools here "
     "(tools/run_text_generation_server.py, tools/generate.py) take their own flags",
     "--enable-chunked-prefill --disable-chunked-prefill --inference-max-batch-size "
     "--flash-decode --cache-mla-latents --num-speculative-tokens "
     "--mlp-chunks-for-prefill --nccl-all-reduce-for-prefill --symmetric-ar-type "
     "--use-legacy-static-engine --inference-batch-times-seqlen-threshold "
     "--inference-coordinator-port --inference-cuda-graph-all-prefills "
     "--inference-cuda-graph-max-tokens --inference-cuda-graph-scope "
     "--inference-disable-ep-consensus --no-inference-disable-ep-consensus "
     "--inference-disable-triton-nvls-kernels --inference-dynamic-batching "
     "--inference-dynamic-batching-async-sched-mode --inference-dynamic-batching-block-size "
     "--inference-dynamic-batching-cuda-graph-mixed-prefill-count "
     "--inference-dynamic-batching-logprobs-mode "
     "--inference-dynamic-batching-mamba-memory-ratio "
     "--inference-dynamic-batching-max-requests --inference-dynamic-batching-max-tokens "
     "--inference-dynamic-batching-paused-buffer-size-gb "
     "--inference-dynamic-batching-prefix-caching "
     "--no-inference-dynamic-batching-prefix-caching "
     "--inference-dynamic-batching-prefix-caching-coordinator-policy "
     "--inference-dynamic-batching-prefix-caching-eviction-policy "
     "--inference-dynamic-batching-prefix-caching-mamba-gb "
     "--inference-dynamic-batching-prefix-caching-routing-alpha "
     "--inference-dynamic-batching-sampling-backend "
     "--inference-dynamic-batching-track-generated-token-events "
     "--inference-dynamic-batching-track-paused-request-events "
     "--inference-fuse-tp-communication --inference-grouped-gemm-backend "
     "--inference-max-requests --inference-moe-disable-fused-quant-kernels "
     "--inference-moe-token-dispatcher-type --inference-rng-tracker --inference-shards "
     "--inference-text-gen-server-logging --no-inference-text-gen-server-logging "
     "--inference-use-synchronous-zmq-collectives "
     "--no-inference-use-synchronous-zmq-collectives --inference-wandb-logging "
     "--no-inference-wandb-logging --mamba-inference-conv-states-dtype "
     "--mamba-inference-ssm-states-dtype"),
    ("this option of Megatron-LM's RL loop (train_rl.py is the RL loop here)",
     "--grpo-clamp-eps-lower --grpo-clamp-eps-upper --grpo-entropy-term-weight "
     "--grpo-filter-groups-with-same-reward --grpo-group-size --grpo-iterations "
     "--grpo-kl-beta --grpo-prompts-per-step --langrl-env-config --rl-default-temperature "
     "--rl-default-top-k --rl-default-top-p --rl-durable-rollout-bank "
     "--rl-importance-sampling-truncation-coef --rl-inference-logprobs-is-correction "
     "--no-rl-inference-logprobs-is-correction --rl-inference-parsers "
     "--rl-kv-cache-management-mode --rl-max-inflight-requests --rl-profile --rl-profile-dir "
     "--rl-prompts-per-eval --rl-rollout-bank-dir --rl-rollout-bank-max-bytes "
     "--rl-sequence-packing-max-sequences-per-bin --rl-skip-bos-token --no-rl-skip-bos-token "
     "--rl-use-sequence-packing --no-rl-use-sequence-packing --rl-verify-model-weights-swap "
     "--no-rl-verify-model-weights-swap --no-rl-offload-inference-model-weights-when-idle "
     "--no-rl-partial-rollouts --langrl-external-server --no-langrl-external-server "
     "--langrl-inference-server-conversation-template --langrl-inference-server-type "
     "--rl-offload-kv-cache-during-training --no-rl-offload-kv-cache-during-training "
     "--rl-remove-kv-cache-during-training --no-rl-remove-kv-cache-during-training "
     "--rl-parallel-generation-tasks"),
    ("knowledge distillation from saved teacher logits",
     "--logits-load-dir --logits-load-decode-threads --logits-load-ignore-errors "
     "--logits-load-kd-loss-alpha --logits-load-msc-prefetch-depth "
     "--logits-load-prefetch-factor --logits-save-dir --logits-save-dtype --logits-save-top-k "
     "--logits-save-top-p --logits-save-top-p-min-k"),
    ("DeepSeek sparse attention (--experimental-attention-variant dsa)",
     "--dsa-indexer-k-norm-epsilon --dsa-indexer-k-norm-fp32 --dsa-indexer-rope-interleaved "
     "--dsa-indexer-skip-topk-offset --dsa-indexer-topk-freq --dsa-indexer-use-sparse-loss "
     "--dsa-kernel-backend --disable-dsa-indexer-rotate-activation "
     "--no-dsa-indexer-rotate-activation --disable-dsa-indexer-scoring-relu "
     "--no-dsa-indexer-scoring-relu"),
    ("manifold-constrained hyper-connections (mHC residual streams)",
     "--enable-mhc-connections --mhc-init-gating-factor --mhc-num-residual-streams "
     "--mhc-recompute-layer-num --mhc-sinkhorn-iterations"),
    ("Gated DeltaProduct layers", "--gdp-cutedsl-kernel --gdp-num-chunk-states-to-recompute "
                                  "--gdp-num-householder"),
    ("weight sharding with rematerialisation over a GTP axis (Megatron-LM main's GTP)",
     "--tensor-parallel-num-weight-shards --expert-tensor-parallel-num-weight-shards "
     "--gtp-remat-opt-in-modules --gtp-remat-nccl-ub --gtp-expert-remat-nccl-ub "
     "--gtp-remat-reduce-scatter-with-fp32-accumulation"),
    ("heterogeneous per-layer model configurations (Llama-Nemotron NAS)",
     "--heterogeneous-layers-config-path --heterogeneous-layers-config-encoded-json"),
    ("hybrid context parallelism (packed sequences balanced over DP x CP ranks)",
     "--hybrid-context-parallel --max-seqlen-per-dp-cp-rank"),
    ("optimizer state offloaded to the CPU (Megatron's HybridDeviceOptimizer)",
     "--optimizer-cpu-offload --optimizer-offload-fraction --overlap-cpu-optimizer-d2h-h2d "
     "--use-torch-optimizer-for-cpu-offload --no-pin-cpu-grads --no-pin-cpu-params"),
    ("non-persistent (local or scratch) checkpoints and their replication",
     "--non-persistent-ckpt-type --non-persistent-global-ckpt-dir "
     "--non-persistent-local-ckpt-algo --non-persistent-local-ckpt-dir "
     "--non-persistent-save-interval --persistent-save-interval --replication "
     "--replication-factor --replication-jump"),
    ("conversion of a checkpoint's format at load (use tools/checkpoint/convert.py)",
     "--ckpt-convert-format --ckpt-convert-save --ckpt-convert-update-legacy-dist-opt-format"),
    ("Megatron-FSDP's HSDP full sharding and its non-strict fsdp_dtensor loading "
     "(--dist-ckpt-strictness sets how mismatched keys are handled)",
     "--enable-full-sharding-in-hsdp --disable-strict-fsdp-dtensor-load "
     "--no-strict-fsdp-dtensor-load"),
    ("Multi-Storage Client / object-storage paths (local paths only)",
     "--enable-msc --object-storage-cache-path"),
    ("file of rejected results of the rerun state machine (rejections are logged)",
     "--result-rejected-tracker-filename"),
    ("per-parameter grad-reduction precision (grads here are accumulated and reduced in "
     "fp32, or in bf16 with --grad-reduce-in-bf16)",
     "--ddp-param-name-patterns-for-fp32-local-accumulation "
     "--ddp-reduce-scatter-with-fp32-accumulation"),
    ("numerics option of this kind (fp32 residual stream, fp16 cross entropy, a Mamba SSM "
     "state dtype)", "--fp32-residual-connection --fp16-lm-cross-entropy "
     "--mamba-training-ssm-states-dtype"),
    ("different initial weights on each data-parallel replica",
     "--data-parallel-random-init"),
    ("Llama 4 layer option (q/k L2 norm, RoPE-free layers)",
     "--qk-l2-norm --no-rope-freq"),
    ("multi-token-prediction variant of this kind (detached, hidden-state-mixed, repeated "
     "or standalone-stage MTP layers)",
     "--mtp-detach-heads --mtp-hsm --mtp-use-repeated-layer --mtp-standalone"),
    ("memory saving of this kind (recomputed activations distributed over the "
     "tensor-parallel group, the MLP chunked along the sequence)",
     "--distribute-saved-activations --mlp-chunks-for-training"),
    ("unpadded or explicitly padded vocabulary (--make-vocab-size-divisible-by sets the "
     "padding)", "--no-pad-vocab-size --disable-pad-vocab-size --padded-vocab-size"),
    ("tokenizer option of this kind (SentencePiece whitespace and legacy modes, slow HF "
     "tokenizers, remote code, tokenizer metadata files, gigatoken, SFT prompt formats)",
     "--no-tokenizer-sentencepiece-ignore-extra-whitespaces "
     "--disable-tokenizer-sentencepiece-ignore-extra-whitespaces "
     "--tokenizer-sentencepiece-legacy --tokenizer-hf-no-use-fast --trust-remote-code "
     "--tokenizer-metadata --use-gigatoken --sft-tokenizer-prompt-format"),
    ("loss over pad tokens that share their id with another special token (the datasets "
     "here mask no pad tokens)", "--allow-ambiguous-pad-tokens"),
    ("schedule or data option of this kind (phase transitions, skipped iterations, shrinking "
     "the batch to fit, full-validation passes)",
     "--phase-transition-iterations --iterations-to-skip --decrease-batch-size-if-needed "
     "--full-validation"),
    ("load of fp32 main params from a checkpoint whose optimizer is not loaded",
     "--load-main-params-from-ckpt"),
    ("parallel sizes taken from the --load checkpoint (give them as flags)",
     "--use-mp-args-from-checkpoint-args"),
    ("diagnostics of this kind (dumps of params, activations, grads or routing every N "
     "iterations, GPU sniff tests, energy, device memory and attention-logit logging, a "
     "config dump, a parameter-group map, an on-demand profiling server, chakra traces, "
     "OpenTelemetry export)",
     "--save-params-interval --save-activations-interval --save-dgrads-interval "
     "--save-wgrads-interval --save-tokens-per-expert-interval --gpu-sniff-test-interval "
     "--log-energy --log-device-memory-used --log-memory-interval --log-max-attention-logit "
     "--config-logger-dir --dump-param-to-param-group-map --run-workload-inspector-server "
     "--pytorch-profiler-collect-chakra --otel-enabled --otel-service-name "
     "--otel-span-groups"),
    ("NCCL flight-recorder settings (torch's TORCH_NCCL_* / TORCH_FR_* environment "
     "variables can be set directly)",
     "--flight-recorder-dump-path --flight-recorder-include-stack-trace "
     "--flight-recorder-trace-buffer-size --disable-flight-recorder-dump-on-timeout "
     "--no-flight-recorder-dump-on-timeout --disable-flight-recorder-extra-dump-on-exec "
     "--no-flight-recorder-extra-dump-on-exec --disable-flight-recorder-include-only-active "
     "--no-flight-recorder-include-only-active"),
    ("launch option of this kind (a fake process group, lazy model-parallel init, another "
     "process-group timeout after the first iteration, YAML argument files)",
     "--fake-process-group --lazy-mpu-init --distributed-timeout-seconds-after-init "
     "--yaml-cfg"),
    ("hybrid layer allocation by ratios (core_v0.16.1; give --hybrid-layer-pattern)",
     "--hybrid-attention-ratio --hybrid-mlp-ratio"),
    ("switch for the hybrid model (--hybrid-layer-pattern builds it here: give that and "
     "drop this)", "--is-hybrid-model"),
])


def alias_kwargs(flag: str, kwargs: Dict[str, Any], negated: bool = False) -> Dict[str, Any]:
    """The argparse keywords of an alias of `flag` (declared with `kwargs`): the same action,
    or its negation."""
    kwargs = {key: value for key, value in kwargs.items() if key not in ("help", "required")}
    if negated:
        kwargs["action"] = "store_false"
        return dict(kwargs, help=f"Megatron-LM main's negation of {flag}")
    return dict(kwargs, help=f"Megatron-LM main's spelling of {flag}")


def apply(args: argparse.Namespace, sections: Dict[str, Dict[str, Any]]) -> None:
    """What the IMPLEMENTED flags without a config field of their own do, or the error."""
    optimizer, checkpoint, model = (sections["optimizer"], sections["checkpoint"],
                                    sections["model"])
    if args.no_weight_decay_cond_type is not None:
        if args.no_weight_decay_cond_type != "apply_wd_to_qk_layernorm":
            raise ConfigError(f"Invalid no_weight_decay_cond_type: "
                              f"{args.no_weight_decay_cond_type} (--no-weight-decay-cond-type "
                              "takes apply_wd_to_qk_layernorm; Megatron-LM deprecated it for "
                              "--apply-wd-to-qk-layernorm)")
        optimizer["apply_wd_to_qk_layernorm"] = True
    if args.dataloader_type not in (None, "single"):
        raise ConfigError(f"--dataloader-type {args.dataloader_type}: the sampler here is "
                          "Megatron's single (each sample once per pass, resumed from the "
                          "consumed-sample count); give single or drop it")
    if args.null_tokenizer_pad_id not in (None, -1):
        raise ConfigError(f"--null-tokenizer-pad-id {args.null_tokenizer_pad_id}: the "
                          "NullTokenizer here has no pad token (Megatron-LM's default, -1), "
                          "so no token is masked as padding; drop it")
    if args.no_initialization and not (checkpoint.get("load")
                                       or checkpoint.get("pretrained_checkpoint")):
        raise ConfigError("--no-initialization leaves the weights for a checkpoint to fill: add "
                          "--load (or --pretrained-checkpoint), or drop it")
    for flag in ("--exit-on-missing-checkpoint", "--ckpt-step"):
        field = flag[2:].replace("-", "_")
        if checkpoint.get(field) not in (None, False) and not checkpoint.get("load"):
            raise ConfigError(f"{flag} applies to the --load checkpoint: add --load, or drop it")
    pattern = args.mtp_hybrid_override_pattern
    if pattern is not None:
        from megatron_smp.config import HYBRID_MTP_SEPARATOR

        depth = model.get("mtp_num_layers") or 0
        main = model.get("hybrid_layer_pattern")
        if main is None:
            raise ConfigError("--mtp-hybrid-override-pattern is the MTP part of a hybrid layer "
                              "pattern: add --hybrid-layer-pattern, or drop it")
        if depth > 0 and HYBRID_MTP_SEPARATOR not in main:
            # Megatron-LM's conversion of the legacy form into the unified pattern.
            model["hybrid_layer_pattern"] = (main + HYBRID_MTP_SEPARATOR
                                             + HYBRID_MTP_SEPARATOR.join([pattern] * depth))

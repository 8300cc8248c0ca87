"""The flags of the modes beside pretraining, and their config sections: DPO (`train_dpo.py`:
--dpo-*), RL (`train_rl.py`: Megatron-LM's --grpo-* / --rl-* / --langrl-env-config) and the
inference engine (`tools/generate.py`, the server, `train_rl.py`'s rollouts: --inference-*,
speculative decoding).

An entry script adds a mode's flags to the parser (`extra_args_provider=add_dpo_args`, ...);
`parse_args` then builds that mode's section (`Configs.dpo`, `.rl`, `.inference`) once, from
the flags it finds, and `validate_configs` checks it against the rest of the run.
"""
from __future__ import annotations

import argparse
from typing import Any, Dict, Optional

from megatron_smp.config.errors import ConfigError
from megatron_smp.config.inference import InferenceConfig
from megatron_smp.config.post_training import (
    DPO_LOSS_TYPES as LOSS_TYPES,
    DPO_REFERENCE_MODES as REFERENCE_MODES,
    GRPO_LOSS_TYPES,
    SCALE_REWARDS,
    DPOConfig,
    RLConfig,
)


def add_dpo_args(parser):
    """The --dpo-* flags (Megatron's style; TRL's DPOConfig names after the prefix)."""
    group = parser.add_argument_group("DPO (train_dpo.py)")
    group.add_argument("--dpo-beta", type=float, default=0.1,
                       help="beta: the strength of the reference's pull (TRL's beta)")
    group.add_argument("--dpo-loss-type", default="sigmoid",
                       help=f"TRL's loss_type: {', '.join(LOSS_TYPES)}")
    group.add_argument("--dpo-label-smoothing", type=float, default=0.0,
                       help="the robust loss's label smoothing, in [0, 0.5)")
    group.add_argument("--dpo-rpo-alpha", type=float, default=None,
                       help="add this times the chosen responses' mean NLL (RPO; TRL's "
                            "loss_type 'sft' weighted by it)")
    group.add_argument("--dpo-reference", default=None,
                       help=f"{', '.join(REFERENCE_MODES)} (default: adapters-off with "
                            "--lora-rank, else frozen)")
    return parser


def add_rl_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add Megatron-LM's RL flags (and the GRPO-variant flags) to `parser`; returns it."""
    group = parser.add_argument_group(title="rl")
    group.add_argument("--grpo-group-size", type=int, default=2,
                       help="Completions sampled per prompt (a GRPO group).")
    group.add_argument("--grpo-prompts-per-step", type=int, default=32,
                       help="Prompts (groups) per rollout batch.")
    group.add_argument("--grpo-iterations", type=int, default=2,
                       help="Optimizer updates on each rollout batch.")
    group.add_argument("--grpo-kl-beta", type=float, default=0.001,
                       help="Weight of the k3 KL(policy || reference) term per token.")
    group.add_argument("--grpo-clamp-eps-lower", type=float, default=0.01,
                       help="The ratio is clipped below at 1 - this.")
    group.add_argument("--grpo-clamp-eps-upper", type=float, default=0.01,
                       help="The ratio is clipped above at 1 + this (DAPO: larger than lower).")
    group.add_argument("--grpo-entropy-term-weight", type=float, default=0.0,
                       help="Weight of the entropy bonus (mean response-token entropy).")
    group.add_argument("--grpo-filter-groups-with-same-reward", action="store_true",
                       help="Drop groups whose rewards are all equal (DAPO's dynamic sampling).")
    group.add_argument("--grpo-loss-type", choices=GRPO_LOSS_TYPES, default="dapo",
                       help="Aggregation (TRL's loss_type): grpo sequence-mean, dapo token-mean "
                            "over the batch (Megatron-LM's), dr_grpo sum / max length, gspo "
                            "sequence-level ratio.")
    group.add_argument("--grpo-scale-rewards", choices=SCALE_REWARDS, default="group",
                       help="Divide advantages by the group's std, the batch's, or none "
                            "(Dr. GRPO).")
    group.add_argument("--grpo-unbiased-reward-std", action="store_true",
                       help="Bessel-corrected std in the advantages (TRL's; Megatron-LM's is the "
                            "population std).")
    group.add_argument("--rl-default-temperature", type=float, default=1.0,
                       help="Sampling temperature of the rollouts (0: greedy).")
    group.add_argument("--rl-default-top-p", type=float, default=0.0,
                       help="Nucleus sampling of the rollouts (0: off).")
    group.add_argument("--rl-default-top-k", type=int, default=-1,
                       help="Top-k sampling of the rollouts (<= 0: off).")
    group.add_argument("--rl-max-completion-length", type=int, default=256,
                       help="Most tokens generated per completion (dr_grpo's normaliser).")
    group.add_argument("--rl-use-sequence-packing", action=argparse.BooleanOptionalAction,
                       default=False,
                       help="Pack the rollouts of a training step into rows of --seq-length "
                            "(each attending only to itself) instead of one rollout per row: "
                            "fewer rows, the same loss and update.")
    group.add_argument("--langrl-env-config", type=str, default=None,
                       help="YAML file of RL environments (prompts and reward functions).")
    return parser


def rl_config(args: argparse.Namespace) -> RLConfig:
    """The RLConfig of parsed flags (validated; ConfigError names the flag)."""
    return RLConfig(
        group_size=args.grpo_group_size, prompts_per_step=args.grpo_prompts_per_step,
        iterations=args.grpo_iterations, kl_beta=args.grpo_kl_beta,
        clamp_eps_lower=args.grpo_clamp_eps_lower, clamp_eps_upper=args.grpo_clamp_eps_upper,
        entropy_term_weight=args.grpo_entropy_term_weight,
        filter_groups_with_same_reward=args.grpo_filter_groups_with_same_reward,
        loss_type=args.grpo_loss_type, scale_rewards=args.grpo_scale_rewards,
        unbiased_reward_std=args.grpo_unbiased_reward_std,
        temperature=args.rl_default_temperature, top_k=args.rl_default_top_k,
        top_p=args.rl_default_top_p, max_completion_length=args.rl_max_completion_length,
        env_config=args.langrl_env_config, sequence_packing=args.rl_use_sequence_packing)


def add_inference_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The engine's flags (Megatron-LM's names where it has one)."""
    group = parser.add_argument_group("inference")
    group.add_argument("--inference-max-tokens", type=int, default=16384,
                       help="tokens the paged KV cache holds over all running requests")
    group.add_argument("--inference-max-requests", type=int, default=64,
                       help="requests in the running batch at once (the rest queue)")
    group.add_argument("--inference-max-seq-length", type=int, default=None,
                       help="longest prompt + generation (default: --max-position-embeddings)")
    group.add_argument("--inference-dynamic-batching-block-size", type=int, default=16,
                       help="tokens per KV cache block")
    group.add_argument("--inference-dynamic-batching-max-tokens", type=int, default=None,
                       help="tokens one step runs (each decode counts one); a prompt waits "
                            "for a step with room for it (default: no limit)")
    group.add_argument("--enable-chunked-prefill", action="store_true",
                       help="split prompts into chunks that fill the room steps have "
                            "(needs --inference-dynamic-batching-max-tokens)")
    group.add_argument("--inference-dynamic-batching-prefix-caching",
                       dest="inference_dynamic_batching_enable_prefix_caching",
                       action=argparse.BooleanOptionalAction, default=False,
                       help="share the KV blocks of common prompt prefixes between requests")
    group.add_argument("--inference-dynamic-batching-prefix-caching-eviction-policy",
                       choices=["ref_zero", "lru"], default=None,
                       help="ref_zero (default): a prefix block is freed when no request holds "
                            "it; lru: kept until its space is needed (least recently used "
                            "first)")
    group.add_argument("--speculative-config", default=None,
                       help="speculative decoding, vLLM's JSON: {\"method\": \"ngram\" | "
                            "\"mtp\" | \"draft_model\", \"num_speculative_tokens\": N, "
                            "\"prompt_lookup_max\": 5, \"prompt_lookup_min\": 1, "
                            "\"model\": DRAFT_CHECKPOINT_DIR (draft_model)}")
    group.add_argument("--num-speculative-tokens", type=int, default=None,
                       help="speculative decoding with the model's MTP layers "
                            "(--mtp-num-layers models), N drafts per step (Megatron-LM)")
    group.add_argument("--inference-torch-compile", action="store_true",
                       help="run the decode-only steps through torch.compile at padded "
                            "shapes (batch sizes of --inference-dynamic-batching-num-cuda-"
                            "graphs, key widths of power-of-two blocks); --cuda-graph-impl "
                            "local captures the same steps as CUDA graphs instead (a CUDA "
                            "device)")
    group.add_argument("--inference-dynamic-batching-num-cuda-graphs", type=int, default=16,
                       help="batch sizes the decode step is compiled or captured at (the "
                            "running batch padded up to the next; -1: every size the sizing "
                            "distribution gives), the largest --inference-max-requests")
    group.add_argument("--inference-dynamic-batching-cuda-graph-sizing-distribution",
                       choices=["exponential", "linear"], default="exponential",
                       help="exponential: batch sizes halving from --inference-max-requests "
                            "to 1; linear: evenly spaced")
    group.add_argument("--cuda-graph-warmup-steps", type=int, default=3,
                       help="eager runs of a decode bucket before its CUDA graph is captured")
    return parser


def dpo_section(args: argparse.Namespace, lora: bool) -> DPOConfig:
    """The DPOConfig of the --dpo-* flags (--dpo-reference's default: adapters-off with
    --lora-rank, else frozen)."""
    return DPOConfig(beta=args.dpo_beta, loss_type=args.dpo_loss_type,
                     label_smoothing=args.dpo_label_smoothing, rpo_alpha=args.dpo_rpo_alpha,
                     reference=args.dpo_reference or ("adapters-off" if lora else "frozen"))


def inference_section(args: argparse.Namespace) -> InferenceConfig:
    """The InferenceConfig of the --inference-* and speculative-decoding flags."""
    return InferenceConfig(
        max_tokens=args.inference_max_tokens, max_requests=args.inference_max_requests,
        max_seq_length=args.inference_max_seq_length,
        block_size=args.inference_dynamic_batching_block_size,
        max_step_tokens=args.inference_dynamic_batching_max_tokens,
        chunked_prefill=args.enable_chunked_prefill,
        prefix_caching=args.inference_dynamic_batching_enable_prefix_caching,
        prefix_caching_eviction_policy=(
            args.inference_dynamic_batching_prefix_caching_eviction_policy),
        speculative_config=getattr(args, "speculative_config", None),
        num_speculative_tokens=getattr(args, "num_speculative_tokens", None),
        decode_step=decode_step_mode(args),
        num_cuda_graphs=args.inference_dynamic_batching_num_cuda_graphs,
        cuda_graph_sizing_distribution=(
            args.inference_dynamic_batching_cuda_graph_sizing_distribution),
        cuda_graph_warmup_steps=args.cuda_graph_warmup_steps)


def decode_step_mode(args: argparse.Namespace) -> Optional[str]:
    """The engine's decode step of --cuda-graph-impl and --inference-torch-compile."""
    if args.cuda_graph_impl not in ("none", "local"):
        raise ConfigError(f"--cuda-graph-impl {args.cuda_graph_impl}: the inference engine "
                          "captures its decode steps with local (its own CUDA graphs); "
                          "Transformer Engine's are not built here")
    if args.cuda_graph_impl == "local" and args.inference_torch_compile:
        raise ConfigError("--cuda-graph-impl local and --inference-torch-compile are two ways "
                          "to run the decode step: give one")
    if args.cuda_graph_impl == "local":
        return "cuda_graph"
    return "compile" if args.inference_torch_compile else None


def mode_sections(args: argparse.Namespace, training: Dict[str, Any]) -> Dict[str, Any]:
    """{"dpo"|"rl"|"inference": section} for each mode whose flags the parser has (an entry
    script added them); `training` is the training section's fields given so far (LoRA picks
    DPO's reference; an RL step's global batch is its rollouts, unless given)."""
    sections: Dict[str, Any] = {}
    if hasattr(args, "dpo_beta"):
        sections["dpo"] = dpo_section(args, bool(training.get("lora_rank")))
    if hasattr(args, "grpo_group_size"):
        sections["rl"] = rl_config(args)
        training.setdefault("global_batch_size", sections["rl"].rollouts_per_step)
    if hasattr(args, "inference_max_tokens"):
        sections["inference"] = inference_section(args)
    return sections

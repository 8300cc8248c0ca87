"""A model for inference from Megatron's flags: what `tools/generate.py` and
`tools/run_text_generation_server.py` share.

    configs, state, engine, tokenizer = build_inference_engine(argv, extra_args_provider)

parses the flags (`--load`, `--use-checkpoint-args`, the model and parallel sizes, the
tokenizer), builds the process group and this rank's pipeline stage of `GPTModel`, loads the
checkpoint's weights (model only: ours, or Megatron-LM's torch_dist / legacy checkpoints,
detected; `torch_dist` reshards to this layout) and wraps it in an
`inference.InferenceEngine` sized by the inference flags added here (with data-parallel
replicas, `inference.replicas.DataParallelEngine`: each replica serves its share).
"""
from __future__ import annotations

import datetime
from typing import Callable, Optional, Sequence

import torch

from megatron_smp.config import ConfigError
from megatron_smp.inference.decode_step import decode_step_options
from megatron_smp.inference.speculative import speculative_config_of  # noqa: F401
from megatron_smp.training.arguments.modes import add_inference_args  # noqa: F401 (its flags)


def _draft_argv(argv: Sequence[str], path: str) -> list:
    """The flags with --load PATH (and --use-checkpoint-args): the draft checkpoint's model
    with the same tokenizer."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--load":
            skip = True
        elif not arg.startswith("--load="):
            out.append(str(arg))
    out += ["--load", path]
    return out if "--use-checkpoint-args" in out else out + ["--use-checkpoint-args"]


def _load_draft_model(argv, path, providers, defaults, tokenizer, device):
    """The draft model of speculative decoding, whole on every rank (the engine's leader
    uses it), loaded from `path` with its checkpoint's model arguments (collective)."""
    from megatron_smp.checkpointing import CheckpointError
    from megatron_smp.checkpointing.loop import load_inference_weights, model_vocab_size
    from megatron_smp.models.gpt import GPTModel
    from megatron_smp.parallel_state import local_parallel_state
    from megatron_smp.training.arguments import parse_args

    configs = parse_args(_draft_argv(argv, path), providers, defaults)
    configs.model.vocab_size = model_vocab_size(configs.model.vocab_size, tokenizer.vocab_size)
    state = local_parallel_state()
    model = GPTModel(configs.model, state).to(device)
    if load_inference_weights([model], state, configs) is None:
        raise CheckpointError(f"--speculative-config model {path} holds no checkpoint")
    return model.eval()


def _model_provider(configs, state, pre_process=True, post_process=True, **stage):
    from megatron_smp.models.gpt import GPTModel

    return GPTModel(configs.model, state, pre_process=pre_process, post_process=post_process,
                    **stage)


def build_inference_engine(argv: Optional[Sequence[str]] = None,
                           extra_args_provider: Optional[Callable] = None,
                           model_provider: Optional[Callable] = None):
    """(configs, state, engine, tokenizer) from Megatron flags; collective. Without --load
    the model keeps its --seed initialisation (a clear warning on rank 0)."""
    from megatron_smp.checkpointing.loop import load_inference_weights, model_vocab_size
    from megatron_smp.data import build_tokenizer
    from megatron_smp.inference import InferenceEngine
    from megatron_smp.inference.replicas import DataParallelEngine, num_replicas
    from megatron_smp.parallel_state import create_parallel_state
    from megatron_smp.tensor_parallel.random import model_parallel_seed
    from megatron_smp.training.arguments import parse_args, validate_configs

    def providers(parser):
        for action in parser._actions:  # a training length means nothing here
            if action.dest == "training__seq_length":
                action.required = False
        parser = add_inference_args(parser)
        if extra_args_provider is not None:
            parser = extra_args_provider(parser) or parser
        return parser

    import sys

    argv = list(argv) if argv is not None else sys.argv[1:]
    # Training's required numbers, at values every layout divides (the engine's own limits
    # are the --inference-* flags).
    defaults = {"micro_batch_size": 1, "train_iters": 1, "seq_length": 8, "mock_data": True}
    configs = parse_args(argv, providers, defaults)
    tokenizer = build_tokenizer(configs.data)
    configs.model.vocab_size = model_vocab_size(configs.model.vocab_size, tokenizer.vocab_size)
    validate_configs(configs)  # the --inference-* flags too (configs.inference)
    inference = configs.inference
    speculative = speculative_config_of(inference)
    if configs.parallel.context_parallel_size > 1:
        raise ConfigError("inference: --context-parallel-size must be 1 (generate at tensor, "
                          "pipeline or expert parallelism)")
    if configs.parallel.virtual_pipeline_model_parallel_size not in (None, 1):
        raise ConfigError("inference: virtual pipeline stages are not supported; drop "
                          "--num-layers-per-virtual-pipeline-stage")
    timeout = datetime.timedelta(minutes=configs.parallel.distributed_timeout_minutes)
    state = create_parallel_state(configs.parallel, timeout=timeout)
    model_parallel_seed(configs.training.seed, state)
    provider = model_provider or _model_provider
    if state.pp_size > 1:
        from megatron_smp.pipeline_parallel.stages import build_pipeline_model_chunks

        chunks = build_pipeline_model_chunks(provider, configs, state)
    else:
        chunks = [provider(configs, state, pre_process=True, post_process=True)]
    for chunk in chunks:
        chunk.to(state.device)
    load = configs.checkpoint.load
    loaded = load_inference_weights(chunks, state, configs) if load else None
    if loaded is None:
        from megatron_smp.checkpointing import CheckpointError

        if load:  # every rank alike: the tracker check above agreed
            raise CheckpointError(f"--load {load} holds no checkpoint (neither ours nor "
                                  "Megatron-LM's)")
        if state.rank == 0:
            print("warning: no --load given: generating from the --seed initialisation",
                  flush=True)
    elif state.rank == 0:
        print(f"loaded {loaded}", flush=True)
    draft = None
    if speculative is not None and speculative.method == "draft_model":
        draft = _load_draft_model(argv, speculative.model, providers, defaults, tokenizer,
                                  state.device)

    def make_engine(group=None):
        return InferenceEngine(
            chunks, max_tokens=inference.max_tokens, max_requests=inference.max_requests,
            block_size=inference.block_size,
            max_seq_length=inference.max_seq_length or configs.model.max_position_embeddings,
            group=group, prefix_caching=inference.eviction_policy,
            max_step_tokens=inference.max_step_tokens,
            chunked_prefill=inference.chunked_prefill, speculative=speculative,
            draft_model=draft, **decode_step_options(inference))

    # Data-parallel replicas each serve their share of the requests (the caches per replica).
    engine = DataParallelEngine(state, make_engine) if num_replicas(state) > 1 \
        else make_engine()
    torch.set_grad_enabled(False)
    return configs, state, engine, tokenizer


__all__ = ["add_inference_args", "build_inference_engine", "speculative_config_of"]

"""An inference engine from validated configs: what `tools/generate.py` and
`tools/run_text_generation_server.py` share, below the flags.

    state, engine = launch_inference_engine(configs, model_provider=None, draft_configs=None)

builds the process group and this rank's pipeline stage of `GPTModel`, loads the
checkpoint's weights (model only: ours, or Megatron-LM's torch_dist / legacy checkpoints,
detected; `torch_dist` reshards to this layout) and wraps it in an
`inference.InferenceEngine` sized by `configs.inference` (with data-parallel replicas,
`inference.replicas.DataParallelEngine`: each replica serves its share). Megatron's flags
become those configs in `training.inference_flags.build_inference_engine`.
"""
from __future__ import annotations

import datetime
from typing import Callable, Optional

import torch

from megatron_smp.config import ConfigError
from megatron_smp.config.sections import Configs
from megatron_smp.inference.decode_step import decode_step_options
from megatron_smp.inference.speculative import speculative_config_of


def check_inference_layout(configs: Configs) -> None:
    """The layouts the engine cannot serve, as ConfigErrors naming the flag (pure: before
    any process group)."""
    if configs.parallel.context_parallel_size > 1:
        raise ConfigError("inference: --context-parallel-size must be 1 (generate at tensor, "
                          "pipeline or expert parallelism)")
    if configs.parallel.virtual_pipeline_model_parallel_size not in (None, 1):
        raise ConfigError("inference: virtual pipeline stages are not supported; drop "
                          "--num-layers-per-virtual-pipeline-stage")


def _load_draft_model(draft_configs: Configs, device):
    """The draft model of speculative decoding, whole on every rank (the engine's leader
    uses it), loaded from its checkpoint (collective)."""
    from megatron_smp.checkpointing import CheckpointError
    from megatron_smp.checkpointing.loop import load_inference_weights
    from megatron_smp.models.gpt import GPTModel
    from megatron_smp.parallel_state import local_parallel_state

    state = local_parallel_state()
    model = GPTModel(draft_configs.model, state).to(device)
    if load_inference_weights([model], state, draft_configs) is None:
        raise CheckpointError(f"--speculative-config model {draft_configs.checkpoint.load} "
                              "holds no checkpoint")
    return model.eval()


def _model_provider(configs, state, pre_process=True, post_process=True, **stage):
    from megatron_smp.models.gpt import GPTModel

    return GPTModel(configs.model, state, pre_process=pre_process, post_process=post_process,
                    **stage)


def launch_inference_engine(configs: Configs, model_provider: Optional[Callable] = None,
                            draft_configs: Optional[Configs] = None):
    """(state, engine) from validated `configs` (`validate_configs` and
    `check_inference_layout`; with their `inference` section and the tokenizer's vocabulary);
    collective. `draft_configs`: the draft model's (its model validated at one process's
    layout), for --speculative-config's draft_model method. Without --load the model keeps
    its --seed initialisation (a clear warning on rank 0)."""
    from megatron_smp.checkpointing.loop import load_inference_weights
    from megatron_smp.inference import InferenceEngine
    from megatron_smp.inference.replicas import DataParallelEngine, num_replicas
    from megatron_smp.parallel_state import create_parallel_state
    from megatron_smp.tensor_parallel.random import model_parallel_seed

    inference = configs.inference
    speculative = speculative_config_of(inference)
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
        draft = _load_draft_model(draft_configs, state.device)

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
    return state, engine


__all__ = ["check_inference_layout", "launch_inference_engine", "speculative_config_of"]

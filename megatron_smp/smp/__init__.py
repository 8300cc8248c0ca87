"""The SageMaker model parallelism v2 surface, one root mirroring `torch.sagemaker`'s module tree:
a v2 script migrates by replacing the string `torch.sagemaker` with `megatron_smp.smp`.

    import megatron_smp.smp as tsm                       # or `import megatron_smp as tsm`
    tsm.init({"tensor_parallel_degree": 2, "random_seed": 7})   # or a JSON file path
    model = tsm.transform(hf_model)      # GPT-2, Llama, Mistral, GPT-NeoX, Mixtral, ... causal LMs

Module tree (each re-exports the framework's one implementation):
  megatron_smp.smp                 init, is_initialized, state, transform, MoEConfig, fully_shard
  .state                           the SMPState object (the module defines SMPState, init)
  .transform                       callable: `transform(model, ...)`; also TransformedModel
  .keys                            the config keys, their defaults and checks (ours)
  .v1_config                       SMP v1 keys: mapped with a log line, or refused (ours)
  .hf_contract                     HF's causal-LM forward/loss/output contract (ours)
  .torch_fsdp                      torch's FSDP1 / FSDP2 / offload_wrapper follow the keys
  .fsdp_grads                      the TP / EP grad reductions a transformed model carries
                                   for torch's FSDP (ours)
  .fsdp                            `fully_shard`: FSDP2 with the `init` keys (ours)
  .nn.attn                         FlashSelfAttention, FlashGroupedQueryAttention
  .nn.huggingface                  HF-specific modules (llama_flashattn, v1 translators)
  .moe.moe_config                  MoEConfig
  .delayed_param                   DelayedParamIniter
  .utils.module_utils              empty_module_params, move_buffers_to_device
  .distributed.checkpoint.state_dict_saver   save, async_save, maybe_finalize_async_calls,
                                             PyTorchDistSaveShardedStrategy
  .distributed.checkpoint.state_dict_loader  load
"""
from megatron_smp.smp.keys import FSDP_SCRIPT_KEYS, parse_smp_config, read_smp_keys
from megatron_smp.smp.moe.moe_config import MoEConfig
from megatron_smp.smp.state import SMPState, init, is_initialized, state
from megatron_smp.smp import transform  # the callable module (see transform.py)
from megatron_smp.smp.transform import TransformedModel
from megatron_smp.smp.fsdp import fully_shard
from megatron_smp.smp import nn  # noqa: F401 (v1 scripts: smp.nn.huggingface.gpt2.translate_...)

__all__ = ["init", "is_initialized", "state", "transform", "TransformedModel", "SMPState",
           "MoEConfig", "fully_shard", "read_smp_keys", "parse_smp_config", "FSDP_SCRIPT_KEYS"]

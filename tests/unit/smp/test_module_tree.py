"""megatron_smp.smp mirrors torch.sagemaker's module tree: a v2 script's imports work with the
string `torch.sagemaker` replaced by `megatron_smp.smp`, and nothing else."""
import importlib

import pytest

import megatron_smp


# (module path under torch.sagemaker, names imported from it) as SMP v2's reference writes them.
REFERENCE_IMPORTS = [
    ("", ["init", "is_initialized", "state", "transform"]),
    (".transform", ["transform"]),
    (".state", ["SMPState"]),
    (".nn.attn", ["FlashSelfAttention", "FlashGroupedQueryAttention"]),
    (".nn.huggingface.llama_flashattn", ["LlamaFlashAttention"]),
    (".moe.moe_config", ["MoEConfig"]),
    (".delayed_param", ["DelayedParamIniter"]),
    (".utils.module_utils", ["empty_module_params", "move_buffers_to_device"]),
    (".distributed.checkpoint.state_dict_saver",
     ["save", "async_save", "maybe_finalize_async_calls", "PyTorchDistSaveShardedStrategy"]),
    (".distributed.checkpoint.state_dict_loader", ["load"]),
]


@pytest.mark.parametrize("suffix,names", REFERENCE_IMPORTS)
def test_reference_import_paths_exist_under_megatron_smp_smp(suffix, names):
    script = "\n".join(f"from torch.sagemaker{suffix} import {name}" for name in names)
    namespace = {}
    exec(script.replace("torch.sagemaker", "megatron_smp.smp"), namespace)
    for name in names:
        assert namespace[name] is not None


def test_transform_is_callable_and_a_module_and_state_is_the_object():
    import megatron_smp.smp as tsm
    from megatron_smp.smp.transform import TransformedModel  # noqa: F401 (module import)
    from megatron_smp.smp.state import SMPState

    importlib.import_module("megatron_smp.smp.transform")
    importlib.import_module("megatron_smp.smp.state")
    assert callable(tsm.transform) and tsm.transform.TransformedModel is TransformedModel
    assert isinstance(tsm.state, SMPState)
    # `import megatron_smp as tsm` keeps the same surface.
    assert megatron_smp.transform is tsm.transform and megatron_smp.state is tsm.state
    assert megatron_smp.init is tsm.init and megatron_smp.MoEConfig is tsm.MoEConfig


def test_save_strategy_accepts_pytorch_dist_and_names_the_others(tmp_path):
    import torch

    from megatron_smp.smp.distributed.checkpoint.state_dict_loader import load
    from megatron_smp.smp.distributed.checkpoint.state_dict_saver import (
        PyTorchDistSaveShardedStrategy, async_save, maybe_finalize_async_calls,
    )

    state_dict = {"w": torch.arange(6.0)}
    async_save(state_dict, checkpoint_id=str(tmp_path),
               sharded_strategy=PyTorchDistSaveShardedStrategy())
    maybe_finalize_async_calls(blocking=True)
    loaded = {"w": torch.zeros(6)}
    load(loaded, checkpoint_id=str(tmp_path))
    assert torch.equal(loaded["w"], state_dict["w"])
    with pytest.raises(NotImplementedError, match="zarr"):
        PyTorchDistSaveShardedStrategy("zarr")
    with pytest.raises(NotImplementedError, match="PyTorchDistSaveShardedStrategy"):
        async_save(state_dict, checkpoint_id=str(tmp_path), sharded_strategy=("zarr", 1))

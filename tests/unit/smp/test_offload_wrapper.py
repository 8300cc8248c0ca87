"""torch's `offload_wrapper` after `init`: with sm_activation_offloading our offloader (with
activation_loading_horizon) handles the checkpointed layers; without, torch's save_on_cpu."""
import torch

import megatron_smp.smp as tsm
from tests.unit.models.test_hf_adapters import build_hf


def _wrapped_grads(smp_config):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing, checkpoint_wrapper, offload_wrapper,
    )

    from megatron_smp.transformer.layer import TransformerLayer

    tsm.init(smp_config)
    model = tsm.transform(build_hf("llama", num_hidden_layers=4).train())
    if smp_config:  # the reference's script: checkpoint the layers, then offload
        apply_activation_checkpointing(model, checkpoint_wrapper_fn=checkpoint_wrapper,
                                       check_fn=lambda m: isinstance(m, TransformerLayer))
        model = offload_wrapper(model)
    ids = torch.arange(2 * 8).reshape(2, 8) % 1003
    model(input_ids=ids, labels=ids)["loss"].backward()
    grads = {n.split("module.")[-1].replace("_checkpoint_wrapped_module.", ""): p.grad
             for n, p in model.named_parameters()}
    return model, grads


def test_offload_wrapper_uses_our_offloader_with_the_horizon():
    _, expected = _wrapped_grads({})
    model, grads = _wrapped_grads({"activation_loading_horizon": 1})
    offloader = model.activation_offloader
    assert offloader.horizon == 1
    assert offloader.offloaded_layers == {0, 1, 2, 3} and offloader.max_resident == 1
    assert set(grads) == set(expected)
    assert max((grads[n] - expected[n]).abs().max().item() for n in expected) < 1e-6
    # sm_activation_offloading false: torch's own wrapper (save_on_cpu), same grads.
    model, grads = _wrapped_grads({"sm_activation_offloading": False})
    assert model.activation_offloader is None
    assert max((grads[n] - expected[n]).abs().max().item() for n in expected) < 1e-6

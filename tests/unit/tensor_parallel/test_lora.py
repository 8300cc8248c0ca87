"""LoRA on the parallel linear layers: TP=2 (and +SP) equals TP=1 in logits and adapter grads,
the base is frozen; the exported PEFT adapter, loaded by `peft.PeftModel.from_pretrained` onto
the HF Llama, gives our logits, and the merged HF export equals the adapter on the base."""
import dataclasses
import json
import os

import pytest
import torch
import torch.distributed as dist

from megatron_smp.config import ConfigError
from megatron_smp.testing import run_distributed
from tests.unit.models.common import to_numpy, to_torch

RANK, ALPHA = 4, 8.0


def _hf_llama():
    from tests.unit.models.test_hf_adapters import build_hf

    return build_hf("llama")


def _worker(rank, world_size, out_dir):
    from megatron_smp.config import ParallelConfig
    from megatron_smp.models import GPTModel, gather_full_logits
    from megatron_smp.models.hf import get_adapter
    from megatron_smp.models.hf.peft import save_peft_adapter
    from megatron_smp.models.sharding import (
        merge_state_dicts,
        shard_state_dict,
        split_tensor,
        tensor_parallel_layout,
    )
    from megatron_smp.parallel_state import build_parallel_state
    from megatron_smp.tensor_parallel.lora import LORA_TARGETS, apply_lora

    hf = _hf_llama()
    adapter = get_adapter("llama")
    state = build_parallel_state(ParallelConfig(tensor_model_parallel_size=world_size))
    ids = torch.randint(0, hf.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    labels = torch.roll(ids, -1, dims=1)
    results = {}
    for sequence_parallel in ([False, True] if world_size > 1 else [False]):
        config = dataclasses.replace(adapter.config_from_hf(hf.config),
                                     sequence_parallel=sequence_parallel)
        full = adapter.from_hf(hf.state_dict(), config)
        model = GPTModel(config, state)
        model.load_state_dict(shard_state_dict(full, config, world_size, state.tp_rank))
        adapted = apply_lora(model, RANK, ALPHA, 0.0, LORA_TARGETS)
        assert len(adapted) == 4 * config.num_layers
        # Random A and B (B starts at zero) drawn whole and split like the parameters.
        generator = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for name in adapted:
                layer = model.get_submodule(name)
                for param, shape in ((layer.lora.lora_A, (RANK, layer.input_size)),
                                     (layer.lora.lora_B, (layer.output_size, RANK))):
                    whole = 0.1 * torch.randn(shape, generator=generator)
                    if getattr(param, "tensor_model_parallel", False):
                        whole = split_tensor(whole, param.partition_dim, param.partition_stride,
                                             world_size, state.tp_rank)
                    param.copy_(whole)
        trainable = [n for n, p in model.named_parameters() if p.requires_grad]
        assert trainable and all(".lora.lora_" in n for n in trainable)
        logits = gather_full_logits(model(ids), state, config.vocab_size)
        model(ids, labels=labels).sum().backward()
        for param in model.parameters():
            if param.requires_grad and getattr(param, "sequence_parallel", False):
                dist.all_reduce(param.grad, group=state.tp_group)
        assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
        layout = tensor_parallel_layout(model)
        grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
        weights = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
        if world_size > 1:
            gathered_g, gathered_w = [None] * world_size, [None] * world_size
            dist.all_gather_object(gathered_g, grads, group=state.tp_group)
            dist.all_gather_object(gathered_w, weights, group=state.tp_group)
            grads = merge_state_dicts(gathered_g, config, layout)
            weights = merge_state_dicts(gathered_w, config, layout)
        if rank == 0:
            save_peft_adapter(os.path.join(out_dir, f"tp{world_size}_sp{int(sequence_parallel)}"),
                              weights, config, RANK, ALPHA, 0.0, LORA_TARGETS)
        if world_size == 1:
            # The merged export: base + alpha/r * B A in our layout, then HF names.
            from megatron_smp.tensor_parallel.lora import merge_lora

            merged = merge_lora({n: p.detach() for n, p in model.state_dict().items()},
                                ALPHA, RANK)
            assert not any(".lora." in n for n in merged)
            hf.load_state_dict(adapter.to_hf(merged, config))
            hf.save_pretrained(os.path.join(out_dir, "merged"))
        results[sequence_parallel] = (logits.detach(), grads)
    return to_numpy(results)


def _peft_model(directory):
    """The HF Llama with our exported adapter loaded by peft itself."""
    from peft import PeftModel

    with open(os.path.join(directory, "adapter_config.json")) as handle:
        assert json.load(handle)["peft_type"] == "LORA"
    return PeftModel.from_pretrained(_hf_llama(), directory).eval()


def test_lora_tp2_equals_tp1_and_peft_export_matches_hf(tmp_path):
    single = to_torch(run_distributed(_worker, 1, args=(str(tmp_path),)))[0][False]
    tp2 = to_torch(run_distributed(_worker, 2, args=(str(tmp_path),), timeout=240))
    ids = torch.randint(0, 1003, (2, 16), generator=torch.Generator().manual_seed(1))
    for rank_results in tp2:
        for sequence_parallel, (logits, grads) in rank_results.items():
            assert (logits - single[0]).abs().max() < 1e-5, sequence_parallel
            assert set(grads) == set(single[1])
            for name, grad in grads.items():
                assert torch.allclose(grad, single[1][name], atol=1e-5, rtol=1e-4), name
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    for run in ("tp1_sp0", "tp2_sp0", "tp2_sp1"):
        tensors = load_file(str(tmp_path / run / "adapter_model.safetensors"))
        assert len(tensors) == 2 * 7 * 2  # q, k, v, o, gate, up, down x (A, B) x 2 layers
        peft_model = _peft_model(str(tmp_path / run))
        lora_params = [n for n, _ in peft_model.named_parameters() if ".lora_" in n]
        assert len(lora_params) == len(tensors)  # every tensor found its module
        with torch.no_grad():
            on_base = peft_model(input_ids=ids).logits
        assert (on_base - single[0]).abs().max() < 2e-4, run
        if run == "tp1_sp0":
            # The merged HF export (a plain from_pretrained directory) equals adapter-on-base.
            merged = LlamaForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
            with torch.no_grad():
                assert (merged(ids).logits - on_base).abs().max() < 2e-5
    # The adapter changes the model: the base alone does not give these logits.
    with torch.no_grad():
        assert (_hf_llama()(ids).logits - single[0]).abs().max() > 1e-2


def test_lora_flag_errors():
    from megatron_smp.tensor_parallel.lora import check_lora_flags

    with pytest.raises(ConfigError, match="--lora-rank"):
        check_lora_flags(0, 8.0, 0.0, ["linear_qkv"])
    with pytest.raises(ConfigError, match="--lora-target-modules .*q_proj"):
        check_lora_flags(4, 8.0, 0.0, ["q_proj"])
    with pytest.raises(ConfigError, match="--lora-dropout"):
        check_lora_flags(4, 8.0, 1.0, ["linear_qkv"])
    from megatron_smp.training.arguments import parse_args, validate_configs

    configs = parse_args("--num-layers 1 --hidden-size 8 --num-attention-heads 1 --seq-length 8 "
                         "--max-position-embeddings 8 --micro-batch-size 1 --mock-data --train-iters 1 "
                         "--pretrained-checkpoint base".split())
    configs.model.vocab_size = 16
    with pytest.raises(ConfigError, match="--pretrained-checkpoint names the base model of a "
                                          "--lora-rank run.*--load DIR --finetune"):
        validate_configs(configs, world_size=1)
    configs.training.lora_rank = 4  # a LoRA run over that base: accepted
    validate_configs(configs, world_size=1)


def test_transformed_model_takes_lora_in_one_call(tmp_path):
    """smp.transform(hf).apply_lora(...): adapters only train; the PEFT directory it saves,
    loaded by peft onto the HF model, and the merged hf_state_dict() give its logits."""
    import megatron_smp.smp as tsm

    tsm.init({})
    model = tsm.transform(_hf_llama())
    assert len(model.apply_lora(rank=RANK, alpha=ALPHA)) == 4 * 2
    assert {n.split(".lora.")[-1] for n, p in model.named_parameters() if p.requires_grad} \
        == {"lora_A", "lora_B"}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("lora_B"):
                param.normal_(0, 0.1)
    ids = torch.randint(0, 1003, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(ids).logits
    model.save_peft_adapter(str(tmp_path / "adapter"))
    with torch.no_grad():
        assert (_peft_model(str(tmp_path / "adapter"))(input_ids=ids).logits - ours).abs().max() \
            < 2e-4
        merged = _hf_llama()
        merged.load_state_dict(model.hf_state_dict())
        assert (merged(ids).logits - ours).abs().max() < 2e-4
    with pytest.raises(ConfigError, match="already has LoRA"):
        model.apply_lora()

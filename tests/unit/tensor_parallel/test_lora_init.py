"""LoRA adapters start from the same values at every parallel layout: a small MoE model (4
experts, grouped GEMM, shared expert, a multi-token-prediction layer) and a hybrid stack
(Mamba, attention, MLP, MoE layers) at TP=2, PP=2, EP=2 and the combined TP2xEP2 and PP2xEP2
with two virtual stages per pipeline rank, their adapters gathered to full (TP shards joined,
stages and expert-parallel ranks merged by global layer number and global expert index),
equal one process's adapters bit for bit; so does a meta-device build with adapters
attached before it is materialised."""
import dataclasses

import torch
import torch.distributed as dist

from megatron_smp.testing import run_distributed
from tests.unit.models.common import to_numpy, to_torch

SEED = 1234
# (TP, PP, EP, virtual stages per PP rank)
LAYOUTS = {"single": (1, 1, 1, 1), "tp2": (2, 1, 1, 1), "pp2": (1, 2, 1, 1),
           "ep2": (1, 1, 2, 1), "tp2_ep2": (2, 1, 2, 1), "pp2_vp2_ep2": (1, 2, 2, 2)}


def _configs():
    """{name: config}: the MoE model with MTP, and a hybrid stack (Mamba, attention, MLP,
    MoE layers: the mixers have no target projections, the rest are adapted)."""
    from megatron_smp.config import TransformerConfig

    moe = TransformerConfig(
        num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2,
        vocab_size=64, max_position_embeddings=16, gated_linear_unit=True,
        activation="silu", add_bias_linear=False, normalization="RMSNorm",
        position_embedding_type="rope",
        num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16, moe_grouped_gemm=True,
        moe_shared_expert_intermediate_size=16, mtp_num_layers=1)
    hybrid = dataclasses.replace(moe, hybrid_layer_pattern="M*-E",
                                 mamba_num_groups=2, mamba_head_dim=16, mamba_state_dim=8,
                                 mtp_num_layers=None, moe_shared_expert_intermediate_size=None)
    return {"moe": moe, "hybrid": hybrid}


def _adapters(model, layer_offset):
    """[(global key, tensor, split dim or None, stride)] of the model's adapters: the
    key names the layer by its global number and the expert by its global index."""
    out = []
    for name, param in model.named_parameters():
        if ".lora.lora_" not in name:
            continue
        rename = getattr(param, "expert_checkpoint_rename", None)
        key = name.replace(*rename) if rename else name
        if key.startswith("decoder.layers."):
            local, rest = key[len("decoder.layers."):].split(".", 1)
            key = f"layer{layer_offset + int(local) + 1}.{rest}"
        split = getattr(param, "tensor_model_parallel", False)
        out.append((key, param.detach().clone(), param.partition_dim if split else None,
                    getattr(param, "partition_stride", 1)))
    return out


def _gathered(config, state, world_size, virtual, check_meta):
    """This layout's adapters gathered to full: {global key: tensor}. `virtual` chunks per
    pipeline rank (interleaved: chunk c of rank r holds stage c * pp + r). With
    `check_meta`, a meta-device build with adapters attached there, then materialised, must
    equal it."""
    from megatron_smp.distributed.delayed_init import materialize_meta_model
    from megatron_smp.models import GPTModel
    from megatron_smp.models.sharding import join_tensors
    from megatron_smp.tensor_parallel.lora import LORA_TARGETS, apply_lora

    per_chunk = config.num_layers // (state.pp_size * virtual)
    mine = []
    for chunk in range(virtual):
        offset = (chunk * state.pp_size + state.pp_rank) * per_chunk
        stage = dict(pre_process=state.is_pipeline_first_stage and chunk == 0,
                     post_process=state.is_pipeline_last_stage and chunk == virtual - 1,
                     layer_offset=offset, num_layers=per_chunk)
        torch.manual_seed(SEED)  # the run's seed, as build_pipeline_model_chunks sets it
        model = GPTModel(config, state, **stage)
        apply_lora(model, 4, 8.0, 0.0, LORA_TARGETS)
        adapters = _adapters(model, offset)
        mine += [(k, state.tp_rank, t, d, s) for k, t, d, s in adapters]
        if check_meta:
            torch.manual_seed(SEED)
            meta = GPTModel(config, state, device=torch.device("meta"), **stage)
            apply_lora(meta, 4, 8.0, 0.0, LORA_TARGETS)
            materialize_meta_model(meta, torch.device("cpu"))
            late = _adapters(meta, offset)
            assert len(late) == len(adapters)
            for (key, eager, _, _), (_, materialised, _, _) in zip(adapters, late):
                assert torch.equal(eager, materialised), ("meta", key)
    gathered = [None] * world_size
    dist.all_gather_object(gathered, mine)
    shards = {}
    for entries in gathered:
        for key, tp_rank, tensor, dim, stride in entries:
            held = shards.setdefault(key, {})
            # Replicas (DP, EP, TP for a whole matrix) must agree exactly.
            assert tp_rank not in held or torch.equal(held[tp_rank][0], tensor), key
            held[tp_rank] = (tensor, dim, stride)
    full = {}
    for key, held in shards.items():
        tensors = [held[r][0] for r in sorted(held)]
        dim, stride = held[0][1], held[0][2]
        full[key] = tensors[0] if dim is None else join_tensors(tensors, dim, stride)
    return full


def _worker(rank, world_size):
    from megatron_smp.config import ParallelConfig
    from megatron_smp.parallel_state import build_parallel_state

    results = {}
    for label, (tp, pp, ep, virtual) in LAYOUTS.items():
        state = build_parallel_state(ParallelConfig(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
            expert_model_parallel_size=ep))
        for name, config in _configs().items():
            results[f"{name} {label}"] = _gathered(
                dataclasses.replace(config, sequence_parallel=tp > 1), state, world_size,
                virtual, check_meta=label in ("single", "tp2_ep2"))
    return to_numpy(results) if rank == 0 else None


def test_lora_init_is_layout_independent():
    results = to_torch(run_distributed(_worker, 4, timeout=240)[0])
    for name in _configs():
        single = results[f"{name} single"]
        assert any("local_experts.3.linear_fc1" in key for key in single)  # experts adapted
        a_matrices = [t for k, t in single.items() if k.endswith("lora_A")]
        # Every adapter draws its own matrix (no two equal), and B starts at zero.
        assert len({t.sum().item() for t in a_matrices}) == len(a_matrices)
        assert all(not t.any() for k, t in single.items() if k.endswith("lora_B"))
        for label in LAYOUTS:
            full = results[f"{name} {label}"]
            assert set(full) == set(single), (name, label)
            for key, tensor in full.items():
                assert torch.equal(tensor, single[key]), (name, label, key)
    assert any(key.startswith("mtp.") for key in results["moe single"])
    hybrid = results["hybrid single"]
    assert {key.split(".")[0] for key in hybrid} == {"layer2", "layer3", "layer4"}
    assert {key.split(".")[0] for key in results["moe single"]} == {
        "layer1", "layer2", "layer3", "layer4", "mtp"}

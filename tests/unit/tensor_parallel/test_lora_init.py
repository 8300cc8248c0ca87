"""LoRA adapters start from the same values at every parallel layout: a small MoE model (4
experts, grouped GEMM, shared expert, a multi-token-prediction layer) at TP=2, PP=2, EP=2 and
the combined TP2xEP2 and PP2xEP2, its adapters gathered to full (TP shards joined, stages and
expert-parallel ranks merged by global layer number and global expert index), equals one
process's adapters bit for bit; so does a meta-device build materialised afterwards."""
import dataclasses

import torch
import torch.distributed as dist

from megatron_smp.testing import run_distributed
from tests.unit.models.common import to_numpy, to_torch

SEED = 1234
LAYOUTS = {"single": (1, 1, 1), "tp2": (2, 1, 1), "pp2": (1, 2, 1), "ep2": (1, 1, 2),
           "tp2_ep2": (2, 1, 2), "pp2_ep2": (1, 2, 2)}


def _config():
    from megatron_smp.config import TransformerConfig

    return TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
        vocab_size=64, max_position_embeddings=16, gated_linear_unit=True,
        activation="silu", add_bias_linear=False, normalization="RMSNorm",
        position_embedding_type="rope",
        num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16, moe_grouped_gemm=True,
        moe_shared_expert_intermediate_size=16, mtp_num_layers=1)


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


def _worker(rank, world_size):
    from megatron_smp.config import ParallelConfig
    from megatron_smp.distributed.delayed_init import materialize_meta_model
    from megatron_smp.models import GPTModel
    from megatron_smp.models.sharding import join_tensors
    from megatron_smp.parallel_state import build_parallel_state
    from megatron_smp.tensor_parallel.lora import LORA_TARGETS, apply_lora

    results = {}
    for label, (tp, pp, ep) in LAYOUTS.items():
        state = build_parallel_state(ParallelConfig(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
            expert_model_parallel_size=ep))
        config = dataclasses.replace(_config(), sequence_parallel=tp > 1)
        per_stage = config.num_layers // pp
        offset = state.pp_rank * per_stage
        stage = dict(pre_process=state.is_pipeline_first_stage,
                     post_process=state.is_pipeline_last_stage, layer_offset=offset,
                     num_layers=per_stage)
        torch.manual_seed(SEED)  # the run's seed, as build_pipeline_model_chunks sets it
        model = GPTModel(config, state, **stage)
        apply_lora(model, 4, 8.0, 0.0, LORA_TARGETS)
        mine = [(k, state.tp_rank, t, d, s) for k, t, d, s in _adapters(model, offset)]
        if label in ("single", "tp2_ep2"):
            # Built on the meta device, adapters attached there, then materialised.
            torch.manual_seed(SEED)
            meta = GPTModel(config, state, device=torch.device("meta"), **stage)
            apply_lora(meta, 4, 8.0, 0.0, LORA_TARGETS)
            materialize_meta_model(meta, torch.device("cpu"))
            for (key, _, eager, _, _), (_, late, _, _) in zip(mine, _adapters(meta, offset)):
                assert torch.equal(eager, late), (label, "meta", key)
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
        results[label] = full
    return to_numpy(results) if rank == 0 else None


def test_lora_init_is_layout_independent():
    results = to_torch(run_distributed(_worker, 4, timeout=240)[0])
    single = results["single"]
    assert any("local_experts.3.linear_fc1" in key for key in single)  # experts are adapted
    assert any(key.startswith("mtp.") for key in single)
    a_matrices = [t for k, t in single.items() if k.endswith("lora_A")]
    # Every adapter draws its own matrix (no two equal), and B starts at zero.
    assert len({t.sum().item() for t in a_matrices}) == len(a_matrices)
    assert all(not t.any() for k, t in single.items() if k.endswith("lora_B"))
    for label, full in results.items():
        assert set(full) == set(single), label
        for key, tensor in full.items():
            assert torch.equal(tensor, single[key]), (label, key)

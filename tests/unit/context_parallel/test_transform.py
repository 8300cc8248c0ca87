"""smp.transform under context_parallel_degree 2: whole sequences in, HF's logits out (every
comm type, learned positions / RoPE+GQA / partial RoPE / YaRN / Llama 3.1 scaling, a padding
mask with all_gather), and
the CP ranks' parameter grads add up to HF's."""
import warnings

import torch

import megatron_smp as smp
from megatron_smp.testing import run_distributed
from tests.unit.models.common import to_numpy, to_torch
from tests.unit.models.test_hf_adapters import _ids, build_hf

warnings.filterwarnings("ignore", message=".*")

# family -> cp_comm_type; SEQ 12 splits into 4 chunks of 3.
# qwen2's YaRN and llama31's Llama 3.1 scaling have original contexts of 8 < 12: the CP ranks'
# global positions reach past them.
COMM_TYPES = {"gpt2": "all_gather", "llama": "p2p", "gpt_neox": "a2a", "qwen2": "a2a",
              "llama31": "p2p"}


def _worker(rank, world_size):
    import torch.distributed as dist

    from megatron_smp.models.hf import get_adapter

    smp.init({"context_parallel_degree": 2, "cp_comm_type": "p2p"})
    results = {}
    for family, comm_type in COMM_TYPES.items():
        hf = build_hf(family)
        ids = _ids(hf.config.vocab_size)
        model = smp.transform(hf, cp_comm_type=comm_type)
        core = model.module.decoder.layers[0].self_attention.core_attention
        with torch.no_grad():
            out = {"core": type(core).__name__, "logits": (model(ids), hf(ids).logits)}
            if comm_type == "all_gather":
                padding = torch.ones_like(ids)
                padding[0, -3:] = 0
                out["padded"] = (model(ids, attention_mask=padding)[0, :-3],
                                 hf(ids, attention_mask=padding).logits[0, :-3])
        if family == "llama":
            labels = torch.roll(ids, -1, dims=1)
            model(ids, labels=labels).mean().backward()
            hf.train()
            logits = hf(ids).logits
            torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)).backward()
            expected = get_adapter(hf).from_hf(
                {name: p.grad for name, p in hf.named_parameters()}, model.config)
            diffs = []
            for name, param in model.module.named_parameters():
                grad = param.grad.clone()
                dist.all_reduce(grad, group=smp.state.parallel_state.cp_group)
                diffs.append(float((grad - expected[name]).abs().max()))
            out["grad_max_diff"] = max(diffs)
        results[family] = out
    return to_numpy(results)


def test_transform_context_parallel_matches_hf():
    results = to_torch(run_distributed(_worker, 2, timeout=300))
    for rank_results in results:
        for family, comm_type in COMM_TYPES.items():
            out = rank_results[family]
            assert out["core"] == {"p2p": "RingAttention", "all_gather": "AllGatherAttention",
                                   "a2a": "AllToAllAttention"}[comm_type]
            for key in ("logits", "padded"):
                if key in out:
                    got, expected = out[key]
                    assert got.shape == expected.shape
                    assert (got - expected).abs().max() < 1e-4, (family, key)
        assert rank_results["llama"]["grad_max_diff"] < 1e-5

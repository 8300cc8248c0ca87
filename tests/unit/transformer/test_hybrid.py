"""Hybrid layer specs: the sharding layout states the mixers' splits, full recompute and
packed rows work through the hybrid layers, and configurations that cannot work are clear
errors naming the flag."""
import pytest
import torch

from megatron_smp.config import ConfigError, ParallelConfig
from megatron_smp.models import GPTModel, llama_config
from megatron_smp.models.sharding import default_layout, tensor_parallel_layout
from megatron_smp.parallel_state import build_parallel_state
from megatron_smp.training.arguments import parse_args

SMALL = dict(max_position_embeddings=32, num_query_groups=2, ffn_hidden_size=96,
             mamba_num_groups=2, mamba_head_dim=16, mamba_state_dim=8, linear_num_key_heads=2,
             linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
             mamba_chunk_size=8, linear_chunk_size=8)
CONFIGS = {
    # With one multi-token-prediction depth of a Gated DeltaNet and an MLP (the `/` part).
    "hybrid": lambda **kw: llama_config(5, 64, 4, 1003, hybrid_layer_pattern="MG*-E/G-",
                                        num_moe_experts=4, **SMALL, **kw),
    "linear_attention": lambda **kw: llama_config(
        4, 64, 4, 1003, experimental_attention_variant="gated_delta_net",
        linear_attention_freq=2, attention_output_gate=True, qk_layernorm=True, **SMALL, **kw),
}


@pytest.fixture(scope="module")
def state():
    return build_parallel_state(ParallelConfig())


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_layout_recompute_and_packed_rows(state, name):
    torch.manual_seed(0)
    config = CONFIGS[name]()
    model = GPTModel(config, state)
    layout = default_layout(config)
    split = tensor_parallel_layout(model)
    assert {k: layout.get(k) for k in split} == split
    ids = torch.randint(0, 1003, (2, 20))

    def grads(model):
        model.zero_grad()
        model(ids, labels=ids).mean().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain = grads(model)
    torch.manual_seed(0)
    recomputed = GPTModel(config.replace(recompute_granularity="full"), state)
    again = grads(recomputed)
    assert plain.keys() == again.keys()
    assert all(torch.allclose(plain[k], again[k], atol=1e-6) for k in plain)
    with torch.no_grad():  # two documents in row 0: the second equals itself run alone
        packed = model(ids, document_ids=torch.tensor([[0] * 7 + [1] * 13, [0] * 20]))
        alone = model(ids[:1, 7:])
        assert (packed[0, 7:] - alone[0]).abs().max() < 1e-5
        with pytest.raises(ValueError, match="explicit attention mask"):
            model(ids, attention_mask=torch.zeros(2, 1, 20, 20, dtype=torch.bool))


def _errors(config, parallel=None):
    with pytest.raises(ConfigError) as info:
        config.validate(parallel or ParallelConfig())
    return str(info.value)


def test_config_errors_name_the_flag():
    hybrid = CONFIGS["hybrid"](sequence_parallel=True)
    assert "--num-layers is 4" in _errors(hybrid.replace(num_layers=4))
    assert "unknown symbols ['D']" in _errors(hybrid.replace(hybrid_layer_pattern="MG*-D"))
    assert "'/'" in _errors(hybrid.replace(hybrid_layer_pattern="MG*-E/M/G"))  # unequal depths
    assert "the 2 '/' parts" in _errors(hybrid.replace(hybrid_layer_pattern="MG*-E/M/M"))
    assert "give --num-experts" in _errors(hybrid.replace(num_moe_experts=None))
    assert "--mamba-num-groups (3)" in _errors(
        hybrid.replace(mamba_num_groups=3, mamba_num_heads=6),
        ParallelConfig(tensor_model_parallel_size=2))
    assert "--linear-num-key-heads (3)" in _errors(
        hybrid.replace(linear_num_key_heads=3, linear_num_value_heads=6),
        ParallelConfig(tensor_model_parallel_size=2))
    assert "--context-parallel-size (4)" in _errors(  # CP ranks scan whole groups
        hybrid, ParallelConfig(tensor_model_parallel_size=2, context_parallel_size=2))
    linear = CONFIGS["linear_attention"]()
    assert "--experimental-attention-variant" in _errors(
        linear.replace(experimental_attention_variant=None))
    # The variant alone places nothing in a GPT stack (Megatron asserts the same).
    assert "needs --linear-attention-freq" in _errors(linear.replace(linear_attention_freq=None))


BASE = ("--hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 1 "
        "--train-iters 1 --mock-data --tokenizer-type NullTokenizer --vocab-size 100").split()


def test_flags():
    configs = parse_args(BASE + ["--num-layers", "7", "--hybrid-layer-pattern", "M-|M*-"])
    assert configs.model.num_layers == 5 and configs.model.hybrid_stage_layer_counts() == [2, 3]
    configs = parse_args(BASE + ["--hybrid-override-pattern", "M*", "--spec",
                                 "megatron.core.models.hybrid.hybrid_layer_specs",
                                 "hybrid_stack_spec"])
    assert configs.model.hybrid_layer_pattern == "M*" and configs.model.num_layers == 2
    with pytest.raises(ConfigError, match="--spec my.module my_spec"):
        parse_args(BASE + ["--num-layers", "2", "--spec", "my.module", "my_spec"])
    configs = parse_args(BASE + ["--num-layers", "8", "--linear-attention-freq", "4",
                                 "--experimental-attention-variant", "gated_delta_net"])
    assert configs.model.linear_attention_pattern() == [1, 1, 1, 0] * 2
    configs = parse_args(BASE + ["--hybrid-layer-pattern", "E", "--num-experts", "4",
                                 "--moe-latent-size", "16"])
    assert configs.model.moe_latent_size == 16
    with pytest.raises(ConfigError, match="--moe-latent-size must be >= 1"):
        configs.model.replace(moe_latent_size=0).validate(ParallelConfig())


def test_stage_breaks_are_the_pipeline_layout():
    from megatron_smp.pipeline_parallel.stages import layout_from_configs
    from megatron_smp.training.arguments import validate_configs

    argv = BASE + ["--hybrid-layer-pattern", "M-|M*-", "--mamba-num-groups", "2",
                   "--pipeline-model-parallel-size"]
    assert layout_from_configs(parse_args(argv + ["2"]), 2) == [[(0, 2)], [(2, 3)]]
    with pytest.raises(ConfigError, match="one non-empty segment per stage"):
        validate_configs(parse_args(argv + ["3"]), world_size=3)


def test_hybrid_flops_follow_megatron_main():
    """Megatron-LM main's hybrid_flops, evaluated by hand for "M*-G" (h 256, s 128, batch 2):
    Mamba 2*256*(2*512 + 2*8*128 + 8) + 7*512*128 + 2*512*256 = 2297856; attention
    2*256*(256 + 2*128) + 2*256*256 + 2*128*256 = 458752; MLP 2*2*256*512 = 524288; GDN
    2*(256*(2*64 + 2*128 + 2*4) + 4*(2*64 + 128) + 4*32*32*4 + 256*128) = 301056; logits
    2*256*1024 = 524288; sum 4106240, times 3 * 128 * 2."""
    from megatron_smp.config import TransformerConfig
    from megatron_smp.training.logging import flops_per_iteration

    config = TransformerConfig(
        num_layers=4, hidden_size=256, num_attention_heads=4, num_query_groups=2,
        kv_channels=64, ffn_hidden_size=512, vocab_size=1000, max_position_embeddings=128,
        hybrid_layer_pattern="M*-G", linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=32, linear_value_head_dim=32)
    assert flops_per_iteration(config, 128, 2, 1024) == 4106240 * 3 * 128 * 2
    # One multi-token-prediction depth "-": its MLP 524288 and the logits once more 524288.
    mtp = config.replace(hybrid_layer_pattern="M*-G/-", mtp_num_layers=None)
    assert mtp.mtp_num_layers == 1
    assert flops_per_iteration(mtp, 128, 2, 1024) == (4106240 + 2 * 524288) * 3 * 128 * 2


@pytest.mark.parametrize("kind", ["M", "G"])
def test_planner_mixer_bytes_match_saved_tensors(state, kind):
    from megatron_smp.training.memory_planner import mixer_activation_bytes
    from megatron_smp.transformer.ssm.gated_delta_net import GatedDeltaNet
    from megatron_smp.transformer.ssm.mamba_mixer import MambaMixer

    config = llama_config(1, 192, 4, 100, mamba_num_groups=2, mamba_head_dim=24,
                          mamba_state_dim=24, mamba_chunk_size=32, linear_num_key_heads=2,
                          linear_num_value_heads=6, linear_key_head_dim=24,
                          linear_value_head_dim=20, linear_chunk_size=32)
    mixer = (MambaMixer if kind == "M" else GatedDeltaNet)(config, state)
    x = torch.randn(96, 2, 192, requires_grad=True)
    saved = {}

    def pack(tensor):
        saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        mixer(x)
    ours = {p.untyped_storage().data_ptr() for p in mixer.parameters()}
    ours.add(x.untyped_storage().data_ptr())  # the layer's input, counted by the layer
    measured = sum(size for ptr, size in saved.items() if ptr not in ours)
    planned = mixer_activation_bytes(config, kind, 96, 96 * 2, 1)
    assert abs(planned - measured) / measured < 0.06, (planned, measured)


def test_linear_attention_layers_count_gated_delta_net_flops():
    """--linear-attention-freq 2 over 2 layers (h 256, s 128): per token, in multiply-adds,
    MLPs 2*2*256*512 = 524288, one attention 256*(256 + 2*128) + 256*256 = 196608 and its
    core 256*128 = 32768, one Gated DeltaNet 301056 / 2 = 150528, logits 256*1024 = 262144;
    times 6 * 128."""
    from megatron_smp.config import TransformerConfig
    from megatron_smp.training.logging import flops_per_iteration

    config = TransformerConfig(
        num_layers=2, hidden_size=256, num_attention_heads=4, num_query_groups=2,
        kv_channels=64, ffn_hidden_size=512, vocab_size=1000, max_position_embeddings=128,
        experimental_attention_variant="gated_delta_net", linear_attention_freq=2,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
        linear_value_head_dim=32)
    assert flops_per_iteration(config, 128, 1, 1024) == 1166336 * 6 * 128


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_meta_device_build_materialises_the_eager_weights(state, name):
    """Built on the meta device and materialised (--init-model-with-meta-device, FSDP2's
    unit-by-unit init), the mixers and MoE layers (router, latent projections, experts under
    their seeds, a gated shared expert) hold exactly the eager build's weights for the seed."""
    from megatron_smp.distributed.delayed_init import materialize_meta_model

    config = CONFIGS[name]()
    if name == "hybrid":
        config = config.replace(moe_latent_size=40, moe_shared_expert_intermediate_size=48,
                                moe_shared_expert_gate=True)
        assert GPTModel(config, state, device=torch.device("meta")).decoder.layers[4].mixer \
            .fc1_latent_proj.weight.shape == (40, 64)  # --moe-latent-size: experts in width 40
    torch.manual_seed(0)
    eager = GPTModel(config, state).state_dict()
    torch.manual_seed(0)
    meta = GPTModel(config, state, device=torch.device("meta"))
    assert all(p.is_meta for p in meta.parameters())
    materialised = materialize_meta_model(meta, torch.device("cpu")).state_dict()
    assert eager.keys() == materialised.keys()
    assert all(torch.equal(eager[k], materialised[k]) for k in eager)


def test_latent_experts_count_megatron_flops():
    """--moe-latent-size 32 (h 256, topk 2, moe ffn 128, no shared expert), one E layer and
    s 128: the routed experts on the latent width 2*2*32*128*2 = 32768 plus the projections
    4*256*32 = 32768, logits 2*256*1024 = 524288 per token (Megatron's moe_layer_flops),
    times 3 * 128; the GPT form counts the same MoE layer."""
    from megatron_smp.config import TransformerConfig
    from megatron_smp.training.logging import flops_per_iteration

    common = dict(hidden_size=256, num_attention_heads=4, ffn_hidden_size=512,
                  vocab_size=1000, max_position_embeddings=128, num_moe_experts=4,
                  moe_ffn_hidden_size=128, moe_latent_size=32)
    hybrid = TransformerConfig(num_layers=1, hybrid_layer_pattern="E", **common)
    assert flops_per_iteration(hybrid, 128, 1, 1024) == (65536 + 524288) * 3 * 128
    gpt = TransformerConfig(num_layers=1, **common)
    attention = 6 * 128 * (256 * 768 + 256 * 256 + 256 * 128)
    assert flops_per_iteration(gpt, 128, 1, 1024) == attention + (65536 + 524288) * 3 * 128


def _context_parallel_worker(rank, world_size):
    """Per mixer kind and rows (plain, packed): the largest error, relative to the largest
    value, of this CP rank's outputs and of the grads summed over CP, against one rank's."""
    import torch.distributed as dist

    from megatron_smp.context_parallel.split import packed_rank_indices, split_for_context_parallel
    from megatron_smp.transformer.packed import PackedSequence
    from megatron_smp.transformer.ssm.gated_delta_net import GatedDeltaNet
    from megatron_smp.transformer.ssm.mamba_mixer import MambaMixer

    config = CONFIGS["hybrid"]()
    one, two = (build_parallel_state(ParallelConfig(context_parallel_size=cp)) for cp in (1, 2))
    s, b = 16, 2
    x = torch.randn(s, b, 64, generator=torch.Generator().manual_seed(1))
    weight = torch.randn(s, b, 64, generator=torch.Generator().manual_seed(2))
    # Row 0: documents of 4 and 12 tokens, each split the load-balanced way on its own.
    documents = torch.tensor([[0] * 4 + [1] * 12, [5] * s])
    errors = {}
    for kind in (MambaMixer, GatedDeltaNet):
        torch.manual_seed(0)
        reference = kind(config, one)
        torch.manual_seed(0)
        split = kind(config, two)
        for packed in (False, True):
            if packed:
                indices = packed_rank_indices(documents, 2)
                masks = (PackedSequence(documents), PackedSequence(documents, indices, rank))
                take = indices[rank].t()  # [s/cp, b] row positions
                local = lambda t: t.gather(0, take[..., None].expand(-1, -1, t.shape[-1]))
            else:
                masks = (None, None)
                local = lambda t: split_for_context_parallel(t, 0, 2, rank)
            for model in (reference, split):
                model.zero_grad()
            full = reference(x, masks[0])
            (full * weight).sum().backward()
            mine = split(local(x), masks[1])
            (mine * local(weight)).sum().backward()
            def relative(ours, theirs):
                return ((ours - theirs).abs().max() / theirs.abs().max()).item()

            error = relative(mine, local(full))
            for (name, ours), theirs in zip(split.named_parameters(), reference.parameters()):
                grad = ours.grad.clone()
                dist.all_reduce(grad, group=two.cp_group)
                error = max(error, relative(grad, theirs.grad))
            errors[(kind.__name__, packed)] = error
    return errors


def test_context_parallel_mixers_match_one_rank():
    """CP=2: each rank scans the whole sequence for half the groups / key heads, outputs and
    (summed over CP) grads equal one rank's, for plain rows in CP's load-balanced order and
    packed rows split per document."""
    from megatron_smp.testing import run_distributed

    for errors in run_distributed(_context_parallel_worker, 2, timeout=120):
        assert len(errors) == 4 and max(errors.values()) < 1e-6, errors

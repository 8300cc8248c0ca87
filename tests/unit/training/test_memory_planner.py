"""The memory planner: parameter / gradient / optimizer bytes counted on meta equal a real
built model's (TP=2 x PP=2; EP=2 MoE with the distributed optimizer), the activation
formula equals the bytes autograd saves in a real CPU forward, the in-flight counts follow the
schedules, and --report-memory prints the table before training."""
import dataclasses

import pytest
import torch

from megatron_smp.testing import run_distributed

SHAPE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
         "--vocab-size", "200", "--mock-data", "--tokenizer-type", "NullTokenizer",
         "--train-iters", "1", "--bf16"]
TP_PP = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
EP = ["--expert-model-parallel-size", "2", "--num-experts", "4", "--moe-router-topk", "2",
      "--use-distributed-optimizer", "--moe-token-dispatcher-type", "alltoall",
      "--global-batch-size", "4"]


def _real_bytes(rank, world_size, flags):
    """(pp rank, param bytes, grad-buffer bytes without padding, optimizer-state bytes) of
    this rank's real model and optimizer after one step."""
    from megatron_smp.optimizer import get_megatron_optimizer
    from megatron_smp.parallel_state import build_parallel_state
    from megatron_smp.tensor_parallel.random import model_parallel_seed
    from megatron_smp.training.arguments import parse_args, validate_configs
    from megatron_smp.training.pretrain import build_model_chunks
    from pretrain_gpt import model_provider

    configs = parse_args(flags)
    configs.model.vocab_size = 200
    validate_configs(configs)
    state = build_parallel_state(configs.parallel)
    model_parallel_seed(1234, state)
    chunks = build_model_chunks(model_provider, configs, state)
    optimizer = get_megatron_optimizer(configs.optimizer, chunks, state)
    params = {id(p): p for chunk in chunks for p in chunk.parameters()}
    param_bytes = sum(p.numel() * p.element_size() for p in params.values())
    grad_bytes = sum(buffer.numel_unpadded * buffer.grad_data.element_size()
                     for chunk in chunks for buffer in chunk.param_and_grad_buffers)
    for chunk in chunks:
        for p in chunk.parameters():
            p.main_grad.fill_(1e-3)
    optimizer.step()
    state_bytes = sum(t.numel() * t.element_size()
                      for s in optimizer.optimizer.state.values() for t in s.values()
                      if torch.is_tensor(t) and t.dim() > 0)
    main_bytes = sum(p.numel() * p.element_size()
                     for group in optimizer.optimizer.param_groups for p in group["params"]
                     if id(p) not in params and p.dtype == torch.float32)
    return state.pp_rank, param_bytes, grad_bytes, state_bytes + main_bytes


def _planned(flags, world_size):
    from megatron_smp.training.memory_planner import report_from_argv
    from pretrain_gpt import model_provider

    return report_from_argv(flags, world_size, model_provider, device_type="cpu")


@pytest.mark.parametrize("layout,world_size", [(TP_PP, 4), (EP, 2)],
                         ids=["tp2_pp2", "ep2_moe_distopt"])
def test_state_bytes_equal_a_real_model(layout, world_size):
    flags = SHAPE + layout
    report = _planned(flags, world_size)
    real = run_distributed(_real_bytes, world_size, args=(flags,), timeout=240)
    for pp_rank, params, grads, optimizer in real:
        planned = report.ranks[pp_rank]
        assert planned.params == params
        assert planned.grads == grads
        # The distributed optimizer's shards are padded per bucket to a multiple of dp.
        assert abs(planned.optimizer - optimizer) <= 12 * 64, (planned.optimizer, optimizer)


def _saved_bytes(extra, layers, world_size=1):
    """Bytes of the distinct storages autograd saves in one CPU forward of GPTModel at tensor
    parallel rank 0 of `world_size` (the fake group's collectives move nothing, so values are
    meaningless but every shape, hence every saved byte, is the real layout's)."""
    import torch.distributed as dist

    from megatron_smp.models.gpt import GPTModel
    from megatron_smp.tensor_parallel.random import model_parallel_seed
    from megatron_smp.training.arguments import parse_args
    from megatron_smp.training.memory_planner import fake_layout

    configs = parse_args(SHAPE[:-1] + ["--hidden-size", "128", "--seq-length", "64",
                                      "--max-position-embeddings", "64"] + extra)
    configs.model.vocab_size = 200
    model_config = dataclasses.replace(configs.model, num_layers=layers)
    with fake_layout(configs.parallel, world_size, 0) as state:
        model_parallel_seed(1234, state)
        torch.manual_seed(0)
        model = GPTModel(model_config, state)
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        saved = {}

        def pack(t):
            storage = t.untyped_storage()
            if storage.data_ptr() not in params:
                saved[storage.data_ptr()] = storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(torch.randint(0, 200, (2, 64)))
    assert not dist.is_initialized()
    return sum(saved.values()), configs


@pytest.mark.parametrize("extra", [
    ["--hidden-dropout", "0", "--attention-dropout", "0"],
    ["--attention-dropout", "0", "--normalization", "RMSNorm", "--swiglu",
     "--position-embedding-type", "rope", "--group-query-attention", "--num-query-groups", "2"],
    ["--hidden-dropout", "0", "--attention-dropout", "0", "--recompute-granularity",
     "selective", "--recompute-modules", "core_attn", "mlp"],
    ["--hidden-dropout", "0", "--attention-dropout", "0", "--num-experts", "4",
     "--moe-router-topk", "2"],
    ["--hidden-dropout", "0", "--attention-dropout", "0", "--tensor-model-parallel-size", "2"],
    ["--attention-dropout", "0", "--num-experts", "4", "--moe-router-topk", "2",
     "--tensor-model-parallel-size", "2", "--sequence-parallel"],
    ["--hidden-dropout", "0", "--attention-dropout", "0", "--num-experts", "4",
     "--moe-router-topk", "2", "--recompute-granularity", "selective", "--recompute-modules",
     "moe"],
], ids=["gpt", "llama_gqa_rope", "selective_mlp", "moe", "tp2", "moe_tp2_sp", "selective_moe"])
def test_layer_formula_matches_saved_tensors(extra):
    from megatron_smp.config import recompute_modules
    from megatron_smp.training.memory_planner import layer_activation_bytes

    tp = 2 if "--tensor-model-parallel-size" in extra else 1
    one, configs = _saved_bytes(extra, 1, tp)
    two, _ = _saved_bytes(extra, 2, tp)
    model = configs.model
    parts = layer_activation_bytes(model, 64, 2, tp, 1, bool(model.num_moe_experts), "cpu",
                                   list(recompute_modules(model)) or None)
    # One more layer adds what the formula says, within 3% (small router/norm statistics).
    assert sum(parts.values()) == pytest.approx(two - one, rel=0.03)


GEMMA3 = ["--hidden-dropout", "0", "--attention-dropout", "0", "--normalization", "RMSNorm",
          "--geglu", "--position-embedding-type", "rope", "--group-query-attention",
          "--num-query-groups", "2", "--qk-layernorm", "--sandwich-norm", "--apply-layernorm-1p",
          "--apply-embedding-scaling", "--window-size", "7,0", "--local-rotary-base", "1000",
          "--softmax-scale", "0.2"]


def test_gemma3_terms_match_saved_tensors():
    """Gemma 3's additions: the post norms, the q/k norms, the sliding window's mask (every
    layer windowed here), and the final soft-cap's tanh output (one logits-sized tensor)."""
    from megatron_smp.training.memory_planner import layer_activation_bytes

    one, configs = _saved_bytes(GEMMA3, 1)
    two, _ = _saved_bytes(GEMMA3, 2)
    parts = layer_activation_bytes(configs.model, 64, 2, 1, 1, False, "cpu", None, windowed=True)
    assert parts["window_mask"] == 64 * 64 * 4
    assert sum(parts.values()) == pytest.approx(two - one, rel=0.01)
    capped, _ = _saved_bytes(GEMMA3 + ["--final-logit-softcapping", "5"], 1)
    assert capped - one == 2 * 64 * configs.model.padded_vocab_size(1) * 4


def test_in_flight_microbatches_follow_the_schedules():
    from megatron_smp.training.memory_planner import in_flight_microbatches

    assert [in_flight_microbatches("1f1b", 4, r, 8, 1) for r in range(4)] == [4, 3, 2, 1]
    assert in_flight_microbatches("1f1b", 4, 0, 2, 1) == 2
    assert in_flight_microbatches("gpipe", 4, 3, 8, 1) == 8
    # Interleaved: Megatron's warm-up (pp - r - 1) * 2 + (v - 1) * pp, plus the steady one.
    assert in_flight_microbatches("interleaved_1f1b", 4, 0, 8, 2) == 11
    assert in_flight_microbatches("interleaved_1f1b", 4, 3, 8, 2) == 5


def test_report_memory_prints_the_table_first(capsys):
    """--report-memory on a plain single-process pretrain: the table, then training with the
    losses of the run without it (the meta builds draw nothing from the run's generator)."""
    import torch.distributed as dist

    from megatron_smp.training import pretrain
    from pretrain_gpt import forward_step, model_provider, train_valid_test_datasets_provider

    argv = SHAPE[:-1] + ["--eval-iters", "0", "--lr", "1e-4", "--log-interval", "1",
                         "--train-iters", "2"]
    losses = []
    for extra in ([], ["--report-memory"]):
        result = pretrain(train_valid_test_datasets_provider, model_provider, forward_step,
                          argv=argv + extra)
        dist.destroy_process_group()
        losses.append(result.train_losses)
    assert losses[0] == losses[1]
    out = capsys.readouterr().out
    assert out.count("memory estimate per rank (TP1 PP1 CP1 DP1 EP1") == 1
    reported = out.index("memory estimate per rank")
    assert reported < out.index("iteration", reported)
    assert "largest: pipeline rank 0" in out


LLAMA2_7B = ["--num-layers", "32", "--hidden-size", "4096", "--ffn-hidden-size", "11008",
             "--num-attention-heads", "32", "--seq-length", "4096",
             "--max-position-embeddings", "4096", "--vocab-size", "32000",
             "--tensor-model-parallel-size", "2",
             "--sequence-parallel", "--micro-batch-size", "1", "--global-batch-size", "32",
             "--bf16", "--recompute-granularity", "selective", "--mock-data",
             "--train-iters", "1", "--tokenizer-type", "NullTokenizer"]


def test_megatron_theoretical_memory_fixture():
    """Megatron-LM's own report (recorded once, tests/fixtures/megatron_memory) for Llama-2-7B
    at TP=2 + SP, DP=4: the weight and optimizer bytes equal ours within 0.1% (Megatron
    counts parameters by formula, ours on the built model). Activations differ by design:
    Megatron's formula (Korthikanti et al., 18 + 4 f / h bytes per s b h) assumes an ungated
    MLP and LayerNorm; ours counts this implementation's tensors for SwiGLU (4 f: the 2 f-wide
    fc1 output, the activation, the fc2 input), RMSNorm (its input and normalised output) and
    RoPE's rotated q and k, so ours is larger by that breakdown, term by term."""
    import json
    import os

    from megatron_smp.training.arguments import parse_args
    from megatron_smp.training.memory_planner import (
        MIB, layer_activation_bytes, report_from_argv,
    )
    from pretrain_llama import LLAMA_DEFAULTS, model_provider

    fixture = os.path.join(os.path.dirname(__file__), "..", "..", "fixtures", "megatron_memory",
                           "megatron_memory.json")
    megatron = json.load(open(fixture))["cases"]["llama2_7b_tp2_dp4_sp_selective"]
    defaults = dict(LLAMA_DEFAULTS, tokenizer_type="NullTokenizer")
    report = report_from_argv(LLAMA2_7B, 8, model_provider, defaults, "cuda")
    ours = report.ranks[0]
    assert (ours.params + ours.grads + ours.optimizer) / MIB == pytest.approx(
        megatron["weight_and_optimizer_mib"], rel=1e-3)
    # Per layer: Megatron's (18 + 4 f / h) s b h / tp bytes vs our terms, in units of
    # s b h / tp bf16 elements: Megatron 9 + 2 f / h; ours 6 (RMSNorm in x 2, outputs x 2)
    # + 3 (q, k, v) + 1 (context) + 2 (RoPE q, k) + 4 f / h (SwiGLU) + log-sum-exp.
    configs = parse_args(LLAMA2_7B, None, defaults)
    configs.model.vocab_size = 32000
    parts = layer_activation_bytes(configs.model, 4096, 1, 2, 1, False, "cuda", ["core_attn"])
    unit = 4096 * 4096 * 2 / 2  # s b h / tp, bf16
    f_over_h = 11008 / 4096
    assert parts["replicated"] / unit == pytest.approx(6)
    assert parts["attention"] / unit == pytest.approx(3 + 1 + 2)
    assert parts["mlp"] / unit == pytest.approx(4 * f_over_h)
    megatron_layer = 9 + 2 * f_over_h
    assert (6 + 6 + 4 * f_over_h) - megatron_layer == pytest.approx(3 + 2 * f_over_h)


def test_provider_without_device_is_a_clear_error():
    from megatron_smp.config import ConfigError
    from megatron_smp.training.memory_planner import report_from_argv

    def provider(configs, state, pre_process=True, post_process=True):
        raise AssertionError("never built")

    with pytest.raises(ConfigError, match="model_provider must take device="):
        report_from_argv(SHAPE, 1, provider)


def test_estimate_memory_tool(capsys):
    """tools/estimate_memory.py: the table for a layout (no data flags needed), and a clear
    error naming the flags for a world size that does not fit the layout."""
    from tools.estimate_memory import main

    shape = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
             "--seq-length", "32", "--vocab-size", "100"]
    assert main(shape + ["--world-size", "8", "--entry", "llama",
                         "--pipeline-model-parallel-size", "2",
                         "--tensor-model-parallel-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "(TP2 PP2 CP1 DP2 EP1, world size 8), MiB:" in out
    # The last stage holds the untied output layer besides its layers and the logits.
    assert "largest: pipeline rank 1" in out
    assert main(shape + ["--world-size", "6", "--tensor-model-parallel-size", "4"]) == 2
    assert "--tensor-model-parallel-size (4)" in capsys.readouterr().err


def test_composed_counts_equal_the_stage_builds():
    """count_stages_composed (one-layer pieces, what the step-time planner's search uses)
    equals count_stages (every stage built) field by field: tied and untied embeddings, TP,
    PP with virtual and uneven stages, FSDP2's shards, MoE with dense first layers and MTP."""
    from tools.plan import build_parser, load_configs

    from megatron_smp.training.memory_planner import count_stages, count_stages_composed

    gpt = ["--num-layers", "6", "--hidden-size", "64", "--num-attention-heads", "4",
           "--seq-length", "32", "--max-position-embeddings", "32", "--vocab-size", "1000",
           "--micro-batch-size", "1", "--global-batch-size", "8"]
    moe = gpt + ["--num-experts", "4", "--moe-router-topk", "2", "--moe-layer-freq",
                 "[0]*2+[1]*4", "--mtp-num-layers", "1", "--position-embedding-type", "rope"]
    cases = [
        (gpt, 8, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                  "--virtual-pipeline-model-parallel-size", "3"]),
        (gpt, 8, ["--pipeline-model-parallel-size", "2", "--use-torch-fsdp2"]),
        (gpt + ["--untie-embeddings-and-output-weights"], 4,
         ["--pipeline-model-parallel-size", "4", "--decoder-first-pipeline-num-layers", "1",
          "--decoder-last-pipeline-num-layers", "1"]),
        (moe, 8, ["--expert-model-parallel-size", "4", "--pipeline-model-parallel-size", "2"]),
        (moe, 8, ["--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2",
                  "--sequence-parallel", "--use-torch-fsdp2"]),
    ]
    caches = {}  # one per model shape, kept across its layouts as a search keeps it
    for flags, world, layout in cases:
        ours, rest = build_parser().parse_known_args(["--num-gpus", str(world)] + flags
                                                     + layout)
        configs, provider = load_configs(ours, rest)
        composed = count_stages_composed(configs, world, provider,
                                         caches.setdefault(id(flags), {}))
        assert composed == count_stages(configs, world, provider), layout

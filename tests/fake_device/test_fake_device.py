"""Whole training runs on a fake accelerator (see harness.py): every model family, precision
and optimizer (plain, distributed, FSDP2) trains through `pretrain` with no device mismatch,
and each steady-state step reads the device on the host exactly as often as its budget says.

Known limits (the harness's): `device.type == "cuda"` branches (apex, CUDA streams and events,
flash / efficient SDPA, fused kernels) are not exercised; one rank only, so collectives are
identities and per-rank differences in which collectives run are not seen; kernel selection
is not CUDA's; data-dependent MoE shapes come from the real CPU shadow (no ShapeEnv needed).

Megatron-LM (core_v0.16.1) per dense step: the grad norm (`clip_grads.py`), the loss scale read
for logging (`training.py` `optimizer.get_loss_scale().item()`), and with its default
--check-for-nan-in-loss-and-grad two reads per microbatch (loss NaN, Inf) and two per grad
bucket; fp16 adds the found-inf read. Ours: the grad norm, plus one read of the step agreement
(the NaN/Inf checks, the exit conditions, the per-token loss's token count, whichever are on),
plus found-inf for fp16. Per MoE layer and
microbatch both read twice: the permutation's data-dependent shape (Megatron's masked_select,
our nonzero) and the tokens per expert for the experts' split (Megatron's `.cpu()` copy).
"""
import pytest
import torch

from tests.fake_device.harness import DeviceMismatchError, FakeDevice, pretrain_on_fake_device

COMMON = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
    "--max-position-embeddings 16 --micro-batch-size 2 --global-batch-size 4 --train-iters 3 "
    "--mock-data --tokenizer-type NullTokenizer --vocab-size 128 --lr 1e-3 --log-interval 100 "
    "--eval-interval 100 --eval-iters 0 --seed 7"
).split()
MICROBATCHES, LAYERS = 2, 2
LLAMA = "--group-query-attention --num-query-groups 2 --window-size 7,0".split()
MIXTRAL = ("--group-query-attention --num-query-groups 2 --num-experts 4 --moe-router-topk 2 "
           "--moe-aux-loss-coeff 0.01").split()
QWEN2_MOE = ("--num-experts 4 --moe-router-topk 2 --moe-router-pre-softmax "
             "--moe-shared-expert-intermediate-size 32 --moe-shared-expert-gate "
             "--add-qkv-bias").split()

GRAD_NORM = "scalar read at megatron_smp/optimizer/optimizer.py _total_norm"
# The step agreement (NaN/Inf checks, exit conditions, token count; losses ride along).
NAN_CHECK = "list read at megatron_smp/training/step_agreement.py agree_on_step"
FOUND_INF = "scalar read at megatron_smp/optimizer/optimizer.py _unscale_main_grads_and_check_for_nan"
MOE = {"data-dependent shape at megatron_smp/transformer/moe/token_dispatcher.py permute":
       LAYERS * MICROBATCHES,
       "list read at megatron_smp/transformer/moe/token_dispatcher.py dispatch":
       LAYERS * MICROBATCHES}

CASES = {
    "gpt_fp32_no_nan_check": ("pretrain_gpt", ["--no-check-for-nan-in-loss-and-grad"],
                              {GRAD_NORM: 1}),
    "gpt_bf16_distributed": ("pretrain_gpt", ["--bf16", "--use-distributed-optimizer"],
                             {NAN_CHECK: 1, GRAD_NORM: 1}),
    "llama_gqa_window_fp16_distributed": (
        "pretrain_llama",
        LLAMA + ["--fp16", "--initial-loss-scale", "4096", "--use-distributed-optimizer"],
        {FOUND_INF: 1, GRAD_NORM: 1}),
    "llama_gqa_window_bf16_fsdp2": ("pretrain_llama", LLAMA + ["--bf16", "--use-torch-fsdp2"],
                                    {NAN_CHECK: 1, GRAD_NORM: 1}),
    "mixtral_bf16_distributed": ("pretrain_llama",
                                 MIXTRAL + ["--bf16", "--use-distributed-optimizer"],
                                 {NAN_CHECK: 1, GRAD_NORM: 1, **MOE}),
    "qwen2_moe_fp32": ("pretrain_llama", QWEN2_MOE, {NAN_CHECK: 1, GRAD_NORM: 1, **MOE}),
    # The exit conditions and the token count share the agreement's read (before: 2 reads
    # for the exit flags, 4 for the token count).
    "gpt_fp32_exits_per_token": ("pretrain_gpt", ["--exit-signal-handler",
                                                  "--exit-duration-in-mins", "60",
                                                  "--calculate-per-token-loss"],
                                 {NAN_CHECK: 1, GRAD_NORM: 1}),
}


def _by_site(step) -> dict:
    counts = {}
    for sync in step.syncs:
        path, _, function = sync.where.partition(" ")
        key = f"{sync.kind} at {path.rsplit(':', 1)[0]} {function}"
        counts[key] = counts.get(key, 0) + 1
    return counts


@pytest.mark.parametrize("case", sorted(CASES))
def test_training_step_on_the_fake_device_keeps_its_sync_budget(case):
    script, flags, budget = CASES[case]
    step = pretrain_on_fake_device(script, COMMON + flags)
    assert len(step.losses) == 3
    assert all(4.0 < loss < 5.5 for loss in step.losses), step.losses  # ~ln(128) = 4.85
    assert _by_site(step) == budget, "\n".join(map(str, step.syncs))


def test_the_harness_sees_mismatches_and_syncs():
    """Each check of the harness fails when it should: a CPU tensor meeting a device tensor,
    a CPU tensor handed to a collective (NCCL's "No backend type associated with device type
    cpu"), and each kind of host read is recorded."""
    import torch.distributed as dist

    with FakeDevice() as device:
        x = torch.arange(6.0).reshape(2, 3).to(device.device)
        with pytest.raises(RuntimeError, match="same device"):
            x + torch.ones(2, 3)
        assert (x + torch.tensor(1.0)).device == device.device  # a CPU scalar is legal
        with pytest.raises(DeviceMismatchError, match="all_reduce got a tensor on cpu"):
            dist.all_reduce(torch.zeros(1))
        dist.all_reduce(x)
        assert device.syncs == []
        assert x.sum().item() == 15.0
        assert x[0].tolist() == [0.0, 1.0, 2.0]
        assert bool(x[1, 0] > 2)
        assert (x > 1).nonzero().shape == (4, 2)
        assert x.cpu().shape == (2, 3)
        x.to("cpu", non_blocking=True)  # not a sync
    kinds = [sync.kind for sync in device.syncs]
    assert kinds == ["scalar read", "list read", "scalar read", "data-dependent shape",
                     "device->host copy"], kinds


def test_alltoall_dispatch_reads_its_counts_once(monkeypatch):
    """Expert parallelism (the alltoall dispatcher at EP=2, here one process whose peer sends
    back what it was sent): one read of all the counts per dispatch (Megatron's one copy) plus
    the permutation's data-dependent shape; the round trip gives each token its weighted
    experts' outputs."""
    from types import SimpleNamespace

    from megatron_smp.transformer.moe import token_dispatcher
    from megatron_smp.transformer.moe.moe_utils import topk_routing

    generator = torch.Generator().manual_seed(0)
    tokens = torch.randn(6, 8, generator=generator)
    logits = torch.randn(6, 4, generator=generator)
    with FakeDevice() as device:
        monkeypatch.setattr(token_dispatcher, "group_size", lambda g: 2 if g == "ep" else 1)
        dispatcher = token_dispatcher.MoEAlltoAllTokenDispatcher(
            4, [0, 1], SimpleNamespace(tp_group="tp", etp_group="tp", ep_group="ep"))
        probs, routing_map = topk_routing(logits.to(device.device), 2)
        rows, tokens_per_expert = dispatcher.dispatch(tokens.to(device.device), probs,
                                                      routing_map)
        kinds = [sync.kind for sync in device.syncs]
        output = device.real(dispatcher.combine(rows * 2.0))
    assert kinds == ["data-dependent shape", "list read"], device.syncs
    assert sum(tokens_per_expert) == 12  # 6 tokens x top-2, all come back
    real_probs = torch.softmax(logits.topk(2).values, dim=-1).sum(-1, keepdim=True)
    torch.testing.assert_close(output, 2.0 * tokens * real_probs)


def test_fsdp2_cpu_offload_step_on_the_fake_device():
    """FSDP2 with CPUOffloadPolicy (sharded params, grads and optimizer state on the host):
    forward, backward and the optimizer step run with the accelerator's tensors where they
    belong; a step reads the grad norm only (the offload copies are made at sharding)."""
    import torch.distributed as dist

    from megatron_smp.config import OptimizerConfig, ParallelConfig
    from megatron_smp.distributed.fsdp import fully_shard_model
    from megatron_smp.models.gpt import GPTModel
    from megatron_smp.optimizer import get_megatron_optimizer
    from megatron_smp.parallel_state import build_parallel_state
    from megatron_smp.tensor_parallel.random import model_parallel_seed
    from tests.unit.distributed.test_fsdp import _model_config

    try:
        with FakeDevice() as device:
            state = build_parallel_state(ParallelConfig())
            model_parallel_seed(7, state)
            model = GPTModel(_model_config("llama"), state)
            fully_shard_model(model, state, offload_params=True)
            assert all(p.to_local().device.type == "cpu" for p in model.parameters())
            optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-3, clip_grad=1.0),
                                               [model], state)
            tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
            positions = torch.arange(16).expand(2, 16)
            for step in range(2):  # the second step is measured (the first decides once)
                setup = len(device.syncs)
                optimizer.zero_grad()
                loss = model(tokens.to(device.device), position_ids=positions.to(device.device),
                             labels=tokens.to(device.device)).float().mean()
                loss.backward()
                updated, grad_norm, _ = optimizer.step()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert updated and grad_norm > 0
    assert [sync.where.split(":")[0] + " " + sync.where.split(" ")[-1]
            for sync in device.syncs[setup:]] == [
        "megatron_smp/optimizer/optimizer.py _total_norm"], device.syncs[setup:]


def test_decode_cuda_graphs_on_the_fake_device(monkeypatch, tmp_path):
    """The engine with CUDA-graph decode steps (--cuda-graph-impl local) on the fake
    accelerator, capture stood in (it runs the step; replay runs it again): the captured
    step reads nothing on the host (a capture would fail on any read) and keeps every tensor
    on the device, one graph per (batch, key width) bucket, and the greedy tokens are the
    eager engine's."""
    import datetime

    import torch.distributed as dist

    import megatron_smp.inference.decode_step as decode_step
    from megatron_smp.config import ParallelConfig, TransformerConfig
    from megatron_smp.inference import InferenceEngine, SamplingParams
    from megatron_smp.models.gpt import GPTModel
    from megatron_smp.parallel_state import build_parallel_state

    config = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
        vocab_size=96, max_position_embeddings=64, position_embedding_type="rope",
        normalization="RMSNorm", gated_linear_unit=True, activation="silu",
        add_bias_linear=False, ffn_hidden_size=64, init_method_std=0.5)
    prompts = [[5, 17, 30, 2, 9], [44, 80, 1], [7, 7, 7, 7, 8, 9, 10]]
    params = [SamplingParams(max_new_tokens=n) for n in (6, 3, 5)]
    graph_syncs = []

    def stand_in(api, run, warmup_steps):
        def replay():
            before = len(device.syncs)
            output.copy_(run())
            graph_syncs.append(device.syncs[before:])

        before = len(device.syncs)
        output = run()  # the capture
        graph_syncs.append(device.syncs[before:])
        return replay, output

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/init", rank=0,
                            world_size=1, timeout=datetime.timedelta(seconds=60))
    try:
        with FakeDevice() as device:
            state = build_parallel_state(ParallelConfig())
            torch.manual_seed(0)
            model = GPTModel(config, state).to(device.device).eval()
            eager = InferenceEngine(model, max_tokens=64, block_size=4, max_requests=3)
            expected = [r.output for r in eager.generate(prompts, params)]
            monkeypatch.setattr(decode_step, "_graph_api", lambda where: "stand-in")
            monkeypatch.setattr(decode_step, "capture_graph", stand_in)
            engine = InferenceEngine(model, max_tokens=64, block_size=4, max_requests=3,
                                     decode_step="cuda_graph", num_decode_graphs=2)
            outputs = [r.output for r in engine.generate(prompts, params)]
    finally:
        dist.destroy_process_group()
    assert outputs == expected
    assert len(set(expected[0])) > 1, expected  # the tokens vary: the check means something
    # 5 decode steps, 3 captures: not one host read in any
    assert engine.decode_runner.steps == 5 and graph_syncs == [[]] * 8
    # batch sizes 3, 2 (padded to 3), then 1; keys up to 8, then 16 positions
    assert sorted(engine.decode_runner.graphs) == [(1, 16), (3, 8), (3, 16)]

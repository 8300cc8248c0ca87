"""SMP v2's path on FSDP2: a transformed HF Llama sharded by `smp.fully_shard` (full and with
activation checkpointing + offloading), delayed initialisation of meta-built models, the
offloader's accounting, and the SMP keys' effects."""
import pytest
import torch

from megatron_smp.testing import run_distributed
from tests.unit.models.common import to_numpy, to_torch
from tests.unit.models.test_hf_adapters import build_hf

ITERS, BATCH, SEQ = 10, 4, 16


def _batches(vocab):
    """One batch, ITERS times: the loss then falls step after step."""
    generator = torch.Generator().manual_seed(5)
    batch = (torch.randint(0, vocab, (BATCH, SEQ), generator=generator),
             torch.randint(0, vocab, (BATCH, SEQ), generator=generator))
    return [batch] * ITERS


def _train_transformed(rank, world_size, smp_config, shard_kwargs):
    """smp.init -> transform(HF Llama) -> fully_shard -> 10 AdamW steps; losses and the
    first step's grad norm, plus the offloader's accounting."""
    import torch.distributed as dist

    import megatron_smp as smp
    from megatron_smp.config import OptimizerConfig
    from megatron_smp.distributed import finalize_model_grads
    from megatron_smp.optimizer import get_megatron_optimizer

    smp.init(smp_config)
    parallel_state = smp.state.parallel_state
    hf = build_hf("llama")
    model = smp.transform(hf)
    if shard_kwargs is not None:
        model = smp.fully_shard(model, **shard_kwargs)
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-3, clip_grad=1.0), [model],
                                       parallel_state)
    losses, norms = [], []
    dp, dp_rank = parallel_state.dp_size, parallel_state.dp_rank
    rows = slice(dp_rank * BATCH // dp, (dp_rank + 1) * BATCH // dp)
    for tokens, labels in _batches(hf.config.vocab_size):
        optimizer.zero_grad()
        loss = model(tokens[rows], shift_labels=labels[rows]).loss
        loss.backward()
        finalize_model_grads([model], parallel_state)
        _, norm, _ = optimizer.step()
        norms.append(norm)
        value = loss.detach().clone()
        dist.all_reduce(value, group=parallel_state.dp_group)
        losses.append(value.item() / dp)
    offloader = getattr(model, "activation_offloader", None)
    if smp_config.get("sm_activation_offloading") is False:
        return losses, norms, {"wrapper": type(model).__name__}
    accounting = None
    if offloader is not None:
        accounting = {"offloaded": sorted(offloader.offloaded_layers),
                      "max_resident": offloader.max_resident,
                      "pending": offloader.pending, "trace": offloader.resident_trace}
    return losses, norms, accounting


_REFERENCE = {}


def _reference():
    if "llama" not in _REFERENCE:
        _REFERENCE["llama"] = run_distributed(_train_transformed, 1, args=({}, None))[0]
    return _REFERENCE["llama"]


@pytest.mark.parametrize("name, smp_config, shard_kwargs", [
    ("full", {}, {}),
    ("tp2", {"tensor_parallel_degree": 2}, {}),
    ("offload", {"activation_loading_horizon": 1},
     {"activation_checkpointing": True, "activation_offloading": True}),
    ("torch_offload", {"sm_activation_offloading": False},
     {"activation_checkpointing": True, "activation_offloading": True}),
])
def test_transformed_llama_fully_shard_matches_single_process(name, smp_config, shard_kwargs):
    losses, norms, _ = _reference()
    assert losses[-1] < losses[0]
    for got, got_norms, accounting in run_distributed(
            _train_transformed, 2, args=(smp_config, shard_kwargs), timeout=300):
        assert got == pytest.approx(losses, rel=1e-4), name
        assert got_norms == pytest.approx(norms, rel=1e-4), name
        if name == "offload":
            # Both checkpointed layers went to the host, and with horizon 1 backward never
            # held more than one layer's inputs.
            assert accounting["offloaded"] == [0, 1]
            assert accounting["max_resident"] == 1
            assert accounting["pending"] <= 1  # the first layer's copies, released next step
        if name == "torch_offload":  # sm_activation_offloading false: torch's offload_wrapper
            assert accounting == {"wrapper": "OffloadWrapper"}


def _rank0_weights_worker(rank, world_size):
    """Rank 0 holds the HF weights, every other rank a meta HF model: transform with
    load_state_dict_from_rank0, then fully_shard(sync_module_states=True)."""
    import megatron_smp as smp
    from megatron_smp.config import ConfigError

    smp.init({"tensor_parallel_degree": 2})
    parallel_state = smp.state.parallel_state
    if rank == 0:
        hf = build_hf("llama")
    else:
        with torch.device("meta"):
            hf = build_hf("llama")
    torch.manual_seed(100 + rank)  # the fresh init of other ranks would differ per rank
    model = smp.transform(hf, load_state_dict_from_rank0=True)
    on_meta = all(p.is_meta for p in model.parameters())
    try:
        smp.fully_shard(model)
        refused = None
    except ConfigError as error:
        refused = str(error)
    model = smp.fully_shard(model, sync_module_states=True)
    ids = torch.arange(2 * 8).reshape(2, 8) % 1003
    with torch.no_grad():
        logits = model(ids).logits
    return {"tp_rank": parallel_state.tp_rank, "on_meta": on_meta, "refused": refused,
            "logits": to_numpy(logits)}


def test_load_state_dict_from_rank0_then_sync_module_states_gives_every_rank_rank0_weights():
    """SMP's reference: after transform(load_state_dict_from_rank0=True) only rank 0's TP
    group holds the weights (the others stay on meta); fully_shard(sync_module_states=True)
    copies them to the other data-parallel replicas. TP=2 x DP=2: every rank's logits equal
    the HF model's; without sync_module_states it is a ConfigError."""
    hf = build_hf("llama")
    ids = torch.arange(2 * 8).reshape(2, 8) % 1003
    with torch.no_grad():
        expected = hf(ids).logits
    for rank, out in enumerate(run_distributed(_rank0_weights_worker, 4, timeout=300)):
        assert out["on_meta"] == (rank >= 2)  # ranks 0, 1 form rank 0's TP group
        assert "sync_module_states=True" in out["refused"]
        torch.testing.assert_close(to_torch(out["logits"]), expected, rtol=1e-4, atol=1e-5)


def test_transformed_llama_fully_shard_world4_full_and_hybrid_match_single_process():
    """DP=4 full sharding and hybrid_shard_degree=2 (shard pairs, two replicas) at world 4."""
    losses, norms, _ = _reference()
    for name, smp_config in [("dp4", {}), ("hybrid2", {"hybrid_shard_degree": 2})]:
        for got, got_norms, _ in run_distributed(_train_transformed, 4, args=(smp_config, {}),
                                                 timeout=300):
            assert got == pytest.approx(losses, rel=1e-4), name
            assert got_norms == pytest.approx(norms, rel=1e-4), name


def test_offloader_horizon_bounds_resident_layers():
    """4 checkpointed layers: every layer offloaded, grads equal, at most h resident."""
    from megatron_smp.distributed.activation_offload import ActivationOffloader
    from megatron_smp.tensor_parallel.random import checkpoint

    torch.manual_seed(0)
    layers = [torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()) for _ in range(4)]
    x = torch.randn(3, 8, requires_grad=True)

    def run(offloader):
        for p in [x] + [p for layer in layers for p in layer.parameters()]:
            p.grad = None
        h = x
        for index, layer in enumerate(layers):
            if offloader is None:
                h = layer(h)
            else:
                with offloader.layer(index):
                    h = checkpoint(layer, False, h)
        h.square().sum().backward()
        return [x.grad.clone()] + [p.grad.clone() for layer in layers for p in layer.parameters()]

    expected = run(None)
    for horizon in (1, 2, 3):
        offloader = ActivationOffloader(horizon)
        grads = run(offloader)
        assert all(torch.equal(a, b) for a, b in zip(grads, expected))
        assert offloader.offloaded_layers == {0, 1, 2, 3}
        assert offloader.max_resident == horizon
        assert offloader.offloaded_bytes == {i: 3 * 8 * 4 for i in range(4)}


def _delayed_init_worker(rank, world_size, family):
    """Eager model vs meta model + DelayedParamIniter + FSDP2: the gathered values."""
    import megatron_smp as smp
    from megatron_smp.distributed.delayed_init import DelayedParamIniter
    from megatron_smp.distributed.fsdp import fully_shard_model
    from megatron_smp.models.gpt import GPTModel
    from tests.unit.distributed.test_fsdp import _model_config

    smp.init({"random_seed": 3})
    parallel_state = smp.state.parallel_state
    config = _model_config(family)
    torch.manual_seed(11)
    eager = GPTModel(config, parallel_state)
    torch.manual_seed(11)
    meta = GPTModel(config, parallel_state, device="meta")
    assert all(p.is_meta for p in meta.parameters())
    initer = DelayedParamIniter(meta)
    with initer.validate_params_and_buffers_inited():
        fully_shard_model(meta, parallel_state, param_init_fn=initer.get_param_init_fn())
    gathered = {name: p.full_tensor() for name, p in meta.named_parameters()}
    reference = dict(eager.named_parameters())
    mismatched = [n for n, t in gathered.items() if not torch.equal(t, reference[n].detach())]
    buffers = [n for n, b in meta.named_buffers() if b.is_meta]

    # A meta HF Llama through transform stays on meta, then materialises the same way.
    with torch.device("meta"):
        hf = build_hf("llama")
    torch.manual_seed(12)
    transformed = smp.transform(hf)
    on_meta = all(p.is_meta for p in transformed.parameters())
    smp.fully_shard(transformed, param_init_fn=DelayedParamIniter(transformed).get_param_init_fn())
    torch.manual_seed(12)
    eager_hf = GPTModel(transformed.module.config, parallel_state)  # transform's fresh init
    return {"mismatched": mismatched, "meta_buffers": buffers, "transform_on_meta": on_meta,
            "transform_equal": all(
                torch.equal(p.full_tensor(), q.detach())
                for p, q in zip(transformed.parameters(), eager_hf.parameters()))}


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_delayed_init_materialises_the_eager_values(family):
    for out in run_distributed(_delayed_init_worker, 2, args=(family,), timeout=300):
        assert out["mismatched"] == [] and out["meta_buffers"] == []
        assert out["transform_on_meta"] and out["transform_equal"]


def test_delayed_param_initer_validation_and_helpers():
    from megatron_smp.distributed.delayed_init import (
        DelayedParamIniter, empty_module_params, move_buffers_to_device,
    )

    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    model[0].weight.custom = 5
    empty_module_params(model[0])
    assert not model[0].weight.is_meta and model[0].weight.custom == 5
    assert model[1].weight.is_meta  # not recursive by default
    calls = []

    def init_fn(module):
        calls.append(type(module).__name__)
        empty_module_params(module)
        torch.nn.init.ones_(module.weight)

    initer = DelayedParamIniter(model, init_method_using_config=init_fn)
    with pytest.raises(AssertionError, match="initialised"):
        with initer.validate_params_and_buffers_inited():
            initer.get_param_init_fn()(model[1])  # model[0] was materialised outside
    model.register_buffer("table", torch.arange(3.0))
    move_buffers_to_device(model, torch.device("cpu"))
    assert calls == ["LayerNorm"]


def test_cache_flush_warnings():
    from megatron_smp.distributed.fsdp import CacheFlushMonitor

    stats = {"num_alloc_retries": 0}
    monitor = CacheFlushMonitor(torch.device("cuda"), stats_fn=lambda: dict(stats))
    assert monitor.check() == 0
    stats["num_alloc_retries"] = 2
    with pytest.warns(RuntimeWarning, match="2 CUDA caching-allocator flush"):
        assert monitor.check() == 2
    assert CacheFlushMonitor(torch.device("cpu")).check() == 0

"""Multi-token prediction (--mtp-num-layers, --mtp-loss-scaling-factor): the logged "mtp_k loss"
equals a direct computation from the model's parts (k-times shifted ids, labels and loss mask,
plain cross entropy), in the log line and in TensorBoard; the MTP loss enters backward scaled
by the factor (factor 0 leaves the lm-loss trajectory of a run whose MTP layers get no
gradient); flag errors; the TP layout of the MTP weights; the DeepSeek-V3 HF export drops the
MTP weights with a log line. The parallel layouts (PP=2 with MTP on the last stage, TP, EP,
CP, DP) are in test_deepseek_layouts.py."""
import logging

import pytest
import torch
import torch.nn.functional as F

from megatron_smp.testing import run_distributed
from tests.functional.test_deepseek_layouts import deepseek_argv


def _direct_mtp_losses(model, batch, differentiable=False):
    """[loss of depth k] of one microbatch, from the model's parts: h^0 from the decoder, then
    per depth the embedding of the ids shifted k places, the norms, eh_proj, the inner layer,
    the final norm, the shared output layer and F.cross_entropy against the labels shifted k
    places, averaged over the loss mask shifted k places. Floats, or 0-dim tensors with
    their graph (`differentiable`)."""
    tokens, labels, mask = batch["tokens"], batch["labels"], batch["loss_mask"].float()
    vocab = model.config.vocab_size
    weight = model.embedding.word_embeddings.weight if model.output_layer.weight is None \
        else None

    def shifted(x, k):
        return torch.cat([x[:, k:], torch.zeros_like(x[:, :k])], dim=1)

    model.eval()  # no router bookkeeping (expert-bias counts, aux-loss metrics)
    with torch.set_grad_enabled(differentiable):
        rotary = model.rotary_pos_emb(tokens.shape[1])
        hidden = model.decoder(model.embedding(tokens), None, rotary)
        losses = []
        for k, layer in enumerate(model.mtp.layers, start=1):
            combined = torch.cat([layer.enorm(model.embedding(shifted(tokens, k))),
                                  layer.hnorm(hidden)], dim=-1)
            hidden = layer.final_layernorm(layer.mtp_model_layer(layer.eh_proj(combined)[0],
                                                                 None, rotary))
            logits = model.output_layer(hidden, weight=weight)[0][..., :vocab]
            ce = F.cross_entropy(logits.transpose(0, 1).reshape(-1, vocab).float(),
                                 shifted(labels, k).reshape(-1), reduction="none")
            k_mask = shifted(mask, k).reshape(-1)
            loss = (ce * k_mask).sum() / k_mask.sum()
            losses.append(loss if differentiable else float(loss))
    model.train()
    return losses


def _train_and_compute_directly(rank, world_size, argv, board):
    """(logged losses per iteration, direct MTP losses per iteration (mean of microbatches),
    TensorBoard "mtp_k loss" scalars)."""
    import pretrain_gpt
    from megatron_smp.training import pretrain

    direct = []

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        gpt = next(m for m in model.modules() if hasattr(m, "mtp") and m.mtp is not None)
        if gpt.training:
            direct.append(_direct_mtp_losses(gpt, batch))
        return pretrain_gpt.forward_step(iter([batch]), model)

    result = pretrain(pretrain_gpt.train_valid_test_datasets_provider,
                      pretrain_gpt.model_provider, forward_step, argv=argv)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(board)
    events.Reload()
    scalars = {tag: [e.value for e in events.Scalars(tag)]
               for tag in ("mtp_1 loss", "mtp_2 loss")}
    return ([result.train_losses[i] for i in sorted(result.train_losses)], direct,
            scalars, result.log_lines)


def test_logged_mtp_loss_equals_direct_computation(tmp_path):
    argv = deepseek_argv(["--train-iters", "3", "--tensorboard-dir", str(tmp_path)])
    logged, direct, scalars, lines = run_distributed(
        _train_and_compute_directly, 1, args=(argv, str(tmp_path)), timeout=300)[0]
    microbatches = 4  # global batch 8, micro batch 2
    assert len(direct) == 3 * microbatches
    for iteration in range(3):
        rows = direct[iteration * microbatches:(iteration + 1) * microbatches]
        for k in (1, 2):
            want = sum(row[k - 1] for row in rows) / microbatches
            got = logged[iteration][f"mtp_{k} loss"]
            assert got == pytest.approx(want, rel=1e-5), (iteration, k)
            assert scalars[f"mtp_{k} loss"][iteration] == pytest.approx(got, rel=1e-6)
    line = next(line for line in lines if line.startswith(" iteration        1/"))
    assert f"| mtp_1 loss: {logged[0]['mtp_1 loss']:.6E} |" in line
    assert f"| mtp_2 loss: {logged[0]['mtp_2 loss']:.6E} |" in line


def _small_mtp_model(factor, tied=False, moe=True, device=None):
    from megatron_smp.config import ParallelConfig
    from megatron_smp.models import GPTModel, llama_config
    from megatron_smp.parallel_state import build_parallel_state
    from megatron_smp.tensor_parallel.random import model_parallel_seed

    state = build_parallel_state(ParallelConfig())
    config = llama_config(2, 32, 4, 101, max_position_embeddings=12, ffn_hidden_size=48,
                          multi_latent_attention=True, qk_layernorm=True, q_lora_rank=12,
                          kv_lora_rank=10,
                          qk_head_dim=6, qk_pos_emb_head_dim=4, v_head_dim=6,
                          num_moe_experts=4 if moe else None, moe_router_topk=2,
                          moe_ffn_hidden_size=16 if moe else None,
                          moe_layer_freq=[0, 1] if moe else 1, mtp_num_layers=2,
                          mtp_loss_scaling_factor=factor,
                          untie_embeddings_and_output_weights=not tied)
    model_parallel_seed(5, state)
    return GPTModel(config, state, device=device)


@pytest.mark.parametrize("tied", [False, True])
def test_mtp_loss_enters_backward_scaled_by_the_factor(tied):
    """The grads of one forward/backward of the mean lm loss (the MTP loss attached, factor
    0.3, 2 depths) equal autograd of lm loss + 0.3 / 2 x (sum of the direct MTP losses), for
    every parameter (the shared word embedding and output layer included), with the output
    layer tied or not."""
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 101, (2, 12), generator=generator)
    labels = torch.randint(0, 101, (2, 12), generator=generator)
    mask = (torch.rand(2, 12, generator=generator) > 0.2).float()
    model = _small_mtp_model(0.3, tied)
    lm = (model(tokens, labels=labels, loss_mask=mask) * mask).sum() / mask.sum()
    lm.backward()
    got = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()

    logits = model(tokens)[..., :101]  # no labels: logits, no MTP
    lm_by_hand = (F.cross_entropy(logits.reshape(-1, 101).float(), labels.reshape(-1),
                                  reduction="none") * mask.reshape(-1)).sum() / mask.sum()
    direct = _direct_mtp_losses(model, {"tokens": tokens, "labels": labels, "loss_mask": mask},
                                differentiable=True)
    (lm_by_hand + 0.3 / 2 * sum(direct)).backward()
    for name, param in model.named_parameters():
        torch.testing.assert_close(got[name], param.grad, rtol=1e-4, atol=1e-6, msg=name)
    assert got["mtp.layers.1.eh_proj.weight"].abs().max() > 0


def test_meta_device_build_materializes_the_eager_weights():
    """--init-model-with-meta-device: the MTP layers (and MLA's replicated down-projections)
    get the eager model's values."""
    from megatron_smp.distributed.delayed_init import materialize_meta_model

    eager = _small_mtp_model(0.1, moe=False).state_dict()
    meta = materialize_meta_model(_small_mtp_model(0.1, moe=False, device="meta"),
                                  torch.device("cpu")).state_dict()
    assert meta.keys() == eager.keys() and any(k.startswith("mtp.") for k in eager)
    for name in eager:
        assert torch.equal(meta[name], eager[name]), name


@pytest.mark.parametrize("flags, message", [
    ("--mtp-num-layers 0", "--mtp-num-layers must be >= 1"),
    ("--mtp-num-layers 1 --mtp-loss-scaling-factor -1", "--mtp-loss-scaling-factor must be"),
    ("--mtp-num-layers 1 --calculate-per-token-loss", "--calculate-per-token-loss"),
    ("--mtp-num-layers 1 --pipeline-model-parallel-size 2", "learned absolute positions"),
    ("--mtp-num-layers 1 --reset-attention-mask", "--mtp-num-layers with --reset-attention-mask"),
])
def test_mtp_flag_errors(flags, message):
    from megatron_smp.config import ConfigError
    from megatron_smp.training.arguments import parse_args, validate_configs
    from tests.unit.training.test_arguments import BASE

    configs = parse_args(BASE + ["--vocab-size", "1000"] + flags.split())
    with pytest.raises(ConfigError, match=message):
        validate_configs(configs, world_size=2)


def test_flags_set_the_config_and_the_tp_layout_covers_the_mtp_weights():
    from megatron_smp.models.sharding import default_layout, tensor_parallel_layout
    from tests.unit.training.test_arguments import BASE, parse

    model = parse(BASE + "--mtp-num-layers 2 --mtp-loss-scaling-factor 0.25".split()).model
    assert (model.mtp_num_layers, model.mtp_loss_scaling_factor) == (2, 0.25)
    assert parse(BASE).model.mtp_loss_scaling_factor == 0.1  # Megatron's default
    gpt = _small_mtp_model(0.1)
    layout = tensor_parallel_layout(gpt)
    assert "mtp.layers.*.eh_proj.weight" in layout
    assert "mtp.layers.*.mtp_model_layer.mlp.experts.local_experts.*.linear_fc1.weight" in layout
    assert layout == {k: v for k, v in default_layout(gpt.config).items() if k in layout}


def test_deepseek_v3_export_drops_the_mtp_weights_with_a_log_line(caplog):
    from megatron_smp.models.hf import deepseek_v3
    from tests.unit.models.test_deepseek_v3 import build_hf

    hf = build_hf()
    config = deepseek_v3.config_from_hf(hf.config).replace(mtp_num_layers=1)
    ours = deepseek_v3.from_hf(hf.state_dict(), config)
    ours["mtp.layers.0.eh_proj.weight"] = torch.zeros(48, 96)
    ours["mtp.layers.0.enorm.weight"] = torch.ones(48)
    with caplog.at_level(logging.WARNING):
        back = deepseek_v3.to_hf(ours, config)
    assert back.keys() == hf.state_dict().keys()
    assert "dropping the 1 multi-token-prediction layer(s) (2 tensors" in caplog.text

"""transform keeps the HF causal LM's contract: keywords, HF's shifted -100 loss, padding masks,
HF's output object, config / generation_config / train-eval, and a state dict the translators
turn back into HF's."""
import pytest
import torch

import megatron_smp.smp as tsm
from megatron_smp.config import ConfigError
from tests.unit.models.test_hf_adapters import build_hf

BATCH, SEQ = 3, 12


def _batch(vocab):
    ids = torch.randint(0, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(4))
    padding = torch.ones(BATCH, SEQ, dtype=torch.long)
    padding[0, -4:] = 0          # right padding
    padding[2, :3] = 0           # left padding (fully masked query rows)
    labels = ids.masked_fill(padding == 0, -100)
    labels[1, 5] = -100          # an ignored real token
    return ids, padding, labels


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_hf_keywords_loss_and_output_object(family):
    tsm.init({})
    no_dropout = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0) if family == "gpt2" else {}
    hf = build_hf(family, **no_dropout)  # train() below: dropout would make grads differ
    model = tsm.transform(hf)
    ids, padding, labels = _batch(hf.config.vocab_size)
    expected = hf(input_ids=ids, attention_mask=padding, labels=labels)
    out = model(input_ids=ids, attention_mask=padding, labels=labels)
    assert type(out).__name__ == "CausalLMOutputWithPast"
    assert abs(out["loss"].item() - expected.loss.item()) < 1e-5
    assert out.loss is out["loss"] and out.logits is None  # no vocabulary gather with labels
    with_logits = model(ids, attention_mask=padding, labels=labels, return_logits=True)
    real = padding.bool()
    assert (with_logits.logits[real] - expected.logits[real]).abs().max() < 1e-4
    # return_dict=False: HF's tuple; num_items_in_batch: sum / n as HF's Trainer asks.
    loss, logits = model(ids, attention_mask=padding, labels=labels, return_dict=False,
                         return_logits=True)
    assert torch.equal(loss, with_logits.loss) and logits.shape == expected.logits.shape
    summed = model(ids, attention_mask=padding, labels=labels, num_items_in_batch=7).loss
    reference = hf(ids, attention_mask=padding, labels=labels, num_items_in_batch=7).loss
    assert abs(summed.item() - reference.item()) < 1e-5
    # Gradients of HF's loss equal HF's.
    hf.train(), model.train()
    assert model.module.training
    hf(ids, attention_mask=padding, labels=labels).loss.backward()
    model(ids, attention_mask=padding, labels=labels).loss.backward()
    from megatron_smp.models.hf import get_adapter

    grads = get_adapter(hf).from_hf({n: p.grad for n, p in hf.named_parameters()},
                                    model.transformer_config)
    worst = max((p.grad - grads[n]).abs().max().item()
                for n, p in model.module.named_parameters())
    assert worst < 1e-5
    model.eval()
    assert not model.module.training
    # HF's attributes, and HF's state dict back from the translators.
    assert model.config is hf.config and model.generation_config is hf.generation_config
    back = model.hf_state_dict()
    for name, tensor in hf.state_dict().items():
        if name in back:
            assert torch.equal(back[name], tensor), name


def test_keywords_it_cannot_honour_are_errors():
    tsm.init({})
    hf = build_hf("llama")
    model = tsm.transform(hf)
    ids = torch.zeros(1, 4, dtype=torch.long)
    assert model(ids, use_cache=False, output_attentions=False).logits.shape == (1, 4, 1003)
    for keyword, value in (("past_key_values", object()), ("use_cache", True),
                           ("output_attentions", True), ("output_hidden_states", True),
                           ("inputs_embeds", torch.zeros(1, 4, 64)), ("logits_to_keep", 1)):
        with pytest.raises(ConfigError, match=keyword):
            model(ids, **{keyword: value})
    with pytest.raises(ConfigError, match="unknown keyword 'foo'"):
        model(ids, foo=1)
    with pytest.raises(ConfigError, match="num_beams"):  # generate: what the engine lacks
        model.generate(ids, num_beams=2)


def test_four_d_masks_mean_what_they_mean_to_hf():
    """HF hands a 4-D attention_mask to its attention as it is: bool True = attend (SDPA's),
    or additive float 0 / dtype minimum (eager's)."""
    tsm.init({})
    hf = build_hf("llama")
    model = tsm.transform(hf)
    ids, *_ = _batch(hf.config.vocab_size)
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
    allowed = causal & (torch.arange(SEQ) >= 5)[None, :] | torch.eye(SEQ, dtype=torch.bool)
    allowed = allowed.expand(BATCH, 1, SEQ, SEQ)
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    with torch.no_grad():
        expected = hf(ids, attention_mask=allowed).logits
        assert (model(ids, attention_mask=allowed).logits - expected).abs().max() < 1e-4
        assert (model(ids, attention_mask=additive).logits - expected).abs().max() < 1e-4
    with pytest.raises(ConfigError, match="4-D attention_mask must be bool"):
        model(ids, attention_mask=additive + 0.5)

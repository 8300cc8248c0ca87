"""The DPO losses and metrics equal TRL's own DPOTrainer computation (trl 1.16, `_compute_loss`)
on the same HF Llama, pairs and reference log-probs, for every loss type, with and without
the NLL term on the chosen responses (TRL's "sft" loss, weighted by rpo_alpha)."""
import copy

import pytest
import torch

trl = pytest.importorskip("trl")

VOCAB = 64


def _pairs(generator):
    """Three (prompt, chosen, rejected) id lists of different lengths."""
    def ids(n):
        return torch.randint(3, VOCAB, (n,), generator=generator).tolist()
    return [(ids(5), ids(4), ids(6)), (ids(3), ids(7), ids(2)), (ids(6), ids(3), ids(3))]


@pytest.fixture(scope="module")
def hf_and_trainer(tmp_path_factory):
    import transformers
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64,
                                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    hf = transformers.LlamaForCausalLM(config).float()
    vocab = {f"t{i}": i for i in range(VOCAB)}
    word_level = Tokenizer(models.WordLevel(vocab, unk_token="t3"))
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=word_level, pad_token="t0",
                                        bos_token="t1", eos_token="t2")
    pairs = _pairs(torch.Generator().manual_seed(1))

    def text(ids):
        return " ".join(f"t{i}" for i in ids)

    # The trainer needs a dataset to be built; the batches below are collated from ids.
    dataset = Dataset.from_list([{"prompt": text(p), "chosen": text(c), "rejected": text(r)}
                                 for p, c, r in pairs])
    args = trl.DPOConfig(output_dir=str(tmp_path_factory.mktemp("trl")), report_to=[],
                         use_cpu=True, per_device_train_batch_size=len(pairs))
    # A reference model (unused: the batches bring their reference log-probs) so that the
    # trainer does not load one by name.
    trainer = trl.DPOTrainer(model=hf, ref_model=copy.deepcopy(hf), args=args,
                             train_dataset=dataset, processing_class=tokenizer)
    return hf, trainer, pairs


def _trl(trainer, pairs, ref_chosen, ref_rejected, beta, loss_type, smoothing, rpo_alpha):
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    trainer.loss_types = [loss_type] + (["sft"] if rpo_alpha is not None else [])
    trainer.loss_weights = [1.0] + ([rpo_alpha] if rpo_alpha is not None else [])
    trainer.beta, trainer.label_smoothing = beta, smoothing
    trainer.precompute_ref_logps = True  # the reference log-probs come with the batch
    inputs = DataCollatorForPreference(pad_token_id=0)(
        [{"prompt_ids": p, "chosen_ids": c, "rejected_ids": r} for p, c, r in pairs])
    inputs["ref_chosen_logps"], inputs["ref_rejected_logps"] = ref_chosen, ref_rejected
    trainer._metrics["train"].clear()
    trainer.model.train()
    with torch.no_grad():
        loss = trainer._compute_loss(trainer.model, inputs, False)
    return float(loss), {k: v[-1] for k, v in trainer._metrics["train"].items()}


def _ours(model, pairs, ref_chosen, ref_rejected, config):
    """Every pair packed into one row (chosen then rejected, each prompt + response)."""
    from megatron_smp.post_training.dpo import dpo_loss_and_metrics, pair_sums
    from megatron_smp.post_training.backend_api import token_log_probs

    tokens, labels, mask, documents = [], [], [], []
    for number, (prompt, chosen, rejected) in enumerate(pairs):
        for side, response in enumerate((chosen, rejected)):
            ids = prompt + response
            tokens += ids[:-1]
            labels += ids[1:]
            mask += [0] * (len(prompt) - 1) + [1] * len(response)
            documents += [2 * number + side] * (len(ids) - 1)
    tokens, labels = torch.tensor([tokens]), torch.tensor([labels])
    mask, documents = torch.tensor([mask], dtype=torch.float32), torch.tensor([documents])
    state = model.module.state
    logits = model.module(tokens, document_ids=documents)
    logps, _ = token_log_probs(logits, labels, state, VOCAB)
    sums, counts = pair_sums(logps, mask, documents, 2 * len(pairs))
    reference = torch.stack([ref_chosen, ref_rejected], dim=-1)[None]
    loss, reports = dpo_loss_and_metrics(sums, reference, counts, config)
    return float(loss), {k: float(v[0] / v[1]) for k, v in reports.items()}


@pytest.mark.parametrize("loss_type,smoothing,rpo_alpha", [
    ("sigmoid", 0.0, None), ("hinge", 0.0, None), ("ipo", 0.0, None), ("robust", 0.2, None),
    ("sigmoid", 0.0, 0.5)])
def test_dpo_loss_and_metrics_equal_trl(hf_and_trainer, loss_type, smoothing, rpo_alpha):
    import megatron_smp.smp as smp
    from megatron_smp.post_training.dpo import DPOConfig, METRICS

    hf, trainer, pairs = hf_and_trainer
    smp.init({})
    model = smp.transform(hf)
    # Reference log-probs on either side of the policy's, so that some rewards are positive.
    ref_chosen = torch.tensor([-25.0, -40.0, -18.0])
    ref_rejected = torch.tensor([-30.0, -12.0, -21.0])
    config = DPOConfig(beta=0.3, loss_type=loss_type, label_smoothing=smoothing,
                       rpo_alpha=rpo_alpha)
    config.validate(lora=False)
    expected_loss, expected = _trl(trainer, pairs, ref_chosen, ref_rejected, 0.3, loss_type,
                                   smoothing, rpo_alpha)
    with torch.no_grad():
        loss, metrics = _ours(model, pairs, ref_chosen, ref_rejected, config)
    assert abs(loss - expected_loss) < 1e-5, (loss, expected_loss)
    for key in METRICS:
        assert abs(metrics[key] - expected[key]) < 1e-5, (key, metrics[key], expected[key])
    assert 0.0 < expected["rewards/accuracies"] < 1.0  # a real mix of won and lost pairs


def test_dpo_flags_are_checked():
    from megatron_smp.config import ConfigError
    from megatron_smp.post_training.dpo import DPOConfig

    for config, match in ((DPOConfig(loss_type="kto"), "--dpo-loss-type 'kto'"),
                          (DPOConfig(beta=0.0), "--dpo-beta"),
                          (DPOConfig(loss_type="robust", label_smoothing=0.5),
                           "--dpo-label-smoothing"),
                          (DPOConfig(label_smoothing=0.1), "only shapes"),
                          (DPOConfig(reference="adapters-off"), "needs LoRA")):
        with pytest.raises(ConfigError, match=match):
            config.validate(lora=False)

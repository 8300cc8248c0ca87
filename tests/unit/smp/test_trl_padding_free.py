"""TRL's SFTTrainer(padding_free=True) trains a transformed model as it trains the Hugging Face
model: its collator flattens each batch into one row of documents (restarting position_ids,
cu_seq_lens_q/k, max_length_q/k, seq_idx, -100 at each document's first label), its fused LM
head runs `base_model` and `get_output_embeddings()`, its default gradient checkpointing our
whole-layer recompute, and the per-step losses equal HF's."""
import warnings

import pytest
import torch

import megatron_smp as smp
from megatron_smp.config import ConfigError

warnings.filterwarnings("ignore", message=".*")
STEPS = 3


def _tokenizer():
    import transformers as tf
    from tokenizers import Tokenizer, models

    vocab = {f"t{i}": i for i in range(128)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t1"))
    return tf.PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="t0",
                                      eos_token="t2", unk_token="t1")


def _hf_model():
    import transformers as tf

    config = tf.LlamaConfig(vocab_size=128, num_hidden_layers=2, hidden_size=64,
                            num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                            max_position_embeddings=64)
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(config)


def _dataset():
    from datasets import Dataset

    generator = torch.Generator().manual_seed(1)
    lengths = torch.randint(3, 12, (4 * STEPS,), generator=generator)
    return Dataset.from_list([
        {"input_ids": torch.randint(3, 128, (int(n),), generator=generator).tolist()}
        for n in lengths])


def _train(model, output_dir, gradient_checkpointing):
    from trl import SFTConfig, SFTTrainer

    args = SFTConfig(output_dir=str(output_dir), padding_free=True, max_length=None,
                     per_device_train_batch_size=4, max_steps=STEPS, learning_rate=1e-3,
                     logging_steps=1, gradient_checkpointing=gradient_checkpointing,
                     bf16=False, use_cpu=True,
                     report_to=[], save_strategy="no", seed=0, dataloader_drop_last=True,
                     disable_tqdm=True)
    trainer = SFTTrainer(model=model, args=args, train_dataset=_dataset(),
                         processing_class=_tokenizer())
    batch = next(iter(trainer.get_train_dataloader()))
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return losses, batch


def test_sft_trainer_padding_free_losses_match_hf(tmp_path):
    pytest.importorskip("trl")
    expected, batch = _train(_hf_model(), tmp_path / "hf", gradient_checkpointing=False)
    # What the collator sends: one row of several documents and the flash keywords.
    assert batch["input_ids"].shape[0] == 1 and int((batch["position_ids"] == 0).sum()) == 4
    assert {"cu_seq_lens_q", "max_length_k", "seq_idx"} <= set(batch)
    smp.init({})
    model = smp.transform(_hf_model())
    # TRL's default gradient checkpointing: our whole-layer recompute, the same numbers.
    losses, _ = _train(model, tmp_path / "smp", gradient_checkpointing=True)
    assert model.is_activation_checkpointing
    assert len(losses) == len(expected) == STEPS
    assert max(abs(a - b) for a, b in zip(losses, expected)) < 1e-4, (losses, expected)
    assert model.model_tags and "sft" in model.model_tags  # add_model_tags kept TRL's tags
    model.gradient_checkpointing_disable()
    assert not model.is_gradient_checkpointing
    with pytest.raises(ConfigError, match="every_n_layers=2"):
        model.activation_checkpointing_enable(every_n_layers=2)

"""Every family of the zoo the way a user goes, through the scripts as subprocesses: a small
random Hugging Face model with odd sizes (a vocabulary of 1,003 rows for a tokenizer of 300
ids, as HF checkpoints often have more rows than ids) and its tokenizer -> convert.py ->
the family's entry script with --use-checkpoint-args --finetune for 2 iterations at a layout
that exercises the family (TP=2 + SP, PP=2 with an uneven split, or EP=2) -> convert.py back
to HF -> tools/generate.py at another layout: HF `generate`'s greedy tokens on the exported
directory, and the log-probabilities of those tokens equal HF's logits on it."""
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from tests.unit.inference.common import CORPUS, ROOT, launch, wait_all

PROMPTS = ("In the beginning God created", "The quick brown fox jumps")
NEW_TOKENS = 6
ENTRY = {"gpt2": "pretrain_gpt.py", "gptj": "pretrain_gpt.py", "gpt_neox": "pretrain_gpt.py",
         "qwen3_next": "pretrain_hybrid.py", "qwen3_5": "pretrain_hybrid.py",
         "qwen3_5_moe": "pretrain_hybrid.py", "nemotron_h": "pretrain_hybrid.py"}
TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
TP2 = ["--tensor-model-parallel-size", "2"]
PP2 = ["--pipeline-model-parallel-size", "2"]
EP2 = ["--expert-model-parallel-size", "2"]
# family: (fine-tuning layout, generation layout). Uneven PP splits where the model has the
# layers for one (2 of 5 Nemotron-H layers, 1 of 4 Qwen3-Next, 1 of 3 Qwen3, 3 of 7 Gemma 3
# layers on the first stage).
LAYOUTS = {
    "gpt2": (TP2_SP, PP2), "gptj": (TP2_SP, PP2), "gpt_neox": (PP2, TP2),
    "llama": (TP2_SP, PP2), "llama31": (PP2, TP2), "mistral": (TP2_SP, PP2),
    "qwen2": (TP2_SP, PP2), "qwen3": (PP2 + ["--decoder-first-pipeline-num-layers", "1"], TP2_SP), "gemma3": (TP2_SP, PP2 + ["--decoder-first-pipeline-num-layers", "3"]),
    "mixtral": (EP2, TP2_SP), "qwen2_moe": (EP2, TP2_SP), "qwen3_moe": (EP2, TP2_SP),
    "gpt_oss": (EP2, TP2_SP), "deepseek_v3": (EP2, TP2_SP),
    "qwen3_next": (PP2 + ["--decoder-first-pipeline-num-layers", "1"], TP2_SP),
    "qwen3_5": (TP2_SP, PP2 + ["--decoder-first-pipeline-num-layers", "1"]),
    "qwen3_5_moe": (EP2, TP2_SP),
    "nemotron_h": (PP2 + ["--decoder-first-pipeline-num-layers", "2"], TP2_SP),
}
TIMEOUT = 240


def build_hf(family):
    """The family's small random HF model (the builders the model tests check against HF)."""
    if family == "gemma3":
        from tests.unit.models.test_hf_gemma3 import build_gemma3

        return build_gemma3(0)
    if family == "gpt_oss":
        from tests.unit.models.test_hf_gpt_oss import build_gpt_oss

        return build_gpt_oss(0)
    if family == "deepseek_v3":
        from tests.unit.models.test_deepseek_v3 import build_hf as build_deepseek

        return build_deepseek(seed=0)
    if family in ("qwen3_next", "qwen3_5", "qwen3_5_moe", "nemotron_h"):
        from tests.unit.models.test_hf_hybrid import build_hf as build_hybrid

        return build_hybrid(family)
    if family == "qwen3":  # q/k norms, head_dim != hidden / heads, 3 layers
        import transformers as tf

        torch.manual_seed(0)
        return tf.Qwen3ForCausalLM(tf.Qwen3Config(
            vocab_size=1003, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=24, intermediate_size=96,
            max_position_embeddings=32)).eval()
    from tests.unit.models.test_hf_adapters import build_hf as build_dense

    return build_dense(family)


def _tokenizer():
    import transformers as tf
    from tokenizers import ByteLevelBPETokenizer

    trainer = ByteLevelBPETokenizer()
    trainer.train_from_iterator([CORPUS], vocab_size=300, min_frequency=1,
                                special_tokens=["<|endoftext|>"])
    return tf.PreTrainedTokenizerFast(tokenizer_object=trainer, eos_token="<|endoftext|>",
                                      bos_token="<|endoftext|>")


def _convert(*args):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "checkpoint", "convert.py"),
                           *map(str, args)], capture_output=True, text=True, timeout=TIMEOUT,
                          cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout


def _run(script, args, root, name):
    """Two ranks of `script` (an entry script at the root, or a tool) with their logs in
    root/name/; returns rank 0's log."""
    log_dir = root / name
    log_dir.mkdir()
    procs = launch(script if script == "generate.py" else os.path.join("..", script), args, 2,
                   log_dir)
    codes = wait_all(procs, TIMEOUT)
    logs = [(log_dir / f"rank{r}.log").read_text() for r in range(2)]
    assert codes == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    return logs


def _hf_greedy(model, ids):
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
        full = out[0].tolist()
        logprobs = torch.log_softmax(model(out).logits[0].float(), dim=-1)
    new = full[len(ids):]
    chosen = [logprobs[len(ids) - 1 + i, token].item() for i, token in enumerate(new)]
    return new, chosen


@pytest.mark.parametrize("family", sorted(LAYOUTS))
def test_hf_to_finetune_to_hf_to_generate(family, tmp_path):
    import transformers as tf

    tokenizer = _tokenizer()
    hf_dir, ckpt, tuned, exported = (tmp_path / n for n in ("hf", "ckpt", "tuned", "exported"))
    source = build_hf(family)
    assert source.config.vocab_size > len(tokenizer)
    source.save_pretrained(hf_dir)
    tokenizer.save_pretrained(hf_dir)
    model_type = "llama" if family == "llama31" else family
    _convert("--model-type", model_type, "--loader", "hf", "--saver", "megatron_smp",
             "--load-dir", hf_dir, "--save-dir", ckpt)

    train, generate = LAYOUTS[family]
    entry = ENTRY.get(family, "pretrain_llama.py")
    tokenizer_flags = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", hf_dir]
    logs = _run(entry, ["--load", ckpt, "--use-checkpoint-args", "--finetune", "--save", tuned,
                        *tokenizer_flags, *train, "--mock-data", "--seq-length", "16",
                        "--micro-batch-size", "2", "--global-batch-size", "4",
                        "--train-iters", "2", "--lr", "3e-3", "--log-interval", "1",
                        "--eval-iters", "0", "--seed", "7"], tmp_path, "finetune")
    assert sum(len(re.findall(r"iteration\s+2/\s+2 \|.*lm loss", log)) for log in logs) == 1, \
        logs[1][-2000:]

    _convert("--model-type", model_type, "--loader", "megatron_smp", "--saver", "hf",
             "--load-dir", tuned, "--save-dir", exported)
    tuned_hf = tf.AutoModelForCausalLM.from_pretrained(exported).eval()
    before, after = source.state_dict(), tuned_hf.state_dict()
    changed = [k for k in after if k in before and not torch.equal(before[k], after[k])]
    assert changed, "the fine-tuning changed no weight"

    source_file, output = tmp_path / "prompts.jsonl", tmp_path / "completions.jsonl"
    source_file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    _run("generate.py", ["--load", tuned, "--use-checkpoint-args", *tokenizer_flags,
                         *generate, "--input", source_file, "--output", output,
                         "--max-new-tokens", NEW_TOKENS, "--ignore-eos"], tmp_path, "generate")
    records = [json.loads(line) for line in output.read_text().splitlines()]
    assert len(records) == len(PROMPTS)
    for prompt, record in zip(PROMPTS, records):
        expected, logprobs = _hf_greedy(tuned_hf, tokenizer.encode(prompt))
        assert record["tokens"] == expected, (prompt, record["tokens"], expected)
        assert record["logprobs"] == pytest.approx(logprobs, abs=2e-4), prompt

"""The zoo for the inference tests: one small random HF model per family (the builders of the
model tests), left-padded prompts, and HF's own greedy generation and prompt log-probs."""
import warnings

import torch

warnings.filterwarnings("ignore", message=".*")

# Every family of the zoo: odd vocabularies, GQA, head dims != hidden / heads, Llama 3.1 and
# YaRN RoPE with original contexts (8) the generations run past, sliding windows (mistral,
# gpt-oss), sinks (gpt-oss), MLA (deepseek_v3), MoE (mixtral, qwen2_moe, qwen3_moe, gpt-oss,
# deepseek_v3), parallel residuals (gpt_neox, gptj), Gemma 3's 5:1 sliding/global layers with
# per-type RoPE, sandwich norms and logit soft-capping (gemma3).
FAMILIES = ("gpt2", "llama", "llama31", "mistral", "gpt_neox", "gptj", "qwen2", "mixtral",
            "qwen2_moe", "qwen3_moe", "gpt_oss", "deepseek_v3", "gemma3")
PROMPT, NEW = 9, 12


def build(family, seed=0):
    if family == "gemma3":
        from tests.unit.models.test_hf_gemma3 import build_gemma3

        return build_gemma3(seed)
    if family == "gpt_oss":
        from tests.unit.models.test_hf_gpt_oss import build_gpt_oss

        return build_gpt_oss(seed)
    if family == "deepseek_v3":
        from tests.unit.models.test_deepseek_v3 import build_hf

        return build_hf(seed=seed)
    from tests.unit.models.test_hf_adapters import build_hf

    return build_hf(family, seed=seed)


def prompts(vocab_size, batch=3, seed=1):
    """ids [batch, PROMPT] and a left-padding mask (rows 1 and 2 shorter)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (batch, PROMPT), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    if batch > 2:
        mask[2, :5] = 0
    return ids, mask


def hf_greedy(hf, ids, mask, new=NEW, **kwargs):
    with torch.no_grad():
        return hf.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                           pad_token_id=0, **kwargs)


def hf_prompt_logprobs(hf, prompt):
    """Log-probs of tokens 1.. of `prompt` (a list) under HF's forward."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0].float()
    logprobs = torch.log_softmax(logits[:-1], dim=-1)
    return logprobs.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]


CORPUS = ("In the beginning God created the heaven and the earth. And the earth was without "
          "form, and void; and darkness was upon the face of the deep. The quick brown fox "
          "jumps over the lazy dog. Question: what is two plus two? Answer: four.\n") * 4
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def hf_model_dir(path, family="llama", seed=0):
    """A small random HF model with a real byte-level BPE tokenizer (eos <|endoftext|>, a chat
    template) saved in `path` (from_pretrained-loadable, offline); returns (model, tokenizer)."""
    import transformers as tf
    from tokenizers import ByteLevelBPETokenizer

    trainer = ByteLevelBPETokenizer()
    trainer.train_from_iterator([CORPUS], vocab_size=300, min_frequency=1,
                                special_tokens=["<|endoftext|>", "<|user|>", "<|assistant|>"])
    tokenizer = tf.PreTrainedTokenizerFast(tokenizer_object=trainer, eos_token="<|endoftext|>",
                                           bos_token="<|endoftext|>")
    tokenizer.chat_template = CHAT_TEMPLATE
    torch.manual_seed(seed)
    config = tf.LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            max_position_embeddings=128, eos_token_id=tokenizer.eos_token_id,
                            bos_token_id=tokenizer.bos_token_id, tie_word_embeddings=False)
    model = tf.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # peakier logits than HF's init: fewer near-ties in greedy choices
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
            else:
                param.mul_(5.0)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model, tokenizer


def convert_to_ours(hf_dir, save_dir):
    """tools/checkpoint/convert.py --loader hf --saver megatron_smp (in this process)."""
    import contextlib
    import io

    from tools.checkpoint.convert import main

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        status = main(["--model-type", "llama", "--loader", "hf", "--saver", "megatron_smp",
                       "--load-dir", str(hf_dir), "--save-dir", str(save_dir)])
    assert status == 0


def model_flags(ckpt, hf_dir):
    """Megatron flags that load the converted checkpoint with the HF tokenizer."""
    return ["--load", str(ckpt), "--use-checkpoint-args", "--tokenizer-type",
            "HuggingFaceTokenizer", "--tokenizer-model", str(hf_dir)]


ROOT = __import__("os").path.dirname(__import__("os").path.dirname(__import__("os").path.dirname(
    __import__("os").path.dirname(__import__("os").path.abspath(__file__)))))


def launch(script, args, world, log_dir):
    """Start `world` ranks of tools/<script> (one thread each, the launcher's env variables,
    logs in log_dir/rank<i>.log); each in a session of its own so `stop` reaches it."""
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    procs = []
    for rank in range(world):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "RANK": str(rank), "LOCAL_RANK": str(rank),
               "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "PYTHONPATH": ROOT}
        log = open(os.path.join(log_dir, f"rank{rank}.log"), "w")
        procs.append(subprocess.Popen([sys.executable, os.path.join(ROOT, "tools", script),
                                       *map(str, args)], env=env, stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True,
                                      cwd=ROOT))
    return procs


def stop(procs, grace=20.0):
    """SIGTERM (rank 0 first: the server shuts the others down), then SIGKILL what is left.
    Returns the exit codes."""
    import os
    import signal
    import subprocess

    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            break
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=grace))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            codes.append(proc.wait())
    return codes


def wait_all(procs, timeout):
    """Wait for every rank to exit; kill them all after `timeout` s. Returns exit codes."""
    import subprocess
    import time

    deadline = time.time() + timeout
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=max(deadline - time.time(), 0.1)))
        except subprocess.TimeoutExpired:
            stop(procs, grace=1.0)
            raise
    return codes


def server_url(procs, port_file, log_dir, timeout=120.0):
    """The URL of a server started by `launch` once it writes `port_file` (raises with rank
    0's log if a rank exits or `timeout` s pass first)."""
    import os
    import time

    deadline = time.time() + timeout
    while not os.path.exists(port_file):
        if any(p.poll() is not None for p in procs) or time.time() > deadline:
            with open(os.path.join(log_dir, "rank0.log")) as handle:
                raise RuntimeError(handle.read()[-3000:])
        time.sleep(0.2)
    with open(port_file) as handle:
        return f"http://127.0.0.1:{int(handle.read())}"

"""The zoo for the inference tests: one small random HF model per family (the builders of the
model tests), left-padded prompts, and HF's own greedy generation and prompt log-probs."""
import warnings

import torch

warnings.filterwarnings("ignore", message=".*")

# Every family of the zoo: odd vocabularies, GQA, head dims != hidden / heads, Llama 3.1 and
# YaRN RoPE with original contexts (8) the generations run past, sliding windows (mistral,
# gpt-oss), sinks (gpt-oss), MLA (deepseek_v3), MoE (mixtral, qwen2_moe, qwen3_moe, gpt-oss,
# deepseek_v3), parallel residuals (gpt_neox, gptj).
FAMILIES = ("gpt2", "llama", "llama31", "mistral", "gpt_neox", "gptj", "qwen2", "mixtral",
            "qwen2_moe", "qwen3_moe", "gpt_oss", "deepseek_v3")
PROMPT, NEW = 9, 12


def build(family, seed=0):
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
    ids = torch.randint(0, vocab_size, (batch, PROMPT), generator=torch.Generator().manual_seed(seed))
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

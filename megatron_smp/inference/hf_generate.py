"""`transform(model).generate(...)`: Hugging Face's `generate` contract over the engine.

Takes HF's keywords (`max_new_tokens`, `max_length`, `do_sample`, `temperature`, `top_k`,
`top_p`, `eos_token_id`, `pad_token_id`, `num_return_sequences`, a `GenerationConfig`, a
left-padded `attention_mask`) with HF's defaults (the model's generation config, then
`max_length` 20, `top_k` 50, ...), and returns what HF returns: the input ids followed by the
new tokens, rows that finished early padded with `pad_token_id`, as long as the longest row.
A keyword or generation-config setting the engine does not implement (beam search,
repetition penalty, ...) is a ConfigError naming it. Greedy decoding gives HF's tokens.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

from megatron_smp.config import ConfigError
from megatron_smp.inference.engine import InferenceEngine
from megatron_smp.inference.sampling import SamplingParams

_SUPPORTED = {"max_length", "max_new_tokens", "do_sample", "temperature", "top_k", "top_p",
              "eos_token_id", "pad_token_id", "bos_token_id", "use_cache",
              "num_return_sequences", "output_scores", "return_dict_in_generate"}


def resolve_generation_config(model, generation_config=None, **kwargs) -> Dict[str, Any]:
    """The effective settings of one generate call: HF's defaults, overridden by the model's
    generation config (or `generation_config`), overridden by `kwargs`."""
    from transformers import GenerationConfig

    base = generation_config if generation_config is not None else (
        getattr(model, "generation_config", None) or GenerationConfig())
    settings = GenerationConfig._get_default_generation_params()
    settings.update({k: v for k, v in base.to_dict().items() if v is not None})
    known = set(settings) | set(GenerationConfig().to_dict())
    unknown = sorted(k for k in kwargs if k not in known)
    if unknown:
        raise ConfigError(f"generate: unknown keyword(s) {unknown}")
    settings.update(kwargs)  # an explicit None overrides too (eos_token_id=None: no stop)
    defaults = GenerationConfig._get_default_generation_params()
    for name, default in defaults.items():
        if settings.get(name) is None:
            settings[name] = default
    for name, default in defaults.items():
        if name not in _SUPPORTED and settings.get(name, default) != default:
            raise ConfigError(f"generate: {name}={settings[name]!r} is not supported "
                              "(greedy and sampled decoding with temperature, top_k, top_p)")
    for name in ("min_new_tokens", "stop_strings", "max_time", "assistant_model", "streamer",
                 "logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn"):
        if settings.get(name) is not None:
            raise ConfigError(f"generate: {name} is not supported")
    if settings.get("return_dict_in_generate") or settings.get("output_scores"):
        raise ConfigError("generate: return_dict_in_generate / output_scores are not "
                          "supported; the engine's log-probs are in InferenceEngine.generate")
    return settings


def _prompts(input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor]) -> List[List[int]]:
    if input_ids.dim() != 2:
        raise ConfigError(f"generate: input_ids must be [batch, length], got "
                          f"{tuple(input_ids.shape)}")
    if attention_mask is None:
        return input_ids.tolist()
    mask = attention_mask.to(torch.bool)
    if mask.shape != input_ids.shape:
        raise ConfigError("generate: attention_mask must have input_ids' shape")
    prompts = []
    for row, keep in zip(input_ids.tolist(), mask.tolist()):
        first = keep.index(True) if True in keep else len(keep)
        if not all(keep[first:]):
            raise ConfigError("generate: attention_mask must be left padding (zeros, then "
                              "ones); decoder-only generation needs the prompts to end "
                              "at the right edge")
        prompts.append(row[first:])
    return prompts


def generate(module, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
             settings: Optional[Dict[str, Any]] = None, group=None) -> torch.Tensor:
    """HF's `generate` over `module` (a GPTModel) with resolved `settings`
    (`resolve_generation_config`); collective over `group`."""
    settings = settings or resolve_generation_config(None)
    prompts = _prompts(input_ids, attention_mask)
    length = input_ids.shape[1]
    max_new = settings.get("max_new_tokens")
    if max_new is None:
        max_new = max(settings["max_length"] - length, 0)
    eos = settings.get("eos_token_id")
    eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    pad = settings.get("pad_token_id")
    if pad is None:
        pad = eos[0] if eos else 0
    sampled = bool(settings.get("do_sample"))
    copies = int(settings.get("num_return_sequences") or 1)
    if copies > 1 and not sampled:
        raise ConfigError("generate: num_return_sequences > 1 needs do_sample=True (greedy "
                          "rows would be identical; beam search is not supported)")
    params = []
    for _ in prompts:
        for _ in range(copies):
            seed = int(torch.randint(0, 2**62, (1,)).item()) if sampled else None
            params.append(SamplingParams(
                max_new_tokens=max_new, temperature=float(settings["temperature"]) if sampled
                else 0.0, top_k=int(settings["top_k"] or 0) if sampled else 0,
                top_p=float(settings["top_p"]) if sampled else 1.0, seed=seed,
                stop_token_ids=eos))
    expanded = [p for p in prompts for _ in range(copies)]
    total = sum(len(p) + max_new for p in expanded)
    engine = InferenceEngine(module, max_tokens=max(total, 1), block_size=16,
                             max_requests=max(len(expanded), 1), group=group)
    requests = engine.generate(expanded, params)
    new = max((len(r.output) for r in requests), default=0)
    rows = input_ids.repeat_interleave(copies, dim=0)
    out = torch.full((rows.shape[0], length + new), pad, dtype=input_ids.dtype,
                     device=input_ids.device)
    out[:, :length] = rows
    for index, request in enumerate(requests):
        out[index, length:length + len(request.output)] = torch.tensor(request.output)
    return out


__all__ = ["generate", "resolve_generation_config"]

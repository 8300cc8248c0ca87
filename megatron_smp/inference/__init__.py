"""Inference on the training model: a paged KV cache (`kv_cache`), sampling (`sampling`), the
continuous-batching engine (`engine`), Hugging Face style `generate` (`hf_generate`) and the
OpenAI-compatible server (`server`); `launcher` builds an engine from Megatron's flags.
Imports models, never training (but the launcher, which parses the flags with
`training.arguments`, the one place flags become configs)."""
from megatron_smp.inference.engine import InferenceEngine, Request
from megatron_smp.inference.sampling import SamplingParams

__all__ = ["InferenceEngine", "Request", "SamplingParams"]

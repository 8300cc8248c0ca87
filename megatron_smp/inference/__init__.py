"""Inference on the training model: a paged KV cache (`kv_cache`), sampling (`sampling`), the
continuous-batching engine (`engine`), Hugging Face style `generate` (`hf_generate`) and the
OpenAI-compatible server (`server`). Imports models, never training."""
from megatron_smp.inference.engine import InferenceEngine, Request
from megatron_smp.inference.sampling import SamplingParams

__all__ = ["InferenceEngine", "Request", "SamplingParams"]

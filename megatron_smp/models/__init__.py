"""Models built from the transformer blocks, and their Hugging Face adapters (`models.hf`)."""
from megatron_smp.models.gpt import GPTModel, gather_full_logits
from megatron_smp.models.llama import LlamaModel, llama_config, mistral_config

__all__ = ["GPTModel", "gather_full_logits", "LlamaModel", "llama_config", "mistral_config"]

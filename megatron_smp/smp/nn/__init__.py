"""torch.sagemaker.nn: attention modules (`attn`) and HF-specific ones (`huggingface`)."""
from megatron_smp.smp.nn import attn, huggingface  # noqa: E402,F401 (smp.nn.huggingface.gpt2...)

"""torch.sagemaker.nn: attention modules (`attn`) and HF-specific ones (`huggingface`)."""

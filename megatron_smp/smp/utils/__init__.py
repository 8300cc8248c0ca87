"""torch.sagemaker.utils."""

"""torch.sagemaker.distributed."""

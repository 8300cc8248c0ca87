"""torch.sagemaker.nn.huggingface (and SMP v1's smdistributed.modelparallel.torch.nn.huggingface):
one module per Hugging Face family."""

"""torch.sagemaker.distributed.checkpoint: `state_dict_saver` and `state_dict_loader`."""

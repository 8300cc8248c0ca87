"""Data pipeline: Megatron-LM indexed datasets, tokenizers, GPT datasets, blending, sampling.

Imports no model code. The heavy entry points are loaded lazily so that the preprocessing
tools can use `megatron_smp.data.indexed_dataset` and `.tokenizers` cheaply.
"""
from __future__ import annotations

_LAZY = {
    "build_tokenizer": "megatron_smp.data.tokenizers",
    "build_train_valid_test_datasets": "megatron_smp.data.dataset_builder",
    "build_pretraining_data_loader": "megatron_smp.data.samplers",
    "MegatronPretrainingSampler": "megatron_smp.data.samplers",
    "GPTDataset": "megatron_smp.data.gpt_dataset",
    "BlendedDataset": "megatron_smp.data.blended_dataset",
    "IndexedDataset": "megatron_smp.data.indexed_dataset",
    "IndexedDatasetBuilder": "megatron_smp.data.indexed_dataset",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'megatron_smp.data' has no attribute {name!r}")


__all__ = list(_LAZY)

"""DataConfig: datasets, their blend and split, and the tokenizer."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class DataConfig:
    data_path: list = field(default_factory=list)  # Megatron's "[weight] prefix ..." list
    split: str = "969,30,1"
    mock_data: bool = False
    tokenizer_type: str = "NullTokenizer"
    tokenizer_model: Optional[str] = None
    vocab_file: Optional[str] = None
    merge_file: Optional[str] = None
    vocab_size: Optional[int] = None
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False
    # Megatron's --fim-data and its flags: fill-in-the-middle samples (data/fim.py).
    fim_data: bool = False
    fim_rate: float = 0.5
    fim_spm_rate: float = 0.5
    fim_split_sample: Optional[str] = None
    fim_fragment_rate: Optional[float] = None
    fim_no_prefix: Optional[str] = None
    fim_prefix_token: str = "<fim_prefix>"
    fim_middle_token: str = "<fim_middle>"
    fim_suffix_token: str = "<fim_suffix>"
    fim_pad_token: str = "<fim_pad>"
    fim_eod_token: str = "<|endoftext|>"
    # Megatron's --sft: --data-path is conversations with a loss mask
    # (tools/preprocess_sft_data.py), packed several per sequence with a document mask.
    sft: bool = False
    num_workers: int = 0
    data_cache_path: Optional[str] = None
    # megatron-core's cache flags: every rank loads prepared caches at once (no rank-0 build,
    # no waiting), or maps each .npy at its dataset's first read; both need the caches built
    # (tools/prepare_cache.py) in --data-cache-path.
    dataloader_fast_cache_load: bool = False
    dataloader_defer_npy_index_mmap: bool = False
    # JSON {prefix: [sequence count, document count]}: .idx headers are not read
    # (tools/build_sequences_per_dataset.py writes it).
    per_dataset_sequences_path: Optional[str] = None
    # SentencePieceTokenizer: T5-style <extra_id_i> tokens appended to the vocabulary.
    vocab_extra_ids: int = 0
    # Separate datasets per split (Megatron's --train/valid/test-data-path), instead of
    # --data-path cut by --split.
    train_data_path: Optional[list] = None
    valid_data_path: Optional[list] = None
    test_data_path: Optional[list] = None
    # The same lists read from files, for blends too long for a command line: a text file
    # holding a --data-path list, a JSON file {"train": ..., "valid": ..., "test": ...}.
    data_args_path: Optional[str] = None
    per_split_data_args_path: Optional[str] = None
    # Blend components draw this fraction more samples than their share (megatron-core).
    mid_level_dataset_surplus: float = 0.005
    # False: read .bin slices with file reads instead of mmap (--no-mmap-bin-files).
    mmap_bin_files: bool = True
    # Megatron's --legacy-tokenizer: megatron/training's tokenizers (SentencePiece appends
    # its own <EOD>) instead of megatron-core's (SentencePiece's eod is the model's eos).
    legacy_tokenizer: bool = False
    # HuggingFaceTokenizer: keep the bos / template tokens tokenizer(text) adds (legacy's ids).
    tokenizer_hf_include_special_tokens: bool = False
    # TikTokenizer (--tokenizer-type TikTokenizer).
    tiktoken_pattern: Optional[str] = None
    tiktoken_num_special_tokens: int = 1000
    tokenizer_special_tokens: Optional[list] = None

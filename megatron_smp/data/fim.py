"""Fill-in-the-middle samples (Megatron-LM's GPTFIMDataset, --fim-data).

Each sample of `seq_length + 1` token ids is cut at its EOD tokens; each piece, with
probability --fim-rate, is turned back into text, split at two character positions drawn
uniformly into prefix / middle / suffix, re-tokenized and laid out as

    PSM: <fim_prefix> prefix <fim_suffix> suffix <fim_middle> middle
    SPM: <fim_prefix> <fim_suffix> suffix <fim_middle> prefix middle   (probability --fim-spm-rate)

then the pieces are joined again with their EODs and the sample cut or padded (--fim-pad-token)
back to its length. With --fim-split-sample TOKEN a piece holding that token is split at it
and (with probability --fim-rate) each fragment is transformed with probability
--fim-fragment-rate; --fim-no-prefix STRING leaves pieces whose text starts with it alone.
One numpy RandomState per dataset, seeded with --seed, draws as Megatron's does.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from megatron_smp.config import ConfigError


class FIMTransform:
    """`__call__(sample [n] int64) -> [n] int64`: one sample made fill-in-the-middle."""

    def __init__(self, tokenizer, data_config, seed: int) -> None:
        self.tokenizer = tokenizer
        self.rate = data_config.fim_rate
        self.spm_rate = data_config.fim_spm_rate
        self.fragment_rate = data_config.fim_fragment_rate
        self.no_prefix = data_config.fim_no_prefix
        self.rng = np.random.RandomState(seed=seed)
        tokens = (("prefix", data_config.fim_prefix_token),
                  ("middle", data_config.fim_middle_token),
                  ("suffix", data_config.fim_suffix_token),
                  ("pad", data_config.fim_pad_token), ("eod", data_config.fim_eod_token))
        ids = [token_id(tokenizer, token, f"--fim-{name}-token") for name, token in tokens]
        self.prefix_id, self.middle_id, self.suffix_id, self.pad_id, self.eod_id = ids
        self.split_id = (None if data_config.fim_split_sample is None else
                         token_id(tokenizer, data_config.fim_split_sample, "--fim-split-sample"))

    def __call__(self, sample: np.ndarray) -> np.ndarray:
        length = sample.shape[0]
        breaks = np.flatnonzero(sample == self.eod_id)
        if breaks.size:
            pieces, start = [], 0
            for loc in breaks:
                if loc - start > 0:  # only non-empty segments are permuted
                    pieces += [self._split_and_permute(sample[start:loc]), [self.eod_id]]
                start = loc + 1
            pieces.append(self._split_and_permute(sample[start:]))
            sample = np.concatenate(pieces)
        else:
            sample = self._split_and_permute(sample)
        if sample.shape[0] > length:
            sample = sample[:length]
        elif sample.shape[0] < length:
            sample = np.concatenate([sample, np.full(length - sample.shape[0], self.pad_id)])
        return np.asarray(sample, dtype=np.int64)

    def _split_and_permute(self, sequence: np.ndarray) -> np.ndarray:
        if self.split_id is None:
            return self._permute(sequence, self.rate)
        breaks = np.flatnonzero(sequence == self.split_id)
        if not breaks.size:
            return self._permute(sequence, self.rate)
        if not self.rng.binomial(1, self.rate):
            return sequence
        pieces, start = [], 0
        for loc in breaks:
            if loc - start > 0:
                pieces += [self._permute(sequence[start:loc], self.fragment_rate),
                           [self.split_id]]
            start = loc + 1
        pieces.append(self._permute(sequence[start:], self.fragment_rate))
        return np.concatenate(pieces)

    def _permute(self, sample: np.ndarray, rate: float) -> np.ndarray:
        if not self.rng.binomial(1, rate):
            return sample
        contents = self.tokenizer.detokenize(sample.tolist())
        if self.no_prefix is not None and contents.startswith(self.no_prefix):
            return sample
        low, high = sorted(self.rng.randint(low=0, high=len(contents) + 1, size=2))
        prefix, middle, suffix = (
            np.array(self.tokenizer.tokenize(text), dtype=np.int64)
            for text in (contents[:low], contents[low:high], contents[high:]))
        if self.rng.binomial(1, self.spm_rate):
            return np.concatenate([[self.prefix_id, self.suffix_id], suffix, [self.middle_id],
                                   prefix, middle])
        return np.concatenate([[self.prefix_id], prefix, [self.suffix_id], suffix,
                               [self.middle_id], middle])


def token_id(tokenizer, token: str, flag: str) -> int:
    """The id of the special `token` in the tokenizer's vocabulary; ConfigError without it."""
    lookup = getattr(tokenizer, "token_to_id", None)
    found: Optional[int] = lookup(token) if lookup is not None else None
    if found is None:
        raise ConfigError(f"{flag} {token!r} is not a token of the tokenizer "
                          f"({type(tokenizer).__name__}); --fim-data needs its FIM tokens in "
                          "the vocabulary (give the tokens it has with --fim-*-token)")
    return int(found)


__all__ = ["FIMTransform", "token_id"]

"""RoPE frequencies: the plain RoFormer table, linear scaling, Llama 3.x's frequency scaling
and YaRN.

A scaling is a small frozen value with two methods, so any attention that rotates channels
(the standard one, gpt-oss's, DeepSeek-V3's decoupled RoPE head) builds the same table:

    scaling = rope_scaling_of(config)   # None | Linear- | Llama3- | YarnRopeScaling
    inv_freq, attention_scaling = rope_frequencies(dim, base, scaling)
    # cos/sin = cos(pos * inv_freq) * attention_scaling, sin(...) * attention_scaling

`attention_scaling` multiplies cos and sin (so q.k by its square), as Hugging Face and
Megatron-LM's YarnRotaryEmbedding both apply YaRN's "mscale"; it is 1 for Llama 3.x.
Positions are whatever the caller passes: under context parallelism the global positions of a
rank's tokens (see GPTModel), so the table is the same at every layout.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple, Union

import torch


def _wavelength_factors(dim: int, base: float) -> torch.Tensor:
    """[dim / 2] fp32: base^(2i/dim), computed as Hugging Face does (integer exponents, then
    float) so the tables match it bit for bit."""
    return base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)


def default_inv_freq(dim: int, base: float) -> torch.Tensor:
    """[dim / 2] fp32: base^(-2i/dim), RoFormer's frequencies."""
    return 1.0 / _wavelength_factors(dim, base)


@dataclass(frozen=True)
class LinearRopeScaling:
    """Linear position interpolation (Megatron's --rotary-seq-len-interpolation-factor, HF
    rope_type "linear"): every frequency divided by `factor`, i.e. positions / factor."""

    factor: float

    def inv_freq(self, dim: int, base: float) -> torch.Tensor:
        return default_inv_freq(dim, base) / self.factor

    def attention_scaling(self) -> float:
        return 1.0


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1's scaling (Megatron's --use-rope-scaling, HF rope_type "llama3"): wavelengths
    longer than original_max_position_embeddings / low_freq_factor are divided by `factor`,
    shorter than .. / high_freq_factor kept, those between interpolated smoothly."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def inv_freq(self, dim: int, base: float) -> torch.Tensor:
        inv_freq = default_inv_freq(dim, base)
        context = self.original_max_position_embeddings
        low_freq_wavelen = context / self.low_freq_factor
        high_freq_wavelen = context / self.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / self.factor, inv_freq)
        smooth = ((context / wavelen - self.low_freq_factor)
                  / (self.high_freq_factor - self.low_freq_factor))
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(medium, smoothed, scaled)

    def attention_scaling(self) -> float:
        return 1.0


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(scale) + 1 (1 for scale <= 1)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class YarnRopeScaling:
    """YaRN (Peng et al.; Megatron's --position-embedding-type yarn, HF rope_type "yarn").

    Frequencies with fewer than `beta_slow` rotations over the original context are divided
    by `factor` (interpolated), those with more than `beta_fast` kept (extrapolated), a linear
    ramp between; `correction_range_round_to_int` rounds the ramp's ends outwards (HF's
    `truncate`). cos/sin are multiplied by mscale(factor, mscale) / mscale(factor,
    mscale_all_dim) (Megatron's concentration factor; with mscale_all_dim 0 it is the paper's
    0.1 ln(factor) + 1)."""

    factor: float
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    correction_range_round_to_int: bool = True

    def correction_range(self, dim: int, base: float) -> Tuple[float, float]:
        """The ramp's ends in frequency index (0 .. dim/2 - 1)."""
        def index_of(rotations: float) -> float:
            return (dim * math.log(self.original_max_position_embeddings
                                   / (rotations * 2 * math.pi))) / (2 * math.log(base))

        low, high = index_of(self.beta_fast), index_of(self.beta_slow)
        if self.correction_range_round_to_int:
            low, high = math.floor(low), math.ceil(high)
        return max(low, 0), min(high, dim - 1)

    def inv_freq(self, dim: int, base: float) -> torch.Tensor:
        factors = _wavelength_factors(dim, base)
        extrapolated, interpolated = 1.0 / factors, 1.0 / (self.factor * factors)
        low, high = self.correction_range(dim, base)
        if low == high:
            high += 0.001  # a ramp of zero width
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        keep = 1.0 - ramp  # 1: extrapolate (high frequencies), 0: interpolate
        return interpolated * (1 - keep) + extrapolated * keep

    def attention_scaling(self) -> float:
        return float(yarn_get_mscale(self.factor, self.mscale)
                     / yarn_get_mscale(self.factor, self.mscale_all_dim))


RopeScaling = Union[LinearRopeScaling, Llama3RopeScaling, YarnRopeScaling]


def rope_scaling_of(config) -> Optional[RopeScaling]:
    """The scaling a TransformerConfig asks for: YaRN for --position-embedding-type yarn,
    Llama 3.x's for --use-rope-scaling, linear for --rotary-seq-len-interpolation-factor,
    else None (plain RoPE)."""
    if config.rotary_type() == "yarn":
        return YarnRopeScaling(
            factor=config.yarn_rotary_scaling_factor,
            original_max_position_embeddings=config.yarn_original_max_position_embeddings,
            beta_fast=config.yarn_beta_fast,
            beta_slow=config.yarn_beta_slow,
            mscale=config.yarn_mscale,
            mscale_all_dim=config.yarn_mscale_all_dim,
            correction_range_round_to_int=config.yarn_correction_range_round_to_int,
        )
    if config.use_rope_scaling:
        return Llama3RopeScaling(
            factor=config.rope_scaling_factor,
            low_freq_factor=config.rope_scaling_low_freq_factor,
            high_freq_factor=config.rope_scaling_high_freq_factor,
            original_max_position_embeddings=config.rope_scaling_original_max_position_embeddings,
        )
    if config.rotary_seq_len_interpolation_factor is not None:
        return LinearRopeScaling(factor=config.rotary_seq_len_interpolation_factor)
    return None


def rope_frequencies(dim: int, base: float,
                     scaling: Optional[RopeScaling] = None) -> Tuple[torch.Tensor, float]:
    """(inv_freq [dim / 2] fp32, attention_scaling) of a rotary dim `dim`."""
    if scaling is None:
        return default_inv_freq(dim, base), 1.0
    return scaling.inv_freq(dim, base), scaling.attention_scaling()


__all__ = [
    "LinearRopeScaling",
    "Llama3RopeScaling",
    "YarnRopeScaling",
    "RopeScaling",
    "default_inv_freq",
    "yarn_get_mscale",
    "rope_scaling_of",
    "rope_frequencies",
]

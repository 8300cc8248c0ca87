"""MXFP4 expert weights of the published gpt-oss checkpoints (OCP microscaling, FP4 E2M1).

A checkpoint with `quantization_config.quant_method == "mxfp4"` stores each expert projection
`P` of shape [E, in, out] as two tensors instead of `P`:

    P_blocks  uint8 [E, out, in / 32, 16]   two 4-bit codes per byte, low nibble first
    P_scales  uint8 [E, out, in / 32]       one power-of-two exponent per 32 values, bias 127

Code c is the E2M1 value FP4_VALUES[c] (bit 3 the sign); value = FP4_VALUES[c] * 2^(s - 127).
`dequantize_mxfp4` reads them into an ordinary [E, in, out] tensor (bf16 by default, exact:
an FP4 value times a power of two is representable); `quantize_mxfp4` writes that form (round
to the nearest code, the block exponent chosen so the block's largest magnitude fits in 6).
"""
from __future__ import annotations

from typing import Dict, Mapping, Tuple

import torch

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32  # values per scale
_BIAS = 127
BLOCKS_SUFFIX, SCALES_SUFFIX = "_blocks", "_scales"


def is_mxfp4(hf_config) -> bool:
    """Whether an HF config (object or dict) says its experts are stored in MXFP4."""
    quantization = (hf_config.get("quantization_config") if isinstance(hf_config, dict)
                    else getattr(hf_config, "quantization_config", None))
    if quantization is None:
        return False
    method = (quantization.get("quant_method") if isinstance(quantization, dict)
              else getattr(quantization, "quant_method", None))
    return str(getattr(method, "value", method)) == "mxfp4"


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor,
                     dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """blocks uint8 [E, out, G, 16] + scales uint8 [E, out, G] -> [E, G * 32, out] `dtype`.
    One expert at a time, so the int64 codes never exist for the whole tensor."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} / "
                         f"{scales.dtype}")
    if tuple(blocks.shape[:-1]) != tuple(scales.shape) or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not fit scales "
                         f"{tuple(scales.shape)} (blocks [..., G, 16], scales [..., G])")
    table = torch.tensor(FP4_VALUES, dtype=torch.float32)
    experts = []
    for expert_blocks, expert_scales in zip(blocks, scales):  # [out, G, 16], [out, G]
        codes = torch.stack([expert_blocks & 0x0F, expert_blocks >> 4], dim=-1).long()
        values = table[codes.flatten(-2)]  # [out, G, 32]
        exponent = expert_scales.to(torch.int32) - _BIAS
        values = torch.ldexp(values, exponent[..., None].float())
        experts.append(values.flatten(-2).t().to(dtype))  # [G * 32, out]
    return torch.stack(experts)


def quantize_mxfp4(weight: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """[E, in, out] -> (blocks uint8 [E, out, in / 32, 16], scales uint8 [E, out, in / 32]),
    the inverse of `dequantize_mxfp4` up to FP4 rounding."""
    experts, inputs, outputs = weight.shape
    if inputs % BLOCK:
        raise ValueError(f"MXFP4 needs the input dim ({inputs}) to be a multiple of {BLOCK}")
    rows = weight.float().transpose(1, 2).reshape(experts, outputs, inputs // BLOCK, BLOCK)
    largest = rows.abs().amax(dim=-1)
    # 2^e with largest / 2^e <= 6 (the largest FP4 magnitude); empty blocks take 2^0.
    exponent = torch.where(largest > 0, torch.ceil(torch.log2(largest / 6.0)),
                           torch.zeros_like(largest)).clamp(-_BIAS, _BIAS)
    scaled = rows / torch.exp2(exponent)[..., None]
    magnitudes = torch.tensor(FP4_VALUES[:8])
    nearest = (scaled.abs()[..., None] - magnitudes).abs().argmin(dim=-1)
    codes = (nearest + 8 * (scaled < 0).long()).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exponent.to(torch.int32) + _BIAS).to(torch.uint8)


def dequantize_state_dict(state_dict: Mapping[str, torch.Tensor],
                          dtype: torch.dtype = torch.bfloat16) -> Dict[str, torch.Tensor]:
    """Every `P_blocks` / `P_scales` pair replaced by the dequantized `P` [E, in, out];
    other tensors kept. A lone half of a pair is an error naming it."""
    out: Dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        paired_scales = (name.endswith(SCALES_SUFFIX)
                         and name[: -len(SCALES_SUFFIX)] + BLOCKS_SUFFIX in state_dict)
        if paired_scales:
            continue
        if not name.endswith(BLOCKS_SUFFIX):
            out[name] = tensor
            continue
        base = name[: -len(BLOCKS_SUFFIX)]
        if base + SCALES_SUFFIX not in state_dict:
            raise ValueError(f"MXFP4 tensor {name} has no {base + SCALES_SUFFIX}")
        out[base] = dequantize_mxfp4(tensor, state_dict[base + SCALES_SUFFIX], dtype)
    return out


__all__ = ["FP4_VALUES", "is_mxfp4", "dequantize_mxfp4", "quantize_mxfp4",
           "dequantize_state_dict"]

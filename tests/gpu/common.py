"""Device parametrisation for the GPU tests: every body runs on the CPU (so CI exercises it)
and again on CUDA, marked `gpu` (select with `pytest -m gpu`) and skipped without a device."""
import pytest
import torch

CUDA_PARAM = pytest.param(
    "cuda",
    marks=(pytest.mark.gpu,
           pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")),
)
DEVICES = ["cpu", CUDA_PARAM]

# bf16 keeps 8 significant bits: one rounding is a relative error of at most 2^-8.
BF16_EPS = 2.0 ** -8

"""The Python side's constants of the op contract, in one place: the causal codes the ops take (the
C++ CausalKind, csrc/attention_params.h), the dtypes and their accumulation, and the scale range.
Plain torch only, so the reference, the API, the autograd functions and the fake kernels can all
import it before (or without) the compiled ops."""
from __future__ import annotations

import torch

# attention(causal=...) names -> the ops' integer code (CausalKind), and back.
CAUSAL_CODES = {None: 0, "top_left": 1, "bottom_right": 2}
CAUSAL_NAMES = {code: name for name, code in CAUSAL_CODES.items()}

# The dtypes every kernel takes; fp32/fp16/bf16 accumulate (and return lse) in float32.
FLOAT_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
LOG2E = 1.4426950408889634


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """The accumulation dtype of `dtype` inputs, which is also the dtype of the lse."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def scale_overflows(scale: float, dtype: torch.dtype) -> bool:
    """Whether scale·log2(e), which the kernels hold in the accumulation dtype, is beyond its range
    (the C++ binding's check, the same arithmetic)."""
    return abs(scale) * LOG2E > torch.finfo(lse_dtype(dtype)).max


def max_scale(dtype: torch.dtype) -> float:
    return torch.finfo(lse_dtype(dtype)).max / LOG2E

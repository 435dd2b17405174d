"""attention_ext: fused scaled dot-product attention for PyTorch.

    import attention_ext
    out = attention_ext.scaled_dot_product_attention(q, k, v, is_causal=True)   # drop-in
    out, lse = attention_ext.attention(q, k, v, causal="bottom_right", return_lse=True)
    w = attention_ext.attention_weights(q, k)
    out = attention_ext.flash_attn_func(q, k, v, causal=True)   # FlashAttention 2's API, (B, S, H, D)
    out = attention_ext.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k)   # packed sequences
    out = attention_ext.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=n)   # decode

The same fused kernels serve float64/float32/float16/bfloat16 on CPU (and CUDA where built),
forward and backward, so gradcheck exercises the fast code itself.
"""
from __future__ import annotations

import torch

from . import _ops  # noqa: F401  (loads the compiled ops, registers fake kernels)
from . import function  # noqa: F401  (registers autograd on the ops)
from ._build import load_extension
from .api import (
    attention,
    attention_weights,
    draw_rng_state,
    dropout_mask,
    scaled_dot_product_attention,
)
from ._version import __version__
from .flash import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)
from .kv_cache import flash_attn_with_kvcache
from .varlen import varlen_attention
from .reference import attention_reference

__all__ = [
    "scaled_dot_product_attention",
    "attention",
    "attention_weights",
    "dropout_mask",
    "draw_rng_state",
    "attention_reference",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
    "varlen_attention",
    "build_info",
    "cpu_variant",
    "set_cpu_variant",
]


def build_info() -> dict:
    """How this build was made and what it runs: torch version built against and running,
    compiler, OpenMP, CPU kernel variants (compiled, supported, active, and the active one's
    vector width in bytes, cpu_vector_bytes), CUDA and its archs."""
    info = {}
    for line in torch.ops.attention_ext.build_info().strip().splitlines():
        key, _, value = line.partition("=")
        info[key] = value
    info["torch_version_running"] = torch.__version__
    info["version"] = __version__
    info["loaded_from"] = load_extension()
    info["threads"] = torch.get_num_threads()
    return info


def cpu_variant() -> str:
    """The CPU kernel variant in use: 'amx', 'avx512bf16', 'avx512', 'avx2' or 'generic'."""
    return torch.ops.attention_ext.cpu_variant()


def set_cpu_variant(name: str) -> str:
    """Selects the CPU kernel variant ('auto' = the preferred one this CPU supports, as
    build_info()['cpu_variant_auto'] names it). The environment
    variable ATTENTION_EXT_CPU_ISA sets the initial choice. Returns the active name."""
    return torch.ops.attention_ext.set_cpu_variant(name)

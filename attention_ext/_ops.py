"""Loads the compiled ops and registers their fake (meta) kernels so torch.compile and
torch.export can trace them without running them."""
from __future__ import annotations

import torch

from ._build import load_extension
from ._constants import CAUSAL_CODES, FLOAT_DTYPES, lse_dtype, scale_overflows

load_extension()

ops = torch.ops.attention_ext


def _batch_shape(*tensors):
    return torch.broadcast_shapes(*(t.shape[:-2] for t in tensors))


def _check(cond, message):
    # torch._check: a RuntimeError like the C++ TORCH_CHECK, and with symbolic shapes a runtime
    # assertion instead of a guard.
    torch._check(cond, lambda: "attention_ext: " + message)


def _check_fake_inputs(query, key, value, attn_mask, scale, causal, dropout_p, rng_state):
    """The checks of the C++ check_attention_inputs, for the fake kernels: a call traced (or run
    on meta tensors) must be refused exactly when the real kernels would refuse it."""
    named = [(query, "query"), (key, "key")] + ([(value, "value")] if value is not None else [])
    for t, name in named:
        _check(t.dtype in FLOAT_DTYPES,
               f"{name} must be a floating tensor (float64, float32, float16 or bfloat16), got {t.dtype}")
        _check(t.dim() >= 2, f"{name} must have at least 2 dims (..., length, head_dim), got shape {tuple(t.shape)}")
    _check(all(t.dtype == query.dtype for t, _ in named),
           "query, key and value must have the same dtype, got " + ", ".join(f"{n} {t.dtype}" for t, n in named))
    _check(all(t.device == query.device for t, _ in named),
           "query, key and value must be on the same device, got " + ", ".join(f"{n} {t.device}" for t, n in named))
    _check(query.shape[-1] == key.shape[-1], f"query and key must have the same head dim (last dim), got query "
           f"{tuple(query.shape)} and key {tuple(key.shape)}")
    if value is not None:
        _check(key.shape[-2] == value.shape[-2], f"key and value must have the same length (dim -2), got key "
               f"{tuple(key.shape)} and value {tuple(value.shape)}")
    _check(not scale_overflows(scale, query.dtype),
           f"scale {scale} is not finite in the accumulation of {query.dtype} inputs")
    _check(causal in CAUSAL_CODES.values(), f"causal must be 0 (none), 1 (top-left) or 2 (bottom-right), got {causal}")
    _check(0.0 <= dropout_p < 1.0, f"dropout_p must be in [0, 1), got {dropout_p}")
    if dropout_p > 0.0:
        _check(rng_state is not None, "dropout_p > 0 needs an rng_state tensor")
        _check(rng_state.dtype == torch.int64 and rng_state.numel() == 2,
               f"rng_state must be an int64 tensor of 2 elements (seed, offset), got {rng_state.dtype} of shape "
               f"{tuple(rng_state.shape)}")
        _check(rng_state.device == query.device, f"rng_state must be on {query.device}, got {rng_state.device}")
    if attn_mask is not None:
        _check(attn_mask.device == query.device, f"attn_mask must be on {query.device}, got {attn_mask.device}")
        _check(attn_mask.dtype == torch.bool or attn_mask.dtype == query.dtype,
               f"attn_mask must be bool or have the query's dtype ({query.dtype}), got {attn_mask.dtype}")


@torch.library.register_fake("attention_ext::attention_fwd")
def _attention_fwd_fake(query, key, value, attn_mask, scale, causal, dropout_p, rng_state):
    _check_fake_inputs(query, key, value, attn_mask, scale, causal, dropout_p, rng_state)
    batch = _batch_shape(query, key, value)
    n, dv = query.shape[-2], value.shape[-1]
    out = query.new_empty((*batch, n, dv))
    lse = query.new_empty((*batch, n), dtype=lse_dtype(query.dtype))
    return out, lse


@torch.library.register_fake("attention_ext::attention_bwd")
def _attention_bwd_fake(grad_out, grad_lse, query, key, value, attn_mask, out, lse, scale, causal,
                        dropout_p, rng_state, mask_requires_grad):
    _check_fake_inputs(query, key, value, attn_mask, scale, causal, dropout_p, rng_state)
    for t, name in ((grad_out, "grad_out"), (out, "out"), (lse, "lse")):
        _check(t.device == query.device, f"{name} must be on {query.device}, got {t.device}")
    grad_mask = torch.empty_like(attn_mask, memory_format=torch.contiguous_format) if mask_requires_grad \
        else query.new_empty((0,))
    return (
        torch.empty_like(query, memory_format=torch.contiguous_format),
        torch.empty_like(key, memory_format=torch.contiguous_format),
        torch.empty_like(value, memory_format=torch.contiguous_format),
        grad_mask,
    )


@torch.library.register_fake("attention_ext::attention_probs")
def _attention_probs_fake(query, key, attn_mask, scale, causal):
    _check_fake_inputs(query, key, None, attn_mask, scale, causal, 0.0, None)
    batch = _batch_shape(query, key)
    return query.new_empty((*batch, query.shape[-2], key.shape[-2]))


@torch.library.register_fake("attention_ext::dropout_keep_mask")
def _dropout_keep_mask_fake(rng_state, batch_shape, n, m, dropout_p):
    _check(rng_state.dtype == torch.int64 and rng_state.numel() == 2,
           f"rng_state must be an int64 tensor of 2 elements (seed, offset), got {rng_state.dtype} of shape "
           f"{tuple(rng_state.shape)}")
    _check(0.0 <= dropout_p < 1.0, f"dropout_p must be in [0, 1), got {dropout_p}")
    return rng_state.new_empty((*batch_shape, n, m), dtype=torch.bool)

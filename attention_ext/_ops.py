"""Loads the compiled ops and registers their fake (meta) kernels so torch.compile and
torch.export can trace them without running them. The fake kernels check the arguments by the
rules in _arguments.py, the ones the compiled kernels check."""
from __future__ import annotations

import torch

from ._build import load_extension
from . import _arguments
from ._constants import lse_dtype

_LOADED_FROM = load_extension()

ops = torch.ops.attention_ext

def below_autograd():
    """Inside a Function's forward (and a backward that keeps no graph) the op's own autograd
    kernel (torch.library.register_autograd, Python) has nothing to record: calling the op below
    the autograd keys skips it, tens of microseconds on a small call."""
    return torch._C._AutoDispatchBelowADInplaceOrView()


# The prebuilt extension's direct entries to attention_fwd / attention_bwd and to a decode step's
# attention_kvcache_fwd / attention_kvcache_append / attention_rotary (csrc/module.cpp): the same
# op through the dispatcher without torch.ops' per-argument conversion (~3 µs a call). A JIT build
# has none; an entry answers None where the call must go through torch.ops.
_DIRECT_ENTRIES = {}
# The prebuilt extension's whole decode step for flash_attn_with_kvcache's eager CPU calls
# (csrc/kv_cache_step.h): its result, or None where the Python path must run; None in a JIT build.
KVCACHE_STEP = None
# The prebuilt extension's checks and call for the common attention call (csrc/module.cpp,
# lean_attention; api._lean_forward), or None in a JIT build.
LEAN_ATTENTION = None
if _LOADED_FROM.startswith("prebuilt:"):
    from . import _C as _compiled
    if hasattr(_compiled, "fwd_below_autograd"):
        _DIRECT_ENTRIES = {ops.attention_fwd: _compiled.fwd_below_autograd,
                           ops.attention_bwd: _compiled.bwd_below_autograd}
    if hasattr(_compiled, "kvcache_fwd_below_autograd"):
        _DIRECT_ENTRIES.update({ops.attention_kvcache_fwd: _compiled.kvcache_fwd_below_autograd,
                                ops.attention_kvcache_append: _compiled.kvcache_append_below_autograd,
                                ops.attention_rotary: _compiled.rotary_below_autograd})
    KVCACHE_STEP = getattr(_compiled, "kvcache_step", None)
    LEAN_ATTENTION = getattr(_compiled, "lean_attention", None)


def call_below_autograd(op, *args):
    """op(*args) below the autograd keys (where autograd has nothing to record), through the op's
    direct entry when the build has one."""
    entry = _DIRECT_ENTRIES.get(op)
    if entry is not None and not torch.compiler.is_compiling():
        result = entry(*args)
        if result is not None:
            return result
    with below_autograd():
        return op(*args)


def _batch_shape(*tensors):
    return torch.broadcast_shapes(*(t.shape[:-2] for t in tensors))


def _check_fake_inputs(query, key, value, attn_mask, scale, causal, window_left, window_right, softcap, alibi_slopes,
                       sinks, dropout_p, rng_state):
    _arguments.op_rules(_arguments.check_traced, query, key, value, attn_mask, scale, causal, window_left,
                        window_right, softcap, alibi_slopes, sinks, dropout_p, rng_state)
    _arguments.op_batch_rules(_arguments.check_traced, query, key, value, attn_mask)


@torch.library.register_fake("attention_ext::attention_fwd")
def _attention_fwd_fake(query, key, value, attn_mask, scale, causal, window_left, window_right, softcap, alibi_slopes,
                        sinks, dropout_p, rng_state):
    _check_fake_inputs(query, key, value, attn_mask, scale, causal, window_left, window_right, softcap, alibi_slopes,
                       sinks, dropout_p, rng_state)
    batch = _batch_shape(query, key, value)
    n, dv = query.shape[-2], value.shape[-1]
    out_shape = (*batch, n, dv)
    order = out_dim_order(query, len(out_shape))
    out = query.new_empty([out_shape[i] for i in order]).permute(sorted(range(len(order)), key=order.__getitem__))
    lse = query.new_empty((*batch, n), dtype=lse_dtype(query.dtype))
    return out, lse


def out_dim_order(query, out_dims):
    """The order in memory, outermost first, of attention_fwd's out dims (batch..., n, d_v): the
    dims the query has (size > 1, stride not 0) in the query's order, read from its strides,
    largest first (ties kept in order); the dims it broadcasts where they are; d_v innermost. (The
    kernels' side, csrc/op_arguments.h, states the same rule and why.)"""
    missing = out_dims - query.dim()
    slots = [i for i in range(missing, out_dims - 1)
             if query.shape[i - missing] != 1 and query.stride(i - missing) != 0]
    order = list(range(out_dims))
    for slot, dim in zip(slots, sorted(slots, key=lambda i: query.stride(i - missing), reverse=True)):
        order[slot] = dim
    return order


@torch.library.register_fake("attention_ext::attention_bwd")
def _attention_bwd_fake(grad_out, grad_lse, query, key, value, attn_mask, out, lse, scale, causal, window_left,
                        window_right, softcap, alibi_slopes, sinks, dropout_p, rng_state, mask_requires_grad,
                        merged_lse=False):
    _check_fake_inputs(query, key, value, attn_mask, scale, causal, window_left, window_right, softcap, alibi_slopes,
                       sinks, dropout_p, rng_state)
    batch = _batch_shape(query, key, value)
    n, dv = query.shape[-2], value.shape[-1]
    lse_type = lse_dtype(query.dtype)
    # The forward's outputs and their gradients, as attention_fwd returns them (the op's shape,
    # dtype and device rules, csrc/op_arguments.cpp).
    # (grad_lse: any float dtype, converted to the lse's)
    for t, name, shape, dtype in ((grad_out, "grad_out", (*batch, n, dv), query.dtype),
                                  (grad_lse, "grad_lse", (*batch, n), None), (out, "out", (*batch, n, dv), query.dtype),
                                  (lse, "lse", (*batch, n), lse_type)):
        if t is not None:
            _arguments.device_rule(_arguments.check_traced, t, name, query.device)
            _arguments.check_traced(dtype is None or t.dtype == dtype, TypeError,
                                    lambda t=t, name=name, dtype=dtype: f"{name} must be {dtype}, got {t.dtype}")
            _arguments.check_traced(tuple(t.shape) == tuple(shape), ValueError,
                                    lambda t=t, name=name, shape=shape: f"{name} must have shape {tuple(shape)}, got "
                                    f"{tuple(t.shape)}")
    _arguments.check_traced(grad_lse is None or grad_lse.is_floating_point(), TypeError,
                            lambda: f"grad_lse must be a floating tensor, got {grad_lse.dtype}")
    _arguments.check_traced(not mask_requires_grad or (attn_mask is not None and attn_mask.is_floating_point()),
                            ValueError, lambda: "a mask gradient needs a floating attn_mask")
    grad_mask = torch.empty_like(attn_mask, memory_format=torch.contiguous_format) if mask_requires_grad \
        else query.new_empty((0,))
    # Each gradient in its input's layout (empty_like's rule, as the kernels' side allocates them).
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value), grad_mask


@torch.library.register_fake("attention_ext::attention_probs")
def _attention_probs_fake(query, key, attn_mask, scale, causal, window_left, window_right, softcap, alibi_slopes,
                          sinks):
    _check_fake_inputs(query, key, None, attn_mask, scale, causal, window_left, window_right, softcap, alibi_slopes,
                       sinks, 0.0, None)
    batch = _batch_shape(query, key)
    return query.new_empty((*batch, query.shape[-2], key.shape[-2]))


@torch.library.register_fake("attention_ext::dropout_keep_mask")
def _dropout_keep_mask_fake(rng_state, batch_shape, n, m, dropout_p):
    _arguments.rng_state_rules(_arguments.check_traced, rng_state, rng_state.device)
    _arguments.dropout_rules(_arguments.check_traced, dropout_p)
    _arguments.check_traced(n >= 0 and m >= 0 and all(s >= 0 for s in batch_shape), ValueError,
                            lambda: f"batch_shape's sizes, n and m must be >= 0, got {list(batch_shape)}, {n} and {m}")
    return rng_state.new_empty((*batch_shape, n, m), dtype=torch.bool)

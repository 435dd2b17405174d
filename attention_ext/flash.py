"""FlashAttention 2's Python API on the fused kernels: code written for `flash_attn` runs here
unchanged, on CPU and CUDA, in float64/float32/float16/bfloat16, with gradients.

Same names, argument names, defaults, layouts and semantics as flash_attn.flash_attn_interface:
q (batch, seqlen_q, heads, head_dim), k and v (batch, seqlen_k, kv_heads, head_dim) with heads a
multiple of kv_heads (MQA/GQA, no copy of K/V); `causal` aligns query i with key i + seqlen_k −
seqlen_q (bottom-right, as FlashAttention 2.1 and later); softmax_lse is (batch, heads, seqlen_q),
float32 (float64 for float64 inputs); a query row that sees no key gives output 0 and lse −inf.

What differs, on purpose:
  * any head dim and any dtype of the four, on the CPU too; results are deterministic whatever
    `deterministic` says (it is accepted for compatibility);
  * with return_attn_probs=True the third result is the exact attention probabilities
    (batch, heads, seqlen_q, seqlen_k) (FlashAttention returns a debugging tensor there);
  * dropout draws from torch's generator for the device with this package's counter-based
    RNG, so the dropped entries differ from FlashAttention's (attention_ext.dropout_mask
    reproduces them); dropout_p = 1 drops every weight (zeros, as torch), where FlashAttention
    refuses it;
  * a query row that sees no key (causal with seqlen_q > seqlen_k, a window that excludes every
    key) has softmax_lse = -inf, log(0) (FlashAttention 2's unsplit kernels write +inf there);
    its output is 0 in both.
  * with alibi_slopes, softmax_lse is that of the bias stated below, -slope·|i + seqlen_k -
    seqlen_q - j|, with causal=True too. FlashAttention's causal kernels (without a window) add
    +slope·j instead, which differs from it by the same slope·(i + seqlen_k - seqlen_q) across a
    row: the same output and probabilities, but an lse larger by that amount.

window_size=(left, right) is FlashAttention's sliding window, bottom-right aligned: key j is
visible to query i iff i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right (-1:
unbounded; as in FlashAttention's C++, any negative side, and a side at least seqlen_k long —
max_seqlen_k for varlen — is unbounded too); causal=True sets right to 0. The kernels skip the key
tiles outside the window.

softcap > 0 caps the scaled scores at softcap·tanh(t / softcap) (Gemma 2; 0 or less: none, as in
FlashAttention's kernels) and alibi_slopes
(float32, (heads,) or (batch, heads)) adds -slope·|i + seqlen_k - seqlen_q - j|, both fused in every
kernel; unlike FlashAttention, dropout with softcap is allowed.

flash_attn_varlen_func (and its kvpacked / qkvpacked forms) takes packed sequences: q (total_q,
heads, head_dim), k and v (total_k, kv_heads, head_dim), int32 cu_seqlens_q / cu_seqlens_k
(batch + 1,) from 0; sequence b is rows cu[b]:cu[b + 1] and sees only itself, causal and window
aligned bottom-right per sequence; softmax_lse is (heads, total_q). The kernels do no work on
padding (attention_ext.varlen). With return_attn_probs=True the third result is the exact
probabilities zero-padded to (batch, heads, max_seqlen_q, max_seqlen_k).

flash_attn_with_kvcache (attention_ext.kv_cache) is inference against a key/value cache, contiguous
or paged, with in-place append and rotary embeddings. It differs on purpose in one more way: inputs
that require grad (with grad mode on) are refused, where FlashAttention returns an output with no
gradient.

Not supported yet (a clear NotImplementedError, never a silent fallback): a paged key/value cache
through flash_attn_varlen_func's block_table (flash_attn_with_kvcache takes one).
"""
from __future__ import annotations

import numbers

import torch

from ._arguments import enforce, flag, head_groups_rule, shape_is_one_of
from .api import attention, attention_weights
from .kv_cache import flash_attn_with_kvcache
from .varlen import varlen_attention

__all__ = ["flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func",
           "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache"]


def _check_layout(q, k, v):
    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"attention_ext.flash: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"attention_ext.flash: {name} must be (batch, seqlen, heads, head_dim), got shape "
                             f"{tuple(t.shape)}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"attention_ext.flash: k and v must have the same (batch, seqlen_k, kv_heads), got k "
                         f"{tuple(k.shape)} and v {tuple(v.shape)}")
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"attention_ext.flash: q and k must have the same batch size, got q {tuple(q.shape)} and "
                         f"k {tuple(k.shape)}")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"attention_ext.flash: q and k must have the same head_dim, got q {tuple(q.shape)} and "
                         f"k {tuple(k.shape)}")
    head_groups_rule(enforce, q.shape[2], k.shape[2])


def _band_from(causal, window_size, prefix="attention_ext.flash: "):
    """FlashAttention's causal / window_size pair as this package's (causal kind, window):
    causal=True is bottom-right causal (window (-1, 0)); a negative side is unbounded, -1 (its
    documented value; its C++ takes any negative so). (prefix: the calling function's name, for its
    errors.)"""
    if type(causal) is bool and type(window_size) is tuple and len(window_size) == 2 and \
            type(window_size[0]) is int and type(window_size[1]) is int and min(window_size) >= -1:
        return ("bottom_right" if causal else None), window_size  # (the common case, without the checks below)
    causal = flag(causal, "causal", prefix, integers=True)
    try:
        left, right = window_size
    except (TypeError, ValueError):
        left = right = None
    if isinstance(window_size, (str, bytes, torch.Tensor)) or \
            any(isinstance(w, bool) or not isinstance(w, numbers.Integral) for w in (left, right)):
        raise TypeError(f"{prefix}window_size must be a pair of ints (left, right), got {window_size!r}")
    left, right = int(left), int(right)
    return ("bottom_right" if causal else None), (max(left, -1), max(right, -1))


def _window_within(window, seqlen_k):
    """FlashAttention's rule (its C++ entry points, and flash_attn_with_kvcache here): a window side
    at least seqlen_k long (max_seqlen_k for varlen) bounds nothing, -1. (Only the right side can
    matter, and only with seqlen_q > seqlen_k: the first rows, which the literal bound
    i + seqlen_k - seqlen_q + right cuts short, see every key.)"""
    if isinstance(seqlen_k, bool) or not isinstance(seqlen_k, (numbers.Integral, torch.SymInt)):
        return window  # (varlen_attention reports a bad max_seqlen_k)
    if not isinstance(seqlen_k, torch.SymInt):
        seqlen_k = int(seqlen_k)  # (numpy integers too)
    left, right = window
    return (-1 if left >= seqlen_k else left), (-1 if right >= seqlen_k else right)


def _check_softcap(softcap, prefix="attention_ext.flash: "):
    """FlashAttention's softcap: a float, <= 0 for none (its kernels cap only where softcap > 0)."""
    if not isinstance(softcap, numbers.Real) or isinstance(softcap, bool):
        raise TypeError(f"{prefix}softcap must be a float, got {type(softcap).__name__}")
    softcap = float(softcap)
    return 0.0 if softcap <= 0.0 else softcap  # (NaN stays, for the rules to refuse)


def _check_alibi(alibi_slopes, batch, heads, prefix="attention_ext.flash: "):
    """FlashAttention's alibi_slopes: float32 (heads,) or (batch, heads), one slope per query head.
    (prefix: the calling function's name, for its errors.)"""
    if alibi_slopes is None:
        return
    if not isinstance(alibi_slopes, torch.Tensor) or alibi_slopes.dtype != torch.float32 \
            or not shape_is_one_of(alibi_slopes.shape, (heads,), (batch, heads)):
        got = f"{alibi_slopes.dtype} of shape {tuple(alibi_slopes.shape)}" if isinstance(alibi_slopes, torch.Tensor) \
            else type(alibi_slopes).__name__
        raise TypeError(f"{prefix}alibi_slopes must be float32 of shape ({heads},) or ({batch}, {heads}) (one slope "
                        f"per query head), got {got}")


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """FlashAttention 2's flash_attn_func (see the module docstring). Returns out
    (batch, seqlen_q, heads, head_dim_v), or with return_attn_probs=True (out, softmax_lse,
    probabilities)."""
    _check_layout(q, k, v)
    _check_alibi(alibi_slopes, q.shape[0], q.shape[2])
    causal_kind, window = _band_from(causal, window_size)
    window = _window_within(window, k.shape[1])
    softcap = _check_softcap(softcap)
    deterministic = flag(deterministic, "deterministic", "attention_ext.flash: ", integers=True)
    return_attn_probs = flag(return_attn_probs, "return_attn_probs", "attention_ext.flash: ", integers=True)
    gqa = q.shape[2] != k.shape[2]
    # (batch, seqlen, heads, dim) -> (batch, heads, seqlen, dim): views; the kernels take strides.
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    modifiers = dict(causal=causal_kind, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                     scale=softmax_scale, enable_gqa=gqa)
    out, lse = attention(qh, kh, vh, dropout_p=dropout_p, return_lse=True, **modifiers)
    # (batch, seqlen_q, heads, head_dim_v) contiguous, as FlashAttention allocates it: model code
    # views it as (batch, seqlen_q, heads·head_dim_v). Free: out follows qh's layout, rows outside
    # heads (csrc/op_arguments.h); a copy only where q's own layout was otherwise.
    out = out.transpose(1, 2).contiguous()
    if not return_attn_probs:
        return out
    probs = attention_weights(qh, kh, **modifiers)
    return out, lse, probs


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash_attn_func with k and v packed: kv (batch, seqlen_k, 2, kv_heads, head_dim)."""
    if not isinstance(kv, torch.Tensor) or kv.dim() != 5 or kv.shape[2] != 2:
        raise ValueError("attention_ext.flash: kv must be a (batch, seqlen_k, 2, kv_heads, head_dim) tensor, got "
                         + (f"shape {tuple(kv.shape)}" if isinstance(kv, torch.Tensor) else type(kv).__name__))
    return flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                              alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash_attn_func with q, k and v packed: qkv (batch, seqlen, 3, heads, head_dim)."""
    if not isinstance(qkv, torch.Tensor) or qkv.dim() != 5 or qkv.shape[2] != 3:
        raise ValueError("attention_ext.flash: qkv must be a (batch, seqlen, 3, heads, head_dim) tensor, got "
                         + (f"shape {tuple(qkv.shape)}" if isinstance(qkv, torch.Tensor) else type(qkv).__name__))
    return flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale, causal, window_size,
                           softcap, alibi_slopes, deterministic, return_attn_probs)


def _padded_probabilities(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **modifiers):
    """The exact probabilities of each packed sequence, zero-padded to (batch, heads, max_seqlen_q,
    max_seqlen_k): a debugging output, one attention_weights call per sequence."""
    heads = q.shape[1]
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    slopes = modifiers.pop("alibi_slopes")
    probs = q.new_zeros((len(cu_q) - 1, heads, max_seqlen_q, max_seqlen_k))
    for b in range(len(cu_q) - 1):
        qb = q[cu_q[b]:cu_q[b + 1]].transpose(0, 1)
        kb = k[cu_k[b]:cu_k[b + 1]].transpose(0, 1)
        slopes_b = slopes[b] if slopes is not None and slopes.dim() == 2 else slopes
        probs[b, :, :qb.shape[1], :kb.shape[1]] = attention_weights(qb, kb, alibi_slopes=slopes_b, **modifiers)
    return probs


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """FlashAttention 2's flash_attn_varlen_func (see the module docstring). Returns out
    (total_q, heads, head_dim_v), or with return_attn_probs=True (out, softmax_lse (heads, total_q),
    probabilities)."""
    if block_table is not None:
        raise NotImplementedError("attention_ext.flash: a paged key/value cache (block_table) is not supported by "
                                  "flash_attn_varlen_func yet; pass contiguous packed k and v")
    causal_kind, window = _band_from(causal, window_size)
    window = _window_within(window, max_seqlen_k)
    softcap = _check_softcap(softcap)
    deterministic = flag(deterministic, "deterministic", "attention_ext.flash: ", integers=True)
    return_attn_probs = flag(return_attn_probs, "return_attn_probs", "attention_ext.flash: ", integers=True)
    out, lse = varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                scale=softmax_scale, causal=causal_kind is not None, window=window, softcap=softcap,
                                alibi_slopes=alibi_slopes, dropout_p=dropout_p, return_lse=True)
    if not return_attn_probs:
        return out
    probs = _padded_probabilities(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale=softmax_scale,
                                  causal=causal_kind, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                                  enable_gqa=q.shape[1] != k.shape[1])
    return out, lse, probs


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash_attn_varlen_func with k and v packed: kv (total_k, 2, kv_heads, head_dim)."""
    if not isinstance(kv, torch.Tensor) or kv.dim() != 4 or kv.shape[1] != 2:
        raise ValueError("attention_ext.flash: kv must be a (total_k, 2, kv_heads, head_dim) tensor, got "
                         + (f"shape {tuple(kv.shape)}" if isinstance(kv, torch.Tensor) else type(kv).__name__))
    return flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """flash_attn_varlen_func with q, k and v packed: qkv (total, 3, heads, head_dim)."""
    if not isinstance(qkv, torch.Tensor) or qkv.dim() != 4 or qkv.shape[1] != 3:
        raise ValueError("attention_ext.flash: qkv must be a (total, 3, heads, head_dim) tensor, got "
                         + (f"shape {tuple(qkv.shape)}" if isinstance(qkv, torch.Tensor) else type(qkv).__name__))
    return flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                  dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs)

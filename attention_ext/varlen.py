"""Packed variable-length batches: many sequences of different lengths in one call, without padding.

`varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, ...)` takes FlashAttention's varlen layout:
q (total_q, heads, head_dim), k and v (total_k, kv_heads, head_dim), heads a multiple of kv_heads
(GQA/MQA without copies), and int32 cumulative lengths cu_seqlens (sequences + 1,) starting at 0:
sequence s is the rows cu_seqlens[s]:cu_seqlens[s + 1] and sees only its own keys. Causal masks and
windows are aligned bottom-right per sequence (query i at key i + m_s − n_s). Returns out
(total_q, heads, head_dim_v) and, with return_lse, lse (heads, total_q).

The kernels run each sequence as a dense call of its own (csrc/packed_sequences.h), all of them in
one pass of each kernel on the CPU: the cost is Σ n_s·m_s, nothing is spent on padding, and every
kernel path (decode, fused backward, the ISA variants, the tensor-core kernels) applies. On CUDA
the sequences are launched one after another, so many very short sequences pay a launch each.
Gradients flow into q, k, v and sinks (first order; a second derivative raises).

`flash_attn_varlen_func` (attention_ext.flash) is FlashAttention's signature over this.
"""
from __future__ import annotations

import numbers

import torch

from . import _arguments
from ._arguments import enforce
from ._constants import lse_dtype
from ._ops import below_autograd, ops
from .function import first_order_backward, sink_gradient

__all__ = ["varlen_attention"]


# ----------------------------------------------------------------------------------------------
# The op's fake kernels (shapes for torch.compile) and autograd.

def _packed_batch(query, key, value):
    return torch.broadcast_shapes(query.shape[:-2], key.shape[:-2], value.shape[:-2])


def _check_fake(query, key, value, cu_seqlens_q, cu_seqlens_k, scale, causal, window_left, window_right, softcap,
                sinks, dropout_p, rng_state, **on_query_device):
    """The ops' rules that need no values; on_query_device: the other tensors given (alibi_slopes,
    and the backward's grad_out, grad_lse, out, lse), which must be on the query's device."""
    check = _arguments.check_traced
    _arguments.op_rules(check, query, key, value, None, scale, causal, window_left, window_right, softcap, None,
                        sinks, dropout_p, rng_state)
    cu_rules(check, query, cu_seqlens_q, cu_seqlens_k, causal)
    for name, t in on_query_device.items():
        if t is not None:
            _arguments.device_rule(check, t, name, query.device)


def cu_rules(check, query, cu_seqlens_q, cu_seqlens_k, causal) -> None:
    """What can be checked of cu_seqlens without reading them (the kernels check the values)."""
    for cu, name in ((cu_seqlens_q, "cu_seqlens_q"), (cu_seqlens_k, "cu_seqlens_k")):
        _arguments.device_rule(check, cu, name, query.device, cpu_ok=True)
        check(cu.dtype == torch.int32, TypeError, lambda cu=cu, name=name: f"{name} must be int32, got {cu.dtype}")
        check(cu.dim() == 1 and cu.shape[0] >= 1, ValueError,
              lambda cu=cu, name=name: f"{name} must be 1-D with (sequences + 1) entries, got shape {tuple(cu.shape)}")
    check(cu_seqlens_q.shape[0] == cu_seqlens_k.shape[0], ValueError,
          lambda: f"cu_seqlens_q and cu_seqlens_k must have the same number of entries (sequences + 1), got "
          f"{cu_seqlens_q.shape[0]} and {cu_seqlens_k.shape[0]}")
    check(causal != 1, ValueError, lambda: "packed sequences align causal masks and windows bottom-right per "
          "sequence (causal = 2); top-left causal (1) is not supported for them")


@torch.library.register_fake("attention_ext::attention_varlen_fwd")
def _varlen_fwd_fake(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal,
                     window_left, window_right, softcap, alibi_slopes, sinks, dropout_p, rng_state):
    _check_fake(query, key, value, cu_seqlens_q, cu_seqlens_k, scale, causal, window_left, window_right, softcap,
                sinks, dropout_p, rng_state, alibi_slopes=alibi_slopes)
    batch = _packed_batch(query, key, value)
    nd = len(batch)
    # Laid out (total_q, batch..., d_v), seen as (batch..., total_q, d_v), as the kernels allocate it.
    out = query.new_empty((query.shape[-2], *batch, value.shape[-1])).permute(*range(1, nd + 1), 0, nd + 1)
    lse = query.new_empty((*batch, query.shape[-2]), dtype=lse_dtype(query.dtype))
    return out, lse


@torch.library.register_fake("attention_ext::attention_varlen_bwd")
def _varlen_bwd_fake(grad_out, grad_lse, query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                     out, lse, scale, causal, window_left, window_right, softcap, alibi_slopes, sinks, dropout_p,
                     rng_state):
    _check_fake(query, key, value, cu_seqlens_q, cu_seqlens_k, scale, causal, window_left, window_right, softcap,
                sinks, dropout_p, rng_state, alibi_slopes=alibi_slopes, grad_out=grad_out, grad_lse=grad_lse, out=out,
                lse=lse)
    return tuple(torch.empty_like(t) for t in (query, key, value))  # each in its input's layout (as the kernels')


def _setup_context(ctx, inputs, output):
    (query, key, value, cu_q, cu_k, max_q, max_k, scale, causal, window_left, window_right, softcap, alibi_slopes,
     sinks, dropout_p, rng_state) = inputs
    out, lse = output
    ctx.args = (max_q, max_k, scale, causal, window_left, window_right, softcap)
    ctx.dropout_p = dropout_p
    ctx.save_for_backward(query, key, value, cu_q, cu_k, out, lse, alibi_slopes, sinks, rng_state)
    ctx.set_materialize_grads(False)


@first_order_backward("varlen_attention")
def _backward(ctx, grad_out, grad_lse):
    query, key, value, cu_q, cu_k, out, lse, alibi_slopes, sinks, rng_state = ctx.saved_tensors
    if grad_out is None and grad_lse is None:
        return (None,) * 16
    dsinks = sink_gradient(sinks, lse, out, grad_out, grad_lse) if ctx.needs_input_grad[13] else None
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    max_q, max_k, scale, causal, window_left, window_right, softcap = ctx.args
    with below_autograd():
        dq, dk, dv = ops.attention_varlen_bwd(grad_out, grad_lse, query, key, value, cu_q, cu_k, max_q, max_k, out,
                                              lse, scale, causal, window_left, window_right, softcap, alibi_slopes,
                                              sinks, ctx.dropout_p, rng_state)
    return (dq, dk, dv) + (None,) * 10 + (dsinks, None, None)


torch.library.register_autograd("attention_ext::attention_varlen_fwd", _backward,
                                setup_context=_setup_context)


class VarlenAttentionFunction(torch.autograd.Function):
    """(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal,
    window_left, window_right, softcap, alibi_slopes, sinks, dropout_p, rng_state) -> (out, lse), the
    packed op's arguments; backward runs attention_varlen_bwd (first order)."""

    @staticmethod
    def forward(*args):
        with below_autograd():
            return ops.attention_varlen_fwd(*args)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _setup_context(ctx, inputs, output)

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        return _backward(ctx, grad_out, grad_lse)

    @staticmethod
    def vmap(info, in_dims, *args):
        raise NotImplementedError("attention_ext: varlen_attention under torch.func.vmap is not supported: pack the "
                                  "vmapped entries as more sequences of one call (cu_seqlens) instead")

    @staticmethod
    def jvp(ctx, *tangents):
        raise NotImplementedError("attention_ext: varlen_attention has no forward-mode AD (torch.func.jvp, "
                                  "torch.autograd.forward_ad): its backward is first order; attention() on a padded "
                                  "batch with a mask has both")


# ----------------------------------------------------------------------------------------------
# The public function.

def _check_packed_tensor(t, name, dims=3):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"attention_ext: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != dims:
        raise ValueError(f"attention_ext: {name} must be (total_{'q' if name == 'q' else 'k'}, heads, head_dim) "
                         f"in the packed layout, got shape {tuple(t.shape)}")


def _check_max_seqlen(value, name):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"attention_ext: {name} must be an int in [0, 2**63), got {value!r}")
    if not 0 <= value < 2 ** 63:
        raise ValueError(f"attention_ext: {name} must be an int in [0, 2**63), got {value!r}")
    return int(value)


def _per_head(values, name, heads, kv_heads, sequences, dtype):
    """(heads,) or (sequences, heads) values as the op's per-head tensor over (kv_heads, groups)
    (with a leading per-sequence dim)."""
    if values is None:
        return None
    if not isinstance(values, torch.Tensor):
        raise TypeError(f"attention_ext: {name} must be a torch.Tensor or None, got {type(values).__name__}")
    allowed = [(heads,)] + ([(sequences, heads)] if name == "alibi_slopes" else [])
    if not _arguments.shape_is_one_of(values.shape, *allowed):
        raise ValueError(f"attention_ext: {name} must have shape " + " or ".join(map(str, allowed))
                         + f", got {tuple(values.shape)}")
    if name == "alibi_slopes":
        if values.dtype != torch.float32:
            raise TypeError(f"attention_ext: alibi_slopes must be float32, got {values.dtype}")
        if values.requires_grad and torch.is_grad_enabled():
            raise NotImplementedError("attention_ext: gradients into alibi_slopes are not supported (they are "
                                      "constants, as in FlashAttention); pass alibi_slopes.detach()")
    elif not values.is_floating_point():
        raise TypeError(f"attention_ext: {name} must be a floating tensor, got {values.dtype}")
    return values.to(dtype).unflatten(-1, (kv_heads, heads // kv_heads))


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, scale=None, causal=False,
                     window=(-1, -1), softcap=0.0, alibi_slopes=None, sinks=None, dropout_p=0.0, return_lse=False):
    """Attention over packed sequences (see the module docstring). window=(left, right), -1 or None
    unbounded, bottom-right aligned per sequence; causal=True (or "bottom_right", attention()'s name
    for it) bounds the right side at 0; top-left is not offered (per sequence it is the same rule
    only when a sequence has as many queries as keys). softcap
    (0: none), alibi_slopes (float32, (heads,) or (sequences, heads)) and sinks ((heads,), a logit
    per head joining each row's softmax with value 0; differentiable) as in attention().
    max_seqlen_q / max_seqlen_k must be at least the longest sequence (checked)."""
    from .api import (_all_dropped, _check_dropout, _check_scale, _check_softcap, _check_window, _dropout_plan,
                      _needs_autograd, _traced)

    _check_packed_tensor(q, "q")
    _check_packed_tensor(k, "k")
    _check_packed_tensor(v, "v")
    _arguments.qkv_rules(enforce, q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
    if k.shape[1] != v.shape[1]:
        raise ValueError(f"attention_ext: k and v must have the same number of heads, got k {tuple(k.shape)} and "
                         f"v {tuple(v.shape)}")
    heads, kv_heads = q.shape[1], k.shape[1]
    _arguments.head_groups_rule(enforce, heads, kv_heads)
    for cu, name in ((cu_seqlens_q, "cu_seqlens_q"), (cu_seqlens_k, "cu_seqlens_k")):
        if not isinstance(cu, torch.Tensor):
            raise TypeError(f"attention_ext: {name} must be a torch.Tensor, got {type(cu).__name__}")
    if causal is None or isinstance(causal, str):  # attention()'s spelling of the same choice
        if causal not in (None, "bottom_right"):
            raise ValueError(f"attention_ext: causal for packed sequences is True / 'bottom_right' (aligned per "
                             f"sequence, as FlashAttention's) or False / None, got {causal!r}")
        causal = causal is not None
    causal = _arguments.flag(causal, "causal")
    return_lse = _arguments.flag(return_lse, "return_lse")
    causal_code = 2 if causal else 0
    cu_rules(enforce, q, cu_seqlens_q, cu_seqlens_k, causal_code)
    max_seqlen_q = _check_max_seqlen(max_seqlen_q, "max_seqlen_q")
    max_seqlen_k = _check_max_seqlen(max_seqlen_k, "max_seqlen_k")
    scale = _check_scale(scale, k)
    window_left, window_right = _check_window(window)
    softcap = _check_softcap(softcap)
    _arguments.softcap_rules(enforce, softcap, q.dtype)
    _arguments.band_rules(enforce, causal_code, window_left, window_right, 0, 0)
    dropout_p = _check_dropout(dropout_p)
    sequences = cu_seqlens_q.shape[0] - 1
    slopes = _per_head(alibi_slopes, "alibi_slopes", heads, kv_heads, sequences, torch.float32)
    sinks = _per_head(sinks, "sinks", heads, kv_heads, sequences, lse_dtype(q.dtype))
    for t, name in ((slopes, "alibi_slopes"), (sinks, "sinks")):
        if t is not None and t.device != q.device:
            raise ValueError(f"attention_ext: {name} must be on {q.device}, got {t.device}")

    groups = heads // kv_heads
    # (total, heads, d) -> (kv_heads, groups, total, d) and (kv_heads, 1, total, d): views.
    qh = q.unflatten(1, (kv_heads, groups)).permute(1, 2, 0, 3)
    kh, vh = (t.permute(1, 0, 2).unsqueeze(1) for t in (k, v))
    dropout_p, rng_state, all_dropped = _dropout_plan(dropout_p, q.device)
    args = (qh, kh, vh, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal_code, window_left,
            window_right, softcap, slopes, sinks, dropout_p, rng_state)
    if _traced():
        out, lse = ops.attention_varlen_fwd(*args)
    elif _needs_autograd(qh, kh, vh, sinks):
        out, lse = VarlenAttentionFunction.apply(*args)
    else:
        with below_autograd():
            out, lse = ops.attention_varlen_fwd(*args)
    out = out.permute(2, 0, 1, 3).flatten(1, 2)  # rows first again: contiguous as the kernels wrote it
    if all_dropped:
        out = _all_dropped(out)
    if not return_lse:
        return out
    return out, lse.flatten(0, 1)

"""Public entry points: argument validation and normalisation, then the autograd Function. The
ops' own argument rules are _arguments.py's; this module adds the API's (Python types, CausalBias,
enable_gqa, broadcasting, named causal kinds) and turns arguments into the ops' form.

* `scaled_dot_product_attention` — drop-in for torch.nn.functional.scaled_dot_product_attention.
* `attention` — keyword-only extended API (bottom-right causal, return_lse).
* `attention_weights` — the exact attention probabilities.
* `dropout_mask`, `draw_rng_state` — reproduce the dropout a call applied.
"""
from __future__ import annotations

import functools
import math
import numbers
from typing import NamedTuple, Optional

import torch

from ._arguments import (band_rules, enforce, finite, flag, mask_rules, per_head_rules, qkv_rules, scale_rules,
                         softcap_rules)
from ._constants import CAUSAL_CODES, lse_dtype
from ._ops import LEAN_ATTENTION, call_below_autograd, ops
from .function import AttentionFunction, AttentionWeightsFunction, attention_function_apply, forward_ad_possible


def _check_tensor(t, name):
    """What the API asks of a tensor argument beyond the ops' rules (qkv_rules)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"attention_ext: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.is_nested:
        raise NotImplementedError(f"attention_ext: {name} is a nested tensor, which is not supported yet; for "
                                  "batches of sequences of different lengths use attention_ext.varlen_attention "
                                  "(cu_seqlens) or flash_attn_varlen_func")
    if t.layout != torch.strided:
        raise TypeError(f"attention_ext: {name} must be a dense (strided) tensor, got layout {t.layout}")
    if t.device.type not in ("cpu", "cuda", "meta"):
        raise NotImplementedError(f"attention_ext: {name} is on {t.device}; only CPU and CUDA tensors are supported")


def _check_qkv(query, key, value):
    _check_tensor(query, "query")
    _check_tensor(key, "key")
    _check_tensor(value, "value")
    qkv_rules(enforce, query, key, value)
    if query.device.type == "cuda" and not _has_cuda_kernels():
        raise NotImplementedError(
            "attention_ext: got CUDA tensors but this build has no CUDA kernels (build_info()['cuda'] is "
            "0); rebuild with a CUDA-enabled torch and nvcc available (FORCE_CUDA=1 to insist)")


@functools.lru_cache(maxsize=None)
def _has_cuda_kernels() -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key("attention_ext::attention_fwd", "CUDA")


def _broadcast_shapes(*shapes):
    """torch.broadcast_shapes, without its per-call overhead (tens of microseconds: it matters for
    decode-sized calls). One rule for int and symbolic sizes: under torch.compile each test is
    guard_or_false (a backed size guards, an unbacked one is not assumed either way), as in torch's
    own rule, and two sizes not known to differ are asserted equal when the graph runs
    (torch._check). Shapes that do not broadcast raise the RuntimeError _broadcast_batch turns into
    its message, under torch.compile too (torch's fails inside the tracer there)."""
    known, compiling = bool, torch.compiler.is_compiling()
    if compiling:
        try:
            from torch.fx.experimental.symbolic_shapes import guard_or_false as known
        except ImportError:  # (torch before 2.7: torch's rule, with its error)
            return torch.broadcast_shapes(*shapes)
    ndim = max(len(s) for s in shapes)
    out = [1] * ndim
    for shape in shapes:
        for i, size in enumerate(shape, ndim - len(shape)):
            if known(size == 1):
                continue
            if known(out[i] == 1):
                out[i] = size
                continue
            if known(out[i] != size):
                raise RuntimeError(f"shapes {shapes} do not broadcast")
            if compiling:
                torch._check(out[i] == size,
                             lambda: "attention_ext: the batch dims of query, key and value do not broadcast")
    return torch.Size(out)


def _broadcast_batch(query, key, value):
    try:
        return _broadcast_shapes(query.shape[:-2], key.shape[:-2], value.shape[:-2])
    except RuntimeError:
        hint = ""
        if query.dim() >= 3 and key.dim() >= 3 and query.shape[:-3] == key.shape[:-3] \
                and key.shape[-3] > 0 and query.shape[-3] % key.shape[-3] == 0:
            hint = " (fewer key/value heads than query heads: pass enable_gqa=True for grouped-query attention)"
        raise ValueError(
            f"attention_ext: the batch dims of query {tuple(query.shape)}, key {tuple(key.shape)} and value "
            f"{tuple(value.shape)} do not broadcast{hint}") from None


def _default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim) if head_dim > 0 else 1.0


def _refuse_derivatives_into(value: torch.Tensor, name: str) -> None:
    """A one-element tensor taken as a number (scale, dropout_p): read with .item(), it would be a
    constant to every derivative, so one that asks for a derivative (a forward-mode tangent, or a
    torch.func transform tracing it) is refused rather than silently given none."""
    traced = not torch.compiler.is_compiling() and torch._C._functorch.is_functorch_wrapped_tensor(value)
    if traced or torch.autograd.forward_ad.unpack_dual(value).tangent is not None:
        raise TypeError(f"attention_ext: {name} is a tensor with a forward-mode tangent or traced by a torch.func "
                        f"transform (jvp, grad, vmap); derivatives with respect to {name} are not supported (as in "
                        f"torch): pass a float")


def _check_scale(scale, key):
    if scale is None:
        return _default_scale(key.shape[-1])
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1:
            raise TypeError(f"attention_ext: scale must be a number, got a tensor of shape {tuple(scale.shape)}")
        if scale.requires_grad and torch.is_grad_enabled():
            raise TypeError("attention_ext: scale is a tensor that requires grad; gradients into scale are not "
                            "supported (as in torch): pass a float, or scale.detach()")
        _refuse_derivatives_into(scale, "scale")
        scale = scale.item()
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"attention_ext: scale must be a real number or None, got {type(scale).__name__}")
    try:
        scale = float(scale)
    except OverflowError:  # an int beyond float range, e.g. 10**400
        raise ValueError("attention_ext: scale must be finite, got an integer too large for a float") from None
    if not finite(scale):
        raise ValueError(f"attention_ext: scale must be finite, got {scale}")
    scale_rules(enforce, scale, key.dtype)
    return scale


def _check_dropout(dropout_p):
    if isinstance(dropout_p, torch.Tensor) and dropout_p.numel() == 1 and not dropout_p.requires_grad:
        _refuse_derivatives_into(dropout_p, "dropout_p")
        dropout_p = dropout_p.item()  # (as torch takes it)
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"attention_ext: dropout_p must be a number, got {type(dropout_p).__name__}")
    try:
        dropout_p = float(dropout_p)
    except OverflowError:  # an int beyond float range
        raise ValueError("attention_ext: dropout_p must be in [0, 1], got an integer too large for a float") from None
    if dropout_p == 1.0:  # every weight dropped, as torch: the callers return zeros (the ops take [0, 1))
        return dropout_p
    enforce(0.0 <= dropout_p < 1.0, ValueError, lambda: f"dropout_p must be in [0, 1], got {dropout_p}")
    return dropout_p


def _dropout_plan(dropout_p, device):
    """(dropout_p, rng_state, all_dropped) for the kernels: the (seed, offset) drawn for any dropout
    (a call with dropout_p = 1 too, so the generator advances as for every call with dropout), and
    dropout_p = 1 run as the call without dropout, whose output _all_dropped then zeroes."""
    rng_state = draw_rng_state(device) if dropout_p > 0 else None
    if dropout_p == 1.0:
        return 0.0, None, True
    return dropout_p, rng_state, False


def _all_dropped(out):
    """The output of a call with dropout_p = 1 from the same call without dropout: torch's zeros
    (out·0, so its gradients are zeros too, and a non-finite output row stays NaN as torch's
    0·inf does)."""
    return out * 0


def _check_causal(causal):
    if not (causal is None or isinstance(causal, str)) or causal not in CAUSAL_CODES:
        raise ValueError(f"attention_ext: causal must be None, 'top_left' or 'bottom_right', got {causal!r}")
    return causal


def _check_window(window):
    """window=(left, right) -> the ops' (window_left, window_right), -1 for an unbounded side.
    None (or FlashAttention's -1) leaves a side unbounded; window=None is no window."""
    if window is None:
        return -1, -1
    if isinstance(window, torch.Tensor) or not isinstance(window, (tuple, list)) or len(window) != 2:
        raise TypeError(f"attention_ext: window must be None or a pair (left, right) of ints or None, got {window!r}")
    bounds = []
    for side, b in zip(("left", "right"), window):
        if b is None:
            bounds.append(-1)
            continue
        if isinstance(b, bool) or not isinstance(b, numbers.Integral):
            raise TypeError(f"attention_ext: window {side} bound must be an int or None, got {type(b).__name__}")
        if b < -1:
            raise ValueError(f"attention_ext: window {side} bound must be >= 0 (or None / -1 for unbounded), got {b}")
        bounds.append(int(b))
    return bounds[0], bounds[1]


def _check_softcap(softcap):
    """softcap=None (or 0.0, FlashAttention's "none") or a finite number > 0 -> the ops' float."""
    if softcap is None or (type(softcap) is float and softcap == 0.0):
        return 0.0
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"attention_ext: softcap must be a number or None, got {type(softcap).__name__}")
    softcap = float(softcap)
    if not (finite(softcap) and softcap >= 0.0):
        raise ValueError(f"attention_ext: softcap must be a finite number > 0 (or None / 0.0 for none), got {softcap}")
    return softcap


def _check_per_head(values, name, query, batch):
    """alibi_slopes / sinks: a tensor of one value per head, any shape broadcasting to the batch dims
    ((heads,), (batch, heads)); with enable_gqa, already split by _split_gqa_heads. Slopes are
    constants (float32): a gradient into them is refused rather than dropped. Sinks take any float
    dtype, converted (differentiably) to the lse's."""
    if values is None:
        return None
    if not isinstance(values, torch.Tensor):
        raise TypeError(f"attention_ext: {name} must be a torch.Tensor or None, got {type(values).__name__}")
    if name == "alibi_slopes":
        if values.requires_grad and torch.is_grad_enabled():
            raise NotImplementedError("attention_ext: gradients into alibi_slopes are not supported (they are "
                                      "constants, as in FlashAttention); pass alibi_slopes.detach()")
        dtype = torch.float32
    else:
        if values.dtype not in (torch.float64, torch.float32, torch.float16, torch.bfloat16):
            raise TypeError(f"attention_ext: sinks must be a floating tensor, got {values.dtype}")
        dtype = lse_dtype(query.dtype)
        values = values.to(dtype)
    per_head_rules(enforce, values, name, dtype, query, batch)
    return values


def _split_gqa_heads(values, name, call):
    """With enable_gqa's split of the query heads into (kv_heads, groups), a per-query-head tensor
    (alibi_slopes, sinks: last dim one per query head, or 1) splits alike, so that it lines up
    with the split batch dims (before _fold_batch_dims merges any leading ones)."""
    if call.heads is None or not isinstance(values, torch.Tensor) or values.dim() == 0:
        return values
    # (A size of one per K/V head would broadcast over the groups, not the heads. Compared one by
    # one: under torch.compile `size in (...)` is False for a symbolic size.)
    if values.shape[-1] != call.heads and values.shape[-1] != 1:
        raise ValueError(f"attention_ext: {name} must have one value per query head ({call.heads}) or a single "
                         f"value in its last dim, got shape {tuple(values.shape)}")
    if values.shape[-1] == 1:
        return values.unsqueeze(-1)
    return values.unflatten(-1, (call.query.shape[-4], call.query.shape[-3]))


def _causal_bias_kind(attn_mask):
    """torch.nn.attention.bias.CausalBias objects -> causal kind, else None."""
    if attn_mask is None or type(attn_mask) is torch.Tensor:  # the common cases, without the import
        return None
    try:
        from torch.nn.attention.bias import CausalBias, CausalVariant
    except ImportError:  # pragma: no cover - torch without the bias module
        return None
    if isinstance(attn_mask, CausalBias):
        variant = getattr(attn_mask, "variant", None)
        if variant is None:
            # What a tensor operation on a CausalBias returns (e.g. bias.clone()): the
            # subclass without its variant and sizes.
            raise TypeError("attention_ext: attn_mask is a CausalBias without its variant (the result of a tensor "
                            "operation on one?); pass the object causal_upper_left / causal_lower_right returned")
        return "top_left" if variant == CausalVariant.UPPER_LEFT else "bottom_right"
    return None


def _check_causal_bias_size(bias, query, key):
    """A CausalBias is built for (seq_len_q, seq_len_kv); like torch, it must be the problem's."""
    n = query.shape[-2] if isinstance(query, torch.Tensor) and query.dim() >= 2 else None
    m = key.shape[-2] if isinstance(key, torch.Tensor) and key.dim() >= 2 else None
    if n is None or m is None:
        return  # _check_qkv reports the bad query / key
    if (bias.seq_len_q, bias.seq_len_kv) != (n, m):
        raise ValueError(f"attention_ext: the CausalBias attn_mask is for {bias.seq_len_q} queries and "
                         f"{bias.seq_len_kv} keys, but query has {n} and key has {m}")


def _check_mask(attn_mask, query, batch, n, m):
    if attn_mask is None:
        return None
    if type(attn_mask) is not torch.Tensor and _causal_bias_kind(attn_mask) is not None:
        # A CausalBias is a Tensor subclass whose storage is uninitialised memory, not a mask:
        # only scaled_dot_product_attention turns it into a causal alignment.
        raise TypeError("attention_ext: attention() and attention_weights() take causal='top_left' or "
                        "'bottom_right' instead of a CausalBias attn_mask (scaled_dot_product_attention accepts one)")
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"attention_ext: attn_mask must be a torch.Tensor, a CausalBias or None, got "
                        f"{type(attn_mask).__name__}")
    if attn_mask.dtype == torch.float32 and query.dtype == torch.float64 and attn_mask.device == query.device:
        # torch takes a float32 mask with any query dtype: converted to float64 exactly (its gradient
        # returns in float32 through the conversion). (float16 / bfloat16 inputs: _float32_mask_inputs.)
        # Masking is decided in the mask's own dtype (the reference's rule): its lowest finite value
        # masks, so it becomes -inf rather than a float64 bias the row's softmax would keep.
        attn_mask = attn_mask.to(torch.float64).masked_fill(attn_mask == torch.finfo(torch.float32).min,
                                                            float("-inf"))
    mask_rules(enforce, attn_mask, query, float32_taken=True)
    target = (*batch, n, m)
    ok = attn_mask.dim() <= len(target) and all(
        s == 1 or s == t for s, t in zip(reversed(attn_mask.shape), reversed(target)))
    if not ok:
        raise ValueError(
            f"attention_ext: attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to the attention "
            f"weights' shape {target}")
    return attn_mask


_MAX_BATCH_DIMS = 8  # (the kernels' kMaxBatchDims)


def _apply_gqa(query, key, value, attn_mask):
    """torch's enable_gqa without copying K/V: query heads (Hq) split into (Hkv, Hq/Hkv) and
    K/V gain a broadcast dim, so query head h reads key/value head h // (Hq/Hkv). (Key and value
    with different head counts are each repeated to Hq, as torch does.)"""
    if query.dim() < 3 or key.dim() < 3 or value.dim() < 3:
        raise ValueError("attention_ext: enable_gqa=True needs (..., heads, length, dim) inputs, got query "
                         f"{tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}")
    hq, hk, hv = query.shape[-3], key.shape[-3], value.shape[-3]
    if hk != hv:
        # torch repeats each to the query heads on its own: no single split of the query heads
        # serves both, so both are repeated here too (copies, where one head count is shared).
        for t, name in ((key, "key"), (value, "value")):
            if t.shape[-3] == 0 or hq % t.shape[-3] != 0:
                raise ValueError(f"attention_ext: enable_gqa=True needs the query heads ({hq}) to be a multiple of the "
                                 f"{name} heads ({t.shape[-3]}); got key {tuple(key.shape)} and value "
                                 f"{tuple(value.shape)}")
        key = key.repeat_interleave(hq // hk, dim=-3)
        value = value.repeat_interleave(hq // hv, dim=-3)
        hk = hv = hq
    if hk == 0 or hq % hk != 0:
        raise ValueError(f"attention_ext: enable_gqa=True needs the query heads ({hq}) to be a multiple of the "
                         f"key/value heads ({hk})")
    if hq == hk:
        return query, key, value, attn_mask, None
    groups = hq // hk
    query = query.unflatten(-3, (hk, groups))
    key = key.unsqueeze(-3)
    value = value.unsqueeze(-3)
    # (Anything but a plain tensor mask is left for _check_mask to reject.)
    if isinstance(attn_mask, torch.Tensor) and attn_mask.dim() >= 3 and (
            type(attn_mask) is torch.Tensor or _causal_bias_kind(attn_mask) is None):
        if attn_mask.shape[-3] == hq:
            attn_mask = attn_mask.unflatten(-3, (hk, groups))
        elif attn_mask.shape[-3] == 1:
            attn_mask = attn_mask.unsqueeze(-3)
        else:
            # As in torch, the mask broadcasts against the query heads: one mask per key/value
            # head (or any other count) is not a broadcast of Hq.
            raise ValueError(
                f"attention_ext: attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to the attention "
                f"weights' shape (..., {hq}, {query.shape[-2]}, {key.shape[-2]}): its heads dim (-3) must be 1 or "
                f"the query heads ({hq})")
    return query, key, value, attn_mask, hq


def _traced() -> bool:
    """Whether torch.compile (Dynamo) or torch.jit.trace records the call: then the op itself is
    called, with its registered autograd (the same backward), which both record as one node; the
    autograd Function would be a Python call jit.trace cannot save."""
    return torch.compiler.is_compiling() or torch.jit.is_tracing()


def _call(op, function, args, *differentiable):
    """Runs op(*args) the way the call needs: traced (_traced), the op itself (the Function's
    jvp/vmap rules are for eager functorch transforms); when autograd has something to record,
    through the autograd Function; else (inference) the op below the autograd keys."""
    if _traced():
        return op(*args)
    if _needs_autograd(*differentiable):
        return function.apply(*args)
    return call_below_autograd(op, *args)


def _needs_autograd(*tensors) -> bool:
    """Whether a call must go through the autograd Function: an input requires grad (with grad
    mode on), a forward-mode AD level is open (inputs may carry tangents), or a functorch
    transform is active (vmap, grad, jvp: they need the Function's rules)."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        return True
    return forward_ad_possible()


_is_compiling = torch.compiler.is_compiling


def _lean_forward(query, key, value, causal_code, scale, enable_gqa=False):
    """The common call with nothing to normalise, straight to the op: plain tensors of one float
    dtype on one CPU (or CUDA, with kernels) device, the same leading dims (with enable_gqa: the
    same but for the heads, query heads a multiple of K/V's), no mask, dropout or score modifier,
    and no forward-mode AD, transform, compiler or autocast to see: the op (through the
    autograd Function when an input requires grad). Returns (out, lse), or None for any other
    call, which then takes the full path and its checks (so every error is still raised there).
    The checks are the compiled extension's (csrc/module.cpp, lean_attention: ~1 µs, where they
    took 4 µs in Python); a JIT build, which has no such entry, takes the full path. Saves ~25 µs
    of argument handling per call (~20 µs with GQA): the whole cost of a decode-sized call."""
    if LEAN_ATTENTION is None or _is_compiling() or _any_autocast() or forward_ad_possible():
        return None
    prepared = LEAN_ATTENTION(query, key, value, causal_code, scale, enable_gqa)
    if prepared is None or len(prepared) == 2:
        return prepared  # (None, or (out, lse) computed)
    query, key, value, scale, groups = prepared  # autograd records the call
    out, lse = attention_function_apply(query, key, value, None, scale, causal_code, -1, -1, 0.0, None, None, 0.0, None)
    if groups > 1:
        return out.flatten(-4, -3), lse.flatten(-3, -2)
    return out, lse


def draw_rng_state(device="cpu") -> torch.Tensor:
    """The (seed, offset) int64 pair a call with dropout draws from torch's generator for the
    device, so torch.manual_seed replays dropout. After torch.manual_seed(s), this returns exactly
    what the next dropout call will draw; pass it to dropout_mask to get that call's keep mask."""
    return torch.randint(-(2 ** 63), 2 ** 63 - 1, (2,), dtype=torch.int64, device=device)


# Whether any autocast is on (one cheap call; the lean path asks it on every call). A private
# function (torch 2.4 to 2.13 have it); without it, each device is asked.
_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", None) or \
    (lambda: torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda"))


def _autocast_dtype(query):
    """The dtype torch.autocast asks for on the query's device, or None (off, or not a tensor)."""
    if not isinstance(query, torch.Tensor) or (not _is_compiling() and not _any_autocast()):
        return None  # (compiling: the per-device query below, which dynamo traces)
    device_type = query.device.type
    if device_type not in ("cpu", "cuda") or not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def _autocast(query, key, value, attn_mask):
    """Under torch.autocast, as torch's SDPA (on autocast's lower-precision list): floating q, k, v
    and a float mask in the autocast dtype (differentiably; gradients return in the inputs' dtypes)."""
    dtype = _autocast_dtype(query)
    if dtype is None:
        return query, key, value, attn_mask

    def cast(t):  # (autocast leaves float64 be, as torch's does)
        return t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64 \
            else t
    mask = attn_mask if _causal_bias_kind(attn_mask) is not None else cast(attn_mask)  # (a CausalBias stays one)
    return cast(query), cast(key), cast(value), mask


def _float32_mask_inputs(query, key, value, attn_mask):
    """torch adds a float32 attn_mask in float32 whatever the inputs' dtype. With float16 / bfloat16
    inputs (the kernels read an additive mask in the inputs' dtype) the call runs on float32 copies
    of them — exact conversions, differentiable, so gradients return in the inputs' dtype and the
    mask's in float32 — and the result goes back to the inputs' dtype: the mask is never rounded.
    Returns (query, key, value, the dtype to return the result in, or None)."""
    if isinstance(attn_mask, torch.Tensor) and attn_mask.dtype == torch.float32 and \
            all(isinstance(t, torch.Tensor) for t in (query, key, value)) and \
            query.dtype in (torch.float16, torch.bfloat16) and key.dtype == value.dtype == query.dtype and \
            attn_mask.device == query.device and _causal_bias_kind(attn_mask) is None:
        return query.float(), key.float(), value.float(), query.dtype
    return query, key, value, None


class _Prepared(NamedTuple):
    """A call's checked and normalised arguments, as the ops take them (_prepare)."""
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    attn_mask: Optional[torch.Tensor]
    scale: float
    dropout_p: float
    batch: torch.Size  # the broadcast batch dims of query, key and value
    heads: Optional[int]  # with enable_gqa: the query heads, split into (kv heads, groups), to merge back
    result_dtype: Optional[torch.dtype]  # the dtype to return in where the call runs in float32 for a float32 mask


def _prepare(query, key, value, attn_mask, scale, dropout_p, enable_gqa) -> _Prepared:
    """The checks and normalisation attention, attention_weights and the context-parallel calls share."""
    query, key, value, attn_mask = _autocast(query, key, value, attn_mask)
    query, key, value, result_dtype = _float32_mask_inputs(query, key, value, attn_mask)
    _check_qkv(query, key, value)
    scale = _check_scale(scale, key)
    dropout_p = _check_dropout(dropout_p)
    enable_gqa = flag(enable_gqa, "enable_gqa")
    heads = None
    if enable_gqa:
        query, key, value, attn_mask, heads = _apply_gqa(query, key, value, attn_mask)
    batch = _broadcast_batch(query, key, value)
    attn_mask = _check_mask(attn_mask, query, batch, query.shape[-2], key.shape[-2])
    return _Prepared(query, key, value, attn_mask, scale, dropout_p, batch, heads, result_dtype)


def _fold_batch_dims(call: _Prepared, alibi_slopes, sinks):
    """torch takes any number of batch dims, the kernels at most _MAX_BATCH_DIMS: beyond that the
    leading ones are merged into one (each tensor expanded to their broadcast sizes first, so one
    broadcast along them is copied; differentiable), in row-major order, which dropout's batch
    index keeps. Per-head tensors (alibi_slopes, sinks) are merged alike where they reach into
    those dims. Returns (call, alibi_slopes, sinks, the merged dims' sizes or None)."""
    batch = call.batch
    if len(batch) <= _MAX_BATCH_DIMS:
        return call, alibi_slopes, sinks, None
    lead = tuple(batch[:len(batch) - _MAX_BATCH_DIMS + 1])

    def fold(t, trailing, name):
        if not isinstance(t, torch.Tensor) or t.dim() - trailing <= len(batch) - len(lead):
            return t  # (None, or broadcasting against the kept dims only; bad ones are reported later)
        t = t.reshape((1,) * (len(batch) + trailing - t.dim()) + tuple(t.shape))  # (a view: leading 1s)
        if any(size != 1 and size != want for size, want in zip(t.shape[:len(lead)], lead)):
            raise ValueError(f"attention_ext: {name} of shape {tuple(t.shape)} does not broadcast to the batch dims "
                             f"{tuple(batch)}")
        return t.expand(*lead, *t.shape[len(lead):]).flatten(0, len(lead) - 1)

    folded_batch = torch.Size((math.prod(lead), *batch[len(lead):]))
    call = call._replace(query=fold(call.query, 2, "query"), key=fold(call.key, 2, "key"),
                         value=fold(call.value, 2, "value"), attn_mask=fold(call.attn_mask, 2, "attn_mask"),
                         batch=folded_batch)
    return call, fold(alibi_slopes, 0, "alibi_slopes"), fold(sinks, 0, "sinks"), lead


def _logit_args(call: _Prepared, causal, window, softcap, alibi_slopes, sinks):
    """The ops' logit arguments (causal code, window_left, window_right, softcap, alibi_slopes,
    sinks), checked against the prepared (GQA-split, folded) call; the checks attention and
    attention_weights share after _prepare."""
    query = call.query
    band_rules(enforce, CAUSAL_CODES[causal], *window, query.shape[-2], call.key.shape[-2])
    softcap_rules(enforce, softcap, query.dtype)
    return (CAUSAL_CODES[causal], *window, softcap,
            _check_per_head(alibi_slopes, "alibi_slopes", query, call.batch),
            _check_per_head(sinks, "sinks", query, call.batch))


def _prepare_call(query, key, value, attn_mask, causal, scale, dropout_p, enable_gqa, window, softcap, alibi_slopes,
                  sinks):
    """_prepare, the per-head tensors' GQA split, _fold_batch_dims and _logit_args in order.
    Returns (call, logit args, lead)."""
    call = _prepare(query, key, value, attn_mask, scale, dropout_p, enable_gqa)
    alibi_slopes = _split_gqa_heads(alibi_slopes, "alibi_slopes", call)
    sinks = _split_gqa_heads(sinks, "sinks", call)
    call, alibi_slopes, sinks, lead = _fold_batch_dims(call, alibi_slopes, sinks)
    return call, _logit_args(call, causal, window, softcap, alibi_slopes, sinks), lead


def _run(query, key, value, attn_mask, causal, scale, dropout_p, enable_gqa, window=(-1, -1), softcap=0.0,
         alibi_slopes=None, sinks=None):
    call, logit, lead = _prepare_call(query, key, value, attn_mask, causal, scale, dropout_p, enable_gqa, window,
                                      softcap, alibi_slopes, sinks)
    query, key, value, attn_mask = call.query, call.key, call.value, call.attn_mask
    # The kernels own dK/dV per key position, so K and V must broadcast alike: expand (a view).
    if key.shape[:-2] != value.shape[:-2]:
        kv_batch = _broadcast_shapes(key.shape[:-2], value.shape[:-2])
        key = key.expand(*kv_batch, *key.shape[-2:])
        value = value.expand(*kv_batch, *value.shape[-2:])
    dropout_p, rng_state, all_dropped = _dropout_plan(call.dropout_p, query.device)
    args = (query, key, value, attn_mask, call.scale, *logit, dropout_p, rng_state)
    out, lse = _call(ops.attention_fwd, AttentionFunction, args, query, key, value, attn_mask, logit[-1])
    if call.heads is not None:
        out = out.flatten(-4, -3)
        lse = lse.flatten(-3, -2)
    if call.result_dtype is not None:
        out = out.to(call.result_dtype)  # (lse is float32 for float16 / bfloat16 inputs too)
    if lead is not None:
        out, lse = out.unflatten(0, lead), lse.unflatten(0, lead)
    return (_all_dropped(out) if all_dropped else out), lse


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False):
    """Drop-in for torch.nn.functional.scaled_dot_product_attention, same signature and semantics,
    computed by the fused kernels (differentiable, deterministic). Rows where no key takes part
    give 0 instead of NaN. is_causal=True with an attn_mask applies both (a key takes part only if
    both allow it), as torch's CPU flash kernel does; torch's math fallback (which it takes, e.g.,
    for inputs that require grad) refuses the pair."""
    if attn_mask is None and type(dropout_p) is float and dropout_p == 0.0 and type(enable_gqa) is bool and \
            (is_causal is False or is_causal is True):
        result = _lean_forward(query, key, value, 1 if is_causal else 0, scale, enable_gqa)
        if result is not None:
            return result[0]
    is_causal = flag(is_causal, "is_causal")
    causal = _causal_bias_kind(attn_mask)
    if causal is not None:
        if is_causal:
            raise ValueError("attention_ext: pass either is_causal=True or a CausalBias attn_mask, not both")
        _check_causal_bias_size(attn_mask, query, key)
        attn_mask = None
    elif is_causal:
        causal = "top_left"  # (with an attn_mask too: a key takes part only if both allow it)
    out, _ = _run(query, key, value, attn_mask, causal, scale, dropout_p, enable_gqa)
    return out


def attention(query, key, value, *, attn_mask=None, causal: Optional[str] = None, window=None, softcap=None,
              alibi_slopes=None, sinks=None, scale=None, dropout_p=0.0, enable_gqa=False, return_lse=False):
    """Extended API. causal: None, "top_left" (torch's is_causal) or "bottom_right"
    (FlashAttention's; key j visible to query i iff j <= i + m - n); unlike the drop-in, causal
    and attn_mask may be combined (a key takes part only if both allow it). window=(left, right):
    a sliding window, key j visible to query i iff i + m - n - left <= j <= i + m - n + right
    (bottom-right aligned like FlashAttention's window_size; None for an unbounded side); tiles
    outside it are skipped, so a window w costs O(n·w). Score modifiers, on the scaled score t
    before any mask: softcap > 0 makes it softcap·tanh(t / softcap) (Gemma 2), alibi_slopes (float32,
    one per head, broadcasting to the leading dims: (heads,) or (batch, heads)) then add
    -slope·|i + m - n - j| (ALiBi; no gradient into the slopes). sinks (one logit per head, same
    broadcasting; differentiable): each row's softmax gains one more, always visible, key of that
    logit and value 0 (GPT-OSS's attention sinks); the lse includes it. With return_lse=True returns
    (out, lse), lse (..., n) the natural-log logsumexp of each row's scores (-inf for a row where
    no key takes part), float32 for float16/bfloat16/float32 inputs and float64 for float64; it
    is differentiable too."""
    if attn_mask is None and window is None and softcap is None and alibi_slopes is None and sinks is None and \
            type(dropout_p) is float and dropout_p == 0.0 and type(enable_gqa) is bool and \
            (causal is None or type(causal) is str) and causal in CAUSAL_CODES:
        result = _lean_forward(query, key, value, CAUSAL_CODES[causal], scale, enable_gqa)
        if result is not None:
            return result if flag(return_lse, "return_lse") else result[0]
    return_lse = flag(return_lse, "return_lse")
    _check_causal(causal)
    window = _check_window(window)
    softcap = _check_softcap(softcap)
    out, lse = _run(query, key, value, attn_mask, causal, scale, dropout_p, enable_gqa, window, softcap, alibi_slopes,
                    sinks)
    return (out, lse) if return_lse else out


def attention_weights(query, key, *, attn_mask=None, causal: Optional[str] = None, window=None, softcap=None,
                      alibi_slopes=None, sinks=None, scale=None, enable_gqa=False):
    """The exact attention probabilities W (..., n, m): rows sum to 1, masked entries are 0, rows
    with no visible key are all 0 (with sinks: rows sum to 1 minus the sink's weight). causal,
    window, softcap, alibi_slopes and sinks as in attention().
    Differentiable in reverse and forward mode (both composed in torch ops from W)."""
    _check_causal(causal)
    window = _check_window(window)
    softcap = _check_softcap(softcap)
    _check_tensor(query, "query")
    _check_tensor(key, "key")
    # The shared checks, with a value of no columns.
    value = key.new_empty((*key.shape[:-1], 0))
    call, logit, lead = _prepare_call(query, key, value, attn_mask, causal, scale, 0.0, enable_gqa, window, softcap,
                                      alibi_slopes, sinks)
    query, key, attn_mask = call.query, call.key, call.attn_mask
    args = (query, key, attn_mask, call.scale, *logit)
    w = _call(ops.attention_probs, AttentionWeightsFunction, args, query, key, attn_mask, logit[-1])
    if call.heads is not None:
        w = w.flatten(-4, -3)
    if lead is not None:
        w = w.unflatten(0, lead)
    return w if call.result_dtype is None else w.to(call.result_dtype)


def dropout_mask(rng_state: torch.Tensor, shape, dropout_p: float) -> torch.Tensor:
    """The bool keep mask (shape = (*batch, n, m)) that dropout with this rng_state (int64
    (seed, offset)) applies: weight (b, i, j) survives iff the mask is True. The batch index b
    is the row-major index over the broadcast batch dims of the call (after enable_gqa's split
    of the query heads into (kv_heads, groups), which keeps the same order)."""
    if isinstance(shape, torch.Size):
        shape = tuple(shape)
    if not isinstance(shape, (tuple, list)) or \
            any(isinstance(s, bool) or not isinstance(s, numbers.Integral) or s < 0 for s in shape):
        raise TypeError(f"attention_ext: dropout_mask shape must be a tuple of ints >= 0 (*batch, n, m), got {shape!r}")
    shape = tuple(int(s) for s in shape)
    if len(shape) < 2:
        raise ValueError(f"attention_ext: dropout_mask shape must be (*batch, n, m), got {shape}")
    dropout_p = _check_dropout(dropout_p)
    if not isinstance(rng_state, torch.Tensor) or rng_state.dtype != torch.int64 or rng_state.numel() != 2:
        raise TypeError("attention_ext: rng_state must be an int64 tensor (seed, offset) from draw_rng_state()")
    if dropout_p == 1.0:  # nothing survives
        return torch.zeros(shape, dtype=torch.bool, device=rng_state.device)
    return ops.dropout_keep_mask(rng_state, list(shape[:-2]), shape[-2], shape[-1], dropout_p)


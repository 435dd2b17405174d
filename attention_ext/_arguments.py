"""The rules the ops' arguments must follow, written once for Python: the public API (api.py)
enforces them with TypeError / ValueError before it calls an op, and the ops' fake kernels
(_ops.py) with torch._check, so that a call traced by torch.compile, or run on meta tensors, is
refused exactly when the compiled kernels (csrc/op_arguments.cpp, which checks the same rules for
direct torch.ops calls) would refuse it.

Each rule is one call check(holds, error type, message): `holds` may be a symbolic bool under
torch.compile (torch._check then turns it into a runtime assertion instead of a guard), and the
message is a callable, built only when the rule fails. `check` raises at the first rule that
fails, so a rule is only evaluated once the ones before it hold (the head-dim rule reads
shape[-1] only after the at-least-2-dims rule). `enforce` and `check_traced` are the two checks;
a call that passes costs about a microsecond per ten rules (decode-sized calls notice more).
"""
from __future__ import annotations

import math
import numbers
from typing import Callable

import torch

from ._constants import CAUSAL_CODES, FLOAT_DTYPES, LOG2E, lse_dtype, max_scale, scale_overflows

PREFIX = "attention_ext: "
MAX_WINDOW = 2 ** 62  # the largest window bound (the kernels add bounds to int64 positions)
_CAUSAL_CODE_VALUES = tuple(sorted(set(CAUSAL_CODES.values())))  # (a tuple: older dynamo traces `in` on it)


Check = Callable[[object, type, Callable[[], str]], None]


def flag(value, name: str, prefix: str = PREFIX, integers: bool = False) -> bool:
    """A bool argument: Python's bool, or NumPy's (np.True_), returned as Python's; with
    integers=True an int too (FlashAttention's functions: their flags reach torch's dispatcher or
    pybind11, which take 0 and 1); anything else (1 otherwise, "yes", a tensor) is a TypeError
    naming the type it got."""
    if isinstance(value, bool):
        return value
    kind = type(value)
    if kind.__module__ == "numpy" and kind.__name__ in ("bool_", "bool"):
        return bool(value)
    if integers and isinstance(value, numbers.Integral):
        return bool(value)
    shown = kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    raise TypeError(f"{prefix}{name} must be a bool, got {shown}")


def shape_is_one_of(shape, *allowed) -> bool:
    """Whether `shape` is one of the `allowed` tuples, compared size by size: `tuple(shape) in
    allowed` is False under torch.compile when a size is symbolic and the other fixed."""
    return any(len(shape) == len(a) and all(x == y for x, y in zip(shape, a)) for a in allowed)


def device_rule(check: Check, t: torch.Tensor, name: str, device: torch.device, cpu_ok: bool = False) -> None:
    """t on `device` (query's), or with cpu_ok also on the CPU (index tensors the kernels copy):
    every tensor argument's device rule. In a fake kernel this is also what refuses a stray meta
    tensor beside real ones: the dispatcher runs the fake kernel whenever any argument is on meta,
    and it would return uninitialised tensors."""
    check(t.device == device or (cpu_ok and t.device.type == "cpu"), ValueError,
          lambda: f"{name} must be on {device}{' (or the CPU)' if cpu_ok and device.type != 'cpu' else ''}, got "
                  f"{t.device}")


def tensor_rules(check: Check, t: torch.Tensor, name: str) -> None:
    """A query, key or value tensor: a supported float dtype and at least (length, head_dim)."""
    check(t.dtype in FLOAT_DTYPES, TypeError,
          lambda: f"{name} must be float64, float32, float16 or bfloat16, got {t.dtype}")
    check(t.dim() >= 2, ValueError,
          lambda: f"{name} must have at least 2 dims (..., length, head_dim), got shape {tuple(t.shape)}")


def qkv_rules(check: Check, query, key, value=None) -> None:
    """query, key and (unless None: attention_probs) value, each and together."""
    tensor_rules(check, query, "query")
    tensor_rules(check, key, "key")
    if value is not None:
        tensor_rules(check, value, "value")
    check(query.dtype == key.dtype and (value is None or value.dtype == query.dtype), TypeError,
          lambda: "query, key and value must have the same dtype, got " + _listed("dtype", query, key, value))
    check(query.device == key.device and (value is None or value.device == query.device), ValueError,
          lambda: "query, key and value must be on the same device, got " + _listed("device", query, key, value))
    check(query.shape[-1] == key.shape[-1], ValueError,
          lambda: f"query and key must have the same head dim (last dim), got query {tuple(query.shape)} "
          f"and key {tuple(key.shape)}")
    if value is not None:
        check(key.shape[-2] == value.shape[-2], ValueError,
              lambda: f"key and value must have the same length (dim -2), got key {tuple(key.shape)} "
              f"and value {tuple(value.shape)}")


def _listed(attribute, query, key, value):
    named = (("query", query), ("key", key)) + ((("value", value),) if value is not None else ())
    return ", ".join(f"{name} {getattr(t, attribute)}" for name, t in named)


def head_groups_rule(check: Check, heads: int, kv_heads: int, kv_name: str = "k and v") -> None:
    """GQA/MQA in the FlashAttention layouts: query heads in whole groups per key/value head."""
    check(kv_heads > 0 and heads % kv_heads == 0, ValueError,
          lambda: f"the number of heads in q ({heads}) must be a multiple of the number in {kv_name} ({kv_heads})")


def finite(x) -> bool:
    """Whether float x is finite (NaN and ±inf are not), written so torch.compile can trace it:
    Dynamo runs math.isfinite as a torch op that returns no tensor and stops the trace (a float
    traced as a symbol, dynamic=True, gets a guard on the comparison instead)."""
    return abs(x) < math.inf


def scale_rules(check: Check, scale: float, dtype: torch.dtype) -> None:
    """The kernels hold scale·log2(e) in the accumulation dtype (float32 for float32, float16 and
    bfloat16 inputs): a scale that is infinite there would turn every score into inf or NaN."""
    check(scale == scale, ValueError, lambda: f"scale must be a finite number, got {scale}")
    check(not scale_overflows(scale, dtype), ValueError,
          lambda: f"scale must be finite in the {lse_dtype(dtype)} accumulation of {dtype} inputs "
          f"(|scale| <= {max_scale(dtype):.4g}), got {scale}")


def dropout_rules(check: Check, dropout_p: float) -> None:
    check(0.0 <= dropout_p < 1.0, ValueError, lambda: f"dropout_p must be in [0, 1), got {dropout_p}")


def rng_state_rules(check: Check, rng_state, device) -> None:
    """The (seed, offset) pair dropout draws from."""
    check(rng_state is not None, ValueError, lambda: "dropout_p > 0 needs an rng_state tensor")
    check(rng_state.dtype == torch.int64 and rng_state.numel() == 2, TypeError,
          lambda: f"rng_state must be an int64 tensor of 2 elements (seed, offset), got {rng_state.dtype} "
          f"of shape {tuple(rng_state.shape)}")
    device_rule(check, rng_state, "rng_state", device)


def mask_rules(check: Check, attn_mask: torch.Tensor, query: torch.Tensor, float32_taken: bool = False) -> None:
    """A boolean mask (True: the key takes part) or an additive one in the query's dtype (the ops'
    rule). float32_taken: the public functions, which also take a float32 mask (as torch does) and
    say so when they refuse one."""
    also = "float32 or " if float32_taken else ""
    check(attn_mask.dtype == torch.bool or attn_mask.dtype == query.dtype, TypeError,
          lambda: f"attn_mask must be bool, or a float mask in {also}the query's dtype ({query.dtype}), got "
          f"{attn_mask.dtype}")
    device_rule(check, attn_mask, "attn_mask", query.device)


def band_rules(check: Check, causal, window_left, window_right, n, m) -> None:
    """The causal code and the sliding window as the ops take them (-1: unbounded side). A window
    is aligned bottom-right; top-left causal agrees with that only when n == m."""
    check(causal in _CAUSAL_CODE_VALUES, ValueError,
          lambda: f"causal must be 0 (none), 1 (top-left) or 2 (bottom-right), got {causal}")
    check(window_left >= -1 and window_right >= -1, ValueError,
          lambda: f"window bounds must be >= 0, or -1 for unbounded, got ({window_left}, {window_right})")
    check(window_left <= MAX_WINDOW and window_right <= MAX_WINDOW, ValueError,
          lambda: f"window bounds must be at most 2**62 (the kernels add them to int64 positions), got "
          f"({window_left}, {window_right}); use -1 (None) for unbounded")
    check(causal != CAUSAL_CODES["top_left"] or (window_left < 0 and window_right < 0) or n == m, ValueError,
          lambda: f"a sliding window is aligned bottom-right and cannot be combined with top-left causal when "
          f"queries ({n}) and keys ({m}) differ in number; use bottom-right causal")


def softcap_rules(check: Check, softcap: float, dtype: torch.dtype) -> None:
    """The kernels hold softcap·log2(e) and its reciprocal in the accumulation dtype: a softcap
    that overflows there, or underflows below its normal range, would give NaN or silently none."""
    check(finite(softcap) and softcap >= 0.0, ValueError,
          lambda: f"softcap must be a finite number >= 0 (0: none), got {softcap}")
    acc = torch.finfo(lse_dtype(dtype))
    top = min(acc.max, 1.0 / acc.tiny)  # (the reciprocal must stay a normal number too)
    check(softcap == 0.0 or acc.tiny <= softcap * LOG2E <= top, ValueError,
          lambda: f"softcap must be within the {lse_dtype(dtype)} accumulation of {dtype} inputs "
          f"({acc.tiny / LOG2E:.4g} <= softcap <= {top / LOG2E:.4g}, or 0 for none), got {softcap}")


def per_head_rules(check: Check, values: torch.Tensor, name: str, dtype: torch.dtype, query: torch.Tensor,
                   batch) -> None:
    """One value per batch position (per head: ALiBi slopes, float32; sinks, the lse's dtype): a
    shape broadcasting to the batch dims."""
    check(values.dtype == dtype, TypeError,
          lambda: f"{name} must be {dtype} for {query.dtype} inputs, got {values.dtype}")
    device_rule(check, values, name, query.device)
    shape = tuple(values.shape)
    check(len(shape) <= len(batch) and all(s == 1 or s == b for s, b in zip(reversed(shape), reversed(batch))),
          ValueError, lambda: f"{name} of shape {shape} does not broadcast to the batch dims {tuple(batch)} "
          "(one value per head: (heads,) or (batch, heads) for (batch, heads, n, d) inputs)")


def op_rules(check: Check, query, key, value, attn_mask, scale, causal, window_left, window_right, softcap,
             alibi_slopes, sinks, dropout_p, rng_state) -> None:
    """Every rule of one op call (attention_fwd / attention_bwd / attention_probs; value None for
    the last), with causal as the ops take it: an integer code."""
    qkv_rules(check, query, key, value)
    scale_rules(check, scale, query.dtype)
    band_rules(check, causal, window_left, window_right, query.shape[-2], key.shape[-2])
    softcap_rules(check, softcap, query.dtype)
    if alibi_slopes is not None or sinks is not None:
        shapes = (query.shape[:-2], key.shape[:-2]) + (() if value is None else (value.shape[:-2],))
        batch = torch.broadcast_shapes(*shapes)
        if alibi_slopes is not None:
            per_head_rules(check, alibi_slopes, "alibi_slopes", torch.float32, query, batch)
        if sinks is not None:
            per_head_rules(check, sinks, "sinks", lse_dtype(query.dtype), query, batch)
    dropout_rules(check, dropout_p)
    if dropout_p > 0.0:
        rng_state_rules(check, rng_state, query.device)
    if attn_mask is not None:
        mask_rules(check, attn_mask, query)


MAX_BATCH_DIMS = 8  # the kernels' (csrc/attention_params.h); the public API merges leading dims past it


def op_batch_rules(check: Check, query, key, value, attn_mask) -> None:
    """The ops' batch dims (csrc/op_arguments.cpp): those of query, key and value (None:
    attention_probs) broadcast together, at most MAX_BATCH_DIMS of them, key and value with the
    same ones (the backward owns dK and dV per key position), and the mask broadcasts to the
    weights' (batch..., n, m). The public API shapes its calls so; a direct op call, traced or on
    meta tensors, is held to them here."""
    tensors = (("query", query), ("key", key)) + ((("value", value),) if value is not None else ())
    nd = max(t.dim() for _, t in tensors) - 2
    batch = [1] * nd
    for name, t in tensors:
        for i, size in enumerate(t.shape[:-2]):
            d = nd - (t.dim() - 2) + i
            check(size == 1 or batch[d] == 1 or batch[d] == size, ValueError,
                  lambda name=name, size=size, d=d: f"the batch dims of query {tuple(query.shape)}, key "
                  f"{tuple(key.shape)}" + (f" and value {tuple(value.shape)}" if value is not None else "") +
                  f" do not broadcast ({name} has size {size} at batch dim {d})")
            if size != 1:
                batch[d] = size
    check(nd <= MAX_BATCH_DIMS, ValueError,
          lambda: f"at most {MAX_BATCH_DIMS} batch dims are supported, got {nd} (reshape the leading dims together)")
    if value is not None:
        def padded(t):  # (batch dims aligned right, missing ones 1)
            return [1] * (nd - (t.dim() - 2)) + list(t.shape[:-2])

        check(padded(key) == padded(value), ValueError,
              lambda: f"key and value must have the same batch dims at the op level, got key {tuple(key.shape)} and "
              f"value {tuple(value.shape)}")
    if attn_mask is not None:
        target = list(batch) + [query.shape[-2], key.shape[-2]]
        shape = tuple(attn_mask.shape)
        check(len(shape) <= len(target) and all(s == 1 or s == t for s, t in zip(reversed(shape), reversed(target))),
              ValueError, lambda: f"attn_mask of shape {shape} does not broadcast to the attention weights' shape "
              f"{tuple(target)}")


def enforce(holds, error: type, message: Callable[[], str]) -> None:
    """The public API's check: a rule that fails raises its own error type."""
    if not holds:
        raise error(PREFIX + message())


def check_traced(holds, error: type, message: Callable[[], str]) -> None:
    """The fake kernels' check: torch._check, a RuntimeError like the C++ TORCH_CHECK, and with
    symbolic shapes a runtime assertion instead of a guard."""
    torch._check(holds, lambda: PREFIX + message())

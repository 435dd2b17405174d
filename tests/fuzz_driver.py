#!/usr/bin/env python
"""Argument fuzzer for attention_ext's entry points; tests/test_fuzz.py runs it in a subprocess.

    python tests/fuzz_driver.py --seed 1 --iterations 2000 --log /tmp/fuzz.log
    python tests/fuzz_driver.py --seed 1 --start 1234 --iterations 1 --verbose   # replay call 1234

It fuzzes whichever attention_ext Python imports (the installed one, or a checkout on PYTHONPATH;
tests/test_fuzz.py passes the one the test process imported) and names it in its summary.

Each call starts from a valid problem (random shapes, dtypes, layouts, masks) and applies 0 to 3
random mutations — wrong types, dims, dtypes, mixed dtypes or devices, 'meta' tensors,
non-broadcastable masks, NaN / inf / negative / zero / huge scales, out-of-range dropout, zero
sizes, non-tensor arguments, huge (stride-0 or meta) dims, unknown keywords — so most calls are
invalid. Call i is a function of (seed, i) alone, so --start i --iterations 1 replays it.

Before each call the driver writes `CALL <i> <description>` to the log and flushes it, so when
the process dies (segfault, abort, sanitizer report) the last CALL line names the offending
arguments. A call passes if it
  * raises a TypeError, ValueError or RuntimeError (NotImplementedError included) with a
    message, or
  * returns what the float64 reference (attention_ext.reference) gives for the same arguments:
    same structure, shape, dtype and device; values within a tolerance derived from the dtype
    and the size of the scores (meta tensors: shape and dtype only). Dropout is replayed from
    (seed, offset) with draw_rng_state / dropout_mask. Where inputs require grad, gradients are
    compared with autograd through the reference too.
A call the library accepts but the reference cannot compute (it raises) fails: the library
should have raised; a call with no mutation is valid, and fails if it raises anything at all.
Non-finite tensor values are not generated (see tests/test_numerics.py).

The last stdout line is a JSON summary; the exit status is 0 when every call passed, 1 if any
failed (each failure is printed and logged as `FAIL <i> ...`).
"""
from __future__ import annotations

import argparse
import decimal
import fractions
import json
import math
import os
import random
import sys
import traceback
from collections import Counter

import numpy as np
import torch

import attention_ext
from attention_ext.reference import attention_reference, expand_gqa

ops = torch.ops.attention_ext
DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
LOW = (torch.float16, torch.bfloat16)
ATOL = {torch.float64: 1e-10, torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
ALLOWED = (TypeError, ValueError, RuntimeError)
HUGE = [2 ** 40, 2 ** 50, 2 ** 62]
# Above this many (virtual) elements a result is checked on meta copies: shape and dtype only.
MATERIAL_LIMIT = 5_000_000


# ----------------------------------------------------------------------------------------------
# Describing arguments for the log.

def describe(x):
    if isinstance(x, torch.Tensor):
        kind = type(x).__name__
        if kind == "CausalBias":  # (first: older torch's CausalBias refuses even .device)
            return (f"CausalBias({getattr(x, 'variant', '?')}, {getattr(x, 'seq_len_q', '?')}, "
                    f"{getattr(x, 'seq_len_kv', '?')})")
        try:
            layout = "" if x.layout == torch.strided else f", layout={x.layout}"
            stride = f", stride={tuple(x.stride())}" if x.layout == torch.strided else ""
        except Exception:  # pragma: no cover - exotic tensors
            layout, stride = "", ""
        extra = ""
        if x.device.type != "meta" and x.layout == torch.strided and 0 < x.numel() <= 1_000_000 and \
                x.dtype.is_floating_point and x.dtype.itemsize >= 2:
            v = x.detach().double()
            extra = f", range=[{v.min().item():.3g}, {v.max().item():.3g}]"
        if x.requires_grad:
            extra += ", requires_grad"
        return (f"{kind}(shape={tuple(x.shape)}{stride}, {x.dtype}, {x.device}{layout}{extra})")
    if isinstance(x, (list, tuple)) and len(x) > 8:
        return f"{type(x).__name__}(len={len(x)})"
    if isinstance(x, np.ndarray):
        return f"ndarray(shape={x.shape}, {x.dtype})"
    if isinstance(x, float):
        return repr(x)
    if isinstance(x, int) and abs(x) > 10 ** 20:
        return f"int(~1e{len(str(abs(x))) - 1})"
    return repr(x)


def describe_call(spec):
    args = ", ".join(describe(a) for a in spec["args"])
    kwargs = ", ".join(f"{k}={describe(v)}" for k, v in spec["kwargs"].items())
    return f"{spec['fn']}({', '.join(p for p in (args, kwargs) if p)}) mutations={spec['mutations']}"


# ----------------------------------------------------------------------------------------------
# Generating a valid problem.

def randn(g, shape, dtype, scale=1.0):
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype)


def layout_tensor(r, g, shape, dtype, scale=1.0):
    """A tensor of `shape` in a random layout: contiguous, transposed, sliced or expanded."""
    kind = r.choice(["contiguous"] * 3 + ["transposed", "sliced", "expanded"])
    shape = tuple(shape)
    if kind == "transposed" and len(shape) >= 2:
        return randn(g, (*shape[:-2], shape[-1], shape[-2]), dtype, scale).transpose(-1, -2)
    if kind == "sliced" and len(shape) >= 2:
        base = randn(g, (*shape[:-2], 2 * shape[-2] + 1, shape[-1] + 2), dtype, scale)
        return base[..., 1:1 + 2 * shape[-2]:2, 1:1 + shape[-1]]
    if kind == "expanded" and len(shape) >= 3:
        small = (1,) * (len(shape) - 2) + shape[-2:]
        return randn(g, small, dtype, scale).expand(*shape)
    return randn(g, shape, dtype, scale)


def make_mask(r, g, target, dtype):
    """A mask broadcasting to `target` (…, n, m): bool or float (with -inf / finfo.min entries)."""
    nd = r.choice([0, 1, 2, len(target), len(target), len(target)])
    nd = min(nd, len(target))
    shape = [s if r.random() < 0.7 else 1 for s in target[len(target) - nd:]]
    if r.random() < 0.4:
        mask = torch.rand(shape, generator=g, dtype=torch.float64) < r.choice([0.3, 0.8, 1.0])
    else:
        vals = randn(g, shape, torch.float64, r.choice([1.0, 1.0, 10.0]))
        drop = torch.rand(shape, generator=g, dtype=torch.float64) < r.choice([0.0, 0.2, 0.5])
        fill = torch.finfo(dtype).min if r.random() < 0.3 else -math.inf
        mask = vals.masked_fill(drop, fill).to(dtype)
    if mask.dim() >= 2 and r.random() < 0.2:
        mask = mask.transpose(-1, -2).contiguous().transpose(-1, -2)
    return mask


def valid_problem(r, g):
    dtype = r.choice(DTYPES)
    nb = r.choice([0, 1, 1, 2, 2, 3])
    batch = [r.choice([1, 2, 3]) for _ in range(nb)]
    n = 0 if r.random() < 0.02 else r.choice([1, 2, 3, 5, 9, 17, 33, 64, 65])
    m = 0 if r.random() < 0.02 else r.choice([1, 2, 3, 7, 16, 31, 64, 66])
    dk = r.choice([1, 2, 3, 8, 16, 33, 64] + ([0] if r.random() < 0.1 else []))
    dv = r.choice([1, 2, 4, 8, 16, 31, 64] + ([0] if r.random() < 0.1 else []))
    # Keep the reference cheap: at most ~20k attention weights per call.
    while batch and math.prod(batch) * max(n, 1) * max(m, 1) > 20_000:
        batch[batch.index(max(batch))] = 1
    qb = [s if r.random() < 0.8 else 1 for s in batch]
    kb = [s if r.random() < 0.8 else 1 for s in batch]
    if r.random() < 0.2 and kb:
        kb = kb[1:]
    vb = list(kb) if r.random() < 0.8 else [1] * len(kb)
    scale_qk = r.choice([1.0, 1.0, 1.0, 0.1, 3.0])
    q = layout_tensor(r, g, (*qb, n, dk), dtype, scale_qk)
    k = layout_tensor(r, g, (*kb, m, dk), dtype, scale_qk)
    v = layout_tensor(r, g, (*vb, m, dv), dtype)
    target = (*torch.broadcast_shapes(tuple(qb), tuple(kb), tuple(vb)), n, m)
    mask = make_mask(r, g, target, dtype) if r.random() < 0.5 else None
    return dict(dtype=dtype, q=q, k=k, v=v, mask=mask, n=n, m=m, target=target)


# ----------------------------------------------------------------------------------------------
# Mutations of a public-API call. Each takes (r, g, spec) and edits spec["args"] / ["kwargs"].

def weird_object(r, g, like=None):
    """Something that is not a valid query/key/value/mask: another type, dtype, layout or rank."""
    options = [lambda: None, lambda: 3, lambda: 2.5, lambda: "query", lambda: [[1.0, 2.0]], lambda: (1, 2),
               lambda: {"a": 1}, lambda: object(), lambda: np.ones((2, 3, 4)), lambda: torch.tensor(1.0),
               lambda: torch.ones(4), lambda: torch.ones(2, 3, 4, dtype=torch.int64),
               lambda: torch.ones(2, 3, 4, dtype=torch.bool),
               lambda: torch.ones(2, 3, 4, dtype=torch.complex64),
               lambda: torch.ones(2, 3, 4).to(torch.float8_e4m3fn),
               lambda: torch.ones(2, 3, 4, dtype=torch.uint8)]
    if plain_tensor(like) and like.numel() < 100_000:
        options += [lambda: like.to(torch.int32), lambda: like.to(torch.complex64),
                    lambda: like.detach().to(torch.float32).to_sparse(), lambda: like.reshape(-1)]
    return r.choice(options)()


TENSOR_SLOTS = {"sdpa": ["query", "key", "value", "attn_mask"],
                "attention": ["query", "key", "value", "attn_mask"],
                "weights": ["query", "key", "attn_mask"]}


def get_slot(spec, name):
    pos = {"query": 0, "key": 1, "value": 2}
    if name in pos and pos[name] < len(spec["args"]):
        return spec["args"][pos[name]]
    return spec["kwargs"].get(name)


def set_slot(spec, name, value):
    pos = {"query": 0, "key": 1, "value": 2}
    if name in pos and pos[name] < len(spec["args"]):
        spec["args"][pos[name]] = value
    else:
        spec["kwargs"][name] = value


def plain_tensor(x):
    """A tensor the mutations may transform (not a CausalBias: torch ops on one give a broken
    CausalBias without its attributes, which no API could make sense of)."""
    return isinstance(x, torch.Tensor) and type(x).__name__ != "CausalBias"


def pick_tensor_slot(r, spec, include_mask=True):
    slots = [s for s in TENSOR_SLOTS[spec["fn"]] if include_mask or s != "attn_mask"]
    slots = [s for s in slots if plain_tensor(get_slot(spec, s))]
    return r.choice(slots) if slots else None


def m_replace_tensor(r, g, spec):
    slot = r.choice(TENSOR_SLOTS[spec["fn"]])
    set_slot(spec, slot, weird_object(r, g, get_slot(spec, slot)))


def m_mix_dtype(r, g, spec):
    slot = pick_tensor_slot(r, spec)
    if slot:
        t = get_slot(spec, slot)
        set_slot(spec, slot, t.to(r.choice([d for d in DTYPES if d != t.dtype])))


def m_meta(r, g, spec):
    slots = TENSOR_SLOTS[spec["fn"]] if r.random() < 0.5 else [pick_tensor_slot(r, spec)]
    for slot in slots:
        t = get_slot(spec, slot)
        if plain_tensor(t):
            set_slot(spec, slot, t.to("meta"))


def m_reshape(r, g, spec):
    """Changes one dim of one tensor (head dim, length, a batch dim), adds or removes dims."""
    slot = pick_tensor_slot(r, spec)
    if not slot:
        return
    t = get_slot(spec, slot)
    how = r.choice(["dim", "dim", "add_leading", "many_leading", "drop", "to_1d", "to_0d"])
    shape = list(t.shape)
    if how == "dim" and shape:
        i = r.randrange(len(shape))
        shape[i] = r.choice([0, 1, 2, 5, 7, 70, shape[i] + 1])
        new = randn(g, shape, t.dtype) if t.dtype.is_floating_point else torch.rand(shape, generator=g) < 0.5
        set_slot(spec, slot, new.to(t.device) if t.device.type == "meta" else new)
    elif how == "add_leading":
        set_slot(spec, slot, t.reshape(*([r.choice([1, 2])] if r.random() < 0.5 else [1]), *shape)
                 if r.random() < 0.5 else t.unsqueeze(0).expand(r.choice([1, 2, 4]), *shape))
    elif how == "many_leading":
        set_slot(spec, slot, t.reshape(*([1] * r.choice([6, 7, 8, 9, 12])), *shape))
    elif how == "drop" and t.dim() >= 1:
        set_slot(spec, slot, t.select(0, 0) if shape[0] > 0 else t.sum(0))
    elif how == "to_1d":
        set_slot(spec, slot, t.reshape(-1))
    elif how == "to_0d" and t.numel() > 0:
        set_slot(spec, slot, t.reshape(-1)[0])


def m_zero_size(r, g, spec):
    slot = pick_tensor_slot(r, spec)
    if slot:
        t = get_slot(spec, slot)
        if t.dim():
            i = r.randrange(t.dim())
            set_slot(spec, slot, t.narrow(i, 0, 0))


def m_huge(r, g, spec):
    """Huge dims that cost nothing: meta tensors of any size, or CPU stride-0 expansions of the
    query rows / batch (whose output cannot be allocated), never of keys or head dims on CPU
    (a valid call with those would run for hours)."""
    q = get_slot(spec, "query")
    if not isinstance(q, torch.Tensor) or q.dim() < 2:
        return
    big = r.choice(HUGE)
    if r.random() < 0.5 or q.device.type == "meta":
        slot = pick_tensor_slot(r, spec)
        t = get_slot(spec, slot)
        if t.dim() == 0:
            return
        shape = list(t.shape)
        shape[r.randrange(len(shape))] = big
        try:
            set_slot(spec, slot, torch.empty(shape, dtype=t.dtype, device="meta"))
        except RuntimeError:
            return  # the size overflows int64 storage: torch itself refuses to build it
        for other in TENSOR_SLOTS[spec["fn"]]:
            o = get_slot(spec, other)
            if plain_tensor(o) and o.device.type != "meta":
                set_slot(spec, other, o.to("meta"))
    else:
        shape = list(q.shape)
        which = r.choice(["rows", "batch"]) if q.dim() > 2 else "rows"
        if which == "rows":
            shape[-2] = big
        else:
            shape[0] = big
        small = [1 if i in (len(shape) - 2 if which == "rows" else 0,) else s for i, s in enumerate(shape)]
        try:
            set_slot(spec, "query", randn(g, small, q.dtype).expand(*shape))
        except RuntimeError:
            return


def m_mask(r, g, spec):
    q, k = get_slot(spec, "query"), get_slot(spec, "key")
    if not isinstance(q, torch.Tensor) or not isinstance(k, torch.Tensor) or q.dim() < 2 or k.dim() < 2:
        return
    from torch.nn.attention.bias import causal_lower_right, causal_upper_left
    n, m = q.shape[-2], k.shape[-2]
    dtype = q.dtype if q.dtype.is_floating_point else torch.float32
    choice = r.choice(["int", "other_float", "no_broadcast", "too_many_dims", "meta", "non_tensor",
                       "causal_bias", "causal_bias_wrong_size", "requires_grad"])
    if choice == "int":
        mask = torch.ones(n, m, dtype=r.choice([torch.int64, torch.int32, torch.uint8]))
    elif choice == "other_float":
        mask = torch.zeros(n, m, dtype=r.choice([d for d in DTYPES if d != dtype]))
    elif choice == "no_broadcast":
        mask = torch.zeros(n + r.choice([1, 2]), m + r.choice([0, 1]), dtype=dtype)
    elif choice == "too_many_dims":
        mask = torch.zeros(*([2] * r.choice([3, 5, 9])), n, m, dtype=dtype)
    elif choice == "meta":
        mask = torch.zeros(n, m, dtype=dtype, device="meta")
    elif choice == "non_tensor":
        mask = r.choice([[[True] * m] * n, 0.5, True, np.zeros((n, m), dtype=bool), "causal"])
    elif choice == "causal_bias":
        mask = (causal_upper_left if r.random() < 0.5 else causal_lower_right)(n, m)
    elif choice == "causal_bias_wrong_size":
        mask = (causal_upper_left if r.random() < 0.5 else causal_lower_right)(n + 1, m + r.choice([0, 2]))
    else:
        mask = randn(g, (n, m), dtype).requires_grad_()
    set_slot(spec, "attn_mask", mask)


SCALES = [math.nan, math.inf, -math.inf, 0.0, -0.0, -1.5, 1e3, -1e3, 1e300, 1e39, 1e-320, 10 ** 400, True,
          "0.5", [0.5], 1j, np.float32(0.5), np.float64(math.nan), np.int64(2), fractions.Fraction(1, 3),
          decimal.Decimal("0.5"), 7, None]


def scale_value(r, g):
    choice = r.randrange(len(SCALES) + 8)
    if choice < len(SCALES):
        return SCALES[choice]
    return [torch.tensor(0.5), torch.tensor([0.5, 1.0]), torch.tensor(2), torch.tensor(True),
            torch.tensor(math.nan), torch.empty((), device="meta"), torch.tensor(0.5, requires_grad=True),
            torch.tensor(0.25, dtype=torch.float16)][choice - len(SCALES)]


def m_scale(r, g, spec):
    spec["kwargs"]["scale"] = scale_value(r, g)


def m_dropout(r, g, spec):
    if spec["fn"] == "weights":
        spec["kwargs"]["dropout_p"] = 0.1  # not a parameter: TypeError
        return
    spec["kwargs"]["dropout_p"] = r.choice([-0.1, 1.0, 1.5, math.nan, math.inf, True, "0.1", None,
                                            torch.tensor(0.1), 0.5, 0.2, 1e-300, 0.999, np.float64(0.2),
                                            10 ** 400, -0.0])


def m_causal(r, g, spec):
    if spec["fn"] == "sdpa":
        spec["kwargs"]["is_causal"] = r.choice([True, True, 1, "yes", None, np.bool_(True), 0.0, False])
    else:
        spec["kwargs"]["causal"] = r.choice(["lower", "TOP_LEFT", 1, 0, [], True, None, "top_left",
                                             "bottom_right", "bottom_right"])


def m_window(r, g, spec):
    if spec["fn"] != "sdpa":
        spec["kwargs"]["window"] = r.choice([(-2, 0), (0, -5), (1,), "left", (1.5, 2), (True, 0), (3, 2), (0, None)])


def m_gqa(r, g, spec):
    spec["kwargs"]["enable_gqa"] = r.choice([True, True, True, 1, None, "yes", np.bool_(True), False])
    q, k, v = (get_slot(spec, s) for s in ("query", "key", "value"))
    # Give GQA a chance: query heads a multiple of the key/value heads.
    if r.random() < 0.6 and all(isinstance(t, torch.Tensor) and t.dim() >= 3 for t in (q, k)):
        groups = r.choice([2, 3])
        if q.device.type == "meta":
            shape = (*q.shape[:-3], q.shape[-3] * groups, *q.shape[-2:])
            set_slot(spec, "query", torch.empty(shape, dtype=q.dtype, device="meta"))
        else:
            set_slot(spec, "query", torch.cat([q] * groups, dim=-3))
        if r.random() < 0.5:
            spec["kwargs"].pop("attn_mask", None)


def m_return_lse(r, g, spec):
    if spec["fn"] == "attention":
        spec["kwargs"]["return_lse"] = r.choice([True, 1, None, "yes", False])


def m_extra_args(r, g, spec):
    if r.random() < 0.5:
        spec["kwargs"][r.choice(["dropout", "mask", "causal_kind", "is_causal", "bogus"])] = True
    else:
        spec["args"] = spec["args"] + [None] * r.choice([1, 5])


def m_requires_grad(r, g, spec):
    for slot in ("query", "key", "value", "attn_mask"):
        t = get_slot(spec, slot)
        if plain_tensor(t) and t.is_floating_point() and t.is_leaf and r.random() < 0.7:
            set_slot(spec, slot, t.detach().clone().requires_grad_())


def m_missing_args(r, g, spec):
    spec["args"] = spec["args"][:r.randrange(len(spec["args"]))]


PUBLIC_MUTATIONS = [(m_replace_tensor, 3), (m_mix_dtype, 2), (m_meta, 2), (m_reshape, 4), (m_zero_size, 2),
                    (m_huge, 2), (m_mask, 3), (m_scale, 4), (m_dropout, 2), (m_causal, 2), (m_window, 1), (m_gqa, 2),
                    (m_return_lse, 1), (m_extra_args, 1), (m_requires_grad, 2), (m_missing_args, 1)]


def public_call(r, g):
    p = valid_problem(r, g)
    fn = r.choice(["sdpa", "sdpa", "attention", "attention", "weights"])
    kwargs = {}
    if fn == "weights":
        args = [p["q"], p["k"]]
    else:
        args = [p["q"], p["k"], p["v"]]
    if p["mask"] is not None:
        kwargs["attn_mask"] = p["mask"]
    if fn != "sdpa" and r.random() < 0.5:
        kwargs["causal"] = r.choice([None, "top_left", "bottom_right"])
    if fn != "sdpa" and r.random() < 0.3 and (kwargs.get("causal") != "top_left" or
                                              p["q"].shape[-2] == p["k"].shape[-2]):
        # (a window is bottom-right aligned: with top-left causal only when n == m)
        kwargs["window"] = r.choice([None, (2, 0), (0, 0), (None, 3), (4, None), (1, 1)])
    if fn != "sdpa" and r.random() < 0.2:
        kwargs["softcap"] = r.choice([None, 5.0, 30.0])
    if fn != "sdpa" and r.random() < 0.15 and p["q"].dim() >= 3:
        kwargs["alibi_slopes"] = torch.rand(p["q"].shape[-3]).to(p["q"].device)
    if fn != "sdpa" and r.random() < 0.15 and p["q"].dim() >= 3:
        kwargs["sinks"] = torch.randn(p["q"].shape[-3]).to(p["q"].device)
    if r.random() < 0.3:
        kwargs["scale"] = r.choice([None, 0.5, -1.0, 0.0, 2.0])
    spec = dict(fn=fn, args=args, kwargs=kwargs, mutations=[])
    n_mut = r.choices([0, 1, 2, 3], weights=[2, 5, 3, 2])[0]
    fns, weights = zip(*PUBLIC_MUTATIONS)
    for mut in r.choices(fns, weights=weights, k=n_mut):
        spec["mutations"].append(mut.__name__[2:])
        mut(r, g, spec)
    return spec


# ----------------------------------------------------------------------------------------------
# Raw ops: attention_fwd / attention_probs / attention_bwd / dropout_keep_mask (public too).

def raw_call(r, g):
    p = valid_problem(r, g)
    q, k, v, mask = p["q"], p["k"], p["v"], p["mask"]
    # At the op level K and V have the same batch dims.
    v = v.expand(*torch.broadcast_shapes(k.shape[:-2], v.shape[:-2]), *v.shape[-2:])
    k = k.expand(*v.shape[:-2], *k.shape[-2:])
    scale = r.choice([1.0, 0.5, -0.25, 0.0])
    causal = r.choice([0, 1, 2])
    window = r.choice([(-1, -1), (-1, -1), (-1, -1), (2, 0), (0, 3), (5, -1), (-1, 2)])
    if causal == 1 and q.shape[-2] != k.shape[-2]:  # a window is bottom-right: top-left only when n == m
        window = (-1, -1)
    softcap = r.choice([0.0, 0.0, 0.0, 5.0, 30.0])
    # ALiBi: one slope per batch position of the last batch dim (a head), or one for all.
    alibi = None
    batch = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2])
    if r.random() < 0.2 and len(batch) >= 1:
        alibi = torch.rand(r.choice([1, batch[-1]])).to(q.device)
    sinks = None
    if r.random() < 0.2 and len(batch) >= 1:
        sinks = (torch.randn(r.choice([1, batch[-1]])) * 2).to(q.device, LSE_DTYPE.get(q.dtype, torch.float32))
    dropout_p = r.choice([0.0, 0.0, 0.3])
    rng = torch.tensor([r.randrange(-2 ** 63, 2 ** 63), r.randrange(-2 ** 63, 2 ** 63)], dtype=torch.int64)
    fn = r.choice(["op_fwd", "op_fwd", "op_probs", "op_bwd", "op_bwd", "op_dropout_mask"])
    muts = []
    if r.random() < 0.1:
        causal = r.choice([-1, 3, 7, 2 ** 40, -2 ** 62])
        muts.append("causal")
    if r.random() < 0.05:
        window = r.choice([(-2, 0), (0, -3), (-2 ** 40, 1)])
        muts.append("window")
    if r.random() < 0.1:
        scale = r.choice([math.nan, math.inf, -math.inf, 1e39, 1e300])
        muts.append("scale")
    if r.random() < 0.1:
        dropout_p = r.choice([-0.5, 1.0, 2.0, math.nan])
        muts.append("dropout_p")
    if r.random() < 0.05:
        rng = r.choice([None, rng.to(torch.int32), torch.zeros(3, dtype=torch.int64),
                        torch.zeros(4, dtype=torch.int64)[::2], rng.to("meta"), rng.double()])
        muts.append("rng_state")
        if dropout_p == 0.0:
            dropout_p = 0.3
    if r.random() < 0.2:
        which = r.choice(["q", "k", "v", "mask"])
        obj = dict(q=q, k=k, v=v, mask=mask)[which]
        if isinstance(obj, torch.Tensor) and r.random() < 0.5:
            new = r.choice([lambda: obj.to("meta"),
                            lambda: obj.reshape(*([1] * r.choice([7, 9])), *obj.shape),
                            lambda: obj.narrow(-1, 0, 0)])()
        else:
            new = weird_object(r, g, obj)
        if which == "q":
            q = new
        elif which == "k":
            k = new
        elif which == "v":
            v = new
        else:
            mask = new if (new is None or isinstance(new, torch.Tensor)) else mask
        muts.append(f"replace_{which}")
    if fn == "op_fwd":
        args = [q, k, v, mask, scale, causal, *window, softcap, alibi, sinks, dropout_p, rng]
    elif fn == "op_probs":
        args = [q, k, mask, scale, causal, *window, softcap, alibi, sinks]
    elif fn == "op_dropout_mask":
        shape = list(p["target"])
        if r.random() < 0.3:
            shape[r.randrange(len(shape))] = r.choice([-1, -5, 2 ** 40, 0])
            muts.append("shape")
        args = [rng, shape[:-2], shape[-2], shape[-1], dropout_p if dropout_p != 0.0 else 0.5]
    else:
        args = ["bwd", q, k, v, mask, scale, causal, *window, softcap, alibi, sinks, dropout_p, rng]
        muts.append(r.choice(["none", "none", "grad_out_shape", "grad_out_dtype", "out_shape", "lse_dtype",
                              "lse_shape", "grad_lse_shape", "grad_lse", "mask_grad", "mask_grad_bool",
                              "grad_out_meta", "noncontiguous_grad_out"]))
    return dict(fn=fn, args=args, kwargs={}, mutations=muts)


# ----------------------------------------------------------------------------------------------
# Calling and checking.

def to_float(x):
    if isinstance(x, torch.Tensor):
        return float(x.item())
    return float(x)


def effective_public(spec):
    """What a successful public call means: (q, k, v, mask, band, scale, p, gqa, return_lse), band
    the reference's causal and window keywords."""
    from torch.nn.attention.bias import CausalBias, CausalVariant
    fn, a, kw = spec["fn"], spec["args"], spec["kwargs"]
    q, k = a[0], a[1]
    v = a[2] if fn != "weights" else None
    mask = kw.get("attn_mask")
    causal = kw.get("causal")
    if fn == "sdpa":
        causal = "top_left" if kw.get("is_causal") else None
    if isinstance(mask, CausalBias):
        causal = "top_left" if mask.variant == CausalVariant.UPPER_LEFT else "bottom_right"
        # The bias's own sizes must be the problem's, as torch requires.
        if (mask.seq_len_q, mask.seq_len_kv) != (q.shape[-2], k.shape[-2]):
            raise ValueError(f"CausalBias of size ({mask.seq_len_q}, {mask.seq_len_kv}) for n={q.shape[-2]}, "
                             f"m={k.shape[-2]}: the reference cannot apply it")
        mask = None
    scale = kw.get("scale")
    scale = None if scale is None else to_float(scale)
    p = to_float(kw.get("dropout_p", 0.0))
    band = dict(causal=causal, window=kw.get("window"), softcap=kw.get("softcap") or 0.0,
                alibi_slopes=kw.get("alibi_slopes"), sinks=kw.get("sinks"))
    return q, k, v, mask, band, scale, p, bool(kw.get("enable_gqa", False)), kw.get("return_lse", False)


def virtual_size(*ts):
    return sum(t.numel() for t in ts if isinstance(t, torch.Tensor))


def as_meta(t):
    return t if t is None or t.device.type == "meta" else torch.empty_like(t, device="meta")


def score_size(q, k, mask, scale, gqa=False):
    """max |scaled score| + max |finite mask entry|: how large the logits are (error grows with it)."""
    if q.numel() == 0 or k.numel() == 0:
        return 0.0
    if gqa and q.dim() >= 3 and k.dim() >= 3 and q.shape[-3] != k.shape[-3]:
        k, _ = expand_gqa(q, k, k)
    s = (q.double() @ k.double().transpose(-1, -2)).abs().max().item()
    s *= abs(scale) if scale is not None else 1.0 / math.sqrt(max(k.shape[-1], 1))
    if mask is not None and mask.dtype != torch.bool and mask.numel():
        fin = mask.double()[torch.isfinite(mask.double())]
        s += fin.abs().max().item() if fin.numel() else 0.0
    return s


def compare(name, got, want, tol, failures):
    if name == "lse" and got.shape != want.shape:
        # The reference's lse has the batch dims of the scores (query, key); the library's the
        # full broadcast batch (value's too): compare against the broadcast reference.
        try:
            want = want.expand(got.shape)
        except RuntimeError:
            pass
    if got.shape != want.shape:
        failures.append(f"{name}: shape {tuple(got.shape)} != reference {tuple(want.shape)}")
        return
    if got.device != want.device:
        failures.append(f"{name}: on {got.device}, the reference on {want.device}")
        return
    if got.device.type == "meta":
        return
    g, w = got.detach().double(), want.detach().double()
    nan_g, nan_w = torch.isnan(g), torch.isnan(w)
    if not torch.equal(nan_g, nan_w):
        failures.append(f"{name}: NaN at {int((nan_g != nan_w).sum())} positions where the reference has "
                        f"{'none' if not nan_w.any() else 'a different pattern'}")
        return
    inf_mismatch = (torch.isinf(g) | torch.isinf(w)) & (g != w)
    if inf_mismatch.any():
        failures.append(f"{name}: {int(inf_mismatch.sum())} infinite entries differ from the reference")
        return
    fin = torch.isfinite(w) & torch.isfinite(g)
    if fin.any():
        err = (g[fin] - w[fin]).abs().max().item()
        if not err <= tol:
            failures.append(f"{name}: max abs error {err:.3e} > tolerance {tol:.3e}")


def check_public(spec, result, call_seed, failures):
    q, k, v, mask, band, scale, p, gqa, return_lse = effective_public(spec)
    fn = spec["fn"]
    if fn == "attention" and return_lse:
        if not (isinstance(result, tuple) and len(result) == 2):
            failures.append(f"expected (out, lse), got {type(result).__name__}")
            return
        out, lse = result
    else:
        if not isinstance(result, torch.Tensor) or isinstance(result, tuple):
            failures.append(f"expected a Tensor, got {type(result).__name__}")
            return
        out, lse = result, None
    if type(out) is not torch.Tensor and not isinstance(out, torch.nn.Parameter):
        failures.append(f"expected a plain torch.Tensor, got {type(out).__name__}")
    if out.dtype != q.dtype or out.device != q.device:
        failures.append(f"output {out.dtype} on {out.device}, expected {q.dtype} on {q.device}")
        return
    big = virtual_size(q, k, v, mask) > MATERIAL_LIMIT or out.numel() > MATERIAL_LIMIT or any(
        s > 2 ** 24 for t in (q, k, v, mask) if isinstance(t, torch.Tensor) for s in t.shape)
    meta = q.device.type == "meta" or big
    rq, rk, rv, rmask = (as_meta(t) for t in (q, k, v, mask)) if meta else (q, k, v, mask)
    keep = None
    if p > 0 and fn != "weights":
        # Replay the dropout the call drew: same seed, same (seed, offset), same keep mask.
        torch.manual_seed(call_seed)
        state = attention_ext.draw_rng_state(q.device)
        batch = out.shape[:-2]
        if gqa and q.shape[-3] != k.shape[-3]:
            hk = k.shape[-3]
            split = (*batch[:-1], hk, batch[-1] // hk)
            keep = attention_ext.dropout_mask(state, (*split, out.shape[-2], k.shape[-2]), p).flatten(-4, -3)
        else:
            keep = attention_ext.dropout_mask(state, (*batch, out.shape[-2], k.shape[-2]), p)
        if meta:
            keep = as_meta(keep)
    rv_ = rv if fn != "weights" else rk.new_empty((*rk.shape[:-1], 0))
    try:
        ref_out, ref_lse, ref_w = attention_reference(rq, rk, rv_, rmask, **band, scale=scale,
                                                      dropout_mask=keep, dropout_p=p, enable_gqa=gqa)
    except RuntimeError as e:
        if not big:
            failures.append(f"the library returned but the reference raises {type(e).__name__}: {e}")
            return
        # Huge problem (checked on meta): the reference's (..., n, m) intermediates overflow int64
        # sizes even where the result does not; work out the result's shape directly.
        check_meta_shapes(fn, q, k, v, mask, gqa, out, lse, failures)
        return
    except Exception as e:
        failures.append(f"the library returned but the reference raises {type(e).__name__}: {e}")
        return
    if meta:
        want = ref_w if fn == "weights" else ref_out
        if out.shape != want.shape:
            failures.append(f"shape {tuple(out.shape)} != reference {tuple(want.shape)}")
        if lse is not None:
            # The reference's lse has the batch dims of the scores only; ours the full batch.
            want_lse = torch.broadcast_shapes(ref_lse.shape, ref_out.shape[:-1])
            if lse.shape != want_lse:
                failures.append(f"lse shape {tuple(lse.shape)} != reference {tuple(want_lse)}")
        return
    eps_acc = torch.finfo(torch.float64 if q.dtype == torch.float64 else torch.float32).eps
    smax = score_size(q, k, mask, scale, gqa)
    slack = 64 * eps_acc * (1 + smax)
    if fn == "weights":
        compare("weights", out, ref_w, ATOL[q.dtype] + slack + torch.finfo(q.dtype).eps, failures)
        return
    vmax = v.detach().abs().max().item() if v.numel() else 0.0
    vmax /= (1 - p) if p < 1 else 1.0  # (dropout_p = 1: zeros)
    tol = (ATOL[q.dtype] + slack) * max(1.0, vmax) + torch.finfo(q.dtype).eps * max(1.0, vmax)
    compare("output", out, ref_out, tol, failures)
    if lse is not None:
        if lse.dtype != (torch.float64 if q.dtype == torch.float64 else torch.float32):
            failures.append(f"lse dtype {lse.dtype}")
        lse_tol = slack * (2 + smax + math.log(k.shape[-2] + 1)) + ATOL[torch.float32]
        compare("lse", lse, ref_lse, lse_tol, failures)
    check_public_grads(spec, out, lse, (q, k, v, mask), band, scale, keep, p, gqa, smax, vmax, failures)


def check_meta_shapes(fn, q, k, v, mask, gqa, out, lse, failures):
    kb, vb = k.shape[:-2], (v.shape[:-2] if v is not None else k.shape[:-2])
    if gqa and q.dim() >= 3 and q.shape[-3] != k.shape[-3]:
        kb, vb = (*kb[:-1], q.shape[-3]), (*vb[:-1], q.shape[-3])
    try:
        batch = torch.broadcast_shapes(q.shape[:-2], kb, vb, *(() if mask is None else (mask.shape[:-2],)))
    except RuntimeError as e:
        failures.append(f"the library returned, but the batch dims do not broadcast: {e}")
        return
    n, m = q.shape[-2], k.shape[-2]
    want = (*batch, n, m) if fn == "weights" else (*batch, n, v.shape[-1])
    if tuple(out.shape) != want:
        failures.append(f"shape {tuple(out.shape)} != expected {want}")
    if lse is not None and tuple(lse.shape) != (*batch, n):
        failures.append(f"lse shape {tuple(lse.shape)} != expected {(*batch, n)}")


def check_public_grads(spec, out, lse, tensors, band, scale, keep, p, gqa, smax, vmax, failures):
    leaves = [t for t in tensors if isinstance(t, torch.Tensor) and t.requires_grad]
    if not leaves or not out.requires_grad or out.dtype in LOW or out.numel() == 0:
        return
    g = torch.Generator().manual_seed(12345)
    grad_out = torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.dtype)
    got = torch.autograd.grad(out, leaves, grad_out, allow_unused=True)
    q, k, v, mask = tensors
    ref_in = [t.detach().double().requires_grad_() if t is not None and t.requires_grad else t
              for t in tensors]
    rq, rk, rv, rmask = ref_in
    if rmask is not None and rmask.dtype != torch.bool:
        lowest = mask.detach() <= torch.finfo(mask.dtype).min
        rmask = rmask.masked_fill(lowest, -math.inf)
    ref_out = attention_reference(rq, rk, rv, rmask, **band, scale=scale, dropout_mask=keep,
                                  dropout_p=p, enable_gqa=gqa)[0]
    ref_leaves = [r_ for r_, t in zip(ref_in, tensors) if isinstance(t, torch.Tensor) and t.requires_grad]
    want = torch.autograd.grad(ref_out, ref_leaves, grad_out.double(), allow_unused=True)
    eps_acc = torch.finfo(out.dtype).eps
    for i, (gg, ww, leaf) in enumerate(zip(got, want, leaves)):
        ww = torch.zeros_like(leaf, dtype=torch.float64) if ww is None else torch.nan_to_num(ww)
        gg = torch.zeros_like(leaf) if gg is None else gg
        mag = max(1.0, ww.abs().max().item() if ww.numel() else 0.0)
        tol = (ATOL[out.dtype] * 20 + 256 * eps_acc * (1 + smax)) * mag * max(1.0, vmax)
        compare(f"grad[{i}]", gg, ww, tol, failures)


CAUSAL_NAMES = {0: None, 1: "top_left", 2: "bottom_right"}
LSE_DTYPE = {torch.float64: torch.float64}  # float32 for the other dtypes


def call_raw(spec):
    """Makes the raw op call(s). Returns a context for check_raw; raises what the ops raised."""
    fn, a = spec["fn"], spec["args"]
    if fn == "op_fwd":
        return dict(result=ops.attention_fwd(*a))
    if fn == "op_probs":
        return dict(result=ops.attention_probs(*a))
    if fn == "op_dropout_mask":
        return dict(result=ops.dropout_keep_mask(*a), again=ops.dropout_keep_mask(*a))
    _, q, k, v, mask, scale, causal, wl, wr, softcap, alibi, sinks, p, rng = a
    how = spec["mutations"][-1]
    # A forward first, so that out / lse are consistent (if it raises, so does this call).
    out, lse = ops.attention_fwd(q, k, v, mask, scale, causal, wl, wr, softcap, alibi, sinks, p, rng)
    g = torch.Generator().manual_seed(7)

    def like(t):
        if t.device.type == "meta":
            return torch.empty_like(t)
        return torch.randn(t.shape, generator=g, dtype=torch.float64).to(t.dtype)

    grad_out, grad_lse, mask_grad = like(out), None, False
    if how == "grad_out_shape":
        grad_out = grad_out.unsqueeze(0)
    elif how == "grad_out_dtype":
        grad_out = grad_out.to(torch.float32 if grad_out.dtype != torch.float32 else torch.float64)
    elif how == "out_shape":
        out = out[..., :-1] if out.shape[-1] else out.unsqueeze(0)
    elif how == "lse_dtype":
        lse = lse.to(torch.float16)
    elif how == "lse_shape":
        lse = lse.unsqueeze(-1)
    elif how == "grad_lse_shape":
        grad_lse = torch.zeros(3, 1, dtype=lse.dtype, device=lse.device)
    elif how == "grad_lse":
        grad_lse = like(lse)
    elif how == "mask_grad":
        mask_grad = True
    elif how == "mask_grad_bool":
        # A mask gradient without a floating mask: must raise.
        mask_grad = True
        mask = None if mask is None else (mask > -math.inf if mask.dtype != torch.bool else mask)
    elif how == "grad_out_meta":
        grad_out = grad_out.to("meta")
    elif how == "noncontiguous_grad_out" and grad_out.dim() >= 2:
        grad_out = grad_out.transpose(-1, -2).contiguous().transpose(-1, -2)
    write_log(f"  BWD grad_out={describe(grad_out)} grad_lse={describe(grad_lse)} out={describe(out)} "
              f"lse={describe(lse)} mask={describe(mask)} mask_requires_grad={mask_grad}")
    spec["extra_tensors"] = [t for t in (grad_out, grad_lse, out, lse, mask) if isinstance(t, torch.Tensor)]
    grads = ops.attention_bwd(grad_out, grad_lse, q, k, v, mask, out, lse, scale, causal, wl, wr, softcap, alibi,
                              sinks, p, rng, mask_grad)
    return dict(result=grads, grad_out=grad_out, grad_lse=grad_lse, out=out, lse=lse, mask=mask,
                mask_grad=mask_grad)


def ref_mask(mask, requires_grad=False):
    """The mask as the reference takes it: float64, -inf where the library masks (<= finfo.min)."""
    if mask is None or mask.dtype == torch.bool:
        return mask, None
    leaf = mask.detach().double().requires_grad_(requires_grad)
    return leaf.masked_fill(mask <= torch.finfo(mask.dtype).min, -math.inf), leaf


def check_raw(spec, ctx, failures):
    fn, a = spec["fn"], spec["args"]
    result = ctx["result"]
    if fn == "op_dropout_mask":
        rng, batch, n, m, p = a
        if result.shape != (*batch, n, m) or result.dtype != torch.bool:
            failures.append(f"dropout_keep_mask: {tuple(result.shape)} {result.dtype}")
        elif result.device.type != "meta" and not torch.equal(result, ctx["again"]):
            failures.append("dropout_keep_mask is not a function of its arguments")
        return
    if fn == "op_probs":
        q, k, mask, scale, causal, wl, wr, softcap, alibi, sinks = a
        v, p, rng = k.new_empty((*k.shape[:-1], 0)), 0.0, None
    else:
        q, k, v, mask, scale, causal, wl, wr, softcap, alibi, sinks, p, rng = a[1:] if fn == "op_bwd" else a
    if fn == "op_bwd":
        mask = ctx["mask"]
    # With a meta tensor anywhere the reference runs on the tensors as given: on meta it gives
    # shapes (compare() then checks shapes only); mixed devices make it raise (so must we).
    meta = any(t.device.type == "meta" for t in _raw_tensors(spec))
    keep = None
    if p > 0:
        batch = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2])
        keep = ops.dropout_keep_mask(rng, list(batch), q.shape[-2], k.shape[-2], p)
    eps_acc = torch.finfo(torch.float64 if q.dtype == torch.float64 else torch.float32).eps
    smax = 0.0 if meta else score_size(q, k, mask, scale)
    slack = 64 * eps_acc * (1 + smax)
    vmax = 1.0 if meta else max(1.0, (v.abs().max().item() if v.numel() else 0.0) / (1 - p))
    rmask, mask_leaf = ref_mask(mask, requires_grad=ctx.get("mask_grad", False))
    ins = [t.detach().double().requires_grad_(fn == "op_bwd") for t in (q, k, v)]
    ref_out, ref_lse, ref_w = attention_reference(*ins, rmask, causal=CAUSAL_NAMES[causal], window=(wl, wr),
                                                  softcap=softcap, alibi_slopes=alibi, sinks=sinks, scale=scale,
                                                  dropout_mask=keep, dropout_p=p)
    if fn == "op_probs":
        compare("weights", result, ref_w, ATOL[q.dtype] + slack + torch.finfo(q.dtype).eps, failures)
        return
    if fn == "op_fwd":
        out, lse = result
        compare("output", out, ref_out, (ATOL[q.dtype] + slack + torch.finfo(q.dtype).eps) * vmax, failures)
        compare("lse", lse, ref_lse, slack * (2 + smax + math.log(k.shape[-2] + 1)) + ATOL[torch.float32],
                failures)
        return
    # Backward: autograd of <out, grad_out> + <lse, grad_lse> through the float64 reference.
    total = (ref_out * ctx["grad_out"].double()).sum()
    if ctx["grad_lse"] is not None:
        total = total + (torch.nan_to_num(ref_lse, neginf=0.0) * ctx["grad_lse"].double()).sum()
    leaves = ins + ([mask_leaf] if ctx["mask_grad"] else [])
    want = torch.autograd.grad(total, leaves, allow_unused=True)
    got = list(result[:3]) + ([result[3]] if ctx["mask_grad"] else [])
    for name, gg, ww, leaf in zip(["dq", "dk", "dv", "dmask"], got, want, leaves):
        ww = torch.zeros_like(leaf) if ww is None else torch.nan_to_num(ww)
        if meta:
            compare(name, gg, ww, 0.0, failures)
            continue
        mag = max(1.0, ww.abs().max().item() if ww.numel() else 0.0)
        tol = (ATOL[q.dtype] * 20 + 256 * eps_acc * (1 + smax)) * mag * vmax
        if q.dtype in LOW:
            tol += 2 * torch.finfo(q.dtype).eps * mag
        compare(name, gg, ww, tol, failures)


# ----------------------------------------------------------------------------------------------
# Known issues: calls that return a wrong answer for a reason already pinned down by a strict
# xfail test. They are counted (as known:<name>) instead of failing the run; when the issue is
# fixed the xfail test starts passing, and the entry here should go.

def _raw_tensors(spec):
    return [x for x in spec["args"] if isinstance(x, torch.Tensor)] + spec.get("extra_tensors", [])


KNOWN_ISSUES = {}  # none at present


def known_issue(spec):
    for name, (_, applies) in KNOWN_ISSUES.items():
        try:
            if applies(spec):
                return name
        except Exception:
            pass
    return None


# ----------------------------------------------------------------------------------------------

LOG = None


def write_log(line):
    if LOG is not None:
        LOG.write(line + "\n")
        LOG.flush()


def call_public(spec):
    fn = {"sdpa": attention_ext.scaled_dot_product_attention, "attention": attention_ext.attention,
          "weights": attention_ext.attention_weights}[spec["fn"]]
    return fn(*spec["args"], **spec["kwargs"])


def is_valid(spec):
    """No mutation was applied (an attention_bwd call records "none" for its unmutated inputs)."""
    return all(m == "none" for m in spec["mutations"])


def one_call(seed, i, inject, stats, verbose):
    r = random.Random(f"{seed}-{i}")
    g = torch.Generator().manual_seed(r.randrange(2 ** 62))
    try:
        spec = public_call(r, g) if r.random() < 0.75 else raw_call(r, g)
    except Exception:
        # torch itself refused to build the arguments (e.g. an allocation of 2**50 elements).
        stats["not_generated"] += 1
        return []
    call_seed = r.randrange(2 ** 62)
    line = f"CALL {i} {describe_call(spec)}"
    write_log(line)
    if verbose:
        print(line, flush=True)
    if inject == ("crash", i):
        os.abort()  # what a failed check or an uncaught C++ exception does (SIGABRT)
    raw = spec["fn"].startswith("op_")
    if is_valid(spec):
        stats["valid"] += 1
    torch.manual_seed(call_seed)
    try:
        result = call_raw(spec) if raw else call_public(spec)
    except Exception as e:  # the library refused the call: fine for an invalid one, if it says why
        stats["raised"] += 1
        stats[f"raised:{type(e).__name__}"] += 1
        if verbose:
            print(f"  raised {type(e).__name__}: {str(e)[:300]}")
        if is_valid(spec):
            problem = f"a valid call (no mutation) raised {type(e).__name__}: {e}"
        elif not isinstance(e, ALLOWED):
            problem = f"raised {type(e).__name__} (not TypeError/ValueError/RuntimeError): {e}"
        elif not str(e).strip():
            problem = f"raised {type(e).__name__} without a message"
        else:
            return []
        known = known_issue(spec)
        if known is not None:  # e.g. the fake kernels' IndexError on a 1-d query
            stats[f"known:{known}"] += 1
            return []
        return [problem]
    stats["returned"] += 1
    stats[f"returned:{spec['fn']}"] += 1
    if inject is not None and inject[0] == "wrong" and inject[1] in (i, -1):
        result = corrupt(result)
    failures = []
    try:
        if raw:
            check_raw(spec, result, failures)
        else:
            check_public(spec, result, call_seed, failures)
    except Exception:
        failures.append("the library returned, but checking the result against the reference raised:\n"
                        + traceback.format_exc())
    if failures:
        known = known_issue(spec)
        if known is not None:
            stats[f"known:{known}"] += 1
            if verbose:
                print(f"  known issue {known}: {'; '.join(failures)}")
            return []
    if verbose:
        print(f"  returned; {'FAIL ' + '; '.join(failures) if failures else 'matches the reference'}")
    return failures


def corrupt(result):
    """--inject wrong:I: shift every floating result by 1 (the check must notice)."""
    if isinstance(result, dict):
        return dict(result, result=corrupt(result["result"]))
    if isinstance(result, (tuple, list)):
        return type(result)(corrupt(x) for x in result)
    if isinstance(result, torch.Tensor) and result.is_floating_point():
        return result.detach() + 1.0
    return result


def main(argv=None):
    global LOG
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--iterations", type=int, default=1000)
    ap.add_argument("--log", default=None, help="append each call's description here before making it")
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--inject", default=None,
                    help="harness self-test: 'crash:I' aborts at call I, 'wrong:I' corrupts call I's "
                         "result (I = -1: every call's)")
    args = ap.parse_args(argv)
    inject = None
    if args.inject:
        kind, _, at = args.inject.partition(":")
        inject = (kind, int(at))
    if args.log:
        LOG = open(args.log, "a", buffering=1)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    stats = Counter()
    failed = []
    for i in range(args.start, args.start + args.iterations):
        failures = one_call(args.seed, i, inject, stats, args.verbose)
        if failures:
            msg = f"FAIL {i}: " + " | ".join(failures)
            write_log(msg)
            print(msg, flush=True)
            failed.append(i)
    summary = dict(seed=args.seed, start=args.start, iterations=args.iterations, failed=failed,
                   attention_ext_file=os.path.abspath(attention_ext.__file__), **stats)
    print(json.dumps(summary), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

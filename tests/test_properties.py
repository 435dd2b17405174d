"""Property-based tests (Hypothesis): whatever the shapes, strides, masks, dtypes, causal
alignment and scale, the fused kernels give the float64 reference's answer, and the algebraic
invariants of attention hold.

Every example is a pure function of the values Hypothesis draws (tensors come from a
torch.Generator seeded with a drawn integer), runs are derandomized and keep no example
database, so CI sees the same examples every time and a failure prints a reproducible example.

Drawn per example:
* leading (batch) dims: 0 to 3 of them, sizes 0 to 3, query and key/value broadcasting against
  each other (either side may have 1s or fewer dims), optional grouped-query heads;
* n, m: 1 and sizes around the 64-wide kernel tiles (63, 64, 65, 129, …) or any small size;
  d_k and d_v independently in 1..160;
* layouts: contiguous, transposed (last-dim stride ≠ 1), sliced (strides 2 and a storage
  offset), batch-permuted ((B, N, H, D).transpose(1, 2)-style) and stride-0 expanded views;
* masks: none, bool or float (normal values, −inf and finfo.min entries), of any shape that
  broadcasts to (…, n, m) — dims dropped or 1 anywhere — possibly an expanded view;
* dtype float64 / float32 / float16 / bfloat16, causal None / top_left / bottom_right, the
  scale (None, 0, negative, positive) and the CPU kernel variant.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import attention_ext
from attention_ext.reference import attention_reference

from conftest import ATOL, SLOW, cpu_variants

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
LOW_PRECISION = (torch.float16, torch.bfloat16)
CAUSAL = [None, "top_left", "bottom_right"]
# Lengths at and around the kernels' 64-wide tiles, plus 1 and odd sizes.
LENGTHS = [1, 2, 3, 5, 17, 63, 64, 65, 100, 129]
HEAD_DIMS = [1, 2, 3, 5, 8, 16, 31, 64, 65, 96, 128, 160]
LAYOUTS = ["contiguous", "transposed", "sliced", "batch_permuted", "expanded"]
# Upper bound on batch · n · m · (d_k + d_v) per example, to keep the file fast on 2 cores.
WORK_BUDGET = 120_000


def props(max_examples):
    """Reproducible in CI: derandomized, no example database, no per-example deadline.
    ATTENTION_EXT_SLOW_TESTS=1 runs ten times as many examples."""
    return settings(max_examples=max_examples * (10 if SLOW else 1), deadline=None, derandomize=True,
                    database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much])


# ----------------------------------------------------------------------------------------------
# Building inputs: a leaf "base" tensor and the view function that turns it into the argument,
# so gradients can be compared on the same leaf for the kernel and the float64 reference.

@dataclass
class Input:
    base: torch.Tensor  # float64 values
    view: Callable[[torch.Tensor], torch.Tensor]
    layout: str

    def make(self, dtype, requires_grad=False, round_to=None):
        """The leaf in `dtype` (its values first rounded to `round_to`, the case's dtype, so the
        reference sees exactly the numbers the kernel sees) and the argument viewed from it."""
        base = self.base if round_to is None else self.base.to(round_to)
        leaf = base.to(dtype).requires_grad_(requires_grad)
        return leaf, self.view(leaf)

    def __repr__(self):
        return f"Input({tuple(self.base.shape)} -> {self.layout})"


def build_input(shape, layout, gen, scale=1.0, values=None):
    """A tensor of `shape` read through `layout`. `values(shape)` overrides the randn values."""
    shape = tuple(shape)
    fill = values or (lambda s: torch.randn(s, generator=gen, dtype=torch.float64) * scale)
    nd = len(shape)
    if layout == "transposed" and nd >= 2:
        base = fill((*shape[:-2], shape[-1], shape[-2]))
        return Input(base, lambda t: t.transpose(-1, -2), layout)
    if layout == "sliced" and nd >= 2:
        base = fill((*shape[:-2], 2 * shape[-2] + 1, shape[-1] + 3))
        rows, cols = shape[-2], shape[-1]
        return Input(base, lambda t: t[..., 1:1 + 2 * rows:2, 2:2 + cols], layout)
    if layout == "batch_permuted" and nd >= 3:
        # (..., H, N, D) read from a (..., N, H, D) buffer.
        base = fill((*shape[:-3], shape[-2], shape[-3], shape[-1]))
        return Input(base, lambda t: t.transpose(-3, -2), layout)
    if layout == "expanded" and nd >= 1:
        # Stride 0 along every dim but the last (head) dim whose size is not 1.
        small = tuple(1 if i < nd - 1 else s for i, s in enumerate(shape))
        if small != shape:
            base = fill(small)
            return Input(base, lambda t: t.expand(*shape), layout)
    return Input(fill(shape), lambda t: t, "contiguous")


@dataclass
class Case:
    seed: int
    dtype: torch.dtype
    q: Input
    k: Input
    v: Input
    mask: Optional[Input]
    mask_kind: Optional[str]
    causal: Optional[str]
    scale: Optional[float]
    gqa: bool
    variant: str
    notes: dict = field(default_factory=dict)

    def tensors(self, dtype=None, requires_grad=False):
        """(leaves, (q, k, v, mask)) in `dtype` (the case's own by default)."""
        dtype = dtype or self.dtype
        leaves, args = [], []
        for inp in (self.q, self.k, self.v):
            leaf, t = inp.make(dtype, requires_grad, round_to=self.dtype)
            leaves.append(leaf)
            args.append(t)
        mask = None
        if self.mask is not None:
            if self.mask_kind == "bool":
                mask = self.mask.view(self.mask.base.bool())
            else:
                leaf, mask = self.mask.make(dtype, requires_grad, round_to=self.dtype)
                leaves.append(leaf)
        return leaves, (*args, mask)

    def reference(self, dtype=torch.float64, requires_grad=False, **kw):
        """attention_reference on the case's values. With dtype=None it computes in the case's own
        dtype (plain torch's error, the budget for low precision)."""
        leaves, (q, k, v, mask) = self.tensors(self.dtype if dtype is None else dtype, requires_grad)
        if dtype is not None and self.mask_kind == "float" and mask is not None:
            # Decide "masked out" in the case's dtype like the library (finfo.min of that dtype).
            lowest = self.mask.view(self.mask.base.to(self.dtype)) <= torch.finfo(self.dtype).min
            mask = mask.masked_fill(lowest, float("-inf"))
        out, lse, w = attention_reference(q, k, v, mask, causal=self.causal, scale=self.scale,
                                          enable_gqa=self.gqa, dtype=dtype, **kw)
        return leaves, out, lse, w


@st.composite
def cases(draw, dtypes=DTYPES, causal=CAUSAL, masks=("none", "bool", "float", "float"), allow_empty=True,
          layouts=LAYOUTS, gqa=True, budget=WORK_BUDGET, lengths=LENGTHS, head_dims=HEAD_DIMS,
          minus_inf_only=False):
    seed = draw(st.integers(0, 2 ** 31 - 1))
    gen = torch.Generator().manual_seed(seed)
    dtype = draw(st.sampled_from(dtypes))
    length = st.sampled_from(lengths) | st.integers(1, max(lengths))
    n, m = draw(length), draw(length)
    dk, dv = draw(st.sampled_from(head_dims)), draw(st.sampled_from(head_dims))
    # About one example in 12 has a zero size somewhere (n, m, d_k, d_v or a batch dim).
    zero = draw(st.sampled_from(["n", "m", "dk", "dv", "batch"])) if allow_empty and draw(
        st.integers(0, 11)) == 0 else None
    n, m = (0 if zero == "n" else n), (0 if zero == "m" else m)
    dk, dv = (0 if zero == "dk" else dk), (0 if zero == "dv" else dv)

    # Batch dims: the broadcast result first, then each tensor drops leading dims / uses 1s.
    ndim = draw(st.sampled_from([0, 1, 1, 2, 2, 3, 3]))
    per_item = max(1, n * m * (dk + dv))
    max_batch = max(1, budget // per_item)
    batch = []
    for _ in range(ndim):
        size = draw(st.integers(1, 3))
        if math.prod([*batch, size]) > max_batch:
            size = 1
        batch.append(size)
    if zero == "batch" and batch:
        batch[draw(st.integers(0, len(batch) - 1))] = 0
    use_gqa = gqa and ndim >= 1 and batch[-1] >= 1 and draw(st.booleans())
    groups = 1
    if use_gqa:
        groups = draw(st.sampled_from([1, 2, 3]))
        if math.prod(batch) * groups > max_batch:
            groups = 1

    def sub_batch(full):
        keep = len(full) if draw(st.integers(0, 2)) else draw(st.integers(0, len(full)))
        dims = full[len(full) - keep:]
        return [s if draw(st.booleans()) else 1 for s in dims]

    if use_gqa:
        # The heads dim (-3) is on all three: key/value heads h, query heads h · groups.
        outer, heads = batch[:-1], batch[-1]
        q_batch = sub_batch(outer) + [heads * groups]
        kv_batch = sub_batch(outer) + [heads]
        v_batch = [s if draw(st.booleans()) else 1 for s in kv_batch[:-1]] + [heads]
        kv_as_query = [kv_batch[:-1] + [heads * groups], v_batch[:-1] + [heads * groups]]
    else:
        q_batch = sub_batch(batch)
        kv_batch = sub_batch(batch)
        v_batch = [s if draw(st.booleans()) else 1 for s in kv_batch]  # v may broadcast against k
        kv_as_query = [kv_batch, v_batch]
    full_batch = list(torch.broadcast_shapes(tuple(q_batch), *map(tuple, kv_as_query)))

    qk_scale = 1.0
    if draw(st.integers(0, 4)) == 0:
        qk_scale = draw(st.sampled_from([0.1, 2.0]))
    q = build_input((*q_batch, n, dk), draw(st.sampled_from(layouts)), gen, qk_scale)
    k = build_input((*kv_batch, m, dk), draw(st.sampled_from(layouts)), gen, qk_scale)
    v = build_input((*v_batch, m, dv), draw(st.sampled_from(layouts)), gen)

    # The mask: any shape broadcasting to (*batch, n, m) (the query's view of the batch).
    mask_kind = draw(st.sampled_from(masks))
    mask = None
    if mask_kind != "none":
        target = [*full_batch, n, m]
        keep = len(target) if draw(st.integers(0, 2)) else draw(st.integers(0, len(target)))
        mshape = [s if draw(st.integers(0, 2)) else 1 for s in target[len(target) - keep:]]
        if mask_kind == "bool":
            p_keep = draw(st.sampled_from([0.0, 0.3, 0.8, 1.0]))
            values = lambda s: (torch.rand(s, generator=gen, dtype=torch.float64) < p_keep).double()
        else:
            p_out = draw(st.sampled_from([0.0, 0.2, 0.6]))
            lowest = torch.finfo(dtype).min
            big = draw(st.sampled_from([1.0, 4.0]))

            def values(s):
                val = torch.randn(s, generator=gen, dtype=torch.float64) * big
                out = torch.rand(s, generator=gen, dtype=torch.float64) < p_out
                lo = torch.rand(s, generator=gen, dtype=torch.float64) < (0.0 if minus_inf_only else 0.5)
                fill = torch.where(lo, torch.tensor(lowest, dtype=torch.float64),
                                   torch.tensor(-math.inf, dtype=torch.float64))
                return torch.where(out, fill, val).double()
        mask_layout = draw(st.sampled_from(["contiguous", "transposed", "expanded"]))
        if mask_layout == "expanded" and keep >= 1:
            # Broadcast dims made explicit with stride 0 (expand the 1s the draw chose).
            small = list(mshape)
            mshape = [target[len(target) - keep + i] if s == 1 and draw(st.booleans()) else s
                      for i, s in enumerate(small)]
            base = values(tuple(small))
            shape = tuple(mshape)
            mask = Input(base, lambda t, shape=shape: t.expand(*shape), "expanded")
        else:
            mask = build_input(mshape, mask_layout if len(mshape) >= 2 else "contiguous", gen, values=values)

    causal_kind = draw(st.sampled_from(causal))
    scale = draw(st.one_of(st.none(), st.sampled_from([0.0, -0.5, 1.0]),
                           st.floats(-2.0, 2.0, allow_nan=False).map(lambda s: s / math.sqrt(max(dk, 1)))))
    variant = draw(st.sampled_from(cpu_variants()))
    return Case(seed, dtype, q, k, v, mask, mask_kind if mask is not None else None, causal_kind, scale,
                use_gqa, variant, dict(n=n, m=m, dk=dk, dv=dv))


def run_ours(case, fn="attention", requires_grad=False, **kw):
    leaves, (q, k, v, mask) = case.tensors(requires_grad=requires_grad)
    previous = attention_ext.cpu_variant()
    attention_ext.set_cpu_variant(case.variant)
    try:
        if fn == "attention":
            out = attention_ext.attention(q, k, v, attn_mask=mask, causal=case.causal, scale=case.scale,
                                          enable_gqa=case.gqa, **kw)
        elif fn == "weights":
            out = attention_ext.attention_weights(q, k, attn_mask=mask, causal=case.causal, scale=case.scale,
                                                  enable_gqa=case.gqa)
        else:
            raise AssertionError(fn)
    finally:
        attention_ext.set_cpu_variant(previous)
    return leaves, out


def max_err(a, b):
    if a.numel() == 0:
        return 0.0
    return (a.double() - b.double()).abs().max().item()


def tolerance(case, ref, magnitude=1.0):
    """ATOL for the dtype (scaled by the values' magnitude), or twice plain torch's own error in
    that precision for float16/bfloat16 (conftest's rule)."""
    tol = ATOL[case.dtype] * max(1.0, magnitude)
    if case.dtype in LOW_PRECISION and ref.numel():
        _, out_lp, _, _ = case.reference(dtype=None)
        budget = max_err(torch.nan_to_num(out_lp.double()), ref)
        tol = max(tol, 2.0 * budget)
    return tol


def value_magnitude(case):
    return case.v.base.abs().max().item() if case.v.base.numel() else 1.0


# ----------------------------------------------------------------------------------------------
# Agreement with the float64 reference.

@props(400)
@given(case=cases())
def test_output_and_lse_match_the_float64_reference(case):
    _, (out, lse) = run_ours(case, return_lse=True)
    _, ref, ref_lse, _ = case.reference()
    assert out.shape == ref.shape and out.dtype == case.dtype
    assert lse.shape == ref_lse.shape
    assert lse.dtype == (torch.float64 if case.dtype == torch.float64 else torch.float32)
    err = max_err(out, ref)
    tol = tolerance(case, ref, value_magnitude(case))
    assert err <= tol, f"output: max abs error {err:.3e} > {tol:.3e}"
    # Rows with no visible key: lse -inf and output exactly 0 (never NaN).
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), empty), "lse is -inf exactly on the rows with no visible key"
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    if empty.any():
        assert (out[empty] == 0).all()
    finite = ~empty
    if finite.any():
        lse_err = (lse.double()[finite] - ref_lse[finite]).abs().max().item()
        lse_tol = 1e-9 if case.dtype == torch.float64 else 2e-5 * max(1.0, ref_lse[finite].abs().max().item())
        assert lse_err <= lse_tol, f"lse: max abs error {lse_err:.3e} > {lse_tol:.3e}"


@props(80)
@given(case=cases(causal=[None, "top_left"], gqa=True))
def test_drop_in_matches_the_reference_and_torch_sdpa_semantics(case):
    """scaled_dot_product_attention: is_causal=True is top-left causal and excludes attn_mask."""
    _, (q, k, v, mask) = case.tensors()
    is_causal = case.causal == "top_left"
    if is_causal:
        mask = None
        case = dataclasses.replace(case, mask=None, mask_kind=None)
    out = attention_ext.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal,
                                                     scale=case.scale, enable_gqa=case.gqa)
    _, ref, _, _ = case.reference()
    err = max_err(out, ref)
    tol = tolerance(case, ref, value_magnitude(case))
    assert out.shape == ref.shape and err <= tol, f"max abs error {err:.3e} > {tol:.3e}"


@props(100)
@given(case=cases())
def test_attention_weights_match_the_reference_and_rows_sum_to_one_or_zero(case):
    _, w = run_ours(case, fn="weights")
    _, _, ref_lse, ref_w = case.reference()
    assert w.shape == ref_w.shape and w.dtype == case.dtype
    tol = ATOL[case.dtype] * (1 if case.dtype not in LOW_PRECISION else 2)
    err = max_err(w, ref_w)
    assert err <= tol, f"weights: max abs error {err:.3e} > {tol:.3e}"
    assert (w >= 0).all()
    if w.numel():
        sums = w.double().sum(-1)
        expected = (~torch.isneginf(ref_lse)).double()  # 1 for rows with a visible key, else 0
        m = w.shape[-1]
        sum_tol = (torch.finfo(case.dtype).eps if case.dtype in LOW_PRECISION else ATOL[case.dtype]) * (m + 4)
        assert max_err(sums, expected) <= sum_tol


# ----------------------------------------------------------------------------------------------
# Invariants.

@props(80)
@given(case=cases(causal=[None], allow_empty=False), data=st.data())
def test_permuting_key_and_value_rows_together_leaves_the_output_unchanged(case, data):
    """Without causality attention is a set function of the (key, value) pairs: permuting them
    (and the mask's key columns with them) changes nothing but the summation order."""
    _, (q, k, v, mask) = case.tensors()
    m = k.shape[-2]
    perm = torch.tensor(data.draw(st.permutations(range(m)), label="perm"), dtype=torch.long)
    pmask = mask
    if mask is not None and mask.dim() >= 1 and mask.shape[-1] == m:
        pmask = mask.index_select(-1, perm)
    out = attention_ext.attention(q, k, v, attn_mask=mask, scale=case.scale, enable_gqa=case.gqa)
    out_p = attention_ext.attention(q, k.index_select(-2, perm), v.index_select(-2, perm), attn_mask=pmask,
                                    scale=case.scale, enable_gqa=case.gqa)
    _, ref, _, _ = case.reference()
    err = max_err(out, out_p)
    tol = 2 * tolerance(case, ref, value_magnitude(case))
    assert err <= tol, f"permuted keys: outputs differ by {err:.3e} > {tol:.3e}"


@props(80)
@given(case=cases(masks=("float",), allow_empty=False, minus_inf_only=True),
       shift=st.sampled_from([-8.0, -0.75, 0.5, 3.0, 64.0]))
def test_adding_a_per_row_constant_to_a_float_mask_leaves_the_output_unchanged_and_shifts_lse(case, shift):
    """softmax(s + c) = softmax(s) for a constant c per row: the output is unchanged and the
    row's lse moves by exactly c (masked entries, -inf, stay masked). Mask and c lie on a grid
    coarse enough that mask + c is exact in the dtype, so the invariant holds exactly."""
    _, (q, k, v, mask) = case.tensors()
    n = q.shape[-2]
    grid = 2.0 if case.dtype == torch.bfloat16 else 0.25
    m64 = mask.double()
    mask = torch.where(torch.isinf(m64), m64, ((m64 / grid).round() * grid).clamp(-16, 16)).to(case.dtype)
    # c_i = shift · (1 + i mod 3) on the grid: a different constant per query row, the same along the keys.
    c = ((shift * (1 + torch.arange(n, dtype=torch.float64) % 3)) / grid).round() * grid
    shifted = mask + c.to(case.dtype).unsqueeze(-1)
    assert torch.equal(shifted.double(), mask.double() + c.unsqueeze(-1)), "the shift is exact"
    kw = dict(causal=case.causal, scale=case.scale, enable_gqa=case.gqa, return_lse=True)
    out, lse = attention_ext.attention(q, k, v, attn_mask=mask, **kw)
    out_s, lse_s = attention_ext.attention(q, k, v, attn_mask=shifted, **kw)
    _, ref, _, _ = case.reference()
    tol = 2 * tolerance(case, ref, value_magnitude(case))
    err = max_err(out, out_s)
    assert err <= tol, f"per-row mask shift: outputs differ by {err:.3e} > {tol:.3e}"
    empty = torch.isneginf(lse)
    assert torch.equal(empty, torch.isneginf(lse_s)), "the same rows have no visible key"
    if (~empty).any():
        c_rows = c.expand(lse.shape)
        diff = (lse_s.double() - lse.double() - c_rows)[~empty].abs().max().item()
        size = 1 + c.abs().max().item() + lse.double()[~empty].abs().max().item()
        lse_tol = (1e-13 if case.dtype == torch.float64 else 4e-7) * size
        assert diff <= lse_tol, f"lse moved by c ± {diff:.3e} (tolerance {lse_tol:.3e})"


@props(80)
@given(case=cases(allow_empty=False), a=st.sampled_from([-2.0, 0.5, 1.0, 3.0]),
       b=st.sampled_from([-1.0, 0.25, 2.0]))
def test_output_is_linear_in_the_values(case, a, b):
    """out(a·V1 + b·V2) = a·out(V1) + b·out(V2): the weights do not depend on V."""
    _, (q, k, v1, mask) = case.tensors()
    v2 = torch.randn(v1.shape, generator=torch.Generator().manual_seed(case.seed + 1),
                     dtype=torch.float64).to(case.dtype)
    kw = dict(attn_mask=mask, causal=case.causal, scale=case.scale, enable_gqa=case.gqa)
    combo = (a * v1.double() + b * v2.double()).to(case.dtype)
    lhs = attention_ext.attention(q, k, combo, **kw).double()
    rhs = (a * attention_ext.attention(q, k, v1, **kw).double()
           + b * attention_ext.attention(q, k, v2, **kw).double())
    _, ref, _, _ = case.reference()
    mag = max(value_magnitude(case), v2.abs().max().item() if v2.numel() else 0.0)
    eps = torch.finfo(case.dtype).eps
    # Each side rounds its output (and the combination its input) in the dtype.
    tol = (abs(a) + abs(b) + 1) * (tolerance(case, ref, mag) + 2 * eps * mag)
    err = max_err(lhs, rhs)
    assert err <= tol, f"linearity in V: {err:.3e} > {tol:.3e}"


@props(80)
@given(case=cases(allow_empty=False))
def test_each_output_lies_within_its_value_columns_range_over_the_visible_keys(case):
    """An output row is a convex combination of the value rows of the keys it sees: each element is
    within [min, max] of its value column over those keys; a row that sees no key is exactly 0."""
    _, (q, k, v, mask) = case.tensors()
    out = attention_ext.attention(q, k, v, attn_mask=mask, causal=case.causal, scale=case.scale,
                                  enable_gqa=case.gqa)
    _, _, ref_lse, ref_w = case.reference()
    visible = ref_w > 0  # (..., n, m): weights that do not underflow to 0 in float64
    _, _, v64, _ = case.tensors(dtype=torch.float64)[1]
    if case.gqa:
        v64 = v64.repeat_interleave(q.shape[-3] // v64.shape[-3], dim=-3)
    v64 = v64.unsqueeze(-3)  # (..., 1, m, dv)
    vis = visible.unsqueeze(-1)  # (..., n, m, 1)
    lo = torch.where(vis, v64, math.inf).amin(-2)
    hi = torch.where(vis, v64, -math.inf).amax(-2)
    empty = torch.isneginf(ref_lse)
    o = out.double()
    slack = 2 * torch.finfo(case.dtype).eps * max(1.0, value_magnitude(case)) + ATOL[case.dtype]
    ok = ((o >= lo - slack) & (o <= hi + slack)) | empty.unsqueeze(-1)
    assert ok.all(), f"{(~ok).sum().item()} output elements outside their values' range"
    assert (o[empty] == 0).all()


# ----------------------------------------------------------------------------------------------
# Gradients.

def grads_vs_reference(case, ours_leaves, out, grad_out):
    """Gradients of <out, grad_out> with respect to every leaf (q, k, v bases and a float mask),
    ours against autograd through the float64 reference on the same leaves."""
    ref_leaves, ref_out, _, _ = case.reference(requires_grad=True)
    got = torch.autograd.grad(out, ours_leaves, grad_out, allow_unused=True)
    want = torch.autograd.grad(ref_out, ref_leaves, grad_out.double(), allow_unused=True)
    return got, want


@props(100)
@given(case=cases(dtypes=[torch.float32, torch.float64], budget=60_000))
def test_gradients_match_autograd_through_the_reference(case):
    leaves, out = run_ours(case, requires_grad=True)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(case.seed + 7),
                           dtype=torch.float64).to(case.dtype)
    got, want = grads_vs_reference(case, leaves, out, grad_out)
    names = ["q", "k", "v", "mask"]
    for name, leaf, g, w in zip(names, leaves, got, want):
        w = torch.zeros_like(leaf, dtype=torch.float64) if w is None else torch.nan_to_num(w)
        g = torch.zeros_like(leaf) if g is None else g
        assert g.shape == leaf.shape, f"d{name} has shape {tuple(g.shape)}, leaf {tuple(leaf.shape)}"
        assert not torch.isnan(g).any(), f"d{name} has NaN"
        scale_of = max(1.0, w.abs().max().item() if w.numel() else 0.0)
        tol = ATOL[case.dtype] * 4 * scale_of * max(1.0, value_magnitude(case))
        err = max_err(g, w)
        assert err <= tol, f"d{name}: max abs error {err:.3e} > {tol:.3e}"


@pytest.mark.slow_on_emulation  # thousands of launches; gradcheck runs there in test_backward etc.
@props(30)
@given(case=cases(dtypes=[torch.float64], allow_empty=False, lengths=[1, 2, 3, 4, 5],
                  head_dims=[1, 2, 3], budget=600, layouts=LAYOUTS))
def test_gradcheck_float64_on_tiny_random_problems(case):
    """torch.autograd.gradcheck (finite differences) on the fused kernels themselves, through
    every input including a float mask, whatever the layout, broadcast and causal alignment."""
    _, (q, k, v, mask) = case.tensors()
    bases = [case.q.base.clone().requires_grad_(), case.k.base.clone().requires_grad_(),
             case.v.base.clone().requires_grad_()]
    float_mask = case.mask_kind == "float"
    if float_mask:
        # Finite differences need finite entries: -inf / lowest are masked by the bool mask below.
        keep = case.mask.base > torch.finfo(torch.float64).min
        bases.append(torch.where(keep, case.mask.base, 0.0).clone().requires_grad_())
        bool_keep = case.mask.view(keep)

    def fn(*ts):
        qq, kk, vv = case.q.view(ts[0]), case.k.view(ts[1]), case.v.view(ts[2])
        msk = mask
        if float_mask:
            msk = case.mask.view(ts[3]).masked_fill(~bool_keep, float("-inf"))
        return attention_ext.attention(qq, kk, vv, attn_mask=msk, causal=case.causal, scale=case.scale,
                                       enable_gqa=case.gqa)

    assert torch.autograd.gradcheck(fn, tuple(bases), eps=1e-6, atol=1e-7, rtol=1e-5)

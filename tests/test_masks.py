"""Attention masks: bool and float masks of every broadcast shape, fully masked rows, causal
alignments, torch's CausalBias objects, the exact weights, mask gradients and their determinism.

Every result is compared with the float64 reference (`attention_reference`), gradients with
autograd through that reference.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right, causal_upper_left

from attention_ext import attention, attention_reference, attention_weights, scaled_dot_product_attention
from attention_ext.reference import masked_scores

from conftest import ATOL, rand

B, H, N, M, D, DV = 2, 3, 5, 7, 4, 3

# Gradients accumulate a little more rounding than the forward.
GRAD_ATOL = {torch.float64: 1e-10, torch.float32: 1e-4}


# ----------------------------------------------------------------------------------------------
# Helpers

def _mask_shapes():
    """Every broadcast shape of (B|1, H|1, N|1, M), plus (N, M) and (M,)."""
    shapes = [(b, h, r, M) for b in (B, 1) for h in (H, 1) for r in (N, 1)]
    return shapes + [(N, M), (M,)]


MASK_SHAPES = _mask_shapes()
# Stride-0 masks: (base shape, expanded shape).
EXPANDED = [((1, H, 1, M), (B, H, N, M)), ((M,), (N, M)), ((B, 1, N, 1), (B, H, N, M))]


def _ensure_visible(mask_like, fill):
    """Makes at least one entry per row take part (key r % width for row r)."""
    width = mask_like.shape[-1]
    if mask_like.dim() == 1:
        mask_like[0] = fill
        return mask_like
    rows = mask_like.shape[-2]
    r = torch.arange(rows)
    mask_like[..., r, r % width] = fill
    return mask_like


def make_mask(shape, kind, dtype):
    """A random mask of `shape`: bool (~70% True) or float (normal values, ~20% -inf), each row
    with at least one key taking part."""
    if kind == "bool":
        mask = torch.rand(shape) < 0.7
        return _ensure_visible(mask, True)
    values = torch.randn(shape, dtype=torch.float64)
    values = values.masked_fill(torch.rand(shape) < 0.2, float("-inf"))
    values = _ensure_visible(values, 0.5)
    return values.to(dtype)


def qkv(dtype, batch=(B, H), n=N, m=M, d=D, dv=DV, requires_grad=False):
    q = rand(*batch, n, d, dtype=dtype, requires_grad=requires_grad)
    k = rand(*batch, m, d, dtype=dtype, requires_grad=requires_grad)
    v = rand(*batch, m, dv, dtype=dtype, requires_grad=requires_grad)
    return q, k, v


def as_f64_leaves(*tensors):
    """float64 copies that are fresh autograd leaves (bool tensors and None pass through)."""
    out = []
    for t in tensors:
        if t is None or t.dtype == torch.bool:
            out.append(t)
        else:
            out.append(t.detach().double().requires_grad_(t.requires_grad))
    return out


def assert_close(actual, expected, atol, what):
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert not torch.isnan(actual).any(), f"{what}: NaN"
    err = (actual.double() - expected.double()).abs().max().item() if actual.numel() else 0.0
    assert err <= atol, f"{what}: max abs error {err:.3e} > {atol:.1e}"


def lowest_as_minus_inf(mask):
    """The mask with entries at its dtype's lowest finite value written as -inf, so that the
    float64 reference (which compares against float64's lowest after casting) sees them as
    masked, as the library does for the query's dtype."""
    if mask is None or mask.dtype == torch.bool:
        return mask
    lowest = torch.finfo(mask.dtype).min
    return torch.where(mask <= lowest, torch.full_like(mask, float("-inf")), mask)


def reference_grads(q, k, v, mask, grad_out, **kwargs):
    """Gradients of <out, grad_out> through the float64 reference, for every input that
    requires grad (None where it does not)."""
    q64, k64, v64, m64 = as_f64_leaves(q, k, v, mask)
    out, _, _ = attention_reference(q64, k64, v64, m64, **kwargs)
    leaves = [t for t in (q64, k64, v64, m64) if t is not None and t.requires_grad]
    grads = iter(torch.autograd.grad(out, leaves, grad_out.double()))
    return [next(grads) if (t is not None and t.requires_grad) else None for t in (q64, k64, v64, m64)]


# ----------------------------------------------------------------------------------------------
# The mask grid: forward and backward for every broadcast shape, bool and float.

@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("shape", MASK_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_masked_output_matches_reference_for_every_broadcast_shape(shape, kind, dtype):
    q, k, v = qkv(dtype)
    mask = make_mask(shape, kind, dtype)
    out = scaled_dot_product_attention(q, k, v, attn_mask=mask)
    expected, _, _ = attention_reference(q, k, v, mask)
    assert_close(out, expected, ATOL[dtype], "output")
    assert out.dtype == dtype


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("shape", MASK_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_masked_gradients_match_reference_and_mask_grad_has_the_masks_own_shape(shape, kind, dtype):
    q, k, v = qkv(dtype, requires_grad=True)
    mask = make_mask(shape, kind, dtype)
    if kind == "float":
        mask.requires_grad_(True)
    out = scaled_dot_product_attention(q, k, v, attn_mask=mask)
    grad_out = torch.randn_like(out)
    inputs = [q, k, v] + ([mask] if kind == "float" else [])
    grads = torch.autograd.grad(out, inputs, grad_out)
    expected = reference_grads(q, k, v, mask, grad_out)
    for name, g, e in zip("qkvm", grads, expected):
        assert_close(g, e, GRAD_ATOL[dtype], f"d{name}")
    if kind == "float":
        assert grads[3].shape == mask.shape


@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("base_shape,shape", EXPANDED, ids=lambda s: "x".join(map(str, s)))
def test_stride0_expanded_mask_matches_reference_forward_and_backward(base_shape, shape, kind):
    dtype = torch.float64
    q, k, v = qkv(dtype, requires_grad=True)
    base = make_mask(base_shape, kind, dtype)
    if kind == "float":
        base.requires_grad_(True)
    mask = base.expand(shape)
    assert 0 in mask.stride()
    out = scaled_dot_product_attention(q, k, v, attn_mask=mask)
    expected_out, _, _ = attention_reference(q, k, v, base.detach().expand(shape))
    assert_close(out, expected_out, ATOL[dtype], "output")
    grad_out = torch.randn_like(out)
    inputs = [q, k, v] + ([base] if kind == "float" else [])
    grads = torch.autograd.grad(out, inputs, grad_out)
    expected = reference_grads(q, k, v, base, grad_out) if kind == "bool" else None
    if kind == "float":
        # The reference differentiates through the same expand, so the base's grad is the sum.
        q64, k64, v64, b64 = as_f64_leaves(q, k, v, base)
        ref_out, _, _ = attention_reference(q64, k64, v64, b64.expand(shape))
        expected = torch.autograd.grad(ref_out, [q64, k64, v64, b64], grad_out)
    for name, g, e in zip("qkvm", grads, expected):
        assert_close(g, e, GRAD_ATOL[dtype], f"d{name}")


def test_stride0_expanded_float_mask_leaf_gets_a_per_element_gradient():
    """A mask that is itself an expanded leaf (stride 0 but full shape) needs a full-shape grad:
    each element's own gradient, not the sum the shared storage would suggest."""
    dtype = torch.float64
    q, k, v = qkv(dtype, requires_grad=True)
    base = make_mask((1, H, 1, M), "float", dtype)
    mask = base.expand(B, H, N, M).detach().requires_grad_(True)
    assert mask.stride()[0] == 0 and mask.stride()[2] == 0
    out = scaled_dot_product_attention(q, k, v, attn_mask=mask)
    grad_out = torch.randn_like(out)
    (dmask,) = torch.autograd.grad(out, [mask], grad_out)
    expected = reference_grads(q, k, v, mask, grad_out)[3]
    assert_close(dmask, expected, GRAD_ATOL[dtype], "dmask")


def test_noncontiguous_mask_view_matches_reference():
    dtype = torch.float64
    q, k, v = qkv(dtype)
    big = make_mask((B, H, M, N), "float", dtype)
    mask = big.transpose(-1, -2)  # (B, H, N, M), not contiguous
    assert not mask.is_contiguous()
    out = scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert_close(out, attention_reference(q, k, v, mask)[0], ATOL[dtype], "output")


def test_bool_mask_equals_float_mask_of_zeros_and_minus_inf():
    q, k, v = qkv(torch.float64)
    bmask = make_mask((B, H, N, M), "bool", torch.float64)
    fmask = torch.zeros(bmask.shape, dtype=torch.float64).masked_fill(~bmask, float("-inf"))
    a = scaled_dot_product_attention(q, k, v, attn_mask=bmask)
    b = scaled_dot_product_attention(q, k, v, attn_mask=fmask)
    assert_close(a, b, 1e-14, "bool vs float mask")


def test_masked_output_matches_torch_sdpa():
    q, k, v = qkv(torch.float64)
    for mask in (make_mask((1, H, N, M), "bool", torch.float64), make_mask((B, 1, 1, M), "float", torch.float64)):
        ours = scaled_dot_product_attention(q, k, v, attn_mask=mask)
        theirs = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        assert_close(ours, theirs, 1e-12, "vs torch")


# ----------------------------------------------------------------------------------------------
# Fully masked rows: output 0, lse -inf, grads 0, no NaN.

EMPTY_ROWS = (1, 3)


def _mask_with_empty_rows(kind, dtype, shape=(B, H, N, M)):
    """A mask whose rows EMPTY_ROWS take no key, for every batch and head."""
    if kind == "bool":
        mask = make_mask(shape, "bool", dtype)
        mask[..., EMPTY_ROWS, :] = False
        return mask
    mask = make_mask(shape, "float", dtype)
    if kind == "float_-inf":
        mask[..., EMPTY_ROWS, :] = float("-inf")
    elif kind == "float_lowest":
        mask[..., EMPTY_ROWS, :] = torch.finfo(dtype).min
    else:
        raise AssertionError(kind)
    return mask


FULLY_MASKED_KINDS = ["bool", "float_-inf", "float_lowest"]


@pytest.mark.parametrize("shape", [(B, H, N, M), (1, 1, N, M), (N, M)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("kind", FULLY_MASKED_KINDS)
def test_fully_masked_rows_give_zero_output_minus_inf_lse_and_zero_grads(kind, dtype, shape):
    q, k, v = qkv(dtype, requires_grad=True)
    mask = _mask_with_empty_rows(kind, dtype, shape)
    if mask.is_floating_point():
        mask.requires_grad_(True)
    out, lse = attention(q, k, v, attn_mask=mask, return_lse=True)
    rows = list(EMPTY_ROWS)
    others = [i for i in range(N) if i not in EMPTY_ROWS]

    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.equal(out[..., rows, :], torch.zeros_like(out[..., rows, :]))
    assert torch.isneginf(lse[..., rows]).all()
    assert torch.isfinite(lse[..., others]).all()

    expected_out, expected_lse, _ = attention_reference(q, k, v, lowest_as_minus_inf(mask))
    assert_close(out, expected_out, ATOL[dtype], "output")
    assert_close(lse[..., others], expected_lse[..., others], ATOL[dtype], "lse")

    grad_out = torch.randn_like(out)
    inputs = [q, k, v] + ([mask] if mask.requires_grad else [])
    grads = torch.autograd.grad(out, inputs, grad_out)
    for g in grads:
        assert not torch.isnan(g).any()
    dq = grads[0]
    assert torch.equal(dq[..., rows, :], torch.zeros_like(dq[..., rows, :]))
    if mask.requires_grad:
        dmask = grads[3]
        assert torch.equal(dmask[..., rows, :], torch.zeros_like(dmask[..., rows, :]))
    # The other rows' contributions are exactly what the reference gives without the empty rows.
    ref_mask = lowest_as_minus_inf(mask.detach())[..., others, :].requires_grad_(mask.requires_grad)
    expected = reference_grads(q[..., others, :], k, v, ref_mask, grad_out[..., others, :])
    assert_close(dq[..., others, :], expected[0], GRAD_ATOL[dtype], "dq")
    assert_close(grads[1], expected[1], GRAD_ATOL[dtype], "dk")
    assert_close(grads[2], expected[2], GRAD_ATOL[dtype], "dv")
    if mask.requires_grad:
        assert_close(grads[3][..., others, :], expected[3], GRAD_ATOL[dtype], "dmask")


@pytest.mark.parametrize("kind", FULLY_MASKED_KINDS)
def test_fully_masked_rows_backprop_through_lse_without_nan(kind):
    dtype = torch.float64
    q, k, v = qkv(dtype, requires_grad=True)
    mask = _mask_with_empty_rows(kind, dtype)
    out, lse = attention(q, k, v, attn_mask=mask, return_lse=True)
    # torch.where keeps the -inf entries out of the loss value but still backprops into them.
    finite = torch.isfinite(lse)
    loss = out.sum() + torch.where(finite, lse, torch.zeros_like(lse)).sum()
    dq, dk, dv = torch.autograd.grad(loss, [q, k, v])
    for g in (dq, dk, dv):
        assert not torch.isnan(g).any()
    assert torch.equal(dq[..., list(EMPTY_ROWS), :], torch.zeros_like(dq[..., list(EMPTY_ROWS), :]))


def test_reference_masks_float32_lowest_entries_like_the_library():
    dtype = torch.float32
    q, k, v = qkv(dtype)
    mask = _mask_with_empty_rows("float_lowest", dtype)
    out = scaled_dot_product_attention(q, k, v, attn_mask=mask)
    expected, _, _ = attention_reference(q, k, v, mask)
    assert_close(out, expected, ATOL[dtype], "output")


def test_mask_with_every_key_masked_gives_zeros_everywhere():
    q, k, v = qkv(torch.float64, requires_grad=True)
    mask = torch.zeros(M, dtype=torch.bool)
    out, lse = attention(q, k, v, attn_mask=mask, return_lse=True)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.isneginf(lse).all()
    dq, dk, dv = torch.autograd.grad(out, [q, k, v], torch.randn_like(out))
    for g in (dq, dk, dv):
        assert torch.equal(g, torch.zeros_like(g))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_float_mask_entries_at_dtype_lowest_are_masked_out_exactly(dtype):
    """A finite finfo.min entry counts as masked: its weight is exactly 0 (as in the reference)."""
    q, k, v = qkv(dtype)
    mask = torch.zeros(N, M, dtype=dtype)
    mask[:, 2] = torch.finfo(dtype).min
    w = attention_weights(q, k, attn_mask=mask)
    assert torch.equal(w[..., 2], torch.zeros_like(w[..., 2]))
    out = scaled_dot_product_attention(q, k, v, attn_mask=mask)
    keep = torch.tensor([j != 2 for j in range(M)])
    assert_close(out, attention_reference(q[..., :, :], k[..., keep, :], v[..., keep, :])[0], ATOL[dtype], "output")


def test_a_float32_masks_lowest_value_masks_with_float64_inputs_too():
    """Masking is decided in the mask's own dtype: a float32 mask's finfo(float32).min masks with
    float64 inputs as with float32 ones (a fully masked row: output 0, lse -inf, zero gradients, the
    mask's included), although it is an ordinary bias in float64; as the reference decides it."""
    q, k, v = qkv(torch.float64, requires_grad=True)
    mask = torch.randn(N, M, dtype=torch.float32)
    mask[0] = torch.finfo(torch.float32).min  # row 0: every key masked
    mask[1, 2] = torch.finfo(torch.float32).min
    mask.requires_grad_()
    out, lse = attention(q, k, v, attn_mask=mask, return_lse=True)
    want_out, want_lse, _ = attention_reference(q.detach(), k.detach(), v.detach(), mask.detach())
    assert torch.equal(out[..., 0, :], torch.zeros_like(out[..., 0, :])) and torch.isneginf(lse[..., 0]).all()
    assert_close(out, want_out, 1e-12, "output")
    assert_close(lse[..., 1:], want_lse[..., 1:], 1e-12, "lse")
    dmask, dq = torch.autograd.grad(out, [mask, q], torch.randn_like(out))
    assert dmask.dtype == torch.float32 and torch.equal(dmask[0], torch.zeros_like(dmask[0])) and dmask[1, 2] == 0
    assert torch.equal(dq[..., 0, :], torch.zeros_like(dq[..., 0, :]))
    w = attention_weights(q, k, attn_mask=mask)
    assert torch.equal(w[..., 0, :], torch.zeros_like(w[..., 0, :])) and torch.equal(w[..., 1, 2], torch.zeros_like(w[..., 1, 2]))


def test_mask_with_large_finite_negative_values_is_not_treated_as_masked():
    """-1e30 (above finfo(float64).min) is an ordinary bias: a row of only such values is a
    normal softmax (uniform here, the scores being lost in rounding), not a fully masked row;
    torch's SDPA agrees."""
    q, k, v = qkv(torch.float64)
    mask = torch.full((N, M), -1e30, dtype=torch.float64)
    mask[0, :3] = 0.0
    out, lse = attention(q, k, v, attn_mask=mask, return_lse=True)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert_close(out, expected, 1e-12, "output vs torch")
    assert_close(out[..., 1:, :], v.mean(-2, keepdim=True).expand(B, H, N - 1, DV), 1e-12, "uniform rows")
    assert torch.isfinite(lse).all()
    assert_close(lse[..., 0], attention_reference(q, k, v, mask)[1][..., 0], 1e-10, "lse row 0")


@pytest.mark.parametrize("dtype,bias", [(torch.float32, -1e9), (torch.float64, -1e30)], ids=["f32", "f64"])
def test_rows_with_a_large_negative_bias_have_the_same_gradients_as_torch(dtype, bias):
    """A -1e9 additive mask (a common masked_fill value) on padded query rows: torch's SDPA and
    our forward agree (uniform weights there); the gradients must agree too."""
    q, k, v = qkv(dtype, requires_grad=True)
    mask = torch.zeros(B, 1, N, M, dtype=dtype)
    mask[..., 3:, :] = bias
    out = scaled_dot_product_attention(q, k, v, attn_mask=mask)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, [q, k, v], grad_out)
    q2, k2, v2 = (t.detach().requires_grad_(True) for t in (q, k, v))
    out2 = torch.nn.functional.scaled_dot_product_attention(q2, k2, v2, attn_mask=mask)
    assert_close(out, out2, 1e-5, "output vs torch")  # passes: the forward is right
    expected = torch.autograd.grad(out2, [q2, k2, v2], grad_out)
    for name, g, e in zip("qkv", grads, expected):
        assert_close(g, e, 1e-4, f"d{name} vs torch")


@pytest.mark.parametrize("dtype,bias", [(torch.float32, -1e9), (torch.float64, -1e30)], ids=["f32", "f64"])
def test_attention_weights_rows_sum_to_one_under_a_large_negative_bias(dtype, bias):
    q, k, _ = qkv(dtype)
    mask = torch.full((N, M), bias, dtype=dtype)
    w = attention_weights(q, k, attn_mask=mask)
    assert_close(w.double().sum(-1), torch.ones(B, H, N, dtype=torch.float64), 1e-5, "row sums")


def test_reference_weights_sum_to_one_for_large_negative_biases():
    q, k, v = qkv(torch.float64)
    mask = torch.full((N, M), -1e30, dtype=torch.float64)
    _, _, w = attention_reference(q, k, v, mask)
    assert_close(w.sum(-1), torch.ones(B, H, N, dtype=torch.float64), 1e-12, "reference row sums")


# ----------------------------------------------------------------------------------------------
# Validation.

@pytest.mark.parametrize("mask_dtype", [torch.float16, torch.bfloat16], ids=str)
def test_float_mask_of_another_dtype_than_query_raises_type_error(mask_dtype):
    """(As torch: bool, the query's dtype, or float32, below; the message names all three.)"""
    q, k, v = qkv(torch.float64)
    mask = torch.zeros(N, M, dtype=mask_dtype)
    says = rf"attn_mask must be bool, or a float mask in float32 or the query's dtype \(torch.float64\), got {mask_dtype}"
    with pytest.raises(TypeError, match=says):
        scaled_dot_product_attention(q, k, v, attn_mask=mask)
    with pytest.raises(TypeError, match=says):
        attention(q, k, v, attn_mask=mask)
    with pytest.raises(TypeError, match=says):
        attention_weights(q, k, attn_mask=mask)


@pytest.mark.parametrize("mask_dtype", [torch.int64, torch.uint8], ids=str)
def test_integer_mask_raises_type_error(mask_dtype):
    q, k, v = qkv(torch.float32)
    with pytest.raises(TypeError, match="attn_mask"):
        scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(N, M, dtype=mask_dtype))


@pytest.mark.parametrize("shape", [(N, M + 1), (N + 1, M), (M - 1,), (3, H, N, M), (B, H + 1, 1, M), (1, B, H, N, M)],
                         ids=lambda s: "x".join(map(str, s)))
def test_mask_that_does_not_broadcast_raises_value_error(shape):
    q, k, v = qkv(torch.float32)
    for kind in ("bool", "float"):
        mask = make_mask(shape, kind, torch.float32)
        with pytest.raises(ValueError, match="does not broadcast"):
            scaled_dot_product_attention(q, k, v, attn_mask=mask)
        with pytest.raises(ValueError, match="does not broadcast"):
            attention_weights(q, k, attn_mask=mask)


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_attn_mask_with_is_causal_applies_both_as_torchs_cpu_kernel(kind):
    """is_causal=True with an attn_mask: top-left causal and the mask together, what torch's CPU
    flash kernel computes (its math fallback, which it also takes for d_k != d_v, refuses the
    pair), and what attention() gives."""
    q, k, v = qkv(torch.float64, dv=D, requires_grad=True)
    mask = make_mask((1, H, N, M), kind, torch.float64)
    if kind == "float":
        mask.requires_grad_(True)
    out = scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=True)
    # (torch's flash kernel; inputs that require grad would send torch to the fallback)
    expected = F.scaled_dot_product_attention(q.detach(), k.detach(), v.detach(), attn_mask=mask.detach(),
                                              is_causal=True)
    assert (out - expected).abs().max().item() <= 1e-12
    assert torch.equal(out, attention(q, k, v, attn_mask=mask, causal="top_left"))
    leaves = (q, k, v, mask) if kind == "float" else (q, k, v)
    assert torch.autograd.gradcheck(
        lambda *t: scaled_dot_product_attention(*t[:3], attn_mask=t[3] if kind == "float" else mask, is_causal=True),
        leaves)


def test_a_float32_mask_is_taken_with_every_input_dtype():
    """torch takes a float32 mask with any query dtype and adds it in float32. With float64 inputs
    it converts exactly (its gradient comes back in float32). With bfloat16 / float16 ones the call
    runs in float32 on exact copies of the inputs, so the mask is never rounded: the result in the
    inputs' dtype, bit for bit the float32 call's output rounded once; gradients in each tensor's
    own dtype; torch's SDPA agrees within the dtype's tolerance; so do attention_weights."""
    q, k, v = qkv(torch.float64)
    mask = torch.randn(N, M, requires_grad=True)
    out = scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert torch.equal(out, scaled_dot_product_attention(q, k, v, attn_mask=mask.detach().double()))
    (grad,) = torch.autograd.grad(out.sum(), mask)
    assert grad.dtype == torch.float32
    for dtype in (torch.bfloat16, torch.float16):
        low = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        out = scaled_dot_product_attention(*low, attn_mask=mask, dropout_p=0.0)
        assert out.dtype == dtype
        wide = [t.detach().float() for t in low]
        assert torch.equal(out, scaled_dot_product_attention(*wide, attn_mask=mask.detach()).to(dtype))
        torch.testing.assert_close(out, F.scaled_dot_product_attention(*low, attn_mask=mask.detach()),
                                   atol=ATOL[dtype], rtol=0)
        grads = torch.autograd.grad(out.double().square().sum(), (*low, mask))
        assert [g.dtype for g in grads] == [dtype, dtype, dtype, torch.float32]
        weights = attention_weights(low[0], low[1], attn_mask=mask)
        assert weights.dtype == dtype
        assert torch.equal(weights, attention_weights(wide[0], wide[1], attn_mask=mask.detach()).to(dtype))


@pytest.mark.parametrize("n,m", [(5, 7), (7, 5)])
@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("causal", ["top_left", "bottom_right"])
def test_attention_combines_causal_and_attn_mask_a_key_takes_part_only_if_both_allow(causal, kind, n, m):
    dtype = torch.float64
    q, k, v = qkv(dtype, n=n, m=m, requires_grad=True)
    mask = make_mask((1, H, n, m), kind, dtype)
    if kind == "float":
        mask.requires_grad_(True)
    out, lse = attention(q, k, v, attn_mask=mask, causal=causal, return_lse=True)
    expected_out, expected_lse, expected_w = attention_reference(q, k, v, mask, causal=causal)
    assert_close(out, expected_out, 1e-10, "output")
    assert torch.equal(torch.isneginf(lse), torch.isneginf(expected_lse))
    w = attention_weights(q, k, attn_mask=mask, causal=causal)
    assert_close(w, expected_w, 1e-10, "weights")
    grad_out = torch.randn_like(out)
    inputs = [q, k, v] + ([mask] if kind == "float" else [])
    grads = torch.autograd.grad(out, inputs, grad_out)
    for name, g, e in zip("qkvm", grads, reference_grads(q, k, v, mask, grad_out, causal=causal)):
        assert_close(g, e, 1e-10, f"d{name}")


def test_causal_bias_object_with_is_causal_raises_value_error():
    q, k, v = qkv(torch.float32)
    with pytest.raises(ValueError, match=r"pass either is_causal=True or a CausalBias attn_mask, not both"):
        scaled_dot_product_attention(q, k, v, attn_mask=causal_upper_left(N, M), is_causal=True)


def test_unknown_causal_kind_raises_value_error():
    q, k, v = qkv(torch.float32)
    with pytest.raises(ValueError, match="causal"):
        attention(q, k, v, causal="upper_left")


# ----------------------------------------------------------------------------------------------
# Causal alignments.

CAUSAL_SIZES = [(5, 5), (3, 7), (7, 3), (1, 6), (6, 1)]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("causal", ["top_left", "bottom_right"])
@pytest.mark.parametrize("n,m", CAUSAL_SIZES, ids=lambda s: str(s))
def test_causal_kinds_match_reference_forward_lse_and_grads(n, m, causal, dtype):
    q, k, v = qkv(dtype, n=n, m=m, requires_grad=True)
    out, lse = attention(q, k, v, causal=causal, return_lse=True)
    expected_out, expected_lse, _ = attention_reference(q, k, v, causal=causal)
    assert_close(out, expected_out, ATOL[dtype], "output")
    assert torch.equal(torch.isneginf(lse), torch.isneginf(expected_lse))
    finite = torch.isfinite(expected_lse)
    assert_close(lse[finite], expected_lse[finite], ATOL[dtype], "lse")
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, [q, k, v], grad_out)
    expected = reference_grads(q, k, v, None, grad_out, causal=causal)
    for name, g, e in zip("qkv", grads, expected):
        assert_close(g, e, GRAD_ATOL[dtype], f"d{name}")


@pytest.mark.parametrize("n,m", [(7, 3), (6, 1), (5, 2)])
def test_bottom_right_causal_with_more_queries_than_keys_zeroes_the_first_rows(n, m):
    q, k, v = qkv(torch.float64, n=n, m=m, requires_grad=True)
    out, lse = attention(q, k, v, causal="bottom_right", return_lse=True)
    empty = n - m  # query i sees keys j <= i - (n - m): rows 0 .. n-m-1 see nothing
    assert torch.equal(out[..., :empty, :], torch.zeros_like(out[..., :empty, :]))
    assert torch.isneginf(lse[..., :empty]).all()
    assert torch.isfinite(lse[..., empty:]).all()
    dq, dk, dv = torch.autograd.grad(out, [q, k, v], torch.randn_like(out))
    assert torch.equal(dq[..., :empty, :], torch.zeros_like(dq[..., :empty, :]))
    for g in (dq, dk, dv):
        assert not torch.isnan(g).any()


def test_top_left_causal_with_more_keys_than_queries_ignores_the_trailing_keys():
    n, m = 3, 7
    q, k, v = qkv(torch.float64, n=n, m=m)
    out = attention(q, k, v, causal="top_left")
    expected = attention(q, k[..., :n, :], v[..., :n, :], causal="top_left")
    assert_close(out, expected, 1e-14, "output")


def test_is_causal_equals_top_left_and_torch_sdpa():
    n, m = 4, 6
    q, k, v = qkv(torch.float64, n=n, m=m)
    ours = scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.equal(ours, attention(q, k, v, causal="top_left"))
    theirs = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert_close(ours, theirs, 1e-12, "vs torch")


@pytest.mark.parametrize("n,m", [(5, 5), (3, 7), (7, 3)])
@pytest.mark.parametrize("bias,causal", [(causal_upper_left, "top_left"), (causal_lower_right, "bottom_right")],
                         ids=["upper_left", "lower_right"])
def test_torch_causal_bias_objects_equal_the_causal_kinds(bias, causal, n, m):
    q, k, v = qkv(torch.float64, n=n, m=m, requires_grad=True)
    ours = scaled_dot_product_attention(q, k, v, attn_mask=bias(n, m))
    expected = attention(q, k, v, causal=causal)
    assert torch.equal(ours, expected)
    grad_out = torch.randn_like(ours)
    g1 = torch.autograd.grad(ours, [q, k, v], grad_out)
    g2 = torch.autograd.grad(expected, [q, k, v], grad_out)
    for a, b in zip(g1, g2):
        assert torch.equal(a, b)


@pytest.mark.parametrize("n,m", [(5, 5), (3, 7)])
def test_causal_lower_right_bias_matches_torch_sdpa_where_torch_defines_it(n, m):
    q, k, v = qkv(torch.float64, n=n, m=m)
    bias = causal_lower_right(n, m)
    ours = scaled_dot_product_attention(q, k, v, attn_mask=bias)
    theirs = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    assert_close(ours, theirs, 1e-12, "vs torch")


# ----------------------------------------------------------------------------------------------
# attention_weights: the exact probabilities.

@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("kind", ["bool", "float", "empty_rows", "top_left", "bottom_right"])
def test_attention_weights_rows_sum_to_one_or_zero_and_equal_the_reference(kind, dtype):
    n, m = (7, 4) if kind == "bottom_right" else (N, M)
    q, k, _ = qkv(dtype, n=n, m=m)
    mask, causal = None, None
    if kind in ("bool", "float"):
        mask = make_mask((1, H, n, m), kind, dtype)
    elif kind == "empty_rows":
        mask = _mask_with_empty_rows("bool", dtype)
    else:
        causal = kind
    w = attention_weights(q, k, attn_mask=mask, causal=causal)
    v_dummy = torch.zeros(*k.shape[:-1], 1, dtype=dtype)
    _, lse, expected = attention_reference(q, k, v_dummy, mask, causal=causal)
    assert w.shape == (B, H, n, m) and w.dtype == dtype
    assert_close(w, expected, ATOL[dtype], "weights")

    empty = torch.isneginf(lse)
    sums = w.double().sum(-1)
    assert_close(sums[~empty], torch.ones_like(sums[~empty]), 1e-6 if dtype == torch.float32 else 1e-12, "row sums")
    assert torch.equal(w[empty], torch.zeros_like(w[empty]))
    # Masked entries are exactly 0.
    hidden = torch.isneginf(masked_scores(q.double(), k.double(), mask, causal=causal)).expand_as(w)
    assert torch.equal(w[hidden], torch.zeros_like(w[hidden]))
    assert (w >= 0).all()


def test_attention_weights_times_value_equals_attention_output():
    q, k, v = qkv(torch.float64)
    mask = make_mask((B, 1, N, M), "float", torch.float64)
    w = attention_weights(q, k, attn_mask=mask)
    assert_close(w @ v, attention(q, k, v, attn_mask=mask), 1e-12, "W @ V")


def test_attention_weights_gradients_match_reference():
    dtype = torch.float64
    q, k, _ = qkv(dtype, requires_grad=True)
    mask = make_mask((1, H, 1, M), "float", dtype).requires_grad_(True)
    w = attention_weights(q, k, attn_mask=mask)
    grad_w = torch.randn_like(w)
    grads = torch.autograd.grad(w, [q, k, mask], grad_w)
    q64, k64, m64 = as_f64_leaves(q, k, mask)
    v_dummy = torch.zeros(*k.shape[:-1], 1, dtype=dtype)
    expected = torch.autograd.grad(attention_reference(q64, k64, v_dummy, m64)[2], [q64, k64, m64], grad_w)
    for name, g, e in zip("qkm", grads, expected):
        assert_close(g, e, 1e-10, f"d{name}")


# ----------------------------------------------------------------------------------------------
# gradcheck / gradgradcheck with a float mask requiring grad (tiny float64 shapes).

def _tiny(mask_shape=(2, 3, 4)):
    q = rand(1, 2, 3, 2, requires_grad=True)
    k = rand(1, 2, 4, 2, requires_grad=True)
    v = rand(1, 2, 4, 2, requires_grad=True)
    mask = rand(*mask_shape, requires_grad=True)
    return q, k, v, mask


def _sdpa_with_mask(q, k, v, mask):
    return scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("mask_shape", [(2, 3, 4), (1, 4), (4,)], ids=lambda s: "x".join(map(str, s)))
def test_gradcheck_with_float_mask_requiring_grad(mask_shape):
    assert torch.autograd.gradcheck(_sdpa_with_mask, _tiny(mask_shape))


def test_gradcheck_through_lse_with_float_mask():
    assert torch.autograd.gradcheck(lambda *a: attention(*a[:3], attn_mask=a[3], return_lse=True), _tiny())


@pytest.mark.parametrize("mask_shape", [(2, 3, 4), (1, 4)], ids=lambda s: "x".join(map(str, s)))
def test_gradgradcheck_with_float_mask_requiring_grad(mask_shape):
    assert torch.autograd.gradgradcheck(_sdpa_with_mask, _tiny(mask_shape), fast_mode=True)


def test_gradcheck_with_partially_minus_inf_float_mask():
    q, k, v, mask = _tiny()
    with torch.no_grad():
        mask[0, 1, 2] = float("-inf")
        mask[1, :, 0] = float("-inf")
    assert torch.autograd.gradcheck(_sdpa_with_mask, (q, k, v, mask))


def test_gradcheck_and_gradgradcheck_with_bool_mask_and_an_empty_row():
    q, k, v, _ = _tiny()
    mask = torch.tensor([[True, False, True, False], [False, False, False, False], [True, True, True, True]])
    assert torch.autograd.gradcheck(lambda *a: attention(*a, attn_mask=mask), (q, k, v))
    assert torch.autograd.gradgradcheck(lambda *a: attention(*a, attn_mask=mask), (q, k, v), fast_mode=True)


# ----------------------------------------------------------------------------------------------
# Determinism of the mask gradient (which reduces over broadcast dims).

def _mask_grads(mask_shape):
    gen = torch.Generator().manual_seed(1234)
    b, h, n, m, d = 3, 4, 33, 47, 16
    q = torch.randn(b, h, n, d, generator=gen, dtype=torch.float32, requires_grad=True)
    k = torch.randn(b, h, m, d, generator=gen, dtype=torch.float32, requires_grad=True)
    v = torch.randn(b, h, m, d, generator=gen, dtype=torch.float32, requires_grad=True)
    mask = torch.randn(mask_shape, generator=gen, dtype=torch.float32).requires_grad_(True)
    out = scaled_dot_product_attention(q, k, v, attn_mask=mask)
    grad_out = torch.randn(out.shape, generator=gen, dtype=torch.float32)
    return torch.autograd.grad(out, [q, k, v, mask], grad_out)


@pytest.mark.parametrize("mask_shape", [(3, 4, 33, 47), (1, 4, 1, 47), (47,)], ids=lambda s: "x".join(map(str, s)))
def test_mask_gradient_is_bitwise_deterministic_across_runs_and_thread_counts(mask_shape):
    threads = torch.get_num_threads()
    try:
        first = _mask_grads(mask_shape)
        second = _mask_grads(mask_shape)
        torch.set_num_threads(1)
        single = _mask_grads(mask_shape)
        torch.set_num_threads(2)
        double = _mask_grads(mask_shape)
    finally:
        torch.set_num_threads(threads)
    for name, a, b, c, d in zip("qkvm", first, second, single, double):
        assert torch.equal(a, b), f"d{name} differs between two runs"
        assert torch.equal(a, c), f"d{name} differs with 1 thread"
        assert torch.equal(a, d), f"d{name} differs with 2 threads"
    assert first[3].shape == mask_shape

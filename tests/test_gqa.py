"""Grouped-query attention (enable_gqa=True): equal to torch's own SDPA with enable_gqa and to the
float64 reference, with masks shared by the heads or per query head, gradients in the kv-head
shape, validation, and K/V read in place (never repeated)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from attention_ext import attention, attention_reference, attention_weights, scaled_dot_product_attention

from conftest import ATOL, rand, torch_sdpa_gqa

B, HQ, HKV, N, M, D, DV = 2, 6, 2, 5, 7, 4, 3
GRAD_ATOL = {torch.float64: 1e-10, torch.float32: 1e-4}


def gqa_inputs(dtype=torch.float64, hq=HQ, hkv=HKV, n=N, m=M, requires_grad=True):
    return (rand(B, hq, n, D, dtype=dtype, requires_grad=requires_grad),
            rand(B, hkv, m, D, dtype=dtype, requires_grad=requires_grad),
            rand(B, hkv, m, DV, dtype=dtype, requires_grad=requires_grad))


def assert_close(actual, expected, atol, what):
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert not torch.isnan(actual).any(), f"{what}: NaN"
    err = (actual.double() - expected.double()).abs().max().item() if actual.numel() else 0.0
    assert err <= atol, f"{what}: max abs error {err:.3e} > {atol:.1e}"


def make_mask(shape, kind, dtype):
    if kind is None:
        return None
    if kind == "bool":
        mask = torch.rand(shape) < 0.7
        mask[..., 0] = True  # every row keeps a key: torch would give NaN otherwise
        return mask
    return torch.randn(shape, dtype=torch.float64).to(dtype)


MASKS = [
    (None, None),
    ("bool", (B, 1, N, M)),       # broadcast over heads
    ("bool", (B, HQ, N, M)),      # one per query head
    ("float", (1, 1, N, M)),
    ("float", (B, HQ, N, M)),
    ("float", (HQ, 1, M)),        # per query head, broadcast over rows
    ("float", (N, M)),
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("kind,shape", MASKS, ids=lambda x: "x".join(map(str, x)) if isinstance(x, tuple) else str(x))
def test_gqa_matches_torch_sdpa_and_reference_forward_and_grads(kind, shape, dtype):
    q, k, v = gqa_inputs(dtype)
    mask = make_mask(shape, kind, dtype)
    if kind == "float":
        mask.requires_grad_(True)
    out = scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    assert out.shape == (B, HQ, N, DV)
    leaves = [q, k, v] + ([mask] if kind == "float" else [])
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, grad_out)

    # torch's own GQA.
    t_leaves = [t.detach().clone().requires_grad_(True) for t in leaves]
    t_mask = t_leaves[3] if kind == "float" else mask
    t_out = torch_sdpa_gqa(*t_leaves[:3], attn_mask=t_mask)
    t_grads = torch.autograd.grad(t_out, t_leaves, grad_out)
    tol = ATOL[dtype] if dtype == torch.float32 else 1e-12
    assert_close(out, t_out, tol, "output vs torch")
    for name, g, e in zip("qkvm", grads, t_grads):
        assert_close(g, e, GRAD_ATOL[dtype], f"d{name} vs torch")

    # The float64 reference.
    r_leaves = [t.detach().double().requires_grad_(True) for t in leaves]
    r_mask = r_leaves[3] if kind == "float" else mask
    r_out, _, _ = attention_reference(*r_leaves[:3], r_mask, enable_gqa=True)
    assert_close(out, r_out, ATOL[dtype], "output vs reference")
    r_grads = torch.autograd.grad(r_out, r_leaves, grad_out.double())
    for name, g, e in zip("qkvm", grads, r_grads):
        assert_close(g, e, GRAD_ATOL[dtype], f"d{name} vs reference")

    assert grads[1].shape == (B, HKV, M, D) and grads[2].shape == (B, HKV, M, DV)
    if kind == "float":
        assert grads[3].shape == mask.shape


@pytest.mark.parametrize("hq,hkv", [(4, 1), (3, 3), (8, 4)])
@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
def test_gqa_head_ratios_and_causal_match_reference_with_lse(hq, hkv, causal):
    q, k, v = gqa_inputs(hq=hq, hkv=hkv, n=6, m=4)
    out, lse = attention(q, k, v, causal=causal, enable_gqa=True, return_lse=True)
    r_out, r_lse, _ = attention_reference(q, k, v, causal=causal, enable_gqa=True)
    assert out.shape == (B, hq, 6, DV) and lse.shape == (B, hq, 6)
    assert_close(out, r_out, 1e-10, "output")
    assert torch.equal(torch.isneginf(lse), torch.isneginf(r_lse))
    finite = torch.isfinite(lse)
    assert_close(lse[finite], r_lse[finite], 1e-10, "lse")
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, [q, k, v], grad_out)
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    expected = torch.autograd.grad(attention_reference(*leaves, causal=causal, enable_gqa=True)[0], leaves, grad_out)
    for name, g, e in zip("qkv", grads, expected):
        assert_close(g, e, 1e-10, f"d{name}")


def test_gqa_query_head_h_reads_kv_head_h_div_groups():
    """Query head h uses kv head h // (HQ / HKV), as torch's repeat_interleave does."""
    q, k, v = gqa_inputs(requires_grad=False)
    out = scaled_dot_product_attention(q, k, v, enable_gqa=True)
    groups = HQ // HKV
    for h in range(HQ):
        one = scaled_dot_product_attention(q[:, h], k[:, h // groups], v[:, h // groups])
        assert_close(out[:, h], one, 1e-12, f"head {h}")


def test_gqa_attention_weights_equal_reference():
    q, k, _ = gqa_inputs(requires_grad=False)
    mask = make_mask((B, HQ, N, M), "bool", torch.float64)
    w = attention_weights(q, k, attn_mask=mask, enable_gqa=True)
    v_dummy = torch.zeros(B, HKV, M, 1, dtype=torch.float64)
    expected = attention_reference(q, k, v_dummy, mask, enable_gqa=True)[2]
    assert_close(w, expected, 1e-12, "weights")


def test_gqa_with_different_key_and_value_head_counts_repeats_each_as_torch():
    """torch repeats key and value to the query heads each by its own factor (6 query heads: 3 key
    heads, 2 value heads); so does the drop-in, gradients included."""
    q = rand(B, 6, N, D, dtype=torch.float64, requires_grad=True)
    k = rand(B, 3, M, D, dtype=torch.float64, requires_grad=True)
    v = rand(B, 2, M, DV, dtype=torch.float64, requires_grad=True)
    out = scaled_dot_product_attention(q, k, v, enable_gqa=True)
    expected = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    assert_close(out, expected, 1e-12, "out")
    grad_out = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad_out)
    want = torch.autograd.grad(expected, (q, k, v), grad_out)
    for name, g, e in zip("qkv", got, want):
        assert_close(g, e, 1e-10, f"d{name}")
    with pytest.raises(ValueError, match=r"query heads \(6\) to be a multiple of the key heads \(4\)"):
        scaled_dot_product_attention(q, rand(B, 4, M, D, dtype=torch.float64), v, enable_gqa=True)


def test_gqa_with_equal_head_counts_equals_plain_attention():
    q, k, v = gqa_inputs(hq=3, hkv=3, requires_grad=False)
    assert torch.equal(scaled_dot_product_attention(q, k, v, enable_gqa=True), scaled_dot_product_attention(q, k, v))


def test_gqa_with_more_leading_dims_than_the_kernels_take():
    """The split of the query heads into (kv heads, groups) adds a batch dim; with 8 leading dims
    that is 10, past the kernels' 8: the leading ones are merged as for any call. Output, lse,
    weights and gradients (gradcheck, incl. the sinks) equal the reference's on K/V repeated to
    the query heads, with sinks and ALiBi slopes per query head that vary along a merged dim, and
    a mask per query head; torch's own SDPA gives the same."""
    lead = (2, 1, 1, 1, 1, 1, 1, 2)
    q = rand(*lead, 4, 3, 2, requires_grad=True)
    k = rand(*lead, 2, 5, 2, requires_grad=True)
    v = rand(*lead, 2, 5, 3, requires_grad=True)
    sinks = rand(2, *[1] * 7, 4, requires_grad=True)
    slopes = torch.rand(2, *[1] * 7, 4)
    mask = rand(4, 3, 5, requires_grad=True)
    k_rep, v_rep = k.repeat_interleave(2, dim=-3), v.repeat_interleave(2, dim=-3)
    kw = dict(causal="bottom_right", sinks=sinks, alibi_slopes=slopes)
    out, lse = attention(q, k, v, attn_mask=mask, enable_gqa=True, return_lse=True, **kw)
    ref_out, ref_lse, ref_w = attention_reference(q, k_rep, v_rep, mask, **kw)
    assert out.shape == (*lead, 4, 3, 3) and lse.shape == (*lead, 4, 3)
    assert_close(out, ref_out, 1e-12, "out")
    assert_close(lse, ref_lse, 1e-12, "lse")
    assert_close(attention_weights(q, k, attn_mask=mask, enable_gqa=True, **kw), ref_w, 1e-12, "weights")
    assert torch.autograd.gradcheck(
        lambda q, k, v, m, s: attention(q, k, v, attn_mask=m, enable_gqa=True, sinks=s, alibi_slopes=slopes),
        (q, k, v, mask, sinks))
    sdpa = scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    assert_close(sdpa, F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True), 1e-12, "sdpa")
    with pytest.raises(ValueError, match=r"sinks must have one value per query head \(4\)"):
        attention(q, k, v, enable_gqa=True, sinks=rand(2, *[1] * 7, 2))
    with pytest.raises(ValueError, match=r"sinks of shape \(3, 1, .*\) does not broadcast to the batch dims"):
        attention(q, k, v, enable_gqa=True, sinks=rand(3, *[1] * 7, 4))


# ----------------------------------------------------------------------------------------------
# Validation.

@pytest.mark.parametrize("hq,hkv", [(5, 2), (4, 3), (2, 4)])
def test_query_heads_not_a_multiple_of_kv_heads_raises_value_error(hq, hkv):
    q, k, v = gqa_inputs(hq=hq, hkv=hkv, requires_grad=False)
    with pytest.raises(ValueError, match="multiple"):
        scaled_dot_product_attention(q, k, v, enable_gqa=True)
    with pytest.raises(ValueError, match="multiple"):
        attention_weights(q, k, enable_gqa=True)


def test_gqa_needs_a_heads_dim():
    q, k, v = rand(N, D), rand(M, D), rand(M, DV)
    with pytest.raises(ValueError, match=r"enable_gqa=True needs \(\.\.\., heads, length, dim\) inputs"):
        scaled_dot_product_attention(q, k, v, enable_gqa=True)


def test_head_mismatch_without_enable_gqa_raises_value_error():
    q, k, v = gqa_inputs(requires_grad=False)
    with pytest.raises(ValueError, match=r"do not broadcast \(fewer key/value heads than query heads: pass "
                                         r"enable_gqa=True"):
        scaled_dot_product_attention(q, k, v)


def test_enable_gqa_must_be_a_bool():
    q, k, v = gqa_inputs(requires_grad=False)
    with pytest.raises(TypeError, match="enable_gqa"):
        scaled_dot_product_attention(q, k, v, enable_gqa=1)


# ----------------------------------------------------------------------------------------------
# gradcheck.

def test_gqa_gradcheck_float64_tiny():
    q = rand(1, 2, 3, 2, requires_grad=True)
    k = rand(1, 1, 3, 2, requires_grad=True)
    v = rand(1, 1, 3, 2, requires_grad=True)
    mask = rand(2, 1, 3, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda q, k, v, m: scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True), (q, k, v, mask))


def test_gqa_gradgradcheck_float64_tiny():
    q = rand(1, 4, 3, 2, requires_grad=True)
    k = rand(1, 2, 4, 2, requires_grad=True)
    v = rand(1, 2, 4, 2, requires_grad=True)
    assert torch.autograd.gradgradcheck(
        lambda q, k, v: attention(q, k, v, causal="bottom_right", enable_gqa=True), (q, k, v), fast_mode=True)


# ----------------------------------------------------------------------------------------------
# K and V are read in place.

class _RecordKernelInputs(TorchDispatchMode):
    """Records the storage pointers of the key and value the forward kernel receives."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.attention_ext.attention_fwd.default:
            self.calls.append((args[1].untyped_storage().data_ptr(), args[2].untyped_storage().data_ptr()))
        return func(*args, **(kwargs or {}))


def test_gqa_kernel_receives_the_callers_key_and_value_storage():
    q, k, v = gqa_inputs(requires_grad=False)
    with _RecordKernelInputs() as rec:
        scaled_dot_product_attention(q, k, v, enable_gqa=True)
    assert rec.calls == [(k.untyped_storage().data_ptr(), v.untyped_storage().data_ptr())]


def test_gqa_accepts_stride0_expanded_key_value_and_grads_have_the_kv_head_shape():
    q = rand(B, HQ, N, D, requires_grad=True)
    k_base = rand(1, HKV, M, D, requires_grad=True)
    v_base = rand(1, HKV, 1, DV, requires_grad=True)
    k = k_base.expand(B, HKV, M, D)
    v = v_base.expand(B, HKV, M, DV)
    assert k.stride(0) == 0 and v.stride(0) == 0 and v.stride(2) == 0
    with _RecordKernelInputs() as rec:
        out = scaled_dot_product_attention(q, k, v, enable_gqa=True)
    assert rec.calls == [(k_base.untyped_storage().data_ptr(), v_base.untyped_storage().data_ptr())]
    grad_out = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, [q, k_base, v_base], grad_out)
    assert dk.shape == (1, HKV, M, D) and dv.shape == (1, HKV, 1, DV)
    leaves = [t.detach().requires_grad_(True) for t in (q, k_base, v_base)]
    ref = attention_reference(leaves[0], leaves[1].expand(B, HKV, M, D), leaves[2].expand(B, HKV, M, DV),
                              enable_gqa=True)[0]
    assert_close(out, ref, 1e-10, "output")
    for name, g, e in zip("qkv", (dq, dk, dv), torch.autograd.grad(ref, leaves, grad_out)):
        assert_close(g, e, 1e-10, f"d{name}")


class _RecordBackwardShapes(TorchDispatchMode):
    """Records the shapes of (dq, dk, dv) the backward kernel returns."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.attention_ext.attention_bwd.default:
            self.shapes.append(tuple(tuple(t.shape) for t in out[:3]))
        return out


def test_gqa_backward_kernel_writes_dk_dv_in_the_kv_head_shape():
    """dk/dv come out of the kernel per kv head (B, HKV, 1, M, D) — not a (B, HQ, M, D) copy reduced after."""
    q, k, v = gqa_inputs()
    out = scaled_dot_product_attention(q, k, v, enable_gqa=True)
    with _RecordBackwardShapes() as rec:
        out.sum().backward()
    assert len(rec.shapes) == 1
    dq_shape, dk_shape, dv_shape = rec.shapes[0]
    assert torch.Size(dk_shape).numel() == B * HKV * M * D, dk_shape
    assert torch.Size(dv_shape).numel() == B * HKV * M * DV, dv_shape
    assert k.grad.shape == (B, HKV, M, D) and v.grad.shape == (B, HKV, M, DV)

"""Backward: the fused softmax-Jacobian backward equals autograd through the reference."""
import pytest
import torch

import attention_ext
from attention_ext.reference import attention_reference

from conftest import ATOL, cpu_variants, rand


def reference_grads(q, k, v, grad, **kw):
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out = attention_reference(q64, k64, v64, **kw)[0]
    return torch.autograd.grad(out, (q64, k64, v64), grad.double())


GRAD_SHAPES = [
    ((2,), (2,), 7, 9, 4, 3),
    ((2, 3), (2, 3), 70, 130, 16, 8),
    ((1, 2), (1, 2), 65, 65, 64, 64),
    ((3, 1), (1, 2), 5, 8, 3, 5),  # q broadcast over heads, k/v over batch
    ((), (), 1, 1, 1, 1),
    ((1,), (1,), 33, 17, 257, 2),
]


@pytest.mark.parametrize("shape", GRAD_SHAPES, ids=str)
@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gradients_match_reference(shape, causal, dtype, cpu_variant):
    qb, kb, n, m, dk, dv = shape
    q = rand(*qb, n, dk, dtype=dtype, requires_grad=True)
    k = rand(*kb, m, dk, dtype=dtype, requires_grad=True)
    v = rand(*kb, m, dv, dtype=dtype, requires_grad=True)
    out = attention_ext.attention(q, k, v, causal=causal)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = reference_grads(q, k, v, grad, causal=causal)
    for name, g, w, t in zip("qkv", got, want, (q, k, v)):
        assert g.shape == t.shape and g.dtype == dtype
        w = torch.nan_to_num(w)  # reference NaN only on rows the library defines as 0
        err = (g.double() - w).abs().max().item()
        tol = ATOL[dtype] * 4 * max(1.0, w.abs().max().item() if w.numel() else 0.0)
        assert err <= tol, f"d{name}: {err:.3e} > {tol:.3e}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_gradients(dtype):
    q, k, v = (rand(2, 2, 100, 32, dtype=dtype, requires_grad=True) for _ in range(3))
    out = attention_ext.scaled_dot_product_attention(q, k, v, is_causal=True)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = reference_grads(q, k, v, grad, causal="top_left")
    # Plain torch's own error in this dtype sets the budget (k = 4 for gradients).
    ql, kl, vl = (t.detach().clone().requires_grad_() for t in (q, k, v))
    lp = torch.autograd.grad(attention_reference(ql, kl, vl, causal="top_left", dtype=None)[0], (ql, kl, vl), grad)
    for g, w, b in zip(got, want, lp):
        budget = (b.double() - w).abs().max().item()
        err = (g.double() - w).abs().max().item()
        assert err <= max(4 * budget, ATOL[dtype]), (err, budget)


# (query batch, key batch, n, m, dk, dv): whole tiles; odd head dims, a short last tile and
# K/V broadcast over the batch (dK, dV summed over it); 9 query rows (the fewest that take the
# tiled backward, padded to whole product rows) against many keys.
BF16_GRAD_SHAPES = [
    ((1, 2), (1, 2), 128, 128, 64, 64),
    ((2, 3), (1, 3), 70, 131, 33, 96),
    ((1, 2), (1, 2), 9, 200, 128, 40),
]


@pytest.mark.parametrize("shape", BF16_GRAD_SHAPES, ids=str)
@pytest.mark.parametrize("masked", [False, True], ids=["plain", "mask_and_causal"])
def test_bf16_gradients_on_every_variant_are_within_the_bf16_budget(shape, masked, cpu_variant):
    """bf16 gradients stay within k x plain torch's own bf16 error on every CPU variant. The amx
    (tiles) and avx512bf16 (dot products) variants run the backward's five products on bf16
    pairs, with P and dS rounded to bf16 for dV, dK and dQ as torch's bf16 path rounds them:
    every packing path (odd head dims, padded rows, broadcast K/V, a float mask with causal)
    must keep to the budget."""
    qb, kb, n, m, dk, dv = shape
    q = rand(*qb, n, dk, dtype=torch.bfloat16, requires_grad=True)
    k = rand(*kb, m, dk, dtype=torch.bfloat16, requires_grad=True)
    v = rand(*kb, m, dv, dtype=torch.bfloat16, requires_grad=True)
    kw = dict(causal="bottom_right") if masked else {}
    mask = rand(n, m, dtype=torch.bfloat16) if masked else None
    out = attention_ext.attention(q, k, v, attn_mask=mask, **kw)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = reference_grads(q, k, v, grad, attn_mask=mask, **kw)
    ql, kl, vl = (t.detach().clone().requires_grad_() for t in (q, k, v))
    lp = torch.autograd.grad(attention_reference(ql, kl, vl, mask, dtype=None, **kw)[0], (ql, kl, vl), grad)
    for name, g, w, b in zip("qkv", got, want, lp):
        budget = (b.double() - w).abs().max().item()
        err = (g.double() - w).abs().max().item()
        assert err <= max(4 * budget, ATOL[torch.bfloat16]), f"d{name}: {err:.3e}, budget {budget:.3e}"


@pytest.mark.cpu_kernels
@pytest.mark.skipif("avx512bf16" not in cpu_variants(), reason="this CPU has no AVX512-BF16")
def test_avx512bf16_variant_runs_its_own_bf16_backward():
    # Its products round P and dS to bf16, so its bf16 gradients differ from the avx512 variant's
    # (fp32 products on widened inputs); fp32 runs the same code in both, bit for bit.
    grads = {}
    previous = attention_ext.cpu_variant()
    try:
        for variant in ("avx512bf16", "avx512"):
            attention_ext.set_cpu_variant(variant)
            for dtype in (torch.bfloat16, torch.float32):
                torch.manual_seed(0)
                q, k, v = (rand(1, 2, 100, 64, dtype=dtype, requires_grad=True) for _ in range(3))
                out = attention_ext.scaled_dot_product_attention(q, k, v)
                grads[variant, dtype] = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    finally:
        attention_ext.set_cpu_variant(previous)
    for a, b in zip(grads["avx512bf16", torch.bfloat16], grads["avx512", torch.bfloat16]):
        assert not torch.equal(a, b)
    for a, b in zip(grads["avx512bf16", torch.float32], grads["avx512", torch.float32]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
@pytest.mark.parametrize("shape", [(1, 4, 5, 3, 2), (2, 3, 3, 4, 4), (1, 6, 2, 1, 3)], ids=str)
def test_gradcheck_float64(shape, causal):
    # Tiny shapes (n <= 8 takes the decode forward on the CPU): test_gradcheck_paths.py checks
    # each forward path and backward schedule at sizes that cross tile boundaries.
    b, n, m, dk, dv = shape
    q = rand(b, n, dk, requires_grad=True)
    k = rand(b, m, dk, requires_grad=True)
    v = rand(b, m, dv, requires_grad=True)
    assert torch.autograd.gradcheck(lambda q, k, v: attention_ext.attention(q, k, v, causal=causal), (q, k, v))


def test_gradcheck_broadcast_batch_dims():
    q = rand(2, 1, 3, 2, requires_grad=True)
    k = rand(1, 3, 4, 2, requires_grad=True)
    v = rand(1, 3, 4, 3, requires_grad=True)
    assert torch.autograd.gradcheck(attention_ext.scaled_dot_product_attention, (q, k, v))


def test_gradcheck_through_lse():
    q, k, v = (rand(2, 4, 3, requires_grad=True) for _ in range(3))

    def f(q, k, v):
        out, lse = attention_ext.attention(q, k, v, return_lse=True)
        return out, lse

    assert torch.autograd.gradcheck(f, (q, k, v))


def test_grads_of_expanded_inputs_sum_over_the_expansion():
    base_k = rand(1, 1, 9, 4, dtype=torch.float32, requires_grad=True)
    k = base_k.expand(2, 3, 9, 4)
    q = rand(2, 3, 5, 4, dtype=torch.float32, requires_grad=True)
    v = rand(2, 3, 9, 4, dtype=torch.float32, requires_grad=True)
    out = attention_ext.scaled_dot_product_attention(q, k, v)
    out.sum().backward()
    k64 = base_k.detach().double().requires_grad_()
    ref = attention_reference(q.detach(), k64.expand(2, 3, 9, 4), v.detach())[0]
    ref.sum().backward()
    assert torch.allclose(base_k.grad.double(), k64.grad, atol=1e-5)


def test_only_requested_gradients_are_returned():
    q = rand(2, 5, 4, dtype=torch.float32, requires_grad=True)
    k = rand(2, 6, 4, dtype=torch.float32)
    v = rand(2, 6, 4, dtype=torch.float32)
    attention_ext.scaled_dot_product_attention(q, k, v).sum().backward()
    assert q.grad is not None and k.grad is None and v.grad is None


def column_strided(t):
    """The same values stored one column apart (column stride 2), so kernels cannot read rows in place."""
    wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
    wide[..., ::2] = t.detach()
    return wide[..., ::2].requires_grad_(t.requires_grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_backward_shortcuts_change_no_bits(dtype):
    # On whole tiles the CPU backward reads float Q and dO rows where they are stored (instead of a
    # packed copy) and, with no mask or modifier, takes P and dS in one pass (instead of a logits
    # pass, then P, then dS): the same values with the same roundings. Forced off by column strides
    # (Q and dO rows copied, and delta = rowsum(dO ∘ O) then reads dO's copy) and by an all-zero
    # float mask (the general passes; adding 0 changes no logit), both must give the very same
    # gradients. 132 query rows: two whole tiles and a short one of 4 rows, read in place too.
    q = rand(1, 2, 132, 64, dtype=dtype, requires_grad=True)
    k, v = (rand(1, 2, 128, 64, dtype=dtype, requires_grad=True) for _ in range(2))
    grad = torch.randn(1, 2, 132, 64, dtype=dtype)

    def grads(q, k, v, grad, **kw):
        out = attention_ext.attention(q, k, v, **kw)
        return torch.autograd.grad(out, (q, k, v), grad)

    fast = grads(q, k, v, grad)
    copied = grads(column_strided(q), k, v, column_strided(grad))
    zero_mask = grads(q, k, v, grad, attn_mask=torch.zeros(132, 128, dtype=dtype))
    for a, b, c in zip(fast, copied, zero_mask):
        assert torch.equal(a, b) and torch.equal(a, c)

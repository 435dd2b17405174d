"""The decode backward: calls with at most 8 query rows (and a query that is not broadcast, no
mask gradient) take a backward with the decode forward's products, K and V rows read in place
by row dot products, the keys of few (batch, head) pairs cut into ranges whose partial dQ are
summed in range order (csrc/cpu/backward_decode.inc). It must agree with the float64 reference
in every dtype and semantic corner, stay close to the tiled backward it replaces, keep each row's
dP − delta exactly 0 where one key takes the whole row, and give the same bits on any number of
threads. (Finite differences of every feature: test_gradcheck_paths.py.)"""
from __future__ import annotations

import pytest
import torch

from attention_ext import attention, draw_rng_state, dropout_mask, scaled_dot_product_attention
from attention_ext.reference import attention_reference

from conftest import assert_grads_close_to_reference, on_thread_counts, rand

pytestmark = pytest.mark.cpu_kernels

# One (batch, head) pair and 5000 keys: 9 key ranges, each with its partial dQ.
SPLIT = dict(batch=(1, 1), m=5000)
# 32 pairs: one range each.
UNSPLIT = dict(batch=(4, 8), m=300)


def qkv(batch, n, m, dk=64, dv=64, dtype=torch.float64, kv_batch=None):
    kv_batch = batch if kv_batch is None else kv_batch
    return (rand(*batch, n, dk, dtype=dtype, requires_grad=True),
            rand(*kv_batch, m, dk, dtype=dtype, requires_grad=True),
            rand(*kv_batch, m, dv, dtype=dtype, requires_grad=True))


def gradients(fn, inputs, grad_seed=0):
    """fn(*inputs)'s gradients for a fixed random output gradient, and that gradient."""
    out = fn(*inputs)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(grad_seed), dtype=torch.float64)
    return torch.autograd.grad(out, inputs, g.to(out.dtype)), g


def reference_gradients(inputs, g, dtype=torch.float64, **kw):
    """The reference's gradients, computed in float64 (dtype=float64) or in the inputs' own dtype."""
    leaves = tuple(t.detach().to(dtype).requires_grad_() for t in inputs)
    out = attention_reference(*leaves, dtype=None, **kw)[0]
    return torch.autograd.grad(out, leaves, g.to(out.dtype))


def tiled(monkeypatch, fn):
    with monkeypatch.context() as mp:
        mp.setenv("ATTENTION_EXT_CPU_BACKWARD", "fused")
        return fn()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", [SPLIT, UNSPLIT], ids=["split_keys", "one_range"])
@pytest.mark.parametrize("n", [1, 3, 8])
def test_decode_backward_equals_reference(cpu_variant, dtype, layout, n):
    q, k, v = qkv(layout["batch"], n, layout["m"], dtype=dtype)
    got, g = gradients(lambda q, k, v: scaled_dot_product_attention(q, k, v), (q, k, v))
    want = reference_gradients((q, k, v), g)
    low = reference_gradients((q, k, v), g, dtype=dtype) if dtype in (torch.float16, torch.bfloat16) else want
    assert all(t.dtype == dtype for t in got)
    assert_grads_close_to_reference(got, want, low, dtype)


# Each feature that changes what the backward rebuilds P from or where rows come from.
FEATURES = {
    "causal_top_left": dict(causal="top_left"),
    "causal_bottom_right": dict(causal="bottom_right"),
    "window": dict(window=(40, 3)),
    "softcap_alibi": dict(softcap=2.0, alibi_slopes=torch.tensor([0.5, 0.25, 0.125, 0.0625])),
    "bool_mask": dict(attn_mask="bool"),
    "float_mask": dict(attn_mask="float"),
    "sinks": dict(sinks=torch.tensor([0.3, -1.0, 2.0, 0.0], dtype=torch.float64)),
}


@pytest.mark.parametrize("feature", FEATURES, ids=str)
@pytest.mark.parametrize("m", [1100, 130], ids=["split_keys", "one_range"])
def test_decode_backward_features_equal_reference(feature, m):
    n = 3
    q, k, v = qkv((1, 4), n, m, dk=16, dv=8)
    kw = dict(FEATURES[feature])
    if kw.get("attn_mask") == "bool":
        mask = torch.rand(1, 4, n, m, generator=torch.Generator().manual_seed(1)) < 0.7
        mask[0, 1, 2] = False  # a row where no key takes part: gradients 0
        kw["attn_mask"] = mask
    elif kw.get("attn_mask") == "float":
        kw["attn_mask"] = rand(n, m)  # (no gradient into it: the decode backward runs)
    got, g = gradients(lambda q, k, v: attention(q, k, v, **kw), (q, k, v))
    want = reference_gradients((q, k, v), g, **kw)
    assert_grads_close_to_reference(got, tuple(torch.nan_to_num(w) for w in want), want, torch.float64)


@pytest.mark.parametrize("tokens_major", [False, True], ids=["heads_major", "tokens_major"])
@pytest.mark.parametrize("m", [1500, 200], ids=["split_keys", "one_range"])
def test_decode_backward_gqa_sums_the_group_into_its_kv_head(tokens_major, m):
    # 8 query heads on 2 K/V heads, K/V stored (batch, tokens, heads, d) or (batch, heads, tokens, d).
    hq, hkv, n = 8, 2, 2
    q = rand(1, hq, n, 32, requires_grad=True)
    if tokens_major:
        k, v = (rand(1, m, hkv, 32).transpose(1, 2).requires_grad_() for _ in range(2))
    else:
        k, v = (rand(1, hkv, m, 32, requires_grad=True) for _ in range(2))
    got, g = gradients(lambda q, k, v: scaled_dot_product_attention(q, k, v, enable_gqa=True), (q, k, v))
    kr, vr = (t.detach().repeat_interleave(hq // hkv, dim=1).requires_grad_() for t in (k, v))
    want_q, want_k, want_v = reference_gradients((q, kr, vr), g)
    want = (want_q, want_k.unflatten(1, (hkv, hq // hkv)).sum(2), want_v.unflatten(1, (hkv, hq // hkv)).sum(2))
    assert_grads_close_to_reference(got, want, want, torch.float64)


@pytest.mark.parametrize("dk,dv", [(1, 1), (5, 3), (64, 16), (130, 72)])
def test_decode_backward_any_head_dims_and_strided_inputs(dk, dv):
    # Rows that are not whole vectors, or not of unit stride, are converted into padded tiles.
    q = rand(2, dk, 3).transpose(-1, -2).requires_grad_()
    k = rand(2, 2 * dk, 700)[:, ::2].transpose(-1, -2).requires_grad_()
    v = rand(2, 700, dv, requires_grad=True)
    got, g = gradients(lambda q, k, v: attention(q, k, v, causal="bottom_right"), (q, k, v))
    want = reference_gradients((q, k, v), g, causal="bottom_right")
    assert_grads_close_to_reference(got, want, want, torch.float64)


@pytest.mark.parametrize("layout", [SPLIT, UNSPLIT], ids=["split_keys", "one_range"])
def test_decode_backward_dropout_equals_reference_with_drawn_mask(layout):
    p = 0.25
    q, k, v = qkv(layout["batch"], 3, layout["m"], dk=16, dv=16)
    torch.manual_seed(5)
    keep = dropout_mask(draw_rng_state(), (*layout["batch"], 3, layout["m"]), p)
    torch.manual_seed(5)
    got, g = gradients(lambda q, k, v: scaled_dot_product_attention(q, k, v, dropout_p=p), (q, k, v))
    want = reference_gradients((q, k, v), g, dropout_mask=keep, dropout_p=p)
    assert_grads_close_to_reference(got, want, want, torch.float64)


def test_decode_backward_through_the_lse():
    q, k, v = qkv((2, 2), 4, 1100, dk=8, dv=8)
    out, lse = attention(q, k, v, causal="bottom_right", return_lse=True)
    g_out, g_lse = torch.randn_like(out), torch.randn_like(lse)
    got = torch.autograd.grad((out, lse), (q, k, v), (g_out, g_lse))
    leaves = tuple(t.detach().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse, _ = attention_reference(*leaves, causal="bottom_right")
    want = torch.autograd.grad((ref_out, ref_lse), leaves, (g_out, g_lse))
    assert_grads_close_to_reference(got, want, want, torch.float64)


@pytest.mark.parametrize("layout", [SPLIT, UNSPLIT], ids=["split_keys", "one_range"])
def test_decode_backward_agrees_with_tiled_backward(monkeypatch, layout):
    q, k, v = qkv(layout["batch"], 4, layout["m"], dtype=torch.float32)
    mask = torch.rand(1, 1, 4, layout["m"]) < 0.9
    fn = lambda q, k, v: attention(q, k, v, attn_mask=mask, causal="bottom_right")  # noqa: E731
    decode, _ = gradients(fn, (q, k, v))
    tiled_grads, _ = tiled(monkeypatch, lambda: gradients(fn, (q, k, v)))
    for a, b in zip(decode, tiled_grads):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)
    # The switch is read: the tiled backward sums in other orders, so some bits differ.
    assert any(not torch.equal(a, b) for a, b in zip(decode, tiled_grads))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n", [2, 5])  # (fp32 on 16-lane vectors: five rows go four at a time, then one)
def test_a_row_taken_by_one_key_has_no_query_or_key_gradient(cpu_variant, dtype, n):
    """A row whose softmax is one key's (all others underflow to 0) has P = 1 there and O = that
    key's V row exactly; dP − delta is then exactly 0, because delta sums dO·O as dP sums dO·v: dQ
    and dK are exactly 0 and dV of that key is dO, as the exact Jacobian P∘(dP − rowsum(dO∘O)) says."""
    keys = [7, 150, 64, 3, 199][:n]  # (in whole vectors of keys and in the tail)
    k = rand(1, 2, 200, 16, dtype=dtype)
    k[:, :, keys] *= 3  # (three times as long as the others: each row's next key trails by far)
    q = (k[:, :, keys] * 1000).detach().requires_grad_()  # row r is key keys[r]'s
    k.requires_grad_()
    v = rand(1, 2, 200, 16, dtype=dtype, requires_grad=True)
    (dq, dk, dv), g = gradients(lambda q, k, v: scaled_dot_product_attention(q, k, v), (q, k, v))
    assert torch.all(dq == 0) and torch.all(dk == 0)
    for r, key in enumerate(keys):
        assert torch.equal(dv[:, :, key], g[:, :, r].to(dtype))
    dv[:, :, keys] = 0
    assert torch.all(dv == 0)


@pytest.mark.parametrize("layout", [SPLIT, UNSPLIT], ids=["split_keys", "one_range"])
def test_decode_backward_is_bitwise_independent_of_thread_count(layout):
    q, k, v = qkv(layout["batch"], 2, layout["m"], dtype=torch.float32)
    results = on_thread_counts(lambda: gradients(lambda q, k, v: attention(q, k, v, causal="bottom_right"),
                                                 (q, k, v))[0])
    for grads in results[1:]:
        for a, b in zip(grads, results[0]):
            assert torch.equal(a, b)

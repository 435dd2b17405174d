"""Sliding windows: attention(window=(left, right)), attention_weights(window=...) and the ops'
window_left / window_right.

Key j is visible to query i iff i + m - n - left <= j <= i + m - n + right: bottom-right aligned,
as FlashAttention's window_size; None (or -1) leaves a side unbounded, and causal caps right at 0.
Every kernel applies it and skips the key tiles outside it: on the CPU the tiled and decode
forwards, every ISA variant, the fused and split backward; the CUDA SIMT, tensor-core and split-KV
kernels when this suite runs on the emulation build (.ci/cuda_emulation.sh).
"""
from __future__ import annotations

import pytest
import torch

import attention_ext
from attention_ext.reference import attention_reference

from conftest import (CUDA_KERNELS_DEVICE, FLOAT_DTYPES, assert_close_to_reference,
                      assert_grads_close_to_reference, assert_lse_close, gradcheck, gradgradcheck, rand)

ops = torch.ops.attention_ext
LOW = (torch.float16, torch.bfloat16)

# The windows of the spec: causal-like, symmetric, the diagonal alone, one side unbounded.
WINDOWS = [(16, 0), (8, 8), (0, 0), (None, 4), (32, None)]
# (n, m, head dim): square, fewer and more queries than keys, and few rows (the CPU decode path).
SHAPES = [(70, 70, 64), (40, 150, 32), (150, 40, 80), (3, 300, 128)]


def band(n, m, window, causal=None):
    """The window as an explicit bool (n, m) mask, written out from its definition."""
    left, right = (-1 if b is None else b for b in window)
    if causal is not None:
        right = 0
    diagonal = torch.arange(n).unsqueeze(-1) + (0 if causal == "top_left" else m - n)
    j = torch.arange(m)
    visible = torch.ones(n, m, dtype=torch.bool)
    if right >= 0:
        visible &= j <= diagonal + right
    if left >= 0:
        visible &= j >= diagonal - left
    return visible


def inputs(n, m, d, dtype, batch=(2, 3), requires_grad=False, kv_heads=None):
    kb = batch if kv_heads is None else (*batch[:-1], kv_heads)
    q = rand(*batch, n, d, dtype=dtype, requires_grad=requires_grad)
    k = rand(*kb, m, d, dtype=dtype, requires_grad=requires_grad)
    v = rand(*kb, m, d, dtype=dtype, requires_grad=requires_grad)
    return q, k, v


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("n,m,d", SHAPES, ids=str)
def test_forward_matches_the_reference(dtype, window, n, m, d):
    q, k, v = inputs(n, m, d, dtype)
    out, lse = attention_ext.attention(q, k, v, window=window, return_lse=True)
    ref, ref_lse, _ = attention_reference(q, k, v, window=window)
    budget = (attention_reference(q, k, v, window=window, dtype=None)[0].double() - ref).abs().max().item()
    assert_close_to_reference(out, ref, dtype, budget)
    assert_lse_close(lse, ref_lse, dtype)
    assert torch.all(out[torch.isneginf(ref_lse)] == 0)


def _grads(fn, tensors, grad):
    out = fn(*tensors)
    return torch.autograd.grad(out, tensors, grad)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("n,m,d,kv_heads", [(90, 70, 32, 1), (5, 200, 80, None), (64, 129, 64, 3)], ids=str)
def test_gradients_match_the_reference(dtype, window, n, m, d, kv_heads):
    """dQ, dK, dV within 4x the error of plain torch computing the reference in the same dtype
    (fp64/fp32: the dtype's absolute tolerance), GQA included."""
    q, k, v = inputs(n, m, d, dtype, requires_grad=True, kv_heads=kv_heads)
    grad = rand(2, 3, n, d, dtype=dtype)
    gqa = kv_heads is not None
    got = _grads(lambda q, k, v: attention_ext.attention(q, k, v, window=window, enable_gqa=gqa), (q, k, v), grad)
    ins64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = _grads(lambda q, k, v: attention_reference(q, k, v, window=window, enable_gqa=gqa)[0], ins64,
                  grad.double())
    lp = [t.detach().requires_grad_() for t in (q, k, v)]
    low = _grads(lambda q, k, v: attention_reference(q, k, v, window=window, enable_gqa=gqa, dtype=None)[0], lp,
                 grad)
    assert_grads_close_to_reference(got, want, low, dtype)


def test_gradcheck_in_float64_with_every_modifier_combined():
    """Window, bottom-right causal, a float mask (with its gradient), GQA broadcast and dropout
    (the same rng_state each call), through the fused kernels; then double backward."""
    q, k, v = inputs(7, 9, 4, torch.float64, batch=(1, 4), requires_grad=True, kv_heads=2)
    mask = rand(1, 4, 7, 9, dtype=torch.float64, requires_grad=True)

    def fn(q, k, v, mask):
        torch.manual_seed(11)
        return attention_ext.attention(q, k, v, attn_mask=mask, causal="bottom_right", window=(3, None),
                                       dropout_p=0.3, enable_gqa=True, return_lse=True)

    assert gradcheck(fn, (q, k, v, mask))
    assert gradcheck(
        lambda q, k, v: attention_ext.attention(q, k, v, window=(2, 1), enable_gqa=True, return_lse=True), (q, k, v))
    assert gradgradcheck(
        lambda q, k, v: attention_ext.attention(q, k, v, window=(1, 2), enable_gqa=True), (q, k, v))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("n,m", [(70, 70), (5, 1100), (200, 45)], ids=str)
@pytest.mark.parametrize("window", [(64, 0), (3, 40), (None, 0), (130, None)], ids=str)
def test_a_window_is_the_band_as_a_bool_mask(dtype, n, m, window):
    """Skipping the tiles outside the window changes nothing: the output, lse, weights and
    gradients equal those of the same band passed as a bool mask (5 x 1100: the split decode)."""
    q, k, v = inputs(n, m, 16, dtype, batch=(2,), requires_grad=True)
    mask = band(n, m, window)
    grad = rand(2, n, 16, dtype=dtype)
    out_w, lse_w = attention_ext.attention(q, k, v, window=window, return_lse=True)
    out_m, lse_m = attention_ext.attention(q, k, v, attn_mask=mask, return_lse=True)
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(out_w, out_m, **tol)
    torch.testing.assert_close(lse_w, lse_m, **tol)
    for a, b in zip(torch.autograd.grad(out_w, (q, k, v), grad), torch.autograd.grad(out_m, (q, k, v), grad)):
        torch.testing.assert_close(a, b, **tol)
    torch.testing.assert_close(attention_ext.attention_weights(q, k, window=window),
                               attention_ext.attention_weights(q, k, attn_mask=mask), **tol)


def test_rows_outside_every_window_give_zero_output_lse_and_gradients():
    """Window (0, 0) with 6 queries and 2 keys: query i sits at key i - 4, so rows 0-3 see nothing."""
    q, k, v = inputs(6, 2, 8, torch.float32, batch=(1,), requires_grad=True)
    mask = rand(1, 6, 2, dtype=torch.float32, requires_grad=True)
    out, lse = attention_ext.attention(q, k, v, attn_mask=mask, window=(0, 0), return_lse=True)
    assert torch.all(out[:, :4] == 0) and torch.all(torch.isneginf(lse[:, :4])) and torch.isfinite(lse[:, 4:]).all()
    out.sum().backward()
    for t in (q, k, v, mask):
        assert torch.isfinite(t.grad).all()
    assert torch.all(q.grad[:, :4] == 0) and torch.all(mask.grad[:, :4] == 0)
    w = attention_ext.attention_weights(q, k, window=(0, 0))
    assert torch.all(w[:, :4] == 0) and torch.all(w[:, 4:].sum(-1) == 1)


@pytest.mark.parametrize("n,m", [(9, 9), (6, 11), (11, 6)], ids=str)
def test_causal_caps_the_right_edge_at_the_diagonal(n, m):
    q, k, v = inputs(n, m, 8, torch.float64)
    want = attention_ext.attention(q, k, v, window=(3, 0))
    for right in (None, 0, 5):
        torch.testing.assert_close(attention_ext.attention(q, k, v, causal="bottom_right", window=(3, right)), want)
    if n == m:  # top-left and bottom-right agree: the window may go with either
        torch.testing.assert_close(attention_ext.attention(q, k, v, causal="top_left", window=(3, None)), want)
    else:
        with pytest.raises(ValueError, match=r"aligned bottom-right and cannot be combined with top-left causal"):
            attention_ext.attention(q, k, v, causal="top_left", window=(3, None))
        with pytest.raises(RuntimeError, match=r"aligned bottom-right and cannot be combined with top-left causal"):
            ops.attention_fwd(q, k, v, None, 0.5, 1, 3, -1, 0.0, None, None, 0.0, None)


def test_no_window_and_an_unbounded_window_are_the_same_call():
    q, k, v = inputs(5, 7, 8, torch.float64)
    want = attention_ext.attention(q, k, v)
    for window in ((None, None), (-1, -1), [None, -1]):
        assert torch.equal(attention_ext.attention(q, k, v, window=window), want)


@pytest.mark.parametrize("window,error,match", [
    ((-2, 0), ValueError, r"window left bound must be >= 0 \(or None / -1 for unbounded\), got -2"),
    ((0, -5), ValueError, r"window right bound must be >= 0 \(or None / -1 for unbounded\), got -5"),
    ((1.5, 2), TypeError, r"window left bound must be an int or None, got float"),
    ((True, 2), TypeError, r"window left bound must be an int or None, got bool"),
    ((1,), TypeError, r"window must be None or a pair \(left, right\)"),
    ("left", TypeError, r"window must be None or a pair \(left, right\)"),
    (torch.tensor([1, 2]), TypeError, r"window must be None or a pair \(left, right\)"),
])
def test_bad_windows_are_refused_with_their_value(window, error, match):
    q, k, v = inputs(4, 4, 8, torch.float32)
    with pytest.raises(error, match=match):
        attention_ext.attention(q, k, v, window=window)
    with pytest.raises(error, match=match):
        attention_ext.attention_weights(q, k, window=window)


def test_raw_ops_and_their_fake_kernels_check_the_window():
    q, k, v = inputs(4, 4, 8, torch.float32)
    for device in ("cpu", "meta"):
        qd, kd, vd = (t.to(device) for t in (q, k, v))
        with pytest.raises(RuntimeError, match=r"window bounds must be >= 0, or -1 for unbounded, got \(-2, 0\)"):
            ops.attention_fwd(qd, kd, vd, None, 0.5, 0, -2, 0, 0.0, None, None, 0.0, None)
        with pytest.raises(RuntimeError, match=r"window bounds must be >= 0, or -1 for unbounded, got \(1, -7\)"):
            ops.attention_probs(qd, kd, None, 0.5, 0, 1, -7, 0.0, None, None)


def test_opcheck_and_compiled_fullgraph_calls_with_a_window():
    q, k, v = inputs(5, 9, 8, torch.float32, requires_grad=True)
    torch.library.opcheck(ops.attention_fwd, (q, k, v, None, 0.4, 2, 3, 1, 0.0, None, None, 0.0, None))
    out, lse = ops.attention_fwd(q, k, v, None, 0.4, 0, 2, 2, 0.0, None, None, 0.0, None)
    torch.library.opcheck(ops.attention_bwd, (torch.randn_like(out), None, q, k, v, None, out, lse, 0.4, 0, 2, 2,
                                              0.0, None, None, 0.0, None, False))
    torch.library.opcheck(ops.attention_probs, (q, k, None, 0.4, 0, 0, 3, 0.0, None, None))
    torch._dynamo.reset()
    fn = torch.compile(lambda q, k, v: attention_ext.attention(q, k, v, window=(3, 1)), fullgraph=True, backend="eager")
    out = fn(q, k, v)
    torch.testing.assert_close(out, attention_ext.attention(q, k, v, window=(3, 1)))
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


@pytest.mark.parametrize("n,m", [(33, 33), (20, 90)], ids=str)
def test_weights_are_zero_outside_the_window_and_exact_inside(n, m):
    q, k, _ = inputs(n, m, 16, torch.float64)
    w = attention_ext.attention_weights(q, k, window=(5, 2))
    _, _, ref = attention_reference(q, k, k, window=(5, 2))
    torch.testing.assert_close(w, ref)
    assert torch.all(w[..., ~band(n, m, (5, 2))] == 0)


# --- The CUDA kernels (tensor-core and split-KV paths) -------------------------------------------

@pytest.mark.cuda_kernels
@pytest.mark.skipif(CUDA_KERNELS_DEVICE is None, reason="needs a CUDA device or the CUDA emulation build")
@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("n,m,window,splits", [(150, 170, (40, 0), ""), (130, 70, (8, 8), ""),
                                               (2, 1000, (300, 0), "4"), (3, 1000, (None, 2), "6")], ids=str)
def test_tensor_core_and_split_kv_kernels_apply_the_window(dtype, d, n, m, window, splits, monkeypatch):
    """fp16/bf16 with d = 64/128 take the tensor-core forward and backward; few query rows against
    many keys split the keys into ranges (forced here), which cover only the window's keys."""
    monkeypatch.setenv("ATTENTION_EXT_CUDA_KV_SPLITS", splits)
    dev = CUDA_KERNELS_DEVICE
    q, k, v = (t.to(dev) for t in inputs(n, m, d, dtype, batch=(1, 2)))
    for t in (q, k, v):
        t.requires_grad_()
    out, lse = attention_ext.attention(q, k, v, window=window, return_lse=True)
    ref, ref_lse, _ = attention_reference(q.cpu(), k.cpu(), v.cpu(), window=window)
    budget = (attention_reference(q, k, v, window=window, dtype=None)[0].double().cpu() - ref).abs().max().item()
    assert_close_to_reference(out.cpu(), ref, dtype, budget)
    assert torch.equal(torch.isneginf(lse.cpu()), torch.isneginf(ref_lse))
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    ins64 = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
    want = torch.autograd.grad(attention_reference(*ins64, window=window)[0], ins64, grad.cpu().double())
    lp = [t.detach().requires_grad_() for t in (q, k, v)]
    low = torch.autograd.grad(attention_reference(*lp, window=window, dtype=None)[0], lp, grad)
    assert_grads_close_to_reference([g.cpu() for g in got], want, [g.cpu() for g in low], dtype)

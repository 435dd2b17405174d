"""Score modifiers and sinks: softcap, ALiBi and attention sinks in attention() / attention_weights()
and the ops.

On the scaled score t = scale·q·k, before any mask: softcap > 0 makes it softcap·tanh(t / softcap)
(Gemma 2), then ALiBi adds -slope·|i + m - n - j| with one float32 slope per head (FlashAttention's
alibi_slopes; no gradient into them). Both are fused in every kernel: the backward multiplies dS
by the softcap's derivative 1 - tanh² for dQ and dK, while a float mask (added after the cap)
gets dS itself. Sinks (GPT-OSS): one logit per head joins every row's softmax denominator as a
key of value 0, always visible; the lse includes it and its gradient is -Σ_rows exp(sink - lse)·delta.
The CUDA kernels run all of them under the emulation build (.ci/cuda_emulation.sh).
"""
from __future__ import annotations

import pytest
import torch

import attention_ext
from attention_ext.reference import attention_reference

from conftest import (CUDA_KERNELS_DEVICE, FLOAT_DTYPES, assert_close_to_reference,
                      assert_grads_close_to_reference, assert_lse_close, gradcheck, gradgradcheck, rand)
from test_window import inputs

ops = torch.ops.attention_ext
LOW = (torch.float16, torch.bfloat16)


def slopes_for(kind, batch=2, heads=3):
    g = torch.Generator().manual_seed(7)
    return {None: None, "heads": torch.rand(heads, generator=g), "batch_heads": torch.rand(batch, heads, generator=g),
            "one": torch.tensor([0.4])}[kind]


def _grads(fn, tensors, grad):
    return torch.autograd.grad(fn(*tensors), tensors, grad)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("softcap", [None, 2.0, 30.0], ids=str)
@pytest.mark.parametrize("alibi", [None, "heads", "batch_heads"])
@pytest.mark.parametrize("n,m,d", [(70, 70, 64), (40, 150, 32), (150, 40, 80), (3, 300, 128)], ids=str)
def test_forward_matches_the_reference(dtype, softcap, alibi, n, m, d):
    q, k, v = inputs(n, m, d, dtype)
    kw = dict(softcap=softcap, alibi_slopes=slopes_for(alibi))
    out, lse = attention_ext.attention(q, k, v, return_lse=True, **kw)
    ref, ref_lse, _ = attention_reference(q, k, v, softcap=softcap or 0.0, alibi_slopes=kw["alibi_slopes"])
    low = attention_reference(q, k, v, softcap=softcap or 0.0, alibi_slopes=kw["alibi_slopes"], dtype=None)[0]
    assert_close_to_reference(out, ref, dtype, (low.double() - ref).abs().max().item())
    assert_lse_close(lse, ref_lse, dtype)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("softcap,alibi,window,causal", [(2.0, None, None, None), (None, "heads", None, None),
                                                         (5.0, "batch_heads", (16, 0), None),
                                                         (1.0, "one", None, "bottom_right")], ids=str)
@pytest.mark.parametrize("n,m,d,kv_heads", [(90, 70, 32, 1), (5, 200, 80, None), (64, 129, 64, 3)], ids=str)
def test_gradients_match_the_reference(dtype, softcap, alibi, window, causal, n, m, d, kv_heads):
    """dQ, dK, dV within 4x plain torch's own error in that dtype (fp64/fp32: the dtype's tolerance)."""
    q, k, v = inputs(n, m, d, dtype, requires_grad=True, kv_heads=kv_heads)
    grad = rand(2, 3, n, d, dtype=dtype)
    gqa = kv_heads is not None
    slopes = slopes_for(alibi)
    kw = dict(window=window, causal=causal, alibi_slopes=slopes, enable_gqa=gqa)
    got = _grads(lambda q, k, v: attention_ext.attention(q, k, v, softcap=softcap, **kw), (q, k, v), grad)
    ref_kw = dict(kw, softcap=softcap or 0.0)
    ins64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = _grads(lambda q, k, v: attention_reference(q, k, v, **ref_kw)[0], ins64, grad.double())
    lp = [t.detach().requires_grad_() for t in (q, k, v)]
    low = _grads(lambda q, k, v: attention_reference(q, k, v, dtype=None, **ref_kw)[0], lp, grad)
    assert_grads_close_to_reference(got, want, low, dtype)


def test_gradcheck_in_float64_with_every_modifier_combined():
    """softcap, ALiBi, sinks, window, bottom-right causal, a float mask with its gradient, GQA and
    dropout (the same draw on each call) through the fused kernels; double backward; forward-mode
    AD of the output and of the weights."""
    q, k, v = inputs(7, 9, 4, torch.float64, batch=(1, 4), requires_grad=True, kv_heads=2)
    mask = rand(1, 4, 7, 9, dtype=torch.float64, requires_grad=True)
    sinks = rand(4, dtype=torch.float64, requires_grad=True)
    slopes = torch.tensor([0.3, 0.1, 0.7, 0.2])

    def everything(q, k, v, mask, sinks):
        torch.manual_seed(11)
        return attention_ext.attention(q, k, v, attn_mask=mask, causal="bottom_right", window=(4, None), softcap=0.7,
                                       alibi_slopes=slopes, sinks=sinks, dropout_p=0.3, enable_gqa=True,
                                       return_lse=True)

    assert gradcheck(everything, (q, k, v, mask, sinks))

    def capped(q, k, v, mask, sinks):
        return attention_ext.attention(q, k, v, attn_mask=mask, softcap=0.9, alibi_slopes=slopes, sinks=sinks,
                                       enable_gqa=True, return_lse=True)

    assert gradgradcheck(capped, (q, k, v, mask, sinks))
    assert gradcheck(capped, (q, k, v, mask, sinks), check_forward_ad=True, check_backward_ad=False)
    weights = lambda q, k, mask, sinks: attention_ext.attention_weights(  # noqa: E731
        q, k, attn_mask=mask, softcap=0.6, alibi_slopes=slopes, sinks=sinks, window=(3, 1), enable_gqa=True)
    assert gradcheck(weights, (q, k, mask, sinks), check_forward_ad=True)


def test_a_float_mask_gets_the_gradient_of_the_capped_logit():
    """The mask is added after the cap: its gradient is dS itself, not dS times the cap's slope."""
    q, k, v = inputs(6, 8, 4, torch.float64, batch=(2,))
    mask = rand(2, 6, 8, dtype=torch.float64, requires_grad=True)
    out = attention_ext.attention(q, k, v, attn_mask=mask, softcap=0.5)
    got, = torch.autograd.grad(out.sum(), mask)
    m64 = mask.detach().requires_grad_()
    want, = torch.autograd.grad(attention_reference(q, k, v, m64, softcap=0.5)[0].sum(), m64)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("n,m", [(33, 33), (20, 90)], ids=str)
def test_weights_with_modifiers_are_the_reference_softmax(n, m):
    q, k, _ = inputs(n, m, 16, torch.float64)
    slopes = slopes_for("batch_heads")
    w = attention_ext.attention_weights(q, k, softcap=3.0, alibi_slopes=slopes)
    _, _, ref = attention_reference(q, k, k, softcap=3.0, alibi_slopes=slopes)
    torch.testing.assert_close(w, ref)


def test_gqa_splits_per_query_head_slopes_like_the_heads():
    """With enable_gqa the query heads split into (kv_heads, groups): slopes of the query heads split
    alike, so query head h keeps slope h (as with the K/V heads repeated)."""
    q, k, v = inputs(10, 12, 8, torch.float64, batch=(2, 6), kv_heads=2)
    slopes = torch.rand(6)
    out = attention_ext.attention(q, k, v, alibi_slopes=slopes, enable_gqa=True)
    ref = attention_reference(q, k, v, alibi_slopes=slopes, enable_gqa=True)[0]
    torch.testing.assert_close(out, ref)


@pytest.mark.cpu_kernels
@pytest.mark.parametrize("forward", ["tiled", "decode"])
@pytest.mark.parametrize("backward", ["fused", "split", "decode"])
@pytest.mark.parametrize("options", ["window", "everything"])
def test_every_cpu_path_and_variant_applies_windows_modifiers_and_sinks(cpu_variant, forward, backward, options,
                                                                       monkeypatch):
    monkeypatch.setenv("ATTENTION_EXT_CPU_FORWARD", forward)
    monkeypatch.setenv("ATTENTION_EXT_CPU_BACKWARD", backward)
    kw = dict(window=(100, 3))
    if options == "everything":
        kw = dict(softcap=4.0, alibi_slopes=slopes_for("heads"), window=(300, 2), sinks=torch.tensor([0.5, 3.0, -1.0]))
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = inputs(6, 700, 64, dtype, requires_grad=True)
        out = attention_ext.attention(q, k, v, **kw)
        ref = attention_reference(q, k, v, **kw)[0]
        low = attention_reference(q, k, v, dtype=None, **kw)[0]
        assert_close_to_reference(out, ref, dtype, (low.double() - ref).abs().max().item())
        got = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        ins64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
        want = torch.autograd.grad(attention_reference(*ins64, **kw)[0].sum(), ins64)
        lp = [t.detach().requires_grad_() for t in (q, k, v)]
        low_grads = torch.autograd.grad(attention_reference(*lp, dtype=None, **kw)[0].sum(), lp)
        assert_grads_close_to_reference(got, want, low_grads, dtype)


@pytest.mark.parametrize("softcap,error,match", [
    (-1.0, ValueError, r"softcap must be a finite number > 0 \(or None / 0.0 for none\), got -1.0"),
    (float("inf"), ValueError, r"softcap must be a finite number > 0"),
    ("30", TypeError, r"softcap must be a number or None, got str"),
    (True, TypeError, r"softcap must be a number or None, got bool"),
])
def test_bad_softcaps_are_refused(softcap, error, match):
    q, k, v = inputs(4, 4, 8, torch.float32)
    with pytest.raises(error, match=match):
        attention_ext.attention(q, k, v, softcap=softcap)
    with pytest.raises(error, match=match):
        attention_ext.attention_weights(q, k, softcap=softcap)


@pytest.mark.parametrize("name,values,error,match", [
    ("alibi_slopes", torch.ones(3, dtype=torch.float64), TypeError,
     r"alibi_slopes must be torch.float32 for torch.float32 inputs, got torch.float64"),
    ("alibi_slopes", torch.ones(5), ValueError,
     r"alibi_slopes of shape \(5,\) does not broadcast to the batch dims \(2, 3\)"),
    ("alibi_slopes", torch.ones(4, 2, 3), ValueError, r"alibi_slopes of shape \(4, 2, 3\) does not broadcast"),
    ("alibi_slopes", [0.5, 0.25, 0.1], TypeError, r"alibi_slopes must be a torch.Tensor or None, got list"),
    ("alibi_slopes", torch.ones(3, requires_grad=True), NotImplementedError,
     r"gradients into alibi_slopes are not supported"),
    ("sinks", torch.ones(3, dtype=torch.int64), TypeError, r"sinks must be a floating tensor, got torch.int64"),
    ("sinks", torch.ones(5), ValueError, r"sinks of shape \(5,\) does not broadcast to the batch dims \(2, 3\)"),
    ("sinks", "0.5", TypeError, r"sinks must be a torch.Tensor or None, got str"),
])
def test_bad_slopes_and_sinks_are_refused(name, values, error, match):
    q, k, v = inputs(4, 4, 8, torch.float32)
    with pytest.raises(error, match=match):
        attention_ext.attention(q, k, v, **{name: values})
    with pytest.raises(error, match=match):
        attention_ext.attention_weights(q, k, **{name: values})


def test_raw_ops_and_their_fake_kernels_check_the_modifiers():
    q, k, v = inputs(4, 4, 8, torch.float32)
    for device in ("cpu", "meta"):
        qd, kd, vd = (t.to(device) for t in (q, k, v))
        with pytest.raises(RuntimeError, match=r"softcap must be a finite number >= 0 \(0: none\), got -2"):
            ops.attention_fwd(qd, kd, vd, None, 0.5, 0, -1, -1, -2.0, None, None, 0.0, None)
        with pytest.raises(RuntimeError, match=r"alibi_slopes of shape \(7,\) does not broadcast"):
            ops.attention_probs(qd, kd, None, 0.5, 0, -1, -1, 0.0, torch.ones(7, device=device), None)
        with pytest.raises(RuntimeError, match=r"alibi_slopes must be (Float|torch.float32)"):
            half = torch.ones(3, dtype=torch.half, device=device)
            ops.attention_fwd(qd, kd, vd, None, 0.5, 0, -1, -1, 0.0, half, None,
                              0.0, None)


def test_opcheck_vmap_and_compiled_fullgraph_calls():
    q, k, v = inputs(5, 9, 8, torch.float32, requires_grad=True)
    slopes = torch.rand(3)
    torch.library.opcheck(ops.attention_fwd, (q, k, v, None, 0.4, 2, 3, -1, 4.0, slopes, None, 0.0, None))
    out, lse = ops.attention_fwd(q, k, v, None, 0.4, 0, -1, -1, 4.0, slopes, None, 0.0, None)
    torch.library.opcheck(ops.attention_bwd, (torch.randn_like(out), None, q, k, v, None, out, lse, 0.4, 0, -1, -1,
                                              4.0, slopes, None, 0.0, None, False))
    fn = lambda q, k, v: attention_ext.attention(q, k, v, softcap=4.0, alibi_slopes=slopes)  # noqa: E731
    batched = torch.func.vmap(fn)(q.detach(), k.detach(), v.detach())
    torch.testing.assert_close(batched, torch.stack([fn(*t) for t in zip(q.detach(), k.detach(), v.detach())]))
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(q, k, v), fn(q, k, v))


@pytest.mark.parametrize("modifier", ["sinks", "alibi_slopes"])
def test_per_query_head_values_with_gqa_compile_with_symbolic_heads(modifier):
    # A module's (heads,) parameter beside GQA inputs whose head count torch.compile made symbolic
    # (dynamic=True): the per-head rule takes it, as eagerly, with no graph break.
    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.values = torch.nn.Parameter(torch.rand(4), requires_grad=modifier == "sinks")

        def forward(self, q, k, v):
            return attention_ext.attention(q, k, v, enable_gqa=True, **{modifier: self.values})

    layer = Layer()
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend="eager", dynamic=True)
    torch.testing.assert_close(compiled(q, k, v), layer(q, k, v), rtol=0, atol=0)


# --- Sinks ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("sinks_shape", [(3,), (2, 3), (1,)], ids=str)
@pytest.mark.parametrize("n,m,d,window", [(70, 70, 64, None), (40, 150, 32, (8, 0)), (3, 300, 128, None),
                                          (150, 40, 80, (0, 0))], ids=str)
def test_sinks_forward_and_gradients_match_the_reference(dtype, sinks_shape, n, m, d, window):
    """(150, 40) with window (0, 0): rows 0-109 see no key, only the sink: output 0, lse = sink."""
    q, k, v = inputs(n, m, d, dtype, requires_grad=True)
    sinks = (torch.randn(sinks_shape, dtype=torch.float64) * 2).requires_grad_()
    out, lse = attention_ext.attention(q, k, v, sinks=sinks, window=window, return_lse=True)
    ins64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    s64 = sinks.detach().requires_grad_()
    ref, ref_lse, _ = attention_reference(*ins64, sinks=s64, window=window)
    low = attention_reference(q, k, v, sinks=sinks, window=window, dtype=None)[0]
    assert_close_to_reference(out, ref, dtype, (low.double() - ref).abs().max().item())
    assert_lse_close(lse, ref_lse, dtype)
    grad = rand(2, 3, n, d, dtype=dtype)
    got = torch.autograd.grad(out, (q, k, v, sinks), grad)
    want = torch.autograd.grad(ref, (*ins64, s64), grad.double())
    lp = [t.detach().requires_grad_() for t in (q, k, v, sinks)]
    low_out = attention_reference(*lp[:3], sinks=lp[3], window=window, dtype=None)[0]
    low_grads = torch.autograd.grad(low_out, lp, grad)
    assert_grads_close_to_reference(got, want, low_grads, dtype, names=("dq", "dk", "dv", "dsinks"))
    assert got[3].dtype == sinks.dtype and got[3].shape == sinks.shape


@pytest.mark.parametrize("sink", [40.0, -40.0, 300.0])
def test_a_sink_far_from_the_scores_is_exact(sink):
    """A sink that dominates the row (the keys' weights ~e^-40) or vanishes: lse and weights stay
    exact (the backward recomputes the row's shift with the sink folded in)."""
    q, k, v = inputs(5, 12, 8, torch.float64, batch=(2,), requires_grad=True)
    sinks = torch.tensor([sink, 0.5], dtype=torch.float64, requires_grad=True)
    out, lse = attention_ext.attention(q, k, v, sinks=sinks, return_lse=True)
    ref, ref_lse, ref_w = attention_reference(q, k, v, sinks=sinks)
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-300)
    torch.testing.assert_close(lse, ref_lse)
    torch.testing.assert_close(attention_ext.attention_weights(q, k, sinks=sinks), ref_w, rtol=1e-9, atol=1e-300)
    got = torch.autograd.grad(out.sum() + lse.sum(), (q, k, v, sinks))
    want = torch.autograd.grad(ref.sum() + ref_lse.sum(), (q, k, v, sinks))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-12)


def test_a_sink_of_plus_infinity_takes_the_whole_row():
    """The limit of a growing sink: its row's output 0 and lse +inf, no NaN, and gradients that are
    the limit's (nothing into q, k, v; d lse / d sink = 1 per row). The other head is unaffected."""
    q, k, v = inputs(5, 12, 8, torch.float64, batch=(2,), requires_grad=True)
    sinks = torch.tensor([float("inf"), 0.5], dtype=torch.float64, requires_grad=True)
    out, lse = attention_ext.attention(q, k, v, sinks=sinks, return_lse=True)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isposinf(lse[0]).all()
    assert torch.equal(attention_ext.attention_weights(q, k, sinks=sinks)[0], torch.zeros(5, 12, dtype=torch.float64))
    ref, ref_lse, _ = attention_reference(q[1:], k[1:], v[1:], sinks=sinks[1:])
    torch.testing.assert_close(out[1:], ref, rtol=1e-12, atol=1e-14)
    grads = torch.autograd.grad(out.sum() + lse[0].sum() + lse[1].sum(), (q, k, v, sinks))
    assert all(torch.isfinite(g).all() for g in grads)
    assert all(torch.equal(g[0], torch.zeros_like(g[0])) for g in grads[:3])
    assert grads[3][0].item() == 5.0


@pytest.mark.parametrize("dtype,sink", [(torch.float32, 1e11), (torch.float32, 1e12), (torch.float64, 1e30)], ids=str)
def test_a_sink_that_dominates_its_row_has_d_lse_d_sink_exactly_one_per_row(dtype, sink):
    """The lse may round below such a sink by an ulp larger than exp's range: the sink's weight is
    capped at 1 (it is a probability), not exp(ulp) = inf."""
    q, k, v = inputs(3, 4, 4, dtype, batch=(1,))
    sinks = torch.tensor([sink], dtype=dtype, requires_grad=True)
    _, lse = attention_ext.attention(q, k, v, sinks=sinks, return_lse=True)
    (grad,) = torch.autograd.grad(lse.sum(), sinks)
    assert grad.item() == 3.0


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("softcap", [1e3, 1e8, 1e20], ids=str)
@pytest.mark.parametrize("n", [3, 70], ids=["decode", "tiled"])
def test_a_softcap_far_above_the_scores_leaves_them_as_they_are(dtype, softcap, n):
    """softcap·tanh(t / softcap) tends to t as the cap grows. The vector tanh takes a small argument
    by its series: (1 − e) / (1 + e) would cancel, losing digits in proportion to the cap (1e-8 of
    error at a cap of 1e8 in float64, uniform weights at 1e20)."""
    q, k, v = inputs(n, 40, 16, dtype, batch=(2,), requires_grad=True)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    out = attention_ext.attention(q, k, v, softcap=softcap)
    ref = attention_reference(q, k, v, softcap=softcap)[0]
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    weights = attention_ext.attention_weights(q, k, softcap=softcap)
    torch.testing.assert_close(weights.double(), attention_reference(q, k, v, softcap=softcap)[2], rtol=tol, atol=tol)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(ref, (q, k, v), grad.double())
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b.double(), rtol=10 * tol, atol=10 * tol)


def test_low_precision_sinks_are_converted_and_get_their_gradient_back():
    """bf16 sinks are taken in the lse dtype (float32) and their gradient comes back in bf16, as
    accurate as that rounding allows."""
    q, k, v = inputs(8, 8, 16, torch.bfloat16, requires_grad=True)
    sinks = torch.randn(3, dtype=torch.bfloat16, requires_grad=True)
    out = attention_ext.attention(q, k, v, sinks=sinks)
    out.float().sum().backward()
    assert sinks.grad is not None and sinks.grad.dtype == torch.bfloat16
    ins64 = [t.detach().double().requires_grad_() for t in (q, k, v, sinks)]
    want = torch.autograd.grad(attention_reference(*ins64[:3], sinks=ins64[3])[0].sum(), ins64[3])
    lp = [t.detach().requires_grad_() for t in (q, k, v, sinks)]
    low = torch.autograd.grad(attention_reference(*lp[:3], sinks=lp[3], dtype=None)[0].float().sum(), lp[3])
    assert_grads_close_to_reference([sinks.grad], want, low, torch.bfloat16, names=("dsinks",))


def test_raw_ops_want_sinks_in_the_lse_dtype():
    q, k, v = inputs(4, 4, 8, torch.float32)
    for device in ("cpu", "meta"):
        qd, kd, vd = (t.to(device) for t in (q, k, v))
        with pytest.raises(RuntimeError, match=r"sinks must be (Float|torch.float32) for (Float|torch.float32) inputs"):
            half = torch.ones(3, dtype=torch.half, device=device)
            ops.attention_fwd(qd, kd, vd, None, 0.5, 0, -1, -1, 0.0, None, half,
                              0.0, None)


# --- The CUDA kernels (tensor-core and split-KV paths) -------------------------------------------

@pytest.mark.cuda_kernels
@pytest.mark.skipif(CUDA_KERNELS_DEVICE is None, reason="needs a CUDA device or the CUDA emulation build")
@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("n,m,splits", [(150, 170, ""), (3, 1000, "4")], ids=str)
def test_tensor_core_and_split_kv_kernels_apply_the_modifiers_and_sinks(dtype, d, n, m, splits, monkeypatch):
    monkeypatch.setenv("ATTENTION_EXT_CUDA_KV_SPLITS", splits)
    dev = CUDA_KERNELS_DEVICE
    q, k, v = (t.to(dev).requires_grad_() for t in inputs(n, m, d, dtype, batch=(1, 2)))
    kw = dict(softcap=3.0, alibi_slopes=torch.tensor([0.05, 0.2]).to(dev), sinks=torch.tensor([1.5, -0.5]).to(dev))
    out, lse = attention_ext.attention(q, k, v, return_lse=True, **kw)
    cpu_kw = {name: (t.cpu() if isinstance(t, torch.Tensor) else t) for name, t in kw.items()}
    ref, ref_lse, _ = attention_reference(q.cpu(), k.cpu(), v.cpu(), **cpu_kw)
    low = attention_reference(q, k, v, dtype=None, **kw)[0]
    assert_close_to_reference(out.cpu(), ref, dtype, (low.double().cpu() - ref).abs().max().item())
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    ins64 = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
    want = torch.autograd.grad(attention_reference(*ins64, **cpu_kw)[0], ins64, grad.cpu().double())
    lp = [t.detach().requires_grad_() for t in (q, k, v)]
    low_grads = torch.autograd.grad(attention_reference(*lp, dtype=None, **kw)[0], lp, grad)
    assert_grads_close_to_reference([g.cpu() for g in got], want, [g.cpu() for g in low_grads], dtype)

"""FlashAttention 2's API (attention_ext.flash_attn_func and its packed forms): the same
signature and semantics as flash_attn.flash_attn_interface, on the fused kernels.

Semantics pinned here: (batch, seqlen, heads, head_dim) layout; heads a multiple of kv_heads
(MQA/GQA); causal aligns query i with key i + seqlen_k − seqlen_q (bottom-right); softmax_lse
(batch, heads, seqlen_q); a row that sees no key gives output 0 and lse −inf; the arguments not
supported yet raise NotImplementedError instead of being ignored. window_size (left, right) keeps
the keys within left before and right after a query's aligned key (-1: no limit).
"""
from __future__ import annotations

import inspect
import math

import numpy as np
import pytest
import torch

import attention_ext
from attention_ext import flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func, flash_attn_varlen_func
from conftest import gradcheck, gradgradcheck

# (rtol, atol) of each dtype against the float64 reference.
TOL = {torch.float64: (1e-10, 1e-10), torch.float32: (2e-5, 2e-5), torch.bfloat16: (3e-2, 3e-2)}


def reference(q, k, v, causal=False, scale=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None):
    """float64, FlashAttention's definition written out: (out, lse) in its layouts. Query i sits at
    key i + sk - sq; window (left, right) keeps keys within left before and right after it (-1:
    no limit); causal sets right to 0. softcap: softcap·tanh(s / softcap) of the scaled score s;
    alibi_slopes ((heads,) or (batch, heads)): -slope·|i + sk - sq - j| added after it. A window
    side at least sk long is no limit (FlashAttention's C++ clamps it to -1)."""
    q, k, v = (t.double().transpose(1, 2) for t in (q, k, v))  # (B, H, S, D)
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = q @ k.transpose(-1, -2) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    if alibi_slopes is not None:
        sq, sk = q.shape[-2], k.shape[-2]
        distance = (torch.arange(sq).unsqueeze(-1) + sk - sq - torch.arange(sk)).abs()
        s = s - alibi_slopes.double()[..., None, None] * distance
    sq, sk = q.shape[-2], k.shape[-2]
    # FlashAttention's C++ entry points: a side at least sk long bounds nothing
    left, right = (-1 if w >= sk else w for w in window_size)
    if causal:
        right = 0
    diagonal = torch.arange(sq).unsqueeze(-1) + sk - sq
    j = torch.arange(sk)
    if right >= 0:
        s = s.masked_fill(j > diagonal + right, -math.inf)
    if left >= 0:
        s = s.masked_fill(j < diagonal - left, -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # rows with no visible key: 0
    return (p @ v).transpose(1, 2), lse


def make(batch, sq, sk, heads, kv_heads, d, dtype, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, sq, heads, d, generator=g, dtype=torch.float64)
    k = torch.randn(batch, sk, kv_heads, d, generator=g, dtype=torch.float64)
    v = torch.randn(batch, sk, kv_heads, d, generator=g, dtype=torch.float64)
    return [t.to(dtype).requires_grad_(requires_grad) for t in (q, k, v)]


def test_the_signature_is_flash_attentions():
    expected = ["q", "k", "v", "dropout_p", "softmax_scale", "causal", "window_size", "softcap", "alibi_slopes",
                "deterministic", "return_attn_probs"]
    params = inspect.signature(flash_attn_func).parameters
    assert list(params) == expected
    defaults = {name: p.default for name, p in params.items() if p.default is not inspect.Parameter.empty}
    assert defaults == {"dropout_p": 0.0, "softmax_scale": None, "causal": False, "window_size": (-1, -1),
                        "softcap": 0.0, "alibi_slopes": None, "deterministic": False, "return_attn_probs": False}
    assert list(inspect.signature(flash_attn_qkvpacked_func).parameters)[0] == "qkv"
    assert list(inspect.signature(flash_attn_kvpacked_func).parameters)[:2] == ["q", "kv"]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("causal,window_size", [(False, (-1, -1)), (True, (-1, -1)), (False, (6, 3)),
                                                (True, (9, -1)), (False, (-1, 2))],
                         ids=["full", "causal", "window", "causal_window", "right_only"])
@pytest.mark.parametrize("sq,sk", [(37, 37), (13, 70), (70, 13)], ids=["square", "fewer_queries", "more_queries"])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("d", [32, 80])
def test_forward_and_gradients_match_the_reference(dtype, causal, window_size, sq, sk, heads, kv_heads, d):
    q, k, v = make(2, sq, sk, heads, kv_heads, d, dtype, requires_grad=True)
    out, lse, probs = flash_attn_func(q, k, v, causal=causal, window_size=window_size, return_attn_probs=True)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse = reference(q64, k64, v64, causal=causal, window_size=window_size)
    rtol, atol = TOL[dtype]
    assert out.shape == (2, sq, heads, d) and out.dtype == dtype
    torch.testing.assert_close(out.double(), ref_out, rtol=rtol, atol=atol)
    assert lse.shape == (2, heads, sq)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=rtol, atol=atol)
    assert torch.all(probs[ref_lse.isneginf()] == 0)  # rows that see no key
    torch.testing.assert_close(probs.sum(-1)[ref_lse.isfinite()].double(),
                               torch.ones_like(ref_lse[ref_lse.isfinite()]), rtol=rtol, atol=atol)

    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    got = torch.autograd.grad(out, (q, k, v), grad.to(dtype))
    want = torch.autograd.grad(ref_out, (q64, k64, v64), grad)
    for name, a, b in zip("qkv", got, want):
        assert a.shape == b.shape, name
        torch.testing.assert_close(a.double(), b, rtol=4 * rtol, atol=4 * atol, msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("softcap", [0.0, 1.5], ids=["no_cap", "cap"])
@pytest.mark.parametrize("alibi", [None, "heads", "batch_heads"])
@pytest.mark.parametrize("sq,sk,kv_heads", [(33, 33, 4), (9, 40, 2), (40, 9, 1)], ids=str)
def test_softcap_and_alibi_match_the_reference(dtype, softcap, alibi, sq, sk, kv_heads):
    q, k, v = make(2, sq, sk, 4, kv_heads, 16, dtype, requires_grad=True)
    slopes = {None: None, "heads": torch.tensor([0.5, 0.25, 0.125, 0.0625]),
              "batch_heads": torch.rand(2, 4, generator=torch.Generator().manual_seed(3))}[alibi]
    kwargs = dict(softcap=softcap, alibi_slopes=slopes, window_size=(12, 3))
    out, lse, probs = flash_attn_func(q, k, v, return_attn_probs=True, **kwargs)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse = reference(q64, k64, v64, **kwargs)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(out.double(), ref_out, rtol=rtol, atol=atol)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=rtol, atol=atol)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    got = torch.autograd.grad(out, (q, k, v), grad.to(dtype))
    want = torch.autograd.grad(ref_out, (q64, k64, v64), grad)
    for name, a, b in zip("qkv", got, want):
        torch.testing.assert_close(a.double(), b, rtol=4 * rtol, atol=4 * atol, msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize("sq,sk", [(5, 9), (9, 9)], ids=str)
def test_causal_alibi_lse_is_that_of_the_stated_bias_not_flash_attentions_column_bias(sq, sk):
    # FlashAttention's causal kernels add +slope·j (the same softmax, as the row's bias moves by a
    # constant); ours is -slope·|i + sk - sq - j|, so its lse is smaller by slope·(i + sk - sq).
    q, k, v = make(2, sq, sk, 2, 2, 16, torch.float64)
    slopes = torch.tensor([0.5, 0.25])
    out, lse, probs = flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes, return_attn_probs=True)
    ref_out, ref_lse = reference(q, k, v, causal=True, alibi_slopes=slopes)
    torch.testing.assert_close(lse, ref_lse)
    s = torch.einsum("bihd,bjhd->bhij", q, k) / 4.0 + slopes[:, None, None] * torch.arange(sk)
    s = s.masked_fill(torch.arange(sk) > torch.arange(sq)[:, None] + sk - sq, -math.inf)
    column_bias = torch.softmax(s, -1)
    torch.testing.assert_close(probs, column_bias)
    shift = slopes[:, None] * (torch.arange(sq) + sk - sq)
    torch.testing.assert_close(lse + shift, torch.logsumexp(s, -1))


def test_gradcheck_in_float64_through_the_fused_kernels():
    q, k, v = make(1, 5, 7, 4, 2, 6, torch.float64, requires_grad=True)
    assert gradcheck(lambda q, k, v: flash_attn_func(q, k, v, causal=True), (q, k, v))
    assert gradcheck(lambda q, k, v: flash_attn_func(q, k, v, window_size=(2, 1)), (q, k, v))
    slopes = torch.tensor([0.3, 0.1, 0.7, 0.2])

    def capped_alibi_dropout(q, k, v):
        torch.manual_seed(5)  # the same dropout draw on every call
        return flash_attn_func(q, k, v, causal=True, softcap=0.8, alibi_slopes=slopes, dropout_p=0.2)

    assert gradcheck(capped_alibi_dropout, (q, k, v))
    assert gradgradcheck(lambda q, k, v: flash_attn_func(q, k, v), (q, k, v))


def test_rows_that_see_no_key_give_zero_and_minus_infinite_lse():
    # causal with more queries than keys: query i sees keys j <= i + sk - sq, none for i < sq - sk.
    q, k, v = make(1, 6, 2, 2, 2, 8, torch.float32)
    out, lse, probs = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert torch.all(out[:, :4] == 0) and torch.all(lse[:, :, :4] == -math.inf)
    assert torch.all(probs[:, :, :4] == 0)
    assert torch.isfinite(lse[:, :, 4:]).all()


def test_attn_probs_are_the_exact_softmax():
    q, k, v = make(2, 9, 11, 4, 2, 16, torch.float64)
    out, lse, probs = flash_attn_func(q, k, v, causal=True, softmax_scale=0.3, return_attn_probs=True)
    assert probs.shape == (2, 4, 9, 11)
    ref_out, ref_lse = reference(q, k, v, causal=True, scale=0.3)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse)
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 4, 9, dtype=torch.float64))
    vg = v.transpose(1, 2).repeat_interleave(2, dim=1)
    torch.testing.assert_close((probs @ vg).transpose(1, 2), out)


def test_causal_is_window_minus_one_zero_and_no_window_is_minus_one_minus_one():
    q, k, v = make(1, 7, 9, 2, 2, 8, torch.float64)
    torch.testing.assert_close(flash_attn_func(q, k, v, window_size=(-1, 0)), flash_attn_func(q, k, v, causal=True))
    torch.testing.assert_close(flash_attn_func(q, k, v, window_size=[-1, -1]), flash_attn_func(q, k, v))
    torch.testing.assert_close(flash_attn_func(q, k, v, causal=True, window_size=(-1, -1)),
                               flash_attn_func(q, k, v, causal=True))


def test_a_window_side_at_least_seqlen_k_long_is_no_limit_as_in_flash_attentions_cpp():
    """FlashAttention's mha_fwd / mha_varlen_fwd set a side >= seqlen_k (max_seqlen_k) to -1
    before the kernels see it: with more queries than keys, right = seqlen_k lets the first rows see
    every key (the literal bound i + sk - sq + right leaves rows 0-1 none and row 2 one), as the
    KV-cache call (which clamps against the cache) does."""
    q, k, v = make(1, 8, 3, 2, 2, 16, torch.float64)
    unbounded = flash_attn_func(q, k, v)
    for window in ((-1, 3), (3, -1), (5, 7)):
        torch.testing.assert_close(flash_attn_func(q, k, v, window_size=window), unbounded)
    assert not torch.equal(flash_attn_func(q, k, v, window_size=(-1, 2)), unbounded)  # (2 < 3: a bound)
    cu_q, cu_k = torch.tensor([0, 8], dtype=torch.int32), torch.tensor([0, 3], dtype=torch.int32)
    for max_seqlen_k in (3, np.int64(3)):
        varlen = flash_attn_varlen_func(q[0], k[0], v[0], cu_q, cu_k, 8, max_seqlen_k, window_size=(-1, 3))
        torch.testing.assert_close(varlen, unbounded[0])
    cached = attention_ext.flash_attn_with_kvcache(q, k, v, cache_seqlens=3, window_size=(-1, 3))
    torch.testing.assert_close(cached, unbounded)


def test_out_is_contiguous_in_flash_attentions_layout():
    """FlashAttention allocates out like q: (batch, seqlen_q, heads, head_dim) contiguous, which
    model code views as (batch, seqlen_q, heads · head_dim)."""
    q, k, v = make(2, 5, 7, 4, 2, 8, torch.float32)
    outs = [flash_attn_func(q, k, v), flash_attn_func(q, k, v, return_attn_probs=True)[0],
            flash_attn_kvpacked_func(q, torch.stack([k, k], dim=2)),
            flash_attn_qkvpacked_func(torch.stack([q, q, q], dim=2))]
    for out in outs:
        assert out.shape == (2, 5, 4, 8) and out.is_contiguous()
        assert out.view(2, 5, 32).shape == (2, 5, 32)


def test_packed_forms_equal_the_unpacked_call():
    q, k, v = make(2, 10, 10, 4, 4, 8, torch.float64)
    qkv = torch.stack([q, k, v], dim=2)
    kv = torch.stack([k, v], dim=2)
    want = flash_attn_func(q, k, v, causal=True)
    torch.testing.assert_close(flash_attn_qkvpacked_func(qkv, causal=True), want)
    torch.testing.assert_close(flash_attn_kvpacked_func(q, kv, causal=True), want)


def test_dropout_is_reproducible_from_the_generator_and_deterministic_is_accepted():
    q, k, v = make(1, 8, 8, 2, 2, 8, torch.float32)
    torch.manual_seed(3)
    a = flash_attn_func(q, k, v, dropout_p=0.5, deterministic=True)
    torch.manual_seed(3)
    b = flash_attn_func(q, k, v, dropout_p=0.5)
    assert torch.equal(a, b)
    assert not torch.allclose(a, flash_attn_func(q, k, v))


def test_compiles_fullgraph():
    q, k, v = make(1, 8, 12, 4, 2, 16, torch.float32)
    compiled = torch.compile(lambda q, k, v: flash_attn_func(q, k, v, causal=True), fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(q, k, v), flash_attn_func(q, k, v, causal=True))


@pytest.mark.parametrize("function", ["flash_attn_func", "flash_attn_with_kvcache"])
def test_per_entry_alibi_slopes_compile_once_the_batch_size_is_dynamic(function):
    # The third batch size brings the first (batch, heads) slopes, after torch.compile has made
    # the batch size symbolic: the shape rule compares it size by size, so the call is taken.
    call = getattr(attention_ext, function)
    torch._dynamo.reset()
    compiled = torch.compile(call, backend="eager", fullgraph=True)
    g = torch.Generator().manual_seed(5)
    for batch, slopes in ((3, False), (4, False), (5, True), (6, True)):
        q = torch.randn(batch, 1, 2, 8, generator=g)
        k, v = (torch.randn(batch, 12, 1, 8, generator=g) for _ in range(2))
        kwargs = dict(alibi_slopes=torch.rand(batch, 2, generator=g)) if slopes else {}
        if function == "flash_attn_with_kvcache":
            kwargs["cache_seqlens"] = torch.randint(1, 12, (batch,), dtype=torch.int32, generator=g)
        assert torch.equal(compiled(q, k, v, **kwargs), call(q, k, v, **kwargs)), batch


@pytest.mark.parametrize("kwargs,error,match", [
    ({"window_size": 5}, TypeError, r"window_size must be a pair of ints"),
    ({"softcap": float("nan")}, ValueError, r"softcap must be a finite number > 0 \(or None / 0.0 for none\), got nan"),
    ({"softcap": "big"}, TypeError, r"softcap must be a float"),
    ({"alibi_slopes": torch.ones(3)}, TypeError, r"alibi_slopes must be float32 of shape \(2,\) or \(1, 2\)"),
    ({"alibi_slopes": torch.ones(2, dtype=torch.float64)}, TypeError, r"alibi_slopes must be float32 .* got torch.float64"),
    ({"causal": "yes"}, TypeError, r"causal must be a bool, got str"),
    ({"deterministic": 1.0}, TypeError, r"deterministic must be a bool, got float"),
])
def test_arguments_not_supported_yet_raise_instead_of_being_ignored(kwargs, error, match):
    q, k, v = make(1, 4, 4, 2, 2, 8, torch.float32)
    with pytest.raises(error, match=match):
        flash_attn_func(q, k, v, **kwargs)


def test_negative_softcap_window_sides_and_num_splits_mean_none_as_flash_attentions_kernels_take_them():
    """FlashAttention documents softcap 0.0 and window side -1 for "none", and its C++ takes any
    softcap <= 0 as no cap, any negative window side as unbounded and num_splits < 1 as its own
    choice: code passing those runs here with the same meaning."""
    q, k, v = make(2, 5, 9, 4, 2, 8, torch.float32)
    plain = flash_attn_func(q, k, v, causal=True)
    assert torch.equal(flash_attn_func(q, k, v, causal=True, softcap=-1.0), plain)
    assert torch.equal(flash_attn_func(q, k, v, causal=True, softcap=float("-inf")), plain)
    assert torch.equal(flash_attn_func(q, k, v, causal=True, window_size=(-7, -2)), plain)
    assert torch.equal(flash_attn_func(q, k, v, window_size=(3, -5)), flash_attn_func(q, k, v, window_size=(3, -1)))
    cu = torch.tensor([0, 5], dtype=torch.int32)
    cu_k = torch.tensor([0, 9], dtype=torch.int32)
    assert torch.equal(flash_attn_varlen_func(q[0], k[0], v[0], cu, cu_k, 5, 9, causal=True, softcap=-2.0,
                                              window_size=(-3, -3)),
                       flash_attn_varlen_func(q[0], k[0], v[0], cu, cu_k, 5, 9, causal=True))
    k_cache, v_cache = k.clone(), v.clone()
    want = attention_ext.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=7, causal=True)
    got = attention_ext.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=7, causal=True, softcap=-1.0,
                                                window_size=(-4, -2), num_splits=-1)
    assert torch.equal(got, want)


def test_int_flags_act_as_bools_as_flash_attentions_do():
    """FlashAttention's flags reach torch's dispatcher (or pybind11), which take 0 and 1."""
    q, k, v = make(1, 6, 9, 2, 2, 8, torch.float32)
    assert torch.equal(flash_attn_func(q, k, v, causal=1, deterministic=0), flash_attn_func(q, k, v, causal=True))
    assert torch.equal(flash_attn_func(q, k, v, causal=0), flash_attn_func(q, k, v))
    cu = torch.tensor([0, 6], dtype=torch.int32)
    assert torch.equal(flash_attn_varlen_func(q[0], k[0, :6], v[0, :6], cu, cu, 6, 6, causal=1),
                       flash_attn_varlen_func(q[0], k[0, :6], v[0, :6], cu, cu, 6, 6, causal=True))


def test_bad_layouts_are_named():
    q, k, v = make(1, 4, 4, 3, 2, 8, torch.float32)
    with pytest.raises(ValueError, match=r"heads in q \(3\) must be a multiple of the number in k and v \(2\)"):
        flash_attn_func(q, k, v)
    q, k, v = make(1, 4, 4, 2, 2, 8, torch.float32)
    with pytest.raises(ValueError, match=r"q must be \(batch, seqlen, heads, head_dim\), got shape \(4, 2, 8\)"):
        flash_attn_func(q[0], k, v)
    with pytest.raises(ValueError, match=r"k and v must have the same \(batch, seqlen_k, kv_heads\)"):
        flash_attn_func(q, k, v[:, :3])
    with pytest.raises(ValueError, match=r"qkv must be a \(batch, seqlen, 3, heads, head_dim\) tensor"):
        flash_attn_qkvpacked_func(q)
    with pytest.raises(TypeError, match=r"query, key and value must have the same dtype"):
        flash_attn_func(q, k.double(), v)


def test_exported_from_the_package_and_the_flash_module():
    import attention_ext.flash as flash

    assert attention_ext.flash_attn_func is flash.flash_attn_func
    assert {"flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func"} <= set(attention_ext.__all__)

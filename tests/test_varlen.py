"""Packed variable-length batches: varlen_attention, flash_attn_varlen_func and the
attention_varlen_fwd / attention_varlen_bwd ops.

Sequence b is the rows cu_seqlens[b]:cu_seqlens[b + 1] of the packed q (total_q, heads, d) and
k, v (total_k, kv_heads, d), and sees only its own keys; causal and windows align bottom-right per
sequence. The reference runs each sequence on its own through the float64 reference, so every
sequence boundary, an empty sequence and a sequence of one row are checked against an independent
computation. On the CUDA emulation build the same tests run the CUDA kernels.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import attention_ext
from attention_ext import flash_attn_varlen_func, varlen_attention
from attention_ext.reference import attention_reference

from conftest import (CUDA_KERNELS_DEVICE, FLOAT_DTYPES, assert_close_to_reference,
                      assert_grads_close_to_reference, assert_lse_close, gradcheck, rand)

ops = torch.ops.attention_ext

# (query lengths, key lengths): equal, fewer and more queries than keys, empty and one-row
# sequences, keys without queries and queries without keys, a decode-sized sequence of long keys.
LENGTHS = {
    "equal": ([37, 64, 1, 90], [37, 64, 1, 90]),
    "q<k": ([5, 40, 1, 0, 66], [70, 41, 9, 12, 130]),
    "q>k": ([70, 33, 2], [20, 33, 0]),
    "decode": ([1, 4, 8], [600, 1100, 3]),
}


def cumulative(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)


def packed_inputs(lens_q, lens_k, heads=4, kv_heads=2, d=32, dtype=torch.float64, requires_grad=False, dv=None):
    q = rand(sum(lens_q), heads, d, dtype=dtype, requires_grad=requires_grad)
    k = rand(sum(lens_k), kv_heads, d, dtype=dtype, requires_grad=requires_grad)
    v = rand(sum(lens_k), kv_heads, dv or d, dtype=dtype, requires_grad=requires_grad)
    return q, k, v, cumulative(lens_q), cumulative(lens_k)


def reference(q, k, v, cu_q, cu_k, causal=False, window=(-1, -1), softcap=0.0, alibi_slopes=None, sinks=None,
              scale=None, keep=None, dropout_p=0.0, dtype=torch.float64):
    """Each sequence through attention_reference on its own: out (total_q, heads, dv), lse
    (heads, total_q); rows of no sequence are 0 and -inf."""
    heads = q.shape[1]
    out = torch.zeros(q.shape[0], heads, v.shape[-1], dtype=dtype or q.dtype)
    lse = torch.full((heads, q.shape[0]), float("-inf"), dtype=torch.float64)
    window = tuple(None if w == -1 else w for w in window)
    for b in range(len(cu_q) - 1):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if rows.stop == rows.start:
            continue
        slopes = alibi_slopes[b] if alibi_slopes is not None and alibi_slopes.dim() == 2 else alibi_slopes
        o, l, _ = attention_reference(
            q[rows].transpose(0, 1), k[keys].transpose(0, 1), v[keys].transpose(0, 1), enable_gqa=True,
            causal="bottom_right" if causal else None, window=window, softcap=softcap, alibi_slopes=slopes,
            sinks=sinks, scale=scale, dropout_p=dropout_p,
            dropout_mask=None if keep is None else keep[:, rows, :keys.stop - keys.start], dtype=dtype)
        out[rows] = o.transpose(0, 1)
        lse[:, rows] = l.double()
    return out, lse


CASES = {
    "plain": dict(),
    "causal": dict(causal=True),
    "window": dict(window=(16, 0)),
    "window_both": dict(window=(8, 8)),
    "diagonal": dict(window=(0, 0)),
    "right_only": dict(window=(-1, 4)),
    "left_only": dict(window=(32, -1)),
    "softcap_alibi": dict(causal=True, softcap=30.0, alibi="per_head"),
    "alibi_per_sequence": dict(alibi="per_sequence", window=(20, 3)),
}


def case_kwargs(case, heads, sequences):
    kwargs = dict(CASES[case])
    alibi = kwargs.pop("alibi", None)
    if alibi == "per_head":
        kwargs["alibi_slopes"] = torch.rand(heads) * 0.3
    elif alibi == "per_sequence":
        kwargs["alibi_slopes"] = torch.rand(sequences, heads) * 0.3
    return kwargs


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("lengths", LENGTHS)
def test_forward_matches_each_sequence_on_its_own(dtype, case, lengths):
    lens_q, lens_k = LENGTHS[lengths]
    q, k, v, cu_q, cu_k = packed_inputs(lens_q, lens_k, dtype=dtype)
    kwargs = case_kwargs(case, q.shape[1], len(lens_q))
    window = kwargs.pop("window", (-1, -1))
    out, lse = varlen_attention(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), window=window, return_lse=True,
                                **kwargs)
    ref, ref_lse = reference(q, k, v, cu_q, cu_k, window=window, **kwargs)
    low, _ = reference(q, k, v, cu_q, cu_k, window=window, dtype=None, **kwargs)
    assert out.shape == (q.shape[0], q.shape[1], v.shape[-1]) and out.is_contiguous()
    assert lse.shape == (q.shape[1], q.shape[0]) and lse.dtype == (torch.float64 if dtype == torch.float64
                                                                   else torch.float32)
    assert_close_to_reference(out, ref, dtype, (low.double() - ref).abs().max().item())
    assert_lse_close(lse, ref_lse, dtype)


@pytest.mark.parametrize("d,heads,kv_heads", [(32, 4, 4), (64, 6, 2), (80, 3, 1), (128, 2, 2)], ids=str)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_gradients_match_the_reference(dtype, d, heads, kv_heads):
    """dQ, dK, dV within 4x the error of plain torch in the same dtype, over the head dims and GQA
    ratios of the spec, with a window and sinks (whose gradient is checked in float64)."""
    lens_q, lens_k = [30, 0, 1, 70], [45, 6, 2, 70]
    q, k, v, cu_q, cu_k = packed_inputs(lens_q, lens_k, heads, kv_heads, d, dtype, requires_grad=True)
    sinks = rand(heads, dtype=torch.float32 if dtype != torch.float64 else dtype)
    grad = rand(*q.shape[:2], d, dtype=dtype)
    kwargs = dict(causal=True, window=(24, -1))

    def grads(fn, tensors, g):
        return torch.autograd.grad(fn(*tensors), tensors, g)

    got = grads(lambda q, k, v: varlen_attention(q, k, v, cu_q, cu_k, 70, 70, sinks=sinks, **kwargs), (q, k, v), grad)
    ins64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = grads(lambda q, k, v: reference(q, k, v, cu_q, cu_k, sinks=sinks.double(), **kwargs)[0], ins64,
                 grad.double())
    lp = [t.detach().requires_grad_() for t in (q, k, v)]
    low = grads(lambda q, k, v: reference(q, k, v, cu_q, cu_k, sinks=sinks, dtype=None, **kwargs)[0], lp, grad)
    assert_grads_close_to_reference(got, want, low, dtype)


def test_gradcheck_in_float64_with_every_modifier_combined():
    """GQA, causal with a window, softcap, per-sequence ALiBi, sinks (with their gradient) and
    dropout (the same draw each call), with empty and one-row sequences, through the fused kernels."""
    lens_q, lens_k = [3, 0, 1, 6], [5, 2, 0, 6]
    q, k, v, cu_q, cu_k = packed_inputs(lens_q, lens_k, 4, 2, 5, requires_grad=True)
    slopes = torch.rand(4, 4) * 0.5
    sinks = rand(4, requires_grad=True)

    def finite(out, lse):  # the lse of a row that sees no key is -inf: no finite difference there
        return out, lse.masked_fill(torch.isneginf(lse), 0.0)

    def fn(q, k, v, sinks):
        torch.manual_seed(3)
        return varlen_attention(q, k, v, cu_q, cu_k, 6, 6, causal=True, window=(2, -1), softcap=2.0,
                                alibi_slopes=slopes, sinks=sinks, dropout_p=0.25, return_lse=True)

    assert gradcheck(fn, (q, k, v, sinks))
    assert gradcheck(
        lambda q, k, v: finite(*flash_attn_varlen_func(q, k, v, cu_q, cu_k, 6, 6, window_size=(1, 1),
                                                       return_attn_probs=True)[:2]), (q, k, v))


def test_dropout_draws_per_packed_row_and_matches_the_reference_with_that_mask():
    """The keep mask of a packed call is dropout_mask(rng_state, (heads, total_q, max_seqlen_k)):
    each sequence uses its own rows, so no two sequences share draws."""
    lens_q, lens_k = [20, 7, 33], [25, 7, 30]
    q, k, v, cu_q, cu_k = packed_inputs(lens_q, lens_k, 4, 4, 16, requires_grad=True)
    torch.manual_seed(123)
    rng_state = attention_ext.draw_rng_state()
    torch.manual_seed(123)
    out = varlen_attention(q, k, v, cu_q, cu_k, 33, 30, dropout_p=0.4, causal=True)
    keep = attention_ext.dropout_mask(rng_state, (4, q.shape[0], 30), 0.4)
    ref, _ = reference(q, k, v, cu_q, cu_k, causal=True, keep=keep, dropout_p=0.4)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    grad = rand(*out.shape)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(ref, (q, k, v), grad)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.cpu_kernels
@pytest.mark.parametrize("lengths", LENGTHS)
def test_each_sequence_is_bitwise_a_dense_call_of_its_own(lengths, cpu_variant):
    """A packed call runs every sequence as the dense kernels run it alone: same bits, forward and
    backward, in every CPU variant (so the tiled, decode, fused and split paths all apply)."""
    lens_q, lens_k = LENGTHS[lengths]
    q, k, v, cu_q, cu_k = packed_inputs(lens_q, lens_k, 4, 2, 24, torch.float32, requires_grad=True)
    out = varlen_attention(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True, window=(50, -1))
    grad = rand(*out.shape, dtype=torch.float32)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad)
    for b in range(len(lens_q)):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if rows.stop == rows.start or keys.stop == keys.start:
            continue
        qs, ks, vs = (t[s].detach().transpose(0, 1).requires_grad_() for t, s in ((q, rows), (k, keys), (v, keys)))
        dense = attention_ext.attention(qs, ks, vs, causal="bottom_right", window=(50, None), enable_gqa=True)
        assert torch.equal(out[rows], dense.transpose(0, 1))
        grads = torch.autograd.grad(dense, (qs, ks, vs), grad[rows].transpose(0, 1))
        for got, want in zip((dq[rows], dk[keys], dv[keys]), grads):
            assert torch.equal(got, want.transpose(0, 1))


@pytest.mark.cpu_kernels
def test_results_do_not_depend_on_the_thread_count_or_backward_path(monkeypatch):
    lens_q, lens_k = [300, 2, 129, 64], [300, 900, 129, 1]
    q, k, v, cu_q, cu_k = packed_inputs(lens_q, lens_k, 4, 2, 64, torch.float32, requires_grad=True)

    def run():
        out = varlen_attention(q, k, v, cu_q, cu_k, 300, 900, causal=True)
        return (out,) + torch.autograd.grad(out.square().sum(), (q, k, v))

    threads = torch.get_num_threads()
    first = run()
    try:
        torch.set_num_threads(1)
        single = run()
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(first, single):
        assert torch.equal(a, b)
    forced = {}
    for path in ("fused", "split", "decode"):
        monkeypatch.setenv("ATTENTION_EXT_CPU_BACKWARD", path)
        forced[path] = run()
    # The sequences of at most 8 queries take the decode backward unless a tiled schedule is
    # forced; the tiled backward's two schedules give the same bits, the decode one other roundings.
    for a, fused, split, decode in zip(first, forced["fused"], forced["split"], forced["decode"]):
        assert torch.equal(fused, split) and torch.equal(a, decode)
        torch.testing.assert_close(a, fused, rtol=1e-5, atol=1e-5)


def test_rows_of_no_sequence_and_sequences_without_keys_or_queries():
    """cu_seqlens ending before the packed tensors' end: those rows get output 0, lse -inf and
    gradient 0; a sequence without keys gives 0 and -inf; keys of a sequence without queries get 0."""
    q, k, v, _, _ = packed_inputs([10], [12], 2, 2, 8, requires_grad=True)
    cu_q = torch.tensor([0, 4, 4, 6], dtype=torch.int32)  # rows 6..9 belong to no sequence
    cu_k = torch.tensor([0, 5, 9, 9], dtype=torch.int32)  # sequence 1: keys, no queries; 2: queries, no keys
    out, lse = varlen_attention(q, k, v, cu_q, cu_k, 4, 5, return_lse=True)
    assert torch.all(out[4:] == 0) and torch.all(torch.isneginf(lse[:, 4:])) and torch.isfinite(lse[:, :4]).all()
    out.sum().backward()
    assert torch.all(q.grad[4:] == 0) and q.grad[:4].abs().sum() > 0
    assert torch.all(k.grad[5:] == 0) and torch.all(v.grad[5:] == 0) and v.grad[:5].abs().sum() > 0


def test_a_second_derivative_raises_however_it_is_asked_for():
    """The backward is first order: every way of differentiating it again raises (none silently
    gives zeros), while first-order gradients taken with create_graph=True still work."""
    q, k, v, cu_q, cu_k = packed_inputs([5, 3], [6, 4], 2, 1, 8)
    message = "first-order backward only"

    def loss(q):
        return varlen_attention(q, k, v, cu_q, cu_k, 5, 6).square().sum()

    def linear_loss(q):
        return flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 6).sum()

    leaf = q.clone().requires_grad_()
    (g,) = torch.autograd.grad(loss(leaf), leaf, create_graph=True)
    assert torch.equal(g.detach(), torch.autograd.grad(loss(leaf), leaf)[0])
    with pytest.raises(NotImplementedError, match=message):
        torch.autograd.grad(g[0, 0, 0], leaf)
    for f in (loss, linear_loss):
        with pytest.raises(NotImplementedError, match=message):
            torch.autograd.functional.hessian(f, q)
        with pytest.raises(NotImplementedError, match=message):
            torch.func.grad(lambda q: torch.func.grad(f)(q).sum())(q)
    assert torch.equal(torch.func.grad(loss)(q), torch.autograd.grad(loss(leaf), leaf)[0])
    with pytest.raises(NotImplementedError, match=message):
        torch.func.jacrev(torch.func.jacrev(linear_loss))(q)


def test_forward_mode_ad_raises_a_message_of_its_own():
    """No forward-mode AD (the backward is first order): torch.func.jvp and forward_ad's dual
    tensors each raise this package's NotImplementedError, not torch's generic one."""
    q, k, v, cu_q, cu_k = packed_inputs([5, 3], [6, 4], 2, 1, 8, dtype=torch.float64)
    message = "varlen_attention has no forward-mode AD"
    f = lambda x: varlen_attention(x, k, v, cu_q, cu_k, 5, 6)  # noqa: E731
    with pytest.raises(NotImplementedError, match=message):
        torch.func.jvp(f, (q,), (torch.ones_like(q),))
    with torch.autograd.forward_ad.dual_level():
        with pytest.raises(NotImplementedError, match=message):
            flash_attn_varlen_func(q, torch.autograd.forward_ad.make_dual(k, torch.ones_like(k)), v, cu_q, cu_k, 5, 6)


def test_vmap_over_the_call_raises_with_what_to_do_instead():
    """vmap over the packed call itself has no rule (its sequences are the batch): a message of its
    own, saying to pack the entries as more sequences; jacrev (vmap over the backward) still works."""
    q, k, v, cu_q, cu_k = packed_inputs([2, 3], [2, 3], 2, 1, 4)
    with pytest.raises(NotImplementedError, match="under torch.func.vmap is not supported: pack the vmapped entries"):
        torch.func.vmap(lambda x: flash_attn_varlen_func(x, x, x, cu_q, cu_k, 3, 3))(torch.stack([q, q]))


@pytest.mark.filterwarnings("ignore:There is a performance drop because we have not yet implemented the batching rule")
def test_a_first_order_jacobian_through_torch_func():
    """torch.func.jacrev runs the first-order backward under vmap: the Jacobian is
    autograd.functional.jacobian's (vmap falls back to a loop over the packed backward)."""
    q, k, v, cu_q, cu_k = packed_inputs([3, 1], [3, 2], 2, 1, 4, dtype=torch.float64)

    of_q = lambda x: varlen_attention(x, k, v, cu_q, cu_k, 3, 3)  # noqa: E731
    of_k = lambda x: varlen_attention(q, x, v, cu_q, cu_k, 3, 3)  # noqa: E731
    for f, x in ((of_q, q), (of_k, k)):
        torch.testing.assert_close(torch.func.jacrev(f)(x), torch.autograd.functional.jacobian(f, x),
                                   rtol=1e-12, atol=1e-12)


def test_flash_attn_varlen_func_layout_lse_and_probabilities():
    """FlashAttention's signature: (total_q, heads, d) out, lse (heads, total_q), and with
    return_attn_probs the exact probabilities of each sequence, zero-padded; kvpacked/qkvpacked."""
    lens = [6, 1, 9]
    q, k, v, cu, _ = packed_inputs(lens, lens, 4, 2, 16)
    slopes = torch.rand(3, 4)
    out, lse, probs = flash_attn_varlen_func(q, k, v, cu, cu, 9, 9, causal=True, alibi_slopes=slopes,
                                             return_attn_probs=True)
    ref, ref_lse = reference(q, k, v, cu, cu, causal=True, alibi_slopes=slopes)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(lse, ref_lse)
    assert probs.shape == (3, 4, 9, 9)
    for b, n in enumerate(lens):
        rows = slice(cu[b], cu[b + 1])
        _, _, w = attention_reference(q[rows].transpose(0, 1), k[rows].transpose(0, 1), v[rows].transpose(0, 1),
                                      causal="bottom_right", alibi_slopes=slopes[b], enable_gqa=True)
        torch.testing.assert_close(probs[b, :, :n, :n], w)
        assert torch.all(probs[b, :, n:] == 0) and torch.all(probs[b, :, :, n:] == 0)
    kv = torch.stack((k, v), 1)
    torch.testing.assert_close(attention_ext.flash_attn_varlen_kvpacked_func(q, kv, cu, cu, 9, 9, causal=True,
                                                                             alibi_slopes=slopes), out)
    qkv = torch.stack((q, q, q), 1)
    torch.testing.assert_close(attention_ext.flash_attn_varlen_qkvpacked_func(qkv, cu, 9),
                               reference(q, q, q, cu, cu)[0])


BAD = [
    (dict(cu_q=torch.tensor([0, 3, 6], dtype=torch.int64)), TypeError, "cu_seqlens_q must be int32"),
    (dict(cu_q=torch.tensor([0, 4, 2], dtype=torch.int32)), RuntimeError, "non-decreasing"),
    (dict(cu_q=torch.tensor([1, 3, 6], dtype=torch.int32)), RuntimeError, "must start at 0"),
    (dict(cu_q=torch.tensor([0, 3, 6, 6], dtype=torch.int32)), ValueError, "same number of entries"),
    (dict(cu_q=torch.tensor([0, 3, 9], dtype=torch.int32)), RuntimeError, "ends at 9 but the packed tensor has 6"),
    (dict(cu_q=torch.tensor([[0, 3, 6]], dtype=torch.int32)), ValueError, "must be 1-D"),
    (dict(max_q=2), RuntimeError, "max_seqlen_q is 2 but cu_seqlens_q holds a sequence of 3"),
    (dict(max_q=-1), ValueError, r"max_seqlen_q must be an int in \[0, 2\*\*63\)"),
    (dict(max_q=2.0), TypeError, r"max_seqlen_q must be an int in \[0, 2\*\*63\)"),
    (dict(window=(-2, 0)), ValueError, "window"),
    (dict(alibi_slopes=torch.rand(3)), ValueError, r"alibi_slopes must have shape \(4,\) or \(2, 4\)"),
    (dict(alibi_slopes=torch.rand(4, dtype=torch.float64)), TypeError, "alibi_slopes must be float32"),
    (dict(k_heads=3), ValueError, "must be a multiple"),
    (dict(q_dims=4), ValueError, "packed layout"),
    (dict(causal="top_left"), ValueError, r"causal for packed sequences is True / 'bottom_right'"),
    (dict(causal="yes"), ValueError, r"causal for packed sequences is True / 'bottom_right'"),
    (dict(causal=1.0), TypeError, "causal must be a bool"),
]


@pytest.mark.parametrize("bad,error,message", BAD, ids=[b[2][:30] for b in BAD])
def test_bad_arguments_raise_clear_errors(bad, error, message):
    q, k, v, cu_q, cu_k = packed_inputs([3, 3], [4, 2], 4, 2, 8)
    if "k_heads" in bad:
        k = v = rand(6, bad["k_heads"], 8)
    if "q_dims" in bad:
        q = q.unsqueeze(0)
    kwargs = {key: bad[key] for key in ("window", "alibi_slopes", "causal") if key in bad}
    with pytest.raises(error, match=message):
        varlen_attention(q, k, v, bad.get("cu_q", cu_q), cu_k, bad.get("max_q", 3), 4, **kwargs)


def test_causal_takes_attention_s_names_for_its_two_choices():
    q, k, v, cu_q, cu_k = packed_inputs([3, 3], [4, 2], 4, 2, 8)
    for causal, same_as in (("bottom_right", True), (None, False)):
        assert torch.equal(varlen_attention(q, k, v, cu_q, cu_k, 3, 4, causal=causal),
                           varlen_attention(q, k, v, cu_q, cu_k, 3, 4, causal=same_as))


def test_the_signatures_are_flash_attentions():
    import inspect

    import attention_ext.flash as flash

    params = inspect.signature(flash_attn_varlen_func).parameters
    assert list(params) == ["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "dropout_p",
                            "softmax_scale", "causal", "window_size", "softcap", "alibi_slopes", "deterministic",
                            "return_attn_probs", "block_table"]
    defaults = {name: p.default for name, p in params.items() if p.default is not inspect.Parameter.empty}
    assert defaults == {"dropout_p": 0.0, "softmax_scale": None, "causal": False, "window_size": (-1, -1),
                        "softcap": 0.0, "alibi_slopes": None, "deterministic": False, "return_attn_probs": False,
                        "block_table": None}
    assert list(inspect.signature(attention_ext.flash_attn_varlen_kvpacked_func).parameters)[:2] == ["q", "kv"]
    assert list(inspect.signature(attention_ext.flash_attn_varlen_qkvpacked_func).parameters)[:3] == [
        "qkv", "cu_seqlens", "max_seqlen"]
    for name in ("flash_attn_varlen_func", "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func"):
        assert getattr(attention_ext, name) is getattr(flash, name) and name in attention_ext.__all__


def test_paged_block_table_is_refused_clearly():
    q, k, v, cu_q, cu_k = packed_inputs([3], [4], 2, 2, 8)
    with pytest.raises(NotImplementedError, match="block_table"):
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 4, block_table=torch.zeros(1, 1, dtype=torch.int32))


def test_bad_cu_seqlens_in_direct_op_calls_never_crash():
    """The op reads cu_seqlens itself: values that would index outside the tensors are refused
    with an error in a subprocess that must survive (a crash would fail the test)."""
    code = r"""
import torch, attention_ext
q = torch.randn(2, 6, 8); k = torch.randn(2, 5, 8)
ops = torch.ops.attention_ext
for cu_q, cu_k in (([0, 3, 7], [0, 2, 5]), ([0, 3, 6], [0, 6, 5]), ([0, -1, 6], [0, 2, 5]), ([0, 3, 6], [0, 2, 50])):
    try:
        ops.attention_varlen_fwd(q, k, k, torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_k, dtype=torch.int32),
                                 100, 100, 0.5, 0, -1, -1, 0.0, None, None, 0.0, None)
    except RuntimeError as e:
        assert "cu_seqlens" in str(e), e
    else:
        raise SystemExit("accepted " + str((cu_q, cu_k)))
print("ok")
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            env=dict(os.environ))
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


def test_opcheck_and_compiled_fullgraph_forward_and_backward():
    q, k, v, cu_q, cu_k = packed_inputs([5, 1, 7], [6, 3, 7], 4, 2, 8, torch.float32, requires_grad=True)
    qh = q.unflatten(1, (2, 2)).permute(1, 2, 0, 3)
    kh, vh = (t.permute(1, 0, 2).unsqueeze(1) for t in (k, v))
    args = (qh, kh, vh, cu_q, cu_k, 7, 7, 0.3, 2, 4, -1, 5.0, torch.rand(3, 2, 2), rand(2, 2, dtype=torch.float32),
            0.0, None)
    torch.library.opcheck(ops.attention_varlen_fwd, args)
    out, lse = ops.attention_varlen_fwd(*args)
    inputs = [t.detach() for t in (qh, kh, vh)]  # first order only: the backward op has no autograd
    torch.library.opcheck(ops.attention_varlen_bwd, (torch.randn_like(out), None, *inputs, cu_q, cu_k, 7, 7,
                                                     out.detach(), lse.detach()) + args[7:])
    torch._dynamo.reset()

    def layer(q, k, v):
        return flash_attn_varlen_func(q, k, v, cu_q, cu_k, 7, 7, causal=True, softcap=3.0).relu().sum()

    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    loss = compiled(q, k, v)
    got = torch.autograd.grad(loss, (q, k, v))
    eager = layer(q, k, v)
    torch.testing.assert_close(loss, eager)
    for a, b in zip(got, torch.autograd.grad(eager, (q, k, v))):
        torch.testing.assert_close(a, b)


def test_a_compiled_training_step_keeps_the_longest_sequence_symbolic():
    """Packed batches whose longest sequence changes every step (max_seqlen_q/k SymInt in the ops,
    as torch's own): compiled with dynamic=True and fullgraph=True they run on a few graphs, where
    one per value would pass the recompile limit (8) and fail; eager's loss and gradients."""
    def step(q, k, v, cu, longest):
        return flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, causal=True).square().sum()

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager", dynamic=True)
    for i in range(10):
        lens = [3, 5 + i]
        q, k, v, cu, _ = packed_inputs(lens, lens, 4, 2, 8, torch.float32, requires_grad=True)
        loss = compiled(q, k, v, cu, max(lens))
        eager = step(q, k, v, cu, max(lens))
        torch.testing.assert_close(loss, eager, rtol=0, atol=0)
        for a, b in zip(torch.autograd.grad(loss, (q, k, v)), torch.autograd.grad(eager, (q, k, v))):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 3


@pytest.mark.cuda_kernels
@pytest.mark.skipif(CUDA_KERNELS_DEVICE is None, reason="needs a CUDA device or the CUDA emulation build")
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_cuda_kernels_forward_and_backward(dtype):
    """On the CUDA binding (a GPU or the emulation): decode-sized and tiled sequences, GQA, a
    window, in every dtype (fp16/bf16 d = 64 takes the tensor-core kernels)."""
    lens_q, lens_k = [1, 70, 0, 33], [700, 70, 5, 40]
    q, k, v, cu_q, cu_k = (t.to(CUDA_KERNELS_DEVICE) for t in packed_inputs(lens_q, lens_k, 4, 2, 64, dtype))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = varlen_attention(q, k, v, cu_q, cu_k, 70, 700, causal=True, window=(100, -1))
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    ins = [t.detach().cpu() for t in (q, k, v)]
    ins64 = [t.double().requires_grad_() for t in ins]
    ref, _ = reference(*ins64, cu_q.cpu(), cu_k.cpu(), causal=True, window=(100, -1))
    low, _ = reference(*ins, cu_q.cpu(), cu_k.cpu(), causal=True, window=(100, -1), dtype=None)
    assert_close_to_reference(out.cpu(), ref, dtype, (low.double() - ref).abs().max().item())
    want = torch.autograd.grad(ref, ins64, grad.cpu().double())
    lp = [t.requires_grad_() for t in ins]
    low_out, _ = reference(*lp, cu_q.cpu(), cu_k.cpu(), causal=True, window=(100, -1), dtype=None)
    low_grads = torch.autograd.grad(low_out, lp, grad.cpu())
    assert_grads_close_to_reference([g.cpu() for g in got], want, low_grads, dtype)

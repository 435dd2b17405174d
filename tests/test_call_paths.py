"""Which path a call takes: a call that records nothing for autograd (no input requires grad, or
grad mode off) runs the op directly, without the autograd Function, and returns exactly what the
Function returns; forward-mode AD and functorch transforms still go through the Function's rules
even with grad mode off; small CPU calls run on the calling thread and give the same bits.
"""
from __future__ import annotations

import torch
import torch.autograd.forward_ad as fwAD

import attention_ext
from attention_ext import function


def inputs(n=5, m=7, d=8, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 3, length, d, generator=g, dtype=dtype) for length in (n, m, m)]


def count_function_calls(monkeypatch):
    calls = []
    for cls in (function.AttentionFunction, function.AttentionWeightsFunction):
        original = cls.forward

        def counted(*args, _original=original):
            calls.append(1)
            return _original(*args)

        monkeypatch.setattr(cls, "forward", staticmethod(counted))
    return calls


def test_inference_skips_the_autograd_function_and_returns_the_same_bits(monkeypatch):
    q, k, v = inputs()
    with_graph = attention_ext.attention(*(t.clone().requires_grad_() for t in (q, k, v)), causal="bottom_right")
    calls = count_function_calls(monkeypatch)
    plain = attention_ext.attention(q, k, v, causal="bottom_right")
    with torch.no_grad():
        no_grad = attention_ext.attention(*(t.clone().requires_grad_() for t in (q, k, v)), causal="bottom_right")
        weights = attention_ext.attention_weights(q, k)
    assert calls == []
    assert plain.grad_fn is None and no_grad.grad_fn is None and weights.grad_fn is None
    assert torch.equal(plain, with_graph.detach()) and torch.equal(no_grad, plain)


def test_an_input_that_requires_grad_goes_through_the_function(monkeypatch):
    calls = count_function_calls(monkeypatch)
    q, k, v = inputs()
    out = attention_ext.scaled_dot_product_attention(q, k, v.requires_grad_())
    assert calls == [1] and out.grad_fn is not None


def test_forward_ad_works_with_grad_mode_off():
    q, k, v = inputs()
    tangent = torch.randn_like(q)
    with torch.no_grad(), fwAD.dual_level():
        out = attention_ext.scaled_dot_product_attention(fwAD.make_dual(q, tangent), k, v)
        jvp_no_grad = fwAD.unpack_dual(out).tangent
    _, jvp = torch.func.jvp(lambda q: attention_ext.scaled_dot_product_attention(q, k, v), (q,), (tangent,))
    assert jvp_no_grad is not None
    torch.testing.assert_close(jvp_no_grad, jvp)


def test_vmap_works_with_grad_mode_off():
    q, k, v = inputs()
    qs = torch.stack([q, 2 * q])
    with torch.no_grad():
        batched = torch.vmap(lambda q: attention_ext.scaled_dot_product_attention(q, k, v))(qs)
    for i in range(2):
        torch.testing.assert_close(batched[i], attention_ext.scaled_dot_product_attention(qs[i], k, v))


def test_small_calls_give_the_same_bits_on_any_thread_count():
    # Below the serial threshold (and above it, for contrast): one thread and two agree bitwise.
    threads = torch.get_num_threads()
    try:
        for n, m in ((1, 16), (4, 40), (70, 300)):
            q, k, v = inputs(n=n, m=m, d=16, dtype=torch.float32)
            results = []
            for count in (1, 2):
                torch.set_num_threads(count)
                q1, k1, v1 = (t.clone().requires_grad_() for t in (q, k, v))
                out = attention_ext.scaled_dot_product_attention(q1, k1, v1)
                out.sum().backward()
                results.append((out, q1.grad, k1.grad, v1.grad))
            for a, b in zip(*results):
                assert torch.equal(a, b), (n, m)
    finally:
        torch.set_num_threads(threads)


def count_full_path_calls(monkeypatch):
    """Counts calls that take the full argument handling (api._prepare), not the lean path."""
    from attention_ext import api
    calls = []
    original = api._prepare

    def counted(*args):
        calls.append(1)
        return original(*args)
    monkeypatch.setattr(api, "_prepare", counted)
    return calls


def test_the_common_inference_call_skips_the_argument_handling_and_gives_the_same_bits(monkeypatch):
    """Plain tensors, one dtype and device, the same leading dims, no mask, dropout or modifier, and
    nothing for autograd: straight to the op (decode-sized calls spent most of their time in the
    argument handling). The result is the full path's, bit for bit."""
    direct_entries()  # (the lean path's checks are the compiled extension's)
    q, k, v = inputs(n=1, m=9)
    full = [attention_ext.attention(q, k, v, causal=c, scale=0.3, return_lse=True) for c in (None, "bottom_right")]
    full.append(attention_ext.scaled_dot_product_attention(q, k, v, is_causal=True))
    full_calls = count_full_path_calls(monkeypatch)
    lean = [attention_ext.attention(q, k, v, causal=c, scale=0.3, return_lse=True) for c in (None, "bottom_right")]
    lean.append(attention_ext.scaled_dot_product_attention(q, k, v, is_causal=True))
    assert full_calls == []
    for a, b in zip(torch.utils._pytree.tree_leaves(full), torch.utils._pytree.tree_leaves(lean)):
        assert torch.equal(a, b)


def test_a_gqa_call_takes_the_lean_path_with_the_full_path_s_bits_and_gradients(monkeypatch):
    """enable_gqa splits the query heads into (K/V heads, groups) as views on the lean path too:
    outputs, lse and gradients are the full path's, bit for bit."""
    direct_entries()
    from attention_ext import api
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 6, 3, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 3, 9, 8, generator=g, dtype=torch.float64) for _ in range(2))

    def run():
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse = attention_ext.attention(*leaves, causal="bottom_right", enable_gqa=True, return_lse=True)
        (out.sum() + lse.sum()).backward()
        with torch.no_grad():
            plain = attention_ext.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return [out, lse, plain] + [t.grad for t in leaves]

    monkeypatch.setattr(api, "_lean_forward", lambda *args, **kwargs: None)
    full = run()
    monkeypatch.undo()
    full_calls = count_full_path_calls(monkeypatch)
    lean = run()
    assert full_calls == []
    assert full[0].shape == (2, 6, 3, 8) and full[1].shape == (2, 6, 3)
    for a, b in zip(full, lean):
        assert torch.equal(a, b)


def test_the_lean_path_records_the_autograd_function_when_an_input_requires_grad(monkeypatch):
    direct_entries()  # (the lean path's checks are the compiled extension's)
    q, k, v = inputs(n=3, m=9)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.autograd.backward(attention_ext.attention(*leaves, attn_mask=torch.ones(3, 9, dtype=torch.bool)),
                            torch.ones(2, 3, 3, 8, dtype=torch.float64))  # full path (a mask)
    full_grads = [t.grad for t in leaves]
    calls = count_function_calls(monkeypatch)
    full_calls = count_full_path_calls(monkeypatch)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attention_ext.scaled_dot_product_attention(*leaves)
    assert out.grad_fn is not None and len(calls) == 1 and full_calls == []
    out.backward(torch.ones_like(out))
    assert all(torch.equal(a, t.grad) for a, t in zip(full_grads, leaves))


def test_every_other_call_takes_the_full_path_and_its_checks(monkeypatch):
    q, k, v = inputs()
    calls = count_full_path_calls(monkeypatch)
    attention_ext.attention(q, k, v, attn_mask=torch.ones(5, 7, dtype=torch.bool))
    attention_ext.attention(q, k, v, window=(2, 0))
    attention_ext.attention(q, k[:1], v[:1])  # broadcast leading dims
    attention_ext.scaled_dot_product_attention(q, k, v, enable_gqa=True, attn_mask=torch.ones(5, 7, dtype=torch.bool))
    attention_ext.attention(q, k, v, scale=1)  # an int scale: converted there
    with fwAD.dual_level():
        attention_ext.attention(fwAD.make_dual(q, torch.ones_like(q)), k, v)
    assert len(calls) == 6
    # Errors are still the full path's.
    import pytest
    with pytest.raises(ValueError, match="multiple of the key/value heads"):
        attention_ext.scaled_dot_product_attention(q, k[:, :2], v[:, :2], enable_gqa=True)
    with pytest.raises(TypeError, match="same dtype"):
        attention_ext.attention(q, k.float(), v)
    with pytest.raises(ValueError, match="same head dim"):
        attention_ext.attention(q, k[..., :4], v)
    with pytest.raises(ValueError, match="scale must be finite"):
        attention_ext.attention(q, k, v, scale=float("inf"))
    with pytest.raises(TypeError, match="dropout_p must be a number"):
        attention_ext.scaled_dot_product_attention(q, k, v, dropout_p="0.0")
    with pytest.raises(ValueError, match="causal must be"):
        attention_ext.attention(q, k, v, causal="upper")


def test_the_lean_entry_answers_the_common_call_and_declines_every_other(monkeypatch):
    """csrc/module.cpp's lean_attention holds the lean path's rule: (out, lse) for a call it may
    run, the tensors for the autograd Function when autograd must record it, None (the full path
    then checks the call) for anything else."""
    from attention_ext import _ops
    direct_entries()
    lean = _ops.LEAN_ATTENTION
    q, k, v = inputs(n=3, m=9)
    out, lse = lean(q, k, v, 0, None, False)
    expected = attention_ext.attention(q, k, v, attn_mask=torch.ones(3, 9, dtype=torch.bool), return_lse=True)
    assert torch.equal(out, expected[0]) and torch.equal(lse, expected[1])
    qg = torch.randn(2, 6, 3, 8, dtype=torch.float64, requires_grad=True)
    prepared = lean(qg, k, v, 1, 0.5, True)  # GQA: 6 query heads on 3 K/V heads
    assert len(prepared) == 5 and prepared[0].shape == (2, 3, 2, 3, 8) and prepared[1].shape == (2, 3, 1, 9, 8)
    assert prepared[0]._base is qg and prepared[3:] == (0.5, 2)
    with torch.no_grad():
        out, lse = lean(qg, k, v, 1, 0.5, True)
    assert out.shape == (2, 6, 3, 8) and lse.shape == (2, 6, 3)

    class Sub(torch.Tensor):
        pass
    declined = {
        "an int scale": (q, k, v, 0, 1, False),
        "an infinite scale": (q, k, v, 0, float("inf"), False),
        "a NaN scale": (q, k, v, 0, float("nan"), False),
        "a scale beyond float32 after log2(e)": (q.float(), k.float(), v.float(), 0, 3e38, False),
        "mixed dtypes": (q, k.float(), v, 0, None, False),
        "an int dtype": (q.long(), k.long(), v.long(), 0, None, False),
        "other head dims": (q, k[..., :4], v, 0, None, False),
        "other key counts": (q, k, v[..., :5, :], 0, None, False),
        "broadcast leading dims": (q, k[:1], v[:1], 0, None, False),
        "GQA heads that do not divide": (q, k[:, :2], v[:, :2], 0, None, True),
        "one dim": (q[0, 0, 0], k[0, 0, 0], v[0, 0, 0], 0, None, False),
        "meta tensors": (q.to("meta"), k.to("meta"), v.to("meta"), 0, None, False),
        "a subclass": (q.as_subclass(Sub), k, v, 0, None, False),
        "a sparse key": (q, k.to_sparse(), v, 0, None, False),
        "a non-bool enable_gqa": (q, k, v, 0, None, 1),
    }
    escaped = []  # a functorch wrapper whose transform has ended (torch's apply unwraps those)
    torch.func.grad(lambda x: escaped.append(x) or x.sum())(q.clone())
    declined["a dead functorch wrapper"] = (escaped[0], k, v, 0, None, False)
    for what, args in declined.items():
        assert lean(*args) is None, what
    assert torch.equal(attention_ext.scaled_dot_product_attention(escaped[0], k, v),
                       attention_ext.scaled_dot_product_attention(q, k, v))
    import warnings
    with warnings.catch_warnings():  # (torch calls its strided nested tensors a prototype)
        warnings.simplefilter("ignore")
        nested = torch.nested.nested_tensor([torch.randn(2, 3, 8), torch.randn(2, 4, 8)], layout=torch.strided)
    assert lean(nested, nested, nested, 0, None, False) is None
    # Autocast, forward-mode AD and torch.compile are the Python side's to rule out: full path.
    calls = count_full_path_calls(monkeypatch)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        attention_ext.scaled_dot_product_attention(q.float(), k.float(), v.float())
    assert len(calls) == 1


def test_scratch_beyond_the_thread_buffer_and_small_calls_between_give_the_same_results(monkeypatch):
    """The kernels' scratch tiles come from a per-thread buffer kept between calls; a chunk that
    needs more than it may hold (8 MiB: here the fused backward's dQ rows of a 17000-row query)
    gets heap memory, and the buffer grows for what fits. Calls of both kinds, interleaved and
    repeated, give the reference's results and the same bits every time."""
    from attention_ext.reference import attention_reference
    monkeypatch.setenv("ATTENTION_EXT_CPU_BACKWARD", "fused")
    g = torch.Generator().manual_seed(3)

    def case(n, m, d):
        q, k, v = (torch.randn(1, 2, length, d, generator=g) for length in (n, m, m))
        return q, k, v, torch.randn(1, 2, n, d, generator=g)

    def run(q, k, v, grad_out):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = attention_ext.attention(*leaves, causal="bottom_right")
        out.backward(grad_out)
        return [out.detach()] + [t.grad for t in leaves]

    big, small = case(17000, 16, 128), case(5, 70, 16)
    first = {}
    for name in ("small", "big", "small", "big", "small"):
        q, k, v, grad_out = big if name == "big" else small
        result = run(q, k, v, grad_out)
        if name not in first:
            first[name] = result
            leaves = [t.double().requires_grad_() for t in (q, k, v)]
            expected, _, _ = attention_reference(*leaves, causal="bottom_right")
            expected.backward(grad_out.double())
            for got, want in zip(result, [expected.detach()] + [t.grad for t in leaves]):
                torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)
        assert all(torch.equal(a, b) for a, b in zip(result, first[name])), name


def direct_entries():
    """The prebuilt extension's direct entries to the ops (a JIT build has none)."""
    import pytest
    from attention_ext import _ops
    if not _ops._DIRECT_ENTRIES:
        pytest.skip("this build has no direct entries (a JIT build loads the ops alone)")
    return _ops._compiled


def op_arguments(q, k, v):
    return (q, k, v, None, 0.3, 2, -1, -1, 0.0, None, None, 0.0, None)


def test_the_direct_entries_call_the_ops_and_give_their_bits():
    direct = direct_entries()
    q, k, v = inputs(n=3, m=9)
    with torch.no_grad():
        expected = torch.ops.attention_ext.attention_fwd(*op_arguments(q, k, v))
        out, lse = direct.fwd_below_autograd(*op_arguments(q, k, v))
        grad_out = torch.randn_like(out)
        bwd_args = (grad_out, None, q, k, v, None, out, lse, 0.3, 2, -1, -1, 0.0, None, None, 0.0, None, False, False)
        expected_grads = torch.ops.attention_ext.attention_bwd(*bwd_args)
        grads = direct.bwd_below_autograd(*bwd_args)
    assert torch.equal(out, expected[0]) and torch.equal(lse, expected[1])
    assert all(torch.equal(a, b) for a, b in zip(grads, expected_grads))


def test_the_direct_entries_raise_what_the_op_raises():
    import pytest
    direct = direct_entries()
    q, k, v = inputs(n=3, m=9)
    messages = []
    for call in (direct.fwd_below_autograd, torch.ops.attention_ext.attention_fwd):
        with pytest.raises(RuntimeError, match="same head dim") as error:
            call(*op_arguments(q, k[..., :4], v))
        messages.append(str(error.value))
    assert messages[0] == messages[1]
    with pytest.raises(TypeError, match="takes 13 arguments"):
        direct.fwd_below_autograd(q, k, v)


def test_arguments_beyond_the_plain_kinds_go_to_torch_ops():
    """A wrong type, a numpy scalar, an int beyond int64: the direct entry answers None and the
    call goes through torch.ops, which converts the value or raises its own error."""
    import numpy as np
    import pytest
    from attention_ext._ops import call_below_autograd
    direct = direct_entries()
    fwd = torch.ops.attention_ext.attention_fwd
    q, k, v = inputs(n=3, m=9)
    odd = [(4, "0.3"), (4, np.float64(0.3)), (5, True), (6, 2 ** 63), (1, None)]
    with torch.no_grad():
        for position, value in odd:
            args = list(op_arguments(q, k, v))
            args[position] = value
            assert direct.fwd_below_autograd(*args) is None, (position, value)
            try:
                expected = fwd(*args)
            except Exception as error:
                with pytest.raises(type(error)):
                    call_below_autograd(fwd, *args)
            else:
                got = call_below_autograd(fwd, *args)
                assert all(torch.equal(a, b) for a, b in zip(got, expected))


def recording_mode(seen):
    """A TorchFunctionMode class that appends the name of every function it sees to `seen`."""
    from torch.overrides import TorchFunctionMode

    class Recording(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    return Recording


def test_torch_function_modes_and_tensor_subclasses_still_see_the_op():
    """The direct entries step aside (torch.ops takes the call) where __torch_function__ expects
    to see it: under a TorchFunctionMode and for tensor subclasses."""
    direct_entries()
    seen = []
    Recording = recording_mode(seen)

    class Logged(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return super().__torch_function__(func, types, args, kwargs or {})

    q, k, v = inputs(n=3, m=9)
    with Recording():
        attention_ext.scaled_dot_product_attention(q, k, v)
    assert "attention_ext.attention_fwd" in seen
    seen.clear()
    from attention_ext._ops import call_below_autograd
    fwd = torch.ops.attention_ext.attention_fwd
    with torch.no_grad():
        out, _ = call_below_autograd(fwd, *op_arguments(q.as_subclass(Logged), k, v))
    assert "attention_ext.attention_fwd" in seen
    assert torch.equal(out.as_subclass(torch.Tensor), call_below_autograd(fwd, *op_arguments(q, k, v))[0])


def decode_step_arguments(seed=0):
    """A decode step's op arguments: (query as (batch, kv_heads, groups, n, d), caches as
    (rows, kv_heads, 1, length, d) views of (rows, length, kv_heads, d) tensors), and the new
    keys and values with where they go."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 3, 4, 6, generator=g)  # (batch, n, heads, d)
    k_cache, v_cache = (torch.randn(2, 10, 2, 6, generator=g) for _ in range(2))
    k_new, v_new = (torch.randn(2, 2, 2, 6, generator=g) for _ in range(2))
    starts = torch.tensor([3, 5], dtype=torch.int32)
    return q, k_cache, v_cache, k_new, v_new, starts


def test_the_decode_step_s_direct_entries_call_the_ops_and_give_their_bits():
    """flash_attn_with_kvcache's three ops (the rotary, the append, the attention) through their
    direct entries: the same results as through torch.ops, the caches written alike."""
    import pytest
    direct = direct_entries()
    ops = torch.ops.attention_ext
    q, k_cache, v_cache, k_new, v_new, starts = decode_step_arguments()
    cos, sin = torch.randn(16, 3), torch.randn(16, 3)
    with torch.no_grad():
        for per_row, interleaved in ((True, True), (False, False)):
            want = ops.attention_rotary(q, cos, sin, starts, per_row, interleaved)
            assert torch.equal(direct.rotary_below_autograd(q, cos, sin, starts, per_row, interleaved), want)
        caches = [(k_cache.clone(), v_cache.clone()) for _ in range(2)]
        assert direct.kvcache_append_below_autograd(*caches[0], k_new, v_new, starts, None, None) == ()
        ops.attention_kvcache_append(*caches[1], k_new, v_new, starts, None, None)
        assert all(torch.equal(a, b) for a, b in zip(caches[0], caches[1]))
        assert not torch.equal(caches[0][0], k_cache)
        qh = q.permute(0, 2, 1, 3).unflatten(1, (2, 2))  # (batch, kv_heads, groups, n, d)
        kh, vh = (c.permute(0, 2, 1, 3).unsqueeze(2) for c in caches[0])
        args = (qh, kh, vh, starts + 2, None, None, None, 0.4, 2, -1, 0, 0.0, None)
        out, lse = direct.kvcache_fwd_below_autograd(*args)
        want_out, want_lse = ops.attention_kvcache_fwd(*args)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    with pytest.raises(TypeError, match="takes 13 arguments"):
        direct.kvcache_fwd_below_autograd(qh, kh, vh)
    with pytest.raises(RuntimeError, match="overflows the cache") as error:
        direct.kvcache_append_below_autograd(*caches[0], k_new, v_new, starts + 5, None, None)
    with pytest.raises(RuntimeError) as expected:
        ops.attention_kvcache_append(*caches[0], k_new, v_new, starts + 5, None, None)
    assert str(error.value) == str(expected.value)


def test_a_cpu_decode_step_takes_the_direct_entries(monkeypatch):
    """flash_attn_with_kvcache on CPU tensors runs as one C++ call (csrc/kv_cache_step.h), which
    calls its ops itself; its Python path (the C++ step switched off, or a JIT build without it)
    calls the three ops through their direct entries (a torch.ops call converts every argument
    through the schema: microseconds a step)."""
    from attention_ext import _ops
    direct_entries()
    used = []
    ops = torch.ops.attention_ext
    for op in (ops.attention_rotary, ops.attention_kvcache_append, ops.attention_kvcache_fwd):
        entry = _ops._DIRECT_ENTRIES[op]
        monkeypatch.setitem(_ops._DIRECT_ENTRIES, op, lambda *args, _entry=entry, _op=op: used.append(_op) or
                            _entry(*args))
    q, k_cache, v_cache, k_new, v_new, starts = decode_step_arguments(seed=2)
    cos, sin = torch.randn(16, 3), torch.randn(16, 3)

    def step():
        with torch.no_grad():
            attention_ext.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, rotary_cos=cos, rotary_sin=sin,
                                                  cache_seqlens=starts, causal=True)

    if _ops.KVCACHE_STEP is not None:
        step()
        assert used == [], "the C++ step left the call to the Python path"
        monkeypatch.setattr(_ops, "KVCACHE_STEP", None)
    step()
    assert used == [ops.attention_rotary] * 2 + [ops.attention_kvcache_append, ops.attention_kvcache_fwd]


def test_a_decode_step_under_a_torch_function_mode_still_shows_its_ops():
    """The decode step's direct entries step aside under a TorchFunctionMode: the mode sees the
    rotary, the append and the attention as torch.ops calls, and the step gives the same bits."""
    direct_entries()
    seen = []
    Recording = recording_mode(seen)

    q, k_cache, v_cache, k_new, v_new, starts = decode_step_arguments(seed=1)
    cos, sin = torch.randn(16, 3), torch.randn(16, 3)
    results = []
    for mode in (Recording, None):
        k_c, v_c = k_cache.clone(), v_cache.clone()
        with torch.no_grad(), (mode() if mode else torch.no_grad()):
            out = attention_ext.flash_attn_with_kvcache(q, k_c, v_c, k_new, v_new, rotary_cos=cos, rotary_sin=sin,
                                                        cache_seqlens=starts, causal=True)
        results.append((out, k_c, v_c))
    for name in ("attention_rotary", "attention_kvcache_append", "attention_kvcache_fwd"):
        assert f"attention_ext.{name}" in seen, name
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_a_dual_level_entered_behind_forward_ad_s_back_is_a_clear_error():
    """The Function saves its tensors for jvp only while torch.autograd.forward_ad has a level
    open; a level entered through torch._C directly (private) is not seen: a clear error, never a
    tangent silently computed from nothing."""
    import pytest
    q, k, v = inputs(n=3, m=9)
    level = torch._C._enter_dual_level()
    try:
        dual = fwAD.make_dual(q.clone().requires_grad_(), torch.ones_like(q), level=level)
        with pytest.raises(RuntimeError, match="dual level opened through torch.autograd.forward_ad"):
            attention_ext.attention(dual, k, v)
    finally:
        torch._C._exit_dual_level(level=level)

"""The ops work with PyTorch's tooling: opcheck, torch.compile, torch.export, torch.jit.trace, meta tensors."""
import pytest
import torch
from torch._dynamo.testing import CompileCounter

import attention_ext
from attention_ext import attention_reference, dropout_mask
from attention_ext.api import draw_rng_state

from conftest import rand

ops = torch.ops.attention_ext


def fwd_samples():
    f32 = torch.float32
    yield (rand(2, 3, 5, 4, dtype=f32), rand(2, 3, 7, 4, dtype=f32), rand(2, 3, 7, 6, dtype=f32), None, 0.5, 0, -1, -1,
           0.0, None, None, 0.0, None)
    yield (rand(3, 5, 4), rand(1, 7, 4), rand(1, 7, 3), rand(5, 7), 0.3, 2, 4, -1, 30.0, torch.rand(3),
           torch.randn(3, dtype=torch.float64), 0.0, None)
    yield (rand(2, 5, 4, dtype=f32), rand(2, 7, 4, dtype=f32), rand(2, 7, 3, dtype=f32),
           torch.rand(2, 1, 7) > 0.3, 1.0, 0, 1, 2, 0.0, None, torch.randn(2), 0.25,
           draw_rng_state("cpu"))
    # (batch, n, heads, d) memory seen through a transpose: out follows it (the fake kernel too)
    qkv = rand(2, 5, 3, 4, 6, dtype=f32)
    yield (*(qkv[:, :, i].transpose(1, 2) for i in range(3)), None, 0.4, 1, -1, -1, 0.0, None, None, 0.0, None)
    # ... split into (kv_heads, groups) as for GQA; a query broadcast over a batch dim (stride 0)
    # and one missing the leading dim: those dims go outermost
    q = qkv[:, :, 0].transpose(1, 2).unflatten(1, (2, 2))
    kv = rand(2, 2, 1, 7, 6, dtype=f32)
    yield (q, kv, kv, None, 0.4, 0, -1, -1, 0.0, None, None, 0.0, None)
    yield (rand(1, 5, 4, 6, dtype=f32).transpose(1, 2).expand(3, 4, 5, 6), rand(3, 4, 7, 6, dtype=f32),
           rand(3, 4, 7, 2, dtype=f32), None, 0.4, 0, -1, -1, 0.0, None, None, 0.0, None)
    yield (rand(5, 4, 6, dtype=f32).transpose(0, 1), rand(3, 4, 7, 6, dtype=f32), rand(3, 4, 7, 2, dtype=f32), None,
           0.4, 0, -1, -1, 0.0, None, None, 0.0, None)


@pytest.mark.parametrize("requires_grad", [False, True])
def test_opcheck_forward(requires_grad):
    for args in fwd_samples():
        args = [a.clone().requires_grad_(requires_grad) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                for a in args]
        torch.library.opcheck(ops.attention_fwd, args)


@pytest.mark.parametrize("requires_grad", [False, True])
def test_opcheck_backward(requires_grad):
    q, k, v, mask = rand(2, 5, 4), rand(2, 7, 4), rand(2, 7, 3), rand(2, 5, 7)
    out, lse = ops.attention_fwd(q, k, v, mask, 0.5, 1, -1, -1, 0.0, None, None, 0.0, None)
    args = [torch.randn_like(out), torch.randn_like(lse), q, k, v, mask, out, lse, 0.5, 1, -1, -1, 20.0, torch.rand(2),
            torch.randn(2, dtype=torch.float64), 0.0, None, True]
    args = [a.clone().requires_grad_(requires_grad) if isinstance(a, torch.Tensor) else a for a in args]
    torch.library.opcheck(ops.attention_bwd, args)
    # inputs seen through a transpose: the gradients come in their layout (the fake kernel's too)
    qkv = rand(2, 5, 3, 4, 6)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    out, lse = ops.attention_fwd(q, k, v, None, 0.5, 1, -1, -1, 0.0, None, None, 0.0, None)
    args = [torch.randn_like(out), None, q, k, v, None, out, lse, 0.5, 1, -1, -1, 0.0, None, None, 0.0, None, False]
    args = [a.clone().requires_grad_(requires_grad) if isinstance(a, torch.Tensor) else a for a in args]
    torch.library.opcheck(ops.attention_bwd, args)


def test_opcheck_probs_and_dropout_mask():
    q, k = rand(2, 5, 4, requires_grad=True), rand(2, 7, 4)
    torch.library.opcheck(ops.attention_probs, (q, k, None, 0.5, 2, -1, -1, 0.0, None, None))
    torch.library.opcheck(ops.attention_probs, (q, k, None, 0.5, 0, 1, 1, 5.0, torch.rand(1),
                                                rand(2, requires_grad=True)))
    torch.library.opcheck(ops.dropout_keep_mask, (draw_rng_state("cpu"), [2, 3], 5, 7, 0.5))


def test_torch_compile_fullgraph_forward_and_backward():
    torch._dynamo.reset()

    def layer(q, k, v, bias):
        return attention_ext.scaled_dot_product_attention(q, k, v, attn_mask=bias).relu().sum()

    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    q, k, v = (rand(2, 2, 9, 8, dtype=torch.float32, requires_grad=True) for _ in range(3))
    bias = rand(2, 9, 9, dtype=torch.float32, requires_grad=True)
    loss = compiled(q, k, v, bias)
    loss.backward()
    grads = [t.grad.clone() for t in (q, k, v, bias)]
    for t in (q, k, v, bias):
        t.grad = None
    layer(q, k, v, bias).backward()
    assert torch.allclose(loss, layer(q, k, v, bias))
    for g, t in zip(grads, (q, k, v, bias)):
        assert torch.allclose(g, t.grad, atol=1e-6)


@pytest.mark.parametrize("kwargs", [dict(is_causal=True), dict(enable_gqa=True), dict(dropout_p=0.3)], ids=str)
def test_torch_compile_variants(kwargs):
    torch._dynamo.reset()
    f = lambda q, k, v: attention_ext.scaled_dot_product_attention(q, k, v, **kwargs)  # noqa: E731
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    q = rand(1, 4, 6, 8, dtype=torch.float32, requires_grad=True)
    k = rand(1, 2, 6, 8, dtype=torch.float32, requires_grad=True)
    v = rand(1, 2, 6, 8, dtype=torch.float32, requires_grad=True)
    if not kwargs.get("enable_gqa"):
        k, v = (rand(1, 4, 6, 8, dtype=torch.float32, requires_grad=True) for _ in range(2))
    p = kwargs.get("dropout_p", 0.0)
    # The aot_eager graph draws the dropout state from torch's generator as eager code does, so
    # after the same seed the call's keep mask is the one draw_rng_state + dropout_mask give.
    torch.manual_seed(3)
    keep = dropout_mask(draw_rng_state("cpu"), (1, 4, 6, 6), p) if p > 0 else None
    torch.manual_seed(3)
    out = compiled(q, k, v)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)

    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = attention_reference(*leaves, causal="top_left" if kwargs.get("is_causal") else None,
                              enable_gqa=kwargs.get("enable_gqa", False), dropout_mask=keep, dropout_p=p)[0]
    ref_grads = torch.autograd.grad(ref, leaves, grad_out.double())
    assert (out.double() - ref).abs().max().item() <= 2e-6
    for name, g, r in zip("qkv", grads, ref_grads):
        assert g.shape == r.shape
        err = (g.double() - r).abs().max().item()
        assert err <= 1e-5, f"d{name}: max abs error {err:.3e} vs the reference with the drawn mask"


@pytest.mark.parametrize("call", ["sdpa", "sdpa_scale_dropout", "attention_softcap", "flash_scale_softcap",
                                  "weights_scale", "varlen_scale_softcap"])
def test_torch_compile_dynamic_fullgraph_with_float_arguments(call):
    """torch.compile(dynamic=True, fullgraph=True) with float arguments (scale, softcap, dropout_p):
    the checks on them trace (guards, no math.isfinite), so the call compiles, forward and backward,
    and gives eager mode's bits at two shapes and two sets of values. The sizes stay symbols (a
    new shape does not compile again); a float reaches the op as a constant, so each set of values
    compiles once (as README says: at most one graph per set). A bad value still raises with the
    eager call's message (fullgraph wraps it in Dynamo's Unsupported: an exception while tracing is
    a graph break)."""
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    calls = {
        "sdpa": lambda q, s, c: attention_ext.scaled_dot_product_attention(q, q, q, is_causal=True),
        "sdpa_scale_dropout": lambda q, s, c: attention_ext.scaled_dot_product_attention(q, q, q, scale=s,
                                                                                         dropout_p=0.0),
        "attention_softcap": lambda q, s, c: attention_ext.attention(q, q, q, softcap=c, causal="bottom_right"),
        "flash_scale_softcap": lambda q, s, c: attention_ext.flash_attn_func(q, q, q, softmax_scale=s, softcap=c),
        "weights_scale": lambda q, s, c: attention_ext.attention_weights(q, q, scale=s),
        "varlen_scale_softcap": lambda q, s, c: attention_ext.flash_attn_varlen_func(
            q[0, 0], q[0, 0], q[0, 0], cu, cu, 3, 3, softmax_scale=s, softcap=c),
    }
    torch._dynamo.reset()
    fn = calls[call]
    graphs = CompileCounter()
    compiled = torch.compile(fn, backend=graphs, dynamic=True, fullgraph=True)
    for n in (5, 7):
        q = rand(1, 2, n, 8, dtype=torch.float32, requires_grad=True)
        if call == "varlen_scale_softcap":
            q = rand(1, 1, 5, 2, 8, dtype=torch.float32, requires_grad=True)
        for s, c in ((0.3, 2.0), (0.45, 3.5)):
            got = compiled(q, s, c)
            (grad,) = torch.autograd.grad(got.square().sum(), q)
            want = fn(q, s, c)
            assert torch.equal(got, want), (call, n, s, c)
            assert torch.equal(grad, torch.autograd.grad(want.square().sum(), q)[0])
    assert 1 <= graphs.frame_count <= 2, graphs.frame_count  # two sets of values, two shapes
    if call in ("attention_softcap", "flash_scale_softcap", "varlen_scale_softcap"):
        with pytest.raises(Exception, match="softcap must be a finite number"):
            compiled(q, 0.3, float("inf"))


def test_a_compiled_model_layer_with_dynamic_shapes_equals_the_eager_one():
    """A layer as models write it (projections viewed as heads through a transpose, GQA, the output
    reshaped back), compiled with dynamic shapes: the fake kernels' layout rules (out and the
    gradients in the inputs' order of dims) hold for symbolic sizes, and the results are the
    eager ones, bit for bit, at every length."""
    def layer(x, kv):
        batch, n, _ = x.shape
        q = x.view(batch, n, 4, 8).transpose(1, 2)
        k, v = (kv[..., i * 16:(i + 1) * 16].reshape(batch, kv.shape[1], 2, 8).transpose(1, 2) for i in range(2))
        out = attention_ext.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return out.transpose(1, 2).reshape(batch, n, 32)

    torch._dynamo.reset()
    compiled = torch.compile(layer, backend="aot_eager", dynamic=True, fullgraph=True)
    for n in (9, 17, 70):
        x, kv = rand(2, n, 32, requires_grad=True), rand(2, n, 32, requires_grad=True)
        ours, eager = compiled(x, kv), layer(x, kv)
        assert torch.equal(ours, eager)
        for a, b in zip(torch.autograd.grad(ours.sum(), (x, kv)), torch.autograd.grad(eager.sum(), (x, kv))):
            assert torch.equal(a, b)


def test_a_compiled_kv_cache_call_checks_scale_and_softcap_before_it_appends():
    """flash_attn_with_kvcache checks every rule before it writes the cache, compiled as well: a
    bad softcap or scale raises the eager call's ValueError and the cache is left as it was."""
    def step(q, k_cache, v_cache, k, v, scale, softcap):
        return attention_ext.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=2,
                                                     softmax_scale=scale, softcap=softcap)

    torch._dynamo.reset()
    compiled = torch.compile(step, backend="eager", dynamic=True)
    q, k, v = (torch.randn(1, 1, 1, 4) for _ in range(3))
    k_cache, v_cache = torch.zeros(1, 8, 1, 4), torch.zeros(1, 8, 1, 4)
    assert torch.equal(compiled(q, k_cache.clone(), v_cache.clone(), k, v, 0.5, 2.0),
                       step(q, k_cache.clone(), v_cache.clone(), k, v, 0.5, 2.0))
    for scale, softcap, message in ((0.5, float("nan"), "softcap must be a finite number"),
                                    (float("inf"), 0.0, "scale must be finite")):
        with pytest.raises(ValueError, match=message):
            compiled(q, k_cache, v_cache, k, v, scale, softcap)
        assert not k_cache.any() and not v_cache.any()


def _refused_op_calls(device):
    """Direct op calls the CPU kernels refuse, with a phrase of the refusal (op_arguments.cpp)."""
    def t(*shape):
        return torch.randn(*shape, device=device)

    q, k, v = t(1, 2, 4, 8), t(1, 2, 5, 8), t(1, 2, 5, 8)
    fwd = ops.attention_fwd
    rest = (0, -1, -1, 0.0, None, None, 0.0, None)
    return {
        "mask_shape": (lambda: fwd(q, k, v, t(3, 5), 0.3, *rest), "does not broadcast to the attention weights"),
        "qk_batch": (lambda: fwd(t(2, 3, 4, 8), t(3, 2, 5, 8), t(3, 2, 5, 8), None, 0.3, *rest),
                     "batch dims of query"),
        "kv_batch": (lambda: fwd(t(2, 4, 8), t(1, 5, 8), t(2, 5, 8), None, 0.3, *rest),
                     "key and value must have the same batch dims"),
        "nine_batch_dims": (lambda: fwd(t(*(1,) * 9, 4, 8), t(5, 8), t(5, 8), None, 0.3, *rest),
                            "at most 8 batch dims"),
        "nan_scale": (lambda: fwd(q, k, v, None, float("nan"), *rest), "scale must be a finite number"),
        "bwd_grad_out": (lambda: ops.attention_bwd(t(7, 7), None, q, k, v, None, t(1, 2, 4, 8), t(1, 2, 4), 0.3,
                                                   *rest, False, False), "grad_out must have shape"),
        "bwd_lse": (lambda: ops.attention_bwd(t(1, 2, 4, 8), None, q, k, v, None, t(1, 2, 4, 8), t(2, 2), 0.3,
                                              *rest, False, False), "lse must have shape"),
    }


@pytest.mark.parametrize("case", list(_refused_op_calls("cpu")))
def test_fake_kernels_refuse_what_the_cpu_kernels_refuse(case):
    """On meta tensors (and so under torch.compile and torch.export) an op call the kernels would
    refuse raises too, with the same words, instead of returning tensors of a wrong shape."""
    for device in ("cpu", "meta"):
        call, phrase = _refused_op_calls(device)[case]
        with pytest.raises(RuntimeError, match=phrase):
            call()


def _decode_step(q, k_cache, v_cache, k, v, cache_seqlens, cache_leftpad=None, block_table=None, cache_batch_idx=None,
                 rotary=None):
    cos, sin = rotary if rotary is not None else (None, None)
    return attention_ext.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos=cos, rotary_sin=sin,
                                                 cache_seqlens=cache_seqlens, cache_leftpad=cache_leftpad,
                                                 block_table=block_table, cache_batch_idx=cache_batch_idx,
                                                 causal=True, rotary_interleaved=False, return_softmax_lse=True)


def _decode_setup(layout, generator):
    """Caches, per-entry tensors and rotary tables for a 3-entry decode (2 KV heads, 4 query heads)."""
    batch, slots, d = 3, 24, 8
    lengths = torch.tensor([3, 0, 9], dtype=torch.int32)
    extra = {}
    if layout == "paged":
        block, per_entry = 4, 6
        table = torch.randperm(batch * per_entry, generator=generator).view(batch, per_entry).to(torch.int32)
        k_cache = torch.randn(batch * per_entry, block, 2, d, generator=generator)
        extra["block_table"] = table
    elif layout == "batch_idx":
        k_cache = torch.randn(batch + 2, slots, 2, d, generator=generator)
        extra["cache_batch_idx"] = torch.tensor([4, 0, 2], dtype=torch.int32)
    else:
        k_cache = torch.randn(batch, slots, 2, d, generator=generator)
        extra["cache_leftpad"] = torch.tensor([1, 0, 4], dtype=torch.int32)
        angles = torch.arange(slots, dtype=torch.float64)[:, None] / 100 ** (torch.arange(0, d, 2) / d)
        extra["rotary"] = (angles.cos().float(), angles.sin().float())
    return k_cache, torch.randn(k_cache.shape, generator=generator), lengths, extra


@pytest.mark.parametrize("backend, layout", [("aot_eager", "contiguous_rotary_leftpad"), ("aot_eager", "paged"),
                                             ("aot_eager", "batch_idx"), ("inductor", "contiguous_rotary_leftpad")])
def test_a_decode_loop_compiled_whole_with_per_entry_tensors_matches_eager(backend, layout):
    """flash_attn_with_kvcache traces as one graph (fullgraph=True) with cache_seqlens, cache_leftpad,
    cache_batch_idx and block_table as tensors, whose values the checks read only when the graph
    runs: every step's output, lse and both caches are bitwise the eager call's."""
    g = torch.Generator().manual_seed(7)
    k_cache, v_cache, lengths, extra = _decode_setup(layout, g)
    eager_k, eager_v = k_cache.clone(), v_cache.clone()
    torch._dynamo.reset()
    compiled = torch.compile(_decode_step, backend=backend, fullgraph=True)
    with torch.no_grad():
        for step in range(4):
            q = torch.randn(3, 1, 4, 8, generator=g)
            k, v = (torch.randn(3, 1, 2, 8, generator=g) for _ in range(2))
            got = compiled(q, k_cache, v_cache, k, v, lengths, **extra)
            want = _decode_step(q, eager_k, eager_v, k, v, lengths, **extra)
            assert all(torch.equal(a, b) for a, b in zip(got, want)), step
            assert torch.equal(k_cache, eager_k) and torch.equal(v_cache, eager_v), step
            lengths = lengths + 1


@pytest.mark.parametrize("dynamic", [False, True])
def test_a_compiled_call_with_batch_dims_that_do_not_broadcast_raises_the_eager_message(dynamic):
    q, kv = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 6, 8)  # GQA shapes without enable_gqa=True
    f = lambda q, k, v: attention_ext.scaled_dot_product_attention(q, k, v)  # noqa: E731
    message = r"the batch dims of query \(2, 4, 5, 8\), key \(2, 2, 6, 8\) .* pass enable_gqa=True"
    with pytest.raises(ValueError, match=message):
        f(q, kv, kv)
    torch._dynamo.reset()
    with pytest.raises(ValueError, match=message):
        torch.compile(f, backend="eager", dynamic=dynamic)(q, kv, kv)


@pytest.mark.parametrize("entries", ["cache_seqlens", "cache_batch_idx"])
def test_a_compiled_decode_step_keeps_batch_cache_and_query_sizes_symbolic(entries):
    """Continuous batching under torch.compile(dynamic=True, fullgraph=True): ten steps of other
    batch sizes, cache capacities and query rows, with cache_seqlens a tensor, or an int beside a
    cache_batch_idx tensor (the checks then run in an op of the graph), run on a few graphs: the
    sizes reach that op as symbols, not constants (one graph per size would pass the recompile
    limit of 8 and fail). Eager's bits and caches."""
    def step(q, k_cache, v_cache, k, v, lengths):
        if entries == "cache_seqlens":
            return attention_ext.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths,
                                                         causal=True)
        rows = torch.arange(q.shape[0], dtype=torch.int32).flip(0)
        return attention_ext.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=3, causal=True,
                                                     cache_batch_idx=rows)

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(step, backend="eager", fullgraph=True, dynamic=True)
    g = torch.Generator().manual_seed(0)
    for batch, capacity, rows in [(2, 16, 1), (3, 20, 1), (5, 24, 2), (7, 40, 1), (4, 33, 3), (9, 64, 1), (6, 17, 1),
                                  (8, 50, 2), (10, 30, 1), (11, 70, 1)]:
        k_cache, v_cache = (torch.randn(batch, capacity, 2, 8, generator=g) for _ in range(2))
        q = torch.randn(batch, rows, 4, 8, generator=g)
        k, v = (torch.randn(batch, 1, 2, 8, generator=g) for _ in range(2))
        lengths = torch.randint(0, capacity - 1, (batch,), dtype=torch.int32, generator=g)
        eager_k, eager_v = k_cache.clone(), v_cache.clone()
        assert torch.equal(compiled(q, k_cache, v_cache, k, v, lengths), step(q, eager_k, eager_v, k, v, lengths))
        assert torch.equal(k_cache, eager_k) and torch.equal(v_cache, eager_v)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 4


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("bad, message", [("overflow", "overflows the cache's 24 positions"),
                                          ("leftpad", r"cache_leftpad\[2\] = 11 must be in \[0, 10\]"),
                                          ("rotary", "beyond the rotary tables' 8 positions")])
def test_a_compiled_decode_step_refuses_bad_entries_before_it_writes(backend, bad, message):
    """Compiled whole, the per-entry checks run when the graph runs and still come before the
    cache is written (the writes take their positions from the checks' result): the eager call's
    ValueError, the caches untouched."""
    g = torch.Generator().manual_seed(8)
    k_cache, v_cache, lengths, extra = _decode_setup("contiguous_rotary_leftpad", g)
    if bad == "overflow":
        lengths = torch.tensor([3, 0, 24], dtype=torch.int32)
    elif bad == "leftpad":
        extra["cache_leftpad"] = torch.tensor([1, 0, 11], dtype=torch.int32)
    else:
        extra["rotary"] = tuple(t[:8] for t in extra["rotary"])
    before = k_cache.clone(), v_cache.clone()
    torch._dynamo.reset()
    compiled = torch.compile(_decode_step, backend=backend, fullgraph=True)
    q = torch.randn(3, 1, 4, 8, generator=g)
    k, v = (torch.randn(3, 1, 2, 8, generator=g) for _ in range(2))
    with torch.no_grad():
        with pytest.raises(ValueError, match=message):
            _decode_step(q, k_cache, v_cache, k, v, lengths, **extra)
        with pytest.raises(ValueError, match=message):
            compiled(q, k_cache, v_cache, k, v, lengths, **extra)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


def test_torch_compile_inductor():
    torch._dynamo.reset()
    f = torch.compile(lambda q, k, v: attention_ext.scaled_dot_product_attention(q, k, v, is_causal=True) * 2,
                      fullgraph=True)
    q, k, v = (rand(2, 3, 16, 8, dtype=torch.float32) for _ in range(3))
    assert torch.allclose(f(q, k, v), attention_ext.scaled_dot_product_attention(q, k, v, is_causal=True) * 2)


def test_torch_export():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(8, 24)

        def forward(self, x):
            q, k, v = self.proj(x).unflatten(-1, (3, 2, 4)).unbind(-3)
            return attention_ext.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                              is_causal=True)

    model = Block()
    x = torch.randn(2, 5, 8)
    exported = torch.export.export(model, (x,))
    assert torch.allclose(exported.module()(x), model(x))
    assert "attention_ext.attention_fwd" in str(exported.graph)


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
@pytest.mark.parametrize("call", ["sdpa", "varlen"])
def test_torch_jit_trace_records_the_op_and_the_module_saves(grad, call):
    """torch.jit.trace (with grad on, the default, and under no_grad) records the op itself, not
    the autograd Function (a Python call TorchScript cannot save): the trace check passes, the
    module saves and loads, and the loaded module gives eager mode's output and gradients."""
    import io

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(8, 24)

        def forward(self, x):
            q, k, v = self.proj(x).unflatten(-1, (3, 2, 4)).unbind(-3)  # (batch, n, heads, d)
            if call == "varlen":
                cu = torch.tensor([0, 2, x.shape[0] * x.shape[1]], dtype=torch.int32)
                flat = [t.flatten(0, 1) for t in (q, k, v)]
                return attention_ext.flash_attn_varlen_func(*flat, cu, cu, 10, 10, causal=True)
            return attention_ext.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                              is_causal=True)

    torch.manual_seed(0)
    model = Block()
    x = torch.randn(2, 5, 8)
    with torch.set_grad_enabled(grad):
        traced = torch.jit.trace(model, x)
    buffer = io.BytesIO()
    torch.jit.save(traced, buffer)
    buffer.seek(0)
    loaded = torch.jit.load(buffer)
    assert "attention_ext" in str(loaded.graph)
    got, want = loaded(x), model(x)
    assert torch.equal(got, want)
    got_grads = torch.autograd.grad(got.square().sum(), list(loaded.parameters()))
    want_grads = torch.autograd.grad(want.square().sum(), list(model.parameters()))
    for g, w in zip(got_grads, want_grads):
        assert torch.equal(g, w)


def test_meta_tensors_give_shapes_without_computing():
    q = torch.empty(2, 4, 5, 8, device="meta")
    k = torch.empty(2, 2, 7, 8, device="meta")
    v = torch.empty(2, 2, 7, 3, device="meta")
    out, lse = attention_ext.attention(q, k, v, enable_gqa=True, return_lse=True)
    assert out.shape == (2, 4, 5, 3) and out.device.type == "meta" and lse.shape == (2, 4, 5)


def test_the_check_command_runs_and_refuses_a_device_it_cannot_check(capsys):
    """`python -m attention_ext check`: a passing matrix exits 0; a device this build or machine
    cannot run is an error, not "0 passed, 0 failed"."""
    from attention_ext.__main__ import main
    assert main(["check", "--quick", "--device", "cpu", "--dtype", "float64"]) == 0
    assert " 0 failed" in capsys.readouterr().out
    if attention_ext.build_info()["cuda"] == "1" and torch.cuda.is_available():
        pytest.skip("this build and machine can check CUDA")
    with pytest.raises(SystemExit, match=r"--device cuda cannot be checked"):
        main(["check", "--device", "cuda"])

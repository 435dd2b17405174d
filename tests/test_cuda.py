"""CUDA kernels: against the float64 reference, against the CPU kernels, gradcheck, masks, causal
kinds, GQA, dropout (the same Philox mask on both devices), fully masked rows, determinism.

Skipped when no CUDA device is available. On a CUDA machine a build without CUDA kernels fails
(test_build_has_cuda_kernels) instead of silently skipping.
"""
import math

import pytest
import torch

import attention_ext
from attention_ext.function import AttentionFunction
from attention_ext.reference import attention_reference

from conftest import ATOL, rand

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

ops = torch.ops.attention_ext
DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
# Gradient tolerances relative to max(1, |reference|max); low precision also gets k x plain torch's error.
GRAD_TOL = {torch.float64: 1e-9, torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}
CUDA = "cuda"


def _err(a, b):
    if a.numel() == 0:
        return 0.0
    return (a.detach().double().cpu() - b.detach().double().cpu()).abs().max().item()


def _budget(fn_lp, ref):
    """Error of plain torch computing the reference formula in low precision."""
    return max(_err(x, r) for x, r in zip(fn_lp, ref))


def _check(actual, expected, dtype, budget=None, k=2.0, what="", base=ATOL):
    tol = base[dtype] * max(1.0, expected.detach().abs().max().item() if expected.numel() else 1.0)
    if budget is not None and dtype in (torch.float16, torch.bfloat16):
        tol = max(tol, k * budget)
    err = _err(actual, expected)
    assert not torch.isnan(actual.detach().double()).any(), f"{what}: NaN"
    assert err <= tol, f"{what}: max abs error {err:.3e} > {tol:.3e} ({dtype})"


def _inputs(qb, kb, n, m, dk, dv, dtype, grad=False, device=CUDA, gen_seed=0):
    torch.manual_seed(gen_seed)
    q = rand(*qb, n, dk, dtype=dtype, device=device, requires_grad=grad)
    k = rand(*kb, m, dk, dtype=dtype, device=device, requires_grad=grad)
    v = rand(*kb, m, dv, dtype=dtype, device=device, requires_grad=grad)
    return q, k, v


def _leaf64(t):
    return t.detach().double().cpu().requires_grad_(t.requires_grad)


def _compare_fwd_bwd(q, k, v, dtype, mask=None, causal=None, enable_gqa=False, check_mask_grad=False):
    """Runs the CUDA kernels and the float64 reference (on CPU) and compares out, lse and grads."""
    out, lse = attention_ext.attention(q, k, v, attn_mask=mask, causal=causal, enable_gqa=enable_gqa,
                                       return_lse=True)
    q64, k64, v64 = (_leaf64(t) for t in (q, k, v))
    mask64 = None
    if mask is not None:
        mask64 = mask.detach().cpu()
        if mask.dtype != torch.bool:
            # In float64 the dtype's lowest finite value is an ordinary number: make it -inf so
            # the reference keeps the "masked out" meaning it has in the mask's own dtype.
            lowest = mask64 <= torch.finfo(mask.dtype).min
            mask64 = mask64.double().masked_fill(lowest, float("-inf")).requires_grad_(mask.requires_grad)
    ref, ref_lse, _ = attention_reference(q64, k64, v64, mask64, causal=causal, enable_gqa=enable_gqa)
    budget = None
    if dtype in (torch.float16, torch.bfloat16):
        lp = attention_reference(q.detach(), k.detach(), v.detach(),
                                 None if mask is None else mask.detach(), causal=causal,
                                 enable_gqa=enable_gqa, dtype=None)[0]
        budget = _err(lp, ref)
    assert out.dtype == dtype and out.device.type == "cuda"
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    _check(out, ref, dtype, budget, what="out")
    assert torch.equal(torch.isneginf(lse).cpu(), torch.isneginf(ref_lse))
    finite = torch.isfinite(ref_lse)
    if finite.any():
        assert (lse.detach().double().cpu()[finite] - ref_lse[finite]).abs().max().item() <= max(ATOL[dtype], 1e-5) * 10

    if not q.requires_grad:
        return
    g = torch.randn_like(out, dtype=torch.float64).to(dtype)
    out.backward(g)
    ref.backward(g.double().cpu())
    gbudget = None
    if dtype in (torch.float16, torch.bfloat16):
        ql, kl, vl = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
        lp = attention_reference(ql, kl, vl, None if mask is None else mask.detach(), causal=causal,
                                 enable_gqa=enable_gqa, dtype=None)[0]
        lp.backward(g)
        gbudget = _budget([ql.grad, kl.grad, vl.grad], [q64.grad, k64.grad, v64.grad])
    for name, a, r in (("dq", q.grad, q64.grad), ("dk", k.grad, k64.grad), ("dv", v.grad, v64.grad)):
        assert a.shape == r.shape, name
        _check(a, r, dtype, gbudget, k=4.0, what=name, base=GRAD_TOL)
    if check_mask_grad:
        _check(mask.grad, mask64.grad, dtype, gbudget, k=4.0, what="dmask", base=GRAD_TOL)


def test_build_has_cuda_kernels():
    assert torch._C._dispatch_has_kernel_for_dispatch_key("attention_ext::attention_fwd", "CUDA"), \
        "CUDA is available but attention_ext was built without CUDA kernels (rebuild with FORCE_CUDA=1)"


SHAPES = [
    # (q batch, kv batch, n, m, dk, dv)
    ((), (), 3, 3, 2, 2),
    ((1,), (1,), 1, 1, 1, 1),
    ((2, 3), (2, 3), 17, 33, 5, 7),
    ((2, 3), (2, 3), 64, 64, 64, 64),
    ((2, 2), (2, 2), 128, 128, 128, 128),
    ((1, 2), (1, 2), 130, 257, 64, 32),
    ((2,), (2,), 65, 1, 16, 16),
    ((1, 2), (1, 2), 113, 127, 257, 3),
    ((1, 1), (1, 1), 5, 9, 512, 512),
    ((2, 1, 3), (1, 4, 1), 9, 11, 8, 8),
    ((2, 2, 2, 2), (2, 2, 2, 2), 6, 5, 4, 3),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
def test_matches_reference(shape, dtype, causal):
    q, k, v = _inputs(*shape, dtype, grad=True)
    _compare_fwd_bwd(q, k, v, dtype, causal=causal)


MASK_SHAPES = [(64, 80), (1, 80), (64, 1), (3, 1, 64, 80), (1, 4, 1, 80), (80,), ()]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mask_shape", MASK_SHAPES, ids=str)
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_masks(dtype, mask_shape, kind):
    q, k, v = _inputs((3, 4), (3, 4), 64, 80, 32, 24, dtype, grad=True)
    torch.manual_seed(1)
    if kind == "bool":
        mask = torch.rand(mask_shape, device=CUDA) > 0.3
        _compare_fwd_bwd(q, k, v, dtype, mask=mask)
    else:
        mask = torch.randn(mask_shape, dtype=torch.float64, device=CUDA)
        # HF-style "masked out" entries: the dtype's lowest finite value and -inf.
        if mask.dim() > 0 and mask.numel() > 2:
            flat = mask.view(-1)
            flat[0] = torch.finfo(dtype).min
            flat[1] = float("-inf")
        mask = mask.to(dtype).requires_grad_(True)
        _compare_fwd_bwd(q, k, v, dtype, mask=mask, check_mask_grad=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", ["top_left", "bottom_right"])
@pytest.mark.parametrize("nm", [(50, 120), (120, 50), (64, 64), (1, 200), (200, 1)], ids=str)
def test_causal_kinds(dtype, causal, nm):
    n, m = nm
    q, k, v = _inputs((2,), (2,), n, m, 64, 64, dtype, grad=True)
    _compare_fwd_bwd(q, k, v, dtype, causal=causal)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", [(8, 2), (6, 3), (4, 1), (4, 4)], ids=str)
def test_gqa(dtype, heads):
    hq, hk = heads
    torch.manual_seed(0)
    q = rand(2, hq, 70, 64, dtype=dtype, device=CUDA, requires_grad=True)
    k = rand(2, hk, 90, 64, dtype=dtype, device=CUDA, requires_grad=True)
    v = rand(2, hk, 90, 64, dtype=dtype, device=CUDA, requires_grad=True)
    out = attention_ext.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    q64, k64, v64 = (_leaf64(t) for t in (q, k, v))
    ref = attention_reference(q64, k64, v64, enable_gqa=True)[0]
    budget = None
    if dtype in (torch.float16, torch.bfloat16):
        budget = _err(attention_reference(q.detach(), k.detach(), v.detach(), enable_gqa=True, dtype=None)[0], ref)
    _check(out, ref, dtype, budget, what="out")
    g = torch.randn_like(out)
    out.backward(g)
    ref.backward(g.double().cpu())
    tol_budget = None if budget is None else 8 * budget
    for name, a, r in (("dq", q.grad, q64.grad), ("dk", k.grad, k64.grad), ("dv", v.grad, v64.grad)):
        _check(a, r, dtype, tol_budget, k=4.0, what=name, base=GRAD_TOL)


def test_gradcheck_float64():
    torch.manual_seed(0)
    q = rand(2, 7, 5, dtype=torch.float64, device=CUDA, requires_grad=True)
    k = rand(2, 9, 5, dtype=torch.float64, device=CUDA, requires_grad=True)
    v = rand(2, 9, 3, dtype=torch.float64, device=CUDA, requires_grad=True)
    mask = rand(7, 9, dtype=torch.float64, device=CUDA, requires_grad=True)
    for causal in (None, "top_left", "bottom_right"):
        m = None if causal else mask
        assert torch.autograd.gradcheck(
            lambda q, k, v, *mm: attention_ext.attention(q, k, v, attn_mask=mm[0] if mm else None,
                                                          causal=causal, return_lse=True),
            (q, k, v) + ((m,) if m is not None else ()))


def test_gradcheck_float64_dropout_fixed_rng():
    torch.manual_seed(0)
    q = rand(2, 6, 4, dtype=torch.float64, device=CUDA, requires_grad=True)
    k = rand(2, 10, 4, dtype=torch.float64, device=CUDA, requires_grad=True)
    v = rand(2, 10, 3, dtype=torch.float64, device=CUDA, requires_grad=True)
    rng = torch.tensor([1234, 5], dtype=torch.int64, device=CUDA)
    assert torch.autograd.gradcheck(
        lambda q, k, v: AttentionFunction.apply(q, k, v, None, 0.5, 0, 0.3, rng), (q, k, v))


@pytest.mark.parametrize("p", [0.0, 0.1, 0.5, 0.9])
@pytest.mark.parametrize("shape", [((2, 3), 17, 33), ((), 64, 64), ((1,), 5, 130)], ids=str)
def test_dropout_mask_same_on_cpu_and_gpu(p, shape):
    batch, n, m = shape
    rng = attention_ext.draw_rng_state()
    cpu = attention_ext.dropout_mask(rng, (*batch, n, m), p)
    gpu = ops.dropout_keep_mask(rng.cuda(), list(batch), n, m, p)
    assert gpu.device.type == "cuda" and gpu.dtype == torch.bool and gpu.shape == cpu.shape
    assert torch.equal(cpu, gpu.cpu())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dropout_forward_backward_matches_cpu_and_reference(dtype):
    q, k, v = _inputs((2, 2), (2, 2), 40, 70, 24, 16, dtype)
    rng = torch.tensor([987654321, 42], dtype=torch.int64)
    p = 0.25
    scale = 1.0 / math.sqrt(24)
    res = {}
    for dev in ("cpu", CUDA):
        qd, kd, vd = (t.detach().to(dev).requires_grad_(True) for t in (q, k, v))
        out, lse = AttentionFunction.apply(qd, kd, vd, None, scale, 0, p, rng.to(dev))
        out.backward(torch.ones_like(out))
        res[dev] = (out, lse, qd.grad, kd.grad, vd.grad)
    tol = {torch.float64: 1e-12, torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    for a, b in zip(res["cpu"], res[CUDA]):
        assert _err(b, a) <= tol * max(1.0, a.detach().abs().max().item())
    keep = attention_ext.dropout_mask(rng, (2, 2, 40, 70), p)
    ref = attention_reference(q.cpu(), k.cpu(), v.cpu(), scale=scale, dropout_mask=keep, dropout_p=p)[0]
    _check(res[CUDA][0], ref, dtype, budget=None if dtype in (torch.float64, torch.float32) else 1e-2,
           what="dropout out")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cpu_gpu_agree(dtype):
    torch.manual_seed(3)
    shape = ((2, 4), (2, 4), 150, 170, 64, 64)
    q, k, v = _inputs(*shape, dtype, device="cpu")
    mask = torch.randn(1, 4, 150, 170, dtype=dtype)
    res = {}
    for dev in ("cpu", CUDA):
        qd, kd, vd, md = (t.detach().to(dev).requires_grad_(True) for t in (q, k, v, mask))
        out, lse = attention_ext.attention(qd, kd, vd, attn_mask=md, return_lse=True)
        (out.float().square().sum() + lse.sum()).backward()
        res[dev] = (out, lse, qd.grad, kd.grad, vd.grad, md.grad)
    tol = {torch.float64: 1e-11, torch.float32: 5e-5, torch.float16: 1e-2, torch.bfloat16: 8e-2}[dtype]
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv", "dmask"), res["cpu"], res[CUDA]):
        assert _err(b, a) <= tol * max(1.0, a.detach().abs().max().item()), name


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fully_masked_rows(dtype):
    q, k, v = _inputs((2,), (2,), 20, 30, 16, 8, dtype, grad=True)
    mask = torch.ones(20, 30, dtype=torch.bool, device=CUDA)
    mask[3] = False
    mask[17] = False
    out, lse = attention_ext.attention(q, k, v, attn_mask=mask, return_lse=True)
    assert torch.all(out[:, 3] == 0) and torch.all(out[:, 17] == 0)
    assert torch.all(torch.isneginf(lse[:, 3])) and torch.all(torch.isneginf(lse[:, 17]))
    assert torch.isfinite(out).all()
    (out.float().sum() + lse[torch.isfinite(lse)].sum()).backward()
    assert torch.all(q.grad[:, 3] == 0) and torch.all(q.grad[:, 17] == 0)
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    # bottom-right causal with more queries than keys: the first n - m rows see nothing
    q2, k2, v2 = _inputs((), (), 50, 20, 16, 8, dtype, grad=True)
    out2, lse2 = attention_ext.attention(q2, k2, v2, causal="bottom_right", return_lse=True)
    assert torch.all(out2[:30] == 0) and torch.all(torch.isneginf(lse2[:30]))
    out2.float().sum().backward()
    assert torch.all(q2.grad[:30] == 0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_deterministic(dtype):
    torch.manual_seed(0)
    q = rand(2, 8, 200, 64, dtype=dtype, device=CUDA)
    k = rand(2, 2, 300, 64, dtype=dtype, device=CUDA)
    v = rand(2, 2, 300, 64, dtype=dtype, device=CUDA)
    mask = rand(1, 1, 200, 300, dtype=dtype, device=CUDA)
    g = rand(2, 8, 200, 64, dtype=dtype, device=CUDA)
    runs = []
    for _ in range(2):
        leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v, mask)]
        torch.manual_seed(7)
        out = attention_ext.scaled_dot_product_attention(leaves[0], leaves[1], leaves[2],
                                                         attn_mask=leaves[3], dropout_p=0.1, enable_gqa=True)
        out.backward(g)
        runs.append([out] + [t.grad for t in leaves])
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_strided_and_expanded_inputs(dtype):
    torch.manual_seed(0)
    # (b, n, h, d) storage viewed as (b, h, n, d); K/V expanded over a batch dim (stride 0).
    q = rand(2, 33, 4, 40, dtype=dtype, device=CUDA).transpose(1, 2).requires_grad_(True)
    k = rand(1, 4, 47, 40, dtype=dtype, device=CUDA).expand(2, 4, 47, 40).detach().requires_grad_(True)
    v = rand(2, 47, 4, 20, dtype=dtype, device=CUDA).transpose(1, 2).requires_grad_(True)
    assert not q.is_contiguous()
    _compare_fwd_bwd(q, k, v, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [None, "bottom_right"])
def test_attention_weights(dtype, causal):
    q, k, _ = _inputs((2, 3), (2, 3), 45, 70, 32, 1, dtype)
    mask = None if causal else torch.rand(45, 70, device=CUDA) > 0.2
    w = attention_ext.attention_weights(q, k, attn_mask=mask, causal=causal)
    ref = attention_reference(q.cpu(), k.cpu(), k.cpu(), None if mask is None else mask.cpu(), causal=causal)[2]
    assert w.shape == ref.shape and w.dtype == dtype
    assert _err(w, ref) <= {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 2e-3,
                            torch.bfloat16: 1.6e-2}[dtype]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [None, "top_left"])
def test_long_sequences(dtype, d, causal):
    q, k, v = _inputs((1, 4), (1, 4), 1000, 1100, d, d, dtype, grad=True)
    _compare_fwd_bwd(q, k, v, dtype, causal=causal)


def test_empty_sizes():
    for n, m, dk, dv in ((0, 5, 4, 4), (5, 0, 4, 4), (5, 5, 0, 4), (5, 5, 4, 0)):
        q, k, v = _inputs((2,), (2,), n, m, dk, dv, torch.float32, grad=True)
        out, lse = attention_ext.attention(q, k, v, return_lse=True)
        ref, ref_lse, _ = attention_reference(q.cpu(), k.cpu(), v.cpu())
        assert out.shape == ref.shape and lse.shape == ref_lse.shape
        _check(out, ref, torch.float32, what="out")
        if out.numel():
            out.sum().backward()
            for t in (q, k, v):
                assert t.grad is None or torch.isfinite(t.grad).all()


def test_ops_validate_device():
    q = torch.randn(4, 8, device=CUDA)
    with pytest.raises(RuntimeError):
        ops.attention_fwd(q, torch.randn(4, 8), torch.randn(4, 8, device=CUDA), None, 1.0, 0, 0.0, None)
    with pytest.raises(RuntimeError):  # dropout needs rng_state on the inputs' device
        ops.attention_fwd(q, q, q, None, 1.0, 0, 0.5, torch.tensor([1, 2]))


def test_no_host_sync_with_dropout():
    """rng_state stays on the device: the forward with dropout can be captured in a CUDA graph."""
    q = torch.randn(2, 64, 32, device=CUDA)
    rng = torch.tensor([5, 6], dtype=torch.int64, device=CUDA)
    ops.attention_fwd(q, q, q, None, 0.1, 0, 0.2, rng)  # warm-up (allocations)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, _ = ops.attention_fwd(q, q, q, None, 0.1, 0, 0.2, rng)
    graph.replay()
    torch.cuda.synchronize()
    expected, _ = ops.attention_fwd(q, q, q, None, 0.1, 0, 0.2, rng)
    assert torch.equal(out, expected)

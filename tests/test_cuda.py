"""CUDA kernels: against the float64 reference, against the CPU kernels, gradcheck, masks, causal
kinds, GQA, dropout (the Philox mask of csrc/philox.h on every device), fully masked rows, determinism.

Runs on a CUDA device, and on CPU tensors in the CUDA emulation build (.ci/cuda_emulation.sh), whose
CUDA binding is registered for CPU tensors. There only what needs a GPU runtime (CUDA graphs, a
second device type) and the comparisons with the CPU kernels (not in that build) skip; the largest
shapes get smaller stand-ins (the emulation runs one host fiber per CUDA thread). Every test
records its op calls and checks that the CUDA binding served them (the cuda_kernels marker, see
conftest.py). Skipped with neither; on a CUDA machine a build without CUDA kernels fails
(test_build_has_cuda_kernels) instead of silently skipping.
"""
import math

import numpy as np
import pytest
import torch

import attention_ext
from attention_ext.function import AttentionFunction
from attention_ext.reference import attention_reference

from conftest import ATOL, CUDA_EMULATION, CUDA_KERNELS_DEVICE, OPS, kernel_source, rand, served_by_cuda_binding

DEVICE = CUDA_KERNELS_DEVICE
pytestmark = [pytest.mark.skipif(DEVICE is None, reason="needs a CUDA device or the CUDA emulation build"),
              pytest.mark.cuda_kernels]
# The emulation build has no CPU kernels: there "cpu" runs the CUDA kernels too.
needs_cpu_kernels = pytest.mark.skipif(
    CUDA_EMULATION, reason="compares with the CPU kernels, which the CUDA emulation build does not have")

ops = torch.ops.attention_ext
DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
# Gradient tolerances relative to max(1, |reference|max); low precision also gets k x plain torch's error.
GRAD_TOL = {torch.float64: 1e-9, torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}
# lse tolerances relative to max(1, |reference lse|max). lse is accumulated in float64 for float64
# inputs and in float32 otherwise, from the same (rounded) inputs the reference gets: its error is
# the accumulator's, not the storage type's.
LSE_TOL = {torch.float64: 1e-9, torch.float32: 2e-5, torch.float16: 2e-5, torch.bfloat16: 2e-5}


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


def _inputs(qb, kb, n, m, dk, dv, dtype, grad=False, device=DEVICE, gen_seed=0):
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
    assert out.dtype == dtype and out.device.type == DEVICE
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    _check(out, ref, dtype, budget, what="out")
    assert torch.equal(torch.isneginf(lse).cpu(), torch.isneginf(ref_lse))
    finite = torch.isfinite(ref_lse)
    if finite.any():
        _check(lse.detach().cpu()[finite], ref_lse[finite], dtype, what="lse", base=LSE_TOL)

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
    """Every op's kernel for the device's tensors is the CUDA binding: on a CUDA machine a build
    without CUDA kernels fails here; the emulation build registers that binding for CPU tensors."""
    key = {"cuda": "CUDA", "cpu": "CPU"}[DEVICE]
    for op in OPS:
        assert served_by_cuda_binding(op, key), (
            f"attention_ext::{op} for {DEVICE} tensors: {kernel_source(op, key) or 'no kernel'}, not the CUDA "
            "binding (on a CUDA machine rebuild with FORCE_CUDA=1)")
    out = attention_ext.attention(*_inputs((), (), 3, 4, 2, 2, torch.float32))
    assert out.device.type == DEVICE and torch.isfinite(out).all()


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
        mask = torch.rand(mask_shape, device=DEVICE) > 0.3
        _compare_fwd_bwd(q, k, v, dtype, mask=mask)
    else:
        mask = torch.randn(mask_shape, dtype=torch.float64, device=DEVICE)
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
    q = rand(2, hq, 70, 64, dtype=dtype, device=DEVICE, requires_grad=True)
    k = rand(2, hk, 90, 64, dtype=dtype, device=DEVICE, requires_grad=True)
    v = rand(2, hk, 90, 64, dtype=dtype, device=DEVICE, requires_grad=True)
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
    q = rand(2, 7, 5, dtype=torch.float64, device=DEVICE, requires_grad=True)
    k = rand(2, 9, 5, dtype=torch.float64, device=DEVICE, requires_grad=True)
    v = rand(2, 9, 3, dtype=torch.float64, device=DEVICE, requires_grad=True)
    mask = rand(7, 9, dtype=torch.float64, device=DEVICE, requires_grad=True)
    for causal in (None, "top_left", "bottom_right"):
        m = None if causal else mask
        assert torch.autograd.gradcheck(
            lambda q, k, v, *mm: attention_ext.attention(q, k, v, attn_mask=mm[0] if mm else None,
                                                          causal=causal, return_lse=True),
            (q, k, v) + ((m,) if m is not None else ()))


def test_gradcheck_float64_dropout_fixed_rng():
    torch.manual_seed(0)
    q = rand(2, 6, 4, dtype=torch.float64, device=DEVICE, requires_grad=True)
    k = rand(2, 10, 4, dtype=torch.float64, device=DEVICE, requires_grad=True)
    v = rand(2, 10, 3, dtype=torch.float64, device=DEVICE, requires_grad=True)
    rng = torch.tensor([1234, 5], dtype=torch.int64, device=DEVICE)
    assert torch.autograd.gradcheck(
        lambda q, k, v: AttentionFunction.apply(q, k, v, None, 0.5, 0, -1, -1, 0.0, None, None, 0.3, rng), (q, k, v))


def _philox_keep_mask(rng_state, batch_shape, n, m, p):
    """The keep mask csrc/philox.h specifies, computed here with numpy: weight (b, i, j) survives iff
    word j % 4 of Philox4x32-10 at counter (j // 4, i, b, offset) under the 64-bit key `seed` is
    >= floor(p * 2^32) (saturated to 2^32 - 1), where (seed, offset) = rng_state."""
    low32 = np.uint64(0xFFFFFFFF)
    seed, offset = (int(x) % 2 ** 64 for x in rng_state.tolist())
    b, i, quad = np.meshgrid(np.arange(math.prod(batch_shape), dtype=np.uint64), np.arange(n, dtype=np.uint64),
                             np.arange((m + 3) // 4, dtype=np.uint64), indexing="ij")
    c0, c1, c2, c3 = quad, i, b, np.full_like(quad, offset % 2 ** 32)
    k0, k1 = np.uint64(seed % 2 ** 32), np.uint64(seed >> 32)
    for _ in range(10):
        # 32 x 32 -> 64-bit products: exact in uint64.
        p0, p1 = c0 * np.uint64(0xD2511F53), c2 * np.uint64(0xCD9E8D57)
        c0, c1, c2, c3 = (p1 >> np.uint64(32)) ^ c1 ^ k0, p1 & low32, (p0 >> np.uint64(32)) ^ c3 ^ k1, p0 & low32
        k0, k1 = (k0 + np.uint64(0x9E3779B9)) & low32, (k1 + np.uint64(0xBB67AE85)) & low32
    words = np.stack([c0, c1, c2, c3], axis=-1).reshape(*quad.shape[:2], -1)[..., :m]
    threshold = min(math.floor(p * 2.0 ** 32), 0xFFFFFFFF)
    return torch.from_numpy(words >= threshold).reshape(*batch_shape, n, m)


@pytest.mark.parametrize("p", [0.0, 0.1, 0.5, 0.9])
@pytest.mark.parametrize("shape", [((2, 3), 17, 33), ((), 64, 64), ((1,), 5, 130)], ids=str)
def test_dropout_mask_is_the_philox_stream(p, shape):
    """The device's keep mask is Philox4x32-10 as specified (so also the CPU kernels' mask, where
    the build has them): one seed gives one dropout mask on every device."""
    batch, n, m = shape
    rng = attention_ext.draw_rng_state()
    mask = ops.dropout_keep_mask(rng.to(DEVICE), list(batch), n, m, p)
    expected = _philox_keep_mask(rng, batch, n, m, p)
    assert mask.device.type == DEVICE and mask.dtype == torch.bool and mask.shape == expected.shape
    assert torch.equal(mask.cpu(), expected)
    if not CUDA_EMULATION:
        assert torch.equal(attention_ext.dropout_mask(rng, (*batch, n, m), p), expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dropout_forward_backward_matches_cpu_and_reference(dtype):
    """With the same (seed, offset) the device's forward and backward match the float64 reference
    under the specified keep mask, and the CPU kernels (where the build has them)."""
    q, k, v = _inputs((2, 2), (2, 2), 40, 70, 24, 16, dtype)
    rng = torch.tensor([987654321, 42], dtype=torch.int64)
    p = 0.25
    scale = 1.0 / math.sqrt(24)
    res = {}
    for dev in ([DEVICE] if CUDA_EMULATION else ["cpu", DEVICE]):
        qd, kd, vd = (t.detach().to(dev).requires_grad_(True) for t in (q, k, v))
        out, lse = AttentionFunction.apply(qd, kd, vd, None, scale, 0, -1, -1, 0.0, None, None, p, rng.to(dev))
        out.backward(torch.ones_like(out))
        res[dev] = (out, lse, qd.grad, kd.grad, vd.grad)
    if not CUDA_EMULATION:
        tol = {torch.float64: 1e-12, torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
        for a, b in zip(res["cpu"], res[DEVICE]):
            assert _err(b, a) <= tol * max(1.0, a.detach().abs().max().item())
    keep = _philox_keep_mask(rng, (2, 2), 40, 70, p)
    q64, k64, v64 = (t.detach().double().cpu().requires_grad_(True) for t in (q, k, v))
    ref = attention_reference(q64, k64, v64, scale=scale, dropout_mask=keep, dropout_p=p)[0]
    ref.backward(torch.ones_like(ref))
    budget = gbudget = None
    if dtype in (torch.float16, torch.bfloat16):
        ql, kl, vl = (t.detach().cpu().requires_grad_(True) for t in (q, k, v))
        lp = attention_reference(ql, kl, vl, scale=scale, dropout_mask=keep, dropout_p=p, dtype=None)[0]
        lp.backward(torch.ones_like(lp))
        budget = _err(lp, ref)
        gbudget = _budget([ql.grad, kl.grad, vl.grad], [q64.grad, k64.grad, v64.grad])
    out, _, dq, dk, dv = res[DEVICE]
    _check(out, ref, dtype, budget, what="dropout out")
    for name, a, r in (("dq", dq, q64.grad), ("dk", dk, k64.grad), ("dv", dv, v64.grad)):
        _check(a, r, dtype, gbudget, k=4.0, what=f"dropout {name}", base=GRAD_TOL)


@needs_cpu_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cpu_gpu_agree(dtype):
    torch.manual_seed(3)
    shape = ((2, 4), (2, 4), 150, 170, 64, 64)
    q, k, v = _inputs(*shape, dtype, device="cpu")
    mask = torch.randn(1, 4, 150, 170, dtype=dtype)
    res = {}
    for dev in ("cpu", DEVICE):
        qd, kd, vd, md = (t.detach().to(dev).requires_grad_(True) for t in (q, k, v, mask))
        out, lse = attention_ext.attention(qd, kd, vd, attn_mask=md, return_lse=True)
        (out.float().square().sum() + lse.sum()).backward()
        res[dev] = (out, lse, qd.grad, kd.grad, vd.grad, md.grad)
    tol = {torch.float64: 1e-11, torch.float32: 5e-5, torch.float16: 1e-2, torch.bfloat16: 8e-2}[dtype]
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv", "dmask"), res["cpu"], res[DEVICE]):
        assert _err(b, a) <= tol * max(1.0, a.detach().abs().max().item()), name


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fully_masked_rows(dtype):
    q, k, v = _inputs((2,), (2,), 20, 30, 16, 8, dtype, grad=True)
    mask = torch.ones(20, 30, dtype=torch.bool, device=DEVICE)
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
    """Bitwise the same forward and gradients twice, with the reductions a backward makes across
    CTAs: dK/dV over the query heads of a group, the mask gradient over batch and heads."""
    # The emulation gets a smaller instance of the same structure (several row and key tiles).
    b, hq, hk, n, m = (1, 4, 2, 130, 170) if CUDA_EMULATION else (2, 8, 2, 200, 300)
    torch.manual_seed(0)
    q = rand(b, hq, n, 64, dtype=dtype, device=DEVICE)
    k = rand(b, hk, m, 64, dtype=dtype, device=DEVICE)
    v = rand(b, hk, m, 64, dtype=dtype, device=DEVICE)
    mask = rand(1, 1, n, m, dtype=dtype, device=DEVICE)
    g = rand(b, hq, n, 64, dtype=dtype, device=DEVICE)
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
    q = rand(2, 33, 4, 40, dtype=dtype, device=DEVICE).transpose(1, 2).requires_grad_(True)
    k = rand(1, 4, 47, 40, dtype=dtype, device=DEVICE).expand(2, 4, 47, 40).detach().requires_grad_(True)
    v = rand(2, 47, 4, 20, dtype=dtype, device=DEVICE).transpose(1, 2).requires_grad_(True)
    assert not q.is_contiguous()
    _compare_fwd_bwd(q, k, v, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [None, "bottom_right"])
def test_attention_weights(dtype, causal):
    q, k, _ = _inputs((2, 3), (2, 3), 45, 70, 32, 1, dtype)
    mask = None if causal else torch.rand(45, 70, device=DEVICE) > 0.2
    w = attention_ext.attention_weights(q, k, attn_mask=mask, causal=causal)
    ref = attention_reference(q.cpu(), k.cpu(), k.cpu(), None if mask is None else mask.cpu(), causal=causal)[2]
    assert w.shape == ref.shape and w.dtype == dtype
    assert _err(w, ref) <= {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 2e-3,
                            torch.bfloat16: 1.6e-2}[dtype]


# The emulation runs two of the eight with one head each (heads are independent CTAs; the long
# rows and many key tiles are what this checks).
LONG_ON_EMULATION = {(torch.float16, 64, None), (torch.bfloat16, 128, "top_left")}


@pytest.mark.parametrize("dtype,d,causal", [
    pytest.param(dtype, d, causal, id=f"{causal}-{d}-{dtype}",
                 marks=() if (dtype, d, causal) in LONG_ON_EMULATION else pytest.mark.slow_on_emulation)
    for dtype in (torch.float16, torch.bfloat16) for d in (64, 128) for causal in (None, "top_left")])
def test_long_sequences(dtype, d, causal):
    heads = 1 if CUDA_EMULATION else 4
    q, k, v = _inputs((1, heads), (1, heads), 1000, 1100, d, d, dtype, grad=True)
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


@pytest.mark.skipif(DEVICE != "cuda", reason="needs a second device type (the emulation build's kernels take CPU tensors)")
def test_ops_validate_device():
    q = torch.randn(4, 8, device=DEVICE)
    with pytest.raises(RuntimeError, match=r"query, key and value must be on the same device"):
        ops.attention_fwd(q, torch.randn(4, 8), torch.randn(4, 8, device=DEVICE), None, 1.0, 0, -1, -1, 0.0, None, None, 0.0, None)
    with pytest.raises(RuntimeError, match=r"rng_state must be on"):  # on the inputs' device
        ops.attention_fwd(q, q, q, None, 1.0, 0, -1, -1, 0.0, None, None, 0.5, torch.tensor([1, 2]))


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need the CUDA runtime")
def test_no_host_sync_with_dropout():
    """rng_state stays on the device: the forward with dropout can be captured in a CUDA graph."""
    q = torch.randn(2, 64, 32, device=DEVICE)
    rng = torch.tensor([5, 6], dtype=torch.int64, device=DEVICE)
    ops.attention_fwd(q, q, q, None, 0.1, 0, -1, -1, 0.0, None, None, 0.2, rng)  # warm-up (allocations)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, _ = ops.attention_fwd(q, q, q, None, 0.1, 0, -1, -1, 0.0, None, None, 0.2, rng)
    graph.replay()
    torch.cuda.synchronize()
    expected, _ = ops.attention_fwd(q, q, q, None, 0.1, 0, -1, -1, 0.0, None, None, 0.2, rng)
    assert torch.equal(out, expected)

"""The tensor-core forward (csrc/cuda/tc_forward.cuh: fp16/bf16, d_k == d_v in {64, 128}, rows of
aligned unit-stride chunks): every semantic of the SIMT kernels, against the float64 reference,
and the rule deciding which calls take it.

Runs on a CUDA device, and on CPU tensors in the CUDA emulation build (.ci/cuda_emulation.sh),
where mma.sync / ldmatrix / cp.async are emulated from their documented fragment layouts.
ATTENTION_EXT_CUDA_SIMT=1 forces the SIMT kernel, which the tensor-core path is compared with.
"""
import math

import pytest
import torch

import attention_ext
from attention_ext.reference import attention_reference

from conftest import ATOL, CUDA_KERNELS_DEVICE

DEVICE = CUDA_KERNELS_DEVICE
# Under ATTENTION_EXT_CUDA_EMULATION=1 conftest.py refuses a build other than the emulation one,
# so this module cannot skip there; cuda_kernels checks that each test's calls reached the CUDA binding.
pytestmark = [pytest.mark.skipif(DEVICE is None, reason="needs a CUDA device or the CUDA emulation build"),
              pytest.mark.cuda_kernels]

ops = torch.ops.attention_ext
LOW = [torch.float16, torch.bfloat16]
CAUSAL = {None: 0, "top_left": 1, "bottom_right": 2}


def _forward(q, k, v, mask=None, causal=None, p=0.0, rng=None, simt=False, monkeypatch=None):
    monkeypatch.setenv("ATTENTION_EXT_CUDA_SIMT", "1" if simt else "0")
    d = q.shape[-1]
    return ops.attention_fwd(q, k, v, mask, 1.0 / math.sqrt(d), CAUSAL[causal], -1, -1, 0.0, None, None, p, rng)


def _randn(*shape, dtype):
    return torch.randn(*shape, dtype=torch.float64).to(device=DEVICE, dtype=dtype)


def _check_against_reference(out, lse, q, k, v, dtype, mask=None, causal=None, p=0.0, rng=None):
    """out within 2x plain low-precision torch's error of the float64 reference; lse close;
    fully masked rows exactly 0 with lse -inf."""
    keep = None if rng is None else attention_ext.dropout_mask(rng, (*q.shape[:-2], q.shape[-2], k.shape[-2]), p)
    mask64 = None
    if mask is not None:
        mask64 = mask.cpu()
        if mask.dtype != torch.bool:
            mask64 = mask64.double().masked_fill(mask.cpu() <= torch.finfo(dtype).min, float("-inf"))
    ref, ref_lse, _ = attention_reference(q.cpu(), k.cpu(), v.cpu(), mask64, causal=causal,
                                          dropout_mask=None if keep is None else keep.cpu(), dropout_p=p)
    lp = attention_reference(q, k, v, mask, causal=causal, dropout_mask=keep, dropout_p=p, dtype=None)[0]
    budget = (lp.double().cpu() - ref).abs().max().item()
    tol = max(ATOL[dtype] * max(1.0, ref.abs().max().item()), 2.0 * budget)
    err = (out.double().cpu() - ref).abs().max().item()
    assert err <= tol, f"max abs error {err:.3e} > {tol:.3e}"
    masked = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse.cpu()), masked)
    assert torch.all(out.cpu()[masked] == 0)
    fin = ~masked
    if fin.any():
        assert (lse.cpu().double()[fin] - ref_lse[fin]).abs().max().item() <= 1e-4 * max(1.0, ref_lse[fin].abs().max().item())


@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("n,m", [(150, 170), (64, 64), (1, 200), (70, 5)], ids=str)
@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
def test_matches_reference(dtype, d, n, m, causal, monkeypatch):
    """Partial query and key tiles, a single key, one query row, both causal kinds (bottom-right with
    n > m leaves CTAs with no visible key tile at all)."""
    torch.manual_seed(0)
    q, k, v = _randn(2, 3, n, d, dtype=dtype), _randn(2, 3, m, d, dtype=dtype), _randn(2, 3, m, d, dtype=dtype)
    out, lse = _forward(q, k, v, causal=causal, monkeypatch=monkeypatch)
    _check_against_reference(out, lse, q, k, v, dtype, causal=causal)


@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("variant", ["float mask + dropout", "bool mask", "bottom_right", "gqa", "seq-major layout"])
def test_agrees_with_simt_kernel(dtype, d, variant, monkeypatch):
    """The tensor-core and SIMT kernels agree within the rounding of P to the storage type, and
    both match the reference: masks (with a fully masked row), dropout (the same Philox stream),
    causal, K/V broadcast over heads, and a (batch, seq, heads, d) layout read through its strides."""
    torch.manual_seed(1)
    b, h, n, m = 2, 3, 150, 170
    q, k, v = _randn(b, h, n, d, dtype=dtype), _randn(b, h, m, d, dtype=dtype), _randn(b, h, m, d, dtype=dtype)
    mask, causal, p, rng = None, None, 0.0, None
    if variant == "float mask + dropout":
        mask = _randn(n, m, dtype=dtype)
        mask[5] = torch.finfo(dtype).min
        p, rng = 0.2, torch.tensor([11, 3], dtype=torch.int64, device=DEVICE)
    elif variant == "bool mask":
        mask = torch.rand(b, 1, n, m, device=DEVICE) > 0.3
        mask[1, 0, 7] = False
    elif variant == "bottom_right":
        causal = "bottom_right"
        q = q[:, :, :120]
    elif variant == "gqa":
        k, v = k[:, :1].expand(b, h, m, d), v[:, :1].expand(b, h, m, d)
    else:
        q, k, v = (_randn(b, t.shape[2], h, d, dtype=dtype).transpose(1, 2) for t in (q, k, v))
    o_tc, l_tc = _forward(q, k, v, mask, causal, p, rng, simt=False, monkeypatch=monkeypatch)
    o_s, l_s = _forward(q, k, v, mask, causal, p, rng, simt=True, monkeypatch=monkeypatch)
    assert not torch.equal(o_tc, o_s), "expected the tensor-core path (its P is rounded to the storage type)"
    assert torch.equal(torch.isneginf(l_tc), torch.isneginf(l_s))
    fin = torch.isfinite(l_s)
    assert (l_tc[fin] - l_s[fin]).abs().max().item() <= 1e-4 * max(1.0, l_s[fin].abs().max().item())
    tol = {torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype] * max(1.0, o_s.abs().max().item())
    assert (o_tc.double() - o_s.double()).abs().max().item() <= tol
    _check_against_reference(o_tc, l_tc, q, k, v, dtype, mask, causal, p, rng)


@pytest.mark.parametrize("layout", ["unit-stride columns missing", "rows not 16-byte aligned", "d_k != d_v", "d = 96"])
def test_ineligible_calls_take_the_simt_kernel(layout, monkeypatch):
    """Calls the tensor-core kernel cannot read (it copies 16-byte chunks of contiguous columns)
    or has no instantiation for give exactly the SIMT kernel's result."""
    torch.manual_seed(2)
    dtype, d = torch.float16, 64
    q, k, v = _randn(1, 2, 80, d, dtype=dtype), _randn(1, 2, 90, d, dtype=dtype), _randn(1, 2, 90, d, dtype=dtype)
    if layout == "unit-stride columns missing":
        q = q.transpose(-1, -2).contiguous().transpose(-1, -2)
    elif layout == "rows not 16-byte aligned":
        k = _randn(1, 2, 90, d + 1, dtype=dtype)[..., 1:]
    elif layout == "d_k != d_v":
        v = _randn(1, 2, 90, 128, dtype=dtype)
    else:
        q, k, v = (_randn(*t.shape[:-1], 96, dtype=dtype) for t in (q, k, v))
    o_default, l_default = _forward(q, k, v, simt=False, monkeypatch=monkeypatch)
    o_s, l_s = _forward(q, k, v, simt=True, monkeypatch=monkeypatch)
    assert torch.equal(o_default, o_s) and torch.equal(l_default, l_s)
    _check_against_reference(o_default, l_default, q, k, v, dtype)


def test_fp16_dropout_beyond_fp16s_range_takes_the_simt_kernel(monkeypatch):
    """The tensor-core kernels round P·1/(1 − p) to fp16 for the P·V product: past 1/(1 − p) =
    65504 a kept weight near 1 would round to inf. Such calls take the SIMT kernel (P in float):
    rows with a single key whose entry is kept give out = v/(1 − p), finite, as the reference."""
    torch.manual_seed(4)
    dtype, d, n = torch.float16, 64, 256
    p = 1.0 - 1.0 / 66000.0
    shape = (1, 1, n, 1)
    states = (torch.tensor([seed, 0], dtype=torch.int64, device=DEVICE) for seed in range(100000))
    rng = next(r for r in states if attention_ext.dropout_mask(r, shape, p).any())  # a stream keeping some
    q, k = _randn(1, 1, n, d, dtype=dtype), _randn(1, 1, 1, d, dtype=dtype)
    v = (_randn(1, 1, 1, d, dtype=torch.float64) * 1e-3).to(dtype)
    o_default, l_default = _forward(q, k, v, p=p, rng=rng, simt=False, monkeypatch=monkeypatch)
    o_s, l_s = _forward(q, k, v, p=p, rng=rng, simt=True, monkeypatch=monkeypatch)
    assert torch.equal(o_default, o_s) and torch.equal(l_default, l_s)
    assert torch.isfinite(o_default).all() and o_default.abs().max().item() > 1.0
    _check_against_reference(o_default, l_default, q, k, v, dtype, p=p, rng=rng)


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_extreme_and_nan_rows(dtype, monkeypatch):
    """Large logits stay finite and exact (online-softmax rescaling); a NaN in a row's scores gives
    a NaN row and NaN lse, as on every other path; other rows are unaffected."""
    torch.manual_seed(3)
    q, k, v = _randn(1, 1, 70, 64, dtype=dtype), _randn(1, 1, 130, 64, dtype=dtype), _randn(1, 1, 130, 64, dtype=dtype)
    q[0, 0, 3] *= 40.0  # logits of several hundred
    out, lse = _forward(q, k, v, monkeypatch=monkeypatch)
    _check_against_reference(out, lse, q, k, v, dtype)
    q[0, 0, 9, 5] = float("nan")
    out, lse = _forward(q, k, v, monkeypatch=monkeypatch)
    assert torch.isnan(out[0, 0, 9]).all() and torch.isnan(lse[0, 0, 9])
    others = torch.ones(70, dtype=torch.bool)
    others[9] = False
    assert not torch.isnan(out[0, 0, others]).any()


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_bitwise_deterministic(dtype, monkeypatch):
    torch.manual_seed(4)
    q, k, v = _randn(2, 2, 100, 128, dtype=dtype), _randn(2, 2, 140, 128, dtype=dtype), _randn(2, 2, 140, 128, dtype=dtype)
    first = _forward(q, k, v, causal="top_left", monkeypatch=monkeypatch)
    second = _forward(q, k, v, causal="top_left", monkeypatch=monkeypatch)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])


# ---------------------------------------------------------------------------------------------
# Backward: the tensor-core dK/dV and dQ passes (csrc/cuda/tc_backward.cuh).

GRAD_TOL = {torch.float16: 4e-3, torch.bfloat16: 3e-2}


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_(True) for t in tensors]


def _backward(q, k, v, grad, monkeypatch, simt=False, **kwargs):
    """Gradients of attention(q, k, v, **kwargs) for upstream `grad` (out, or (out, lse))."""
    monkeypatch.setenv("ATTENTION_EXT_CUDA_SIMT", "1" if simt else "0")
    mask = kwargs.pop("attn_mask", None)
    leaves = _leaves(q, k, v)
    inputs = list(leaves)
    if mask is not None and mask.requires_grad:
        mask = mask.detach().clone().requires_grad_(True)
        inputs.append(mask)
    result = attention_ext.attention(*leaves, attn_mask=mask, **kwargs)
    outputs = result if isinstance(result, tuple) else (result,)
    grads = grad if isinstance(grad, tuple) else (grad,)
    return torch.autograd.grad(outputs, inputs, grads)


def _reference_grads(q, k, v, grad, mask=None, causal=None, dtype=torch.float64, keep=None, p=0.0, with_lse=False):
    leaves = [t.detach().cpu().to(dtype).requires_grad_(True) for t in (q, k, v)]
    inputs = list(leaves)
    if mask is not None:
        m = mask.detach().cpu()
        if m.dtype != torch.bool:
            lowest = m <= torch.finfo(m.dtype).min
            m = m.to(dtype).masked_fill(lowest, float("-inf"))
        if mask.requires_grad:
            m.requires_grad_(True)
            inputs.append(m)
        mask = m
    out, lse, _ = attention_reference(*leaves, mask, causal=causal, dropout_mask=None if keep is None else keep.cpu(),
                                      dropout_p=p, dtype=None)
    outputs = (out, lse) if with_lse else (out,)
    grads = grad if isinstance(grad, tuple) else (grad,)
    grads = [g.detach().cpu().to(o.dtype) for g, o in zip(grads, outputs)]
    # A fully masked row's lse is -inf: its gradient is defined as 0, which autograd of the
    # composition does not know, so those entries are dropped from the reference's upstream.
    if with_lse:
        grads[1] = grads[1].masked_fill(torch.isneginf(lse.detach()), 0.0)
    return torch.autograd.grad(outputs, inputs, grads, allow_unused=True)


def _check_grads(actual, q, k, v, grad, dtype, **kwargs):
    """Each gradient within max(GRAD_TOL·scale, 4x plain low-precision torch's error) of float64."""
    ref = _reference_grads(q, k, v, grad, **kwargs)
    low = _reference_grads(q, k, v, grad, dtype=dtype, **kwargs)
    for name, a, r, lp in zip(["dq", "dk", "dv", "dmask"], actual, ref, low):
        r = torch.nan_to_num(r, nan=0.0)
        budget = (lp.double() - r).abs().max().item() if r.numel() else 0.0
        tol = max(GRAD_TOL[dtype] * max(1.0, r.abs().max().item() if r.numel() else 1.0), 4.0 * budget)
        assert not torch.isnan(a).any(), f"{name}: NaN"
        err = (a.double().cpu() - r).abs().max().item() if r.numel() else 0.0
        assert err <= tol, f"{name}: max abs error {err:.3e} > {tol:.3e}"


@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("n,m,causal", [(100, 80, None), (70, 130, "top_left"), (130, 70, "bottom_right"),
                                        (1, 65, None)], ids=str)
def test_backward_matches_reference(dtype, d, n, m, causal, monkeypatch):
    """Partial tiles on both axes, a single query row, causal tiles skipped on either side (bottom-right
    with n > m leaves rows that see no key: their gradients are 0)."""
    torch.manual_seed(5)
    q, k, v = _randn(1, 2, n, d, dtype=dtype), _randn(1, 2, m, d, dtype=dtype), _randn(1, 2, m, d, dtype=dtype)
    grad = _randn(1, 2, n, d, dtype=dtype)
    actual = _backward(q, k, v, grad, monkeypatch, causal=causal)
    _check_grads(actual, q, k, v, grad, dtype, causal=causal)


@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("variant", ["float mask with grad", "bool mask", "dropout", "gqa", "lse grad",
                                     "seq-major layout", "expanded grad"])
def test_backward_agrees_with_simt_kernels(dtype, variant, monkeypatch):
    """The tensor-core and SIMT backward agree within the rounding of P and dS, and both match the
    reference: masks (the mask gradient still comes from its SIMT pass), a fully masked row,
    dropout (the same Philox stream), K/V broadcast over heads (dK/dV summed over them), a
    gradient flowing into lse, a (batch, seq, heads, d) layout, and out.sum()'s expanded gradient."""
    torch.manual_seed(6)
    b, h, n, m, d = 1, 2, 90, 75, 64
    q, k, v = _randn(b, h, n, d, dtype=dtype), _randn(b, h, m, d, dtype=dtype), _randn(b, h, m, d, dtype=dtype)
    grad = _randn(b, h, n, d, dtype=dtype)
    kwargs, ref_kwargs = {}, {}
    if variant == "float mask with grad":
        mask = _randn(h, n, m, dtype=dtype)
        mask[:, 4] = torch.finfo(dtype).min  # fully masked rows
        mask.requires_grad_(True)
        kwargs = ref_kwargs = {"attn_mask": mask}
        ref_kwargs = {"mask": mask}
    elif variant == "bool mask":
        mask = torch.rand(b, 1, n, m, device=DEVICE) > 0.4
        mask[0, 0, 11] = False
        kwargs, ref_kwargs = {"attn_mask": mask}, {"mask": mask}
    elif variant == "dropout":
        torch.manual_seed(7)
        kwargs = {"dropout_p": 0.3}
    elif variant == "gqa":
        k, v = k[:, :1], v[:, :1]
        q = _randn(b, 4, n, d, dtype=dtype)
        grad = _randn(b, 4, n, d, dtype=dtype)
        kwargs = {"enable_gqa": True}
    elif variant == "lse grad":
        kwargs = {"return_lse": True, "causal": "bottom_right"}
        ref_kwargs = {"with_lse": True, "causal": "bottom_right"}
        grad = (grad, _randn(b, h, n, dtype=torch.float32))
    elif variant == "seq-major layout":
        q, k, v = (_randn(b, t.shape[2], h, d, dtype=dtype).transpose(1, 2) for t in (q, k, v))
    else:
        grad = torch.ones(1, 1, 1, 1, device=DEVICE, dtype=dtype).expand(b, h, n, d)

    def run(simt):
        if variant == "dropout":
            torch.manual_seed(7)  # the same (seed, offset) for both kernels
        return _backward(q, k, v, grad, monkeypatch, simt=simt, **kwargs)

    tc, simt = run(False), run(True)
    for a, s in zip(tc, simt):
        assert not torch.equal(a, s), "expected the tensor-core backward (P and dS rounded to the storage type)"
        assert (a.double() - s.double()).abs().max().item() <= GRAD_TOL[dtype] * max(1.0, s.abs().max().item())
    if variant == "dropout":
        torch.manual_seed(7)
        rng = attention_ext.draw_rng_state(DEVICE)
        ref_kwargs = {"keep": attention_ext.dropout_mask(rng, (b, h, n, m), 0.3), "p": 0.3}
    if variant == "gqa":
        k, v = k.expand(b, 4, m, d), v.expand(b, 4, m, d)
        ref = _reference_grads(q, k, v, grad)
        low = _reference_grads(q, k, v, grad, dtype=dtype)
        # The reference sees K/V expanded: its dK/dV are summed over the 4 query heads here.
        ref = [ref[0], ref[1].sum(1, keepdim=True), ref[2].sum(1, keepdim=True)]
        low = [low[0], low[1].sum(1, keepdim=True), low[2].sum(1, keepdim=True)]
        for name, a, r, lp in zip(["dq", "dk", "dv"], tc, ref, low):
            tol = max(GRAD_TOL[dtype] * max(1.0, r.abs().max().item()), 4.0 * (lp.double() - r).abs().max().item())
            assert (a.double().cpu() - r).abs().max().item() <= tol, name
        return
    _check_grads(tc, q, k, v, grad, dtype, **ref_kwargs)
    if variant == "float mask with grad":
        assert torch.all(tc[0][:, :, 4] == 0), "a fully masked row's query gradient is exactly 0"


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_backward_bitwise_deterministic(dtype, monkeypatch):
    torch.manual_seed(8)
    q, k, v = _randn(1, 2, 100, 128, dtype=dtype), _randn(1, 1, 90, 128, dtype=dtype), _randn(1, 1, 90, 128, dtype=dtype)
    grad = _randn(1, 2, 100, 128, dtype=dtype)
    first = _backward(q, k, v, grad, monkeypatch, causal="top_left", enable_gqa=True)
    second = _backward(q, k, v, grad, monkeypatch, causal="top_left", enable_gqa=True)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


# ---------------------------------------------------------------------------------------------
# Split-KV decode: calls with fewer CTAs than SMs cut the keys into ranges merged by lse.

@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("variant", ["plain", "bottom_right", "top_left", "float mask", "dropout", "nan row"])
def test_split_kv_decode_matches_reference(dtype, d, variant, monkeypatch):
    """A few query rows against 1000 keys: split into key ranges (the default plan on an H100/H200-
    sized device, and a forced 6), merged exactly as one pass would be: against the reference and
    the unsplit kernel. top_left with 3 rows leaves ranges with no visible key at all."""
    torch.manual_seed(9)
    n, m = (1 if variant in ("plain", "dropout") else 3), 1000
    q, k, v = _randn(1, 2, n, d, dtype=dtype), _randn(1, 2, m, d, dtype=dtype), _randn(1, 2, m, d, dtype=dtype)
    mask, causal, p, rng = None, None, 0.0, None
    if variant in ("bottom_right", "top_left"):
        causal = variant
    elif variant == "float mask":
        mask = _randn(1, 2, n, m, dtype=dtype)
        mask[0, 1, 2] = torch.finfo(dtype).min  # a fully masked row
    elif variant == "dropout":
        p, rng = 0.25, torch.tensor([4, 9], dtype=torch.int64, device=DEVICE)
    elif variant == "nan row":
        q[0, 0, 1, 3] = float("nan")
    results = {}
    for splits in ("", "6", "1"):
        monkeypatch.setenv("ATTENTION_EXT_CUDA_KV_SPLITS", splits)
        results[splits] = _forward(q, k, v, mask, causal, p, rng, monkeypatch=monkeypatch)
    (o_split, l_split), (o_one, l_one) = results[""], results["1"]
    if variant == "nan row":
        for o, l in results.values():
            assert torch.isnan(o[0, 0, 1]).all() and torch.isnan(l[0, 0, 1])
            assert not torch.isnan(o[0, 0, [0, 2]]).any() and not torch.isnan(o[0, 1]).any()
        return
    for o, l in results.values():
        _check_against_reference(o, l, q, k, v, dtype, mask, causal, p, rng)
    assert torch.equal(torch.isneginf(l_split), torch.isneginf(l_one))
    tol = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    assert (o_split.double() - o_one.double()).abs().max().item() <= tol
    assert (l_split - l_one).abs()[torch.isfinite(l_one)].max().item() <= 1e-5 * 10
    if variant == "plain":
        assert not torch.equal(o_split, o_one) or not torch.equal(l_split, l_one), "expected a split call"

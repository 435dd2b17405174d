"""Scale: index arithmetic is 64-bit. A key tensor of more than 2^31 elements (bfloat16, 4.4 GB)
gives the right output and gradients — both as one long sequence (one query row over 2^25 + 2^20
keys of d = 64, so key rows past 2^25 start beyond element 2^31) and as a large batch whose later
batch offsets exceed 2^31 elements.

The keys past the 2^31-element boundary are made to decide the answer (a spike key there takes
most of the weight, and the other keys there carry distinct values), so an offset computed in
32 bits — which would read the wrong rows or crash — cannot go unnoticed. K is zero except for
its first and last columns, which keeps the float64 reference cheap: it only needs those two
columns, in chunks.

Needs about 12 GiB of free memory (K, its gradient and the reference's float64 columns);
skipped with the reason otherwise.
"""
from __future__ import annotations

import math
import os

import pytest
import torch

import attention_ext

from conftest import SANITIZED

D = 64
M = 2 ** 25 + 2 ** 20  # keys: M · D = 2.21e9 elements > 2^31
BOUNDARY_ROW = 2 ** 31 // D  # first key row that starts at element offset >= 2^31
SPIKE = BOUNDARY_ROW + 777_777  # the key that takes most of the weight, past the boundary
NEEDED_GIB = 12


def mem_available_gib():
    """MemAvailable from /proc/meminfo in GiB, or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 2 ** 20
    except OSError:
        pass
    return None


AVAILABLE_GIB = mem_available_gib()
NEED = (f"needs {NEEDED_GIB} GiB of available memory (a 4.4 GB bfloat16 key tensor, its gradient "
        f"and the reference's float64 columns)")

pytestmark = [
    pytest.mark.slow_on_emulation,
    pytest.mark.skipif(AVAILABLE_GIB is None,
                       reason=f"{NEED}; could not read MemAvailable from /proc/meminfo to check"),
    pytest.mark.skipif(AVAILABLE_GIB is not None and AVAILABLE_GIB < NEEDED_GIB,
                       reason=f"{NEED}; only {AVAILABLE_GIB or 0:.1f} GiB available (MemAvailable "
                              f"in /proc/meminfo at collection)"),
    pytest.mark.skipif(SANITIZED,
                       reason="2^31-element tensors under AddressSanitizer take minutes"),
]


@pytest.fixture(scope="module")
def big():
    """K (M, D) bfloat16, zero but for columns 0 and D-1; V (M, 1); q (1, D) reading those columns."""
    g = torch.Generator().manual_seed(0)
    k = torch.zeros(M, D, dtype=torch.bfloat16)
    col0 = torch.randn(M, generator=g, dtype=torch.float32) * 0.5
    col_last = torch.randn(M, generator=g, dtype=torch.float32) * 0.5
    # Score 18 against ~N(0, 0.9²) for the 3.5e7 others: the spike takes about a quarter of the
    # weight, the rest is spread over every key (so both matter).
    col0[SPIKE] = 12.0
    k[:, 0] = col0.to(torch.bfloat16)
    k[:, D - 1] = col_last.to(torch.bfloat16)
    del col0, col_last
    v = (torch.randn(M, 1, generator=g, dtype=torch.float32)).to(torch.bfloat16)
    v[SPIKE] = 100.0
    q = torch.zeros(1, D, dtype=torch.bfloat16)
    q[0, 0], q[0, D - 1] = 1.5, -1.0
    yield q, k, v
    del k, v


def scores(q, k, scale, rows=slice(None)):
    """Float64 scores of the given key rows (only columns 0 and D-1 of K are nonzero)."""
    q64 = q.double()
    return (k[rows, 0].double() * q64[0, 0] + k[rows, D - 1].double() * q64[0, D - 1]) * scale


def test_one_query_over_more_than_2_to_the_31_key_elements_forward_and_backward(big):
    q, k, v = big
    assert k.numel() > 2 ** 31 and SPIKE * D > 2 ** 31
    scale = 1.0
    qq, vv = q.clone().requires_grad_(), v.clone().requires_grad_()
    kk = k.requires_grad_()
    try:
        out, lse = attention_ext.attention(qq, kk, vv, scale=scale, return_lse=True)
        # Reference in float64 over all keys.
        s = scores(q, k, scale)
        ref_lse = torch.logsumexp(s, 0)
        w = torch.exp(s - ref_lse)
        ref_out = (w * v[:, 0].double()).sum()
        assert 0.1 < w[SPIKE] < 0.9, "the spike past the 2^31 boundary weighs as much as all other keys"
        assert abs(lse.item() - ref_lse.item()) < 1e-3 * max(1.0, abs(ref_lse.item()))
        assert abs(out.item() - ref_out.item()) < 2e-2 * abs(ref_out.item()), (out.item(), ref_out.item())

        # Backward: dV_j = w_j · dO, dS_j = w_j (dO·v_j − dO·out), dK_j = scale · dS_j · q,
        # dQ = scale · Σ_j dS_j k_j.
        grad_out = torch.tensor([[1.0]], dtype=torch.bfloat16)
        dq, dk, dv = torch.autograd.grad(out, (qq, kk, vv), grad_out)
        assert dk.shape == k.shape and dv.shape == v.shape
        ds = w * (v[:, 0].double() - ref_out)
        rows = torch.tensor([0, 1, BOUNDARY_ROW - 1, BOUNDARY_ROW, SPIKE - 1, SPIKE, SPIKE + 1, M - 2, M - 1])
        # Per row: a few bfloat16 roundings of dS_j, and of out inside dO·out (|ΔdS_j| <= w_j · 1% · |out|).
        ds_tol = 3e-2 * ds[rows].abs() + 1e-2 * w[rows] * (1 + abs(ref_out.item()))
        for c in (0, D - 1):
            want = scale * ds[rows] * q.double()[0, c]
            err = (dk[rows, c].double() - want).abs()
            assert (err <= ds_tol * abs(q.double()[0, c].item()) * scale + 1e-30).all(), (c, err, want)
        assert dk[SPIKE, 0].abs() > 1.0
        # Columns where q is 0 get exactly zero gradient, on rows on both sides of the boundary.
        for start in (0, BOUNDARY_ROW - 2, SPIKE - 2, M - 4):
            assert torch.equal(dk[start:start + 4, 1:D - 1], torch.zeros_like(dk[start:start + 4, 1:D - 1]))
        assert ((dv[rows, 0].double() - w[rows]).abs() <= 1e-2 * w[rows] + 1e-30).all()
        want_dq0 = scale * (ds * k[:, 0].double()).sum()
        assert abs(dq[0, 0].item() - want_dq0.item()) <= 2e-2 * abs(want_dq0.item()) + 1e-2
    finally:
        kk.requires_grad_(False)


@pytest.mark.parametrize("path", ["decode", "tiled"])
def test_a_batch_whose_later_batch_offsets_exceed_2_to_the_31_elements(big, path, monkeypatch):
    """The same storage as (B, L, D): batch b starts at element b·L·D, past 2^31 for b >= 2^31 / (L·D).
    Through both CPU forwards (one query row takes the decode one unless the tiled one is forced)."""
    monkeypatch.setenv("ATTENTION_EXT_CPU_FORWARD", path)
    q, k, v = big
    L = 1024
    B = M // L
    kb, vb = k.view(B, L, D), v.view(B, L, 1)
    g = torch.Generator().manual_seed(1)
    qb = (torch.randn(B, 1, D, generator=g) * 0.5).to(torch.bfloat16)
    first_past = 2 ** 31 // (L * D)
    assert B > first_past and (B - 1) * L * D > 2 ** 31
    out = attention_ext.attention(qb, kb, vb)
    assert out.shape == (B, 1, 1)
    scale = 1.0 / math.sqrt(D)
    check = sorted({0, 1, first_past - 1, first_past, first_past + 1, SPIKE // L, B - 2, B - 1}
                   | set(torch.randint(0, B, (24,), generator=g).tolist()))
    for b in check:
        s = (kb[b].double() @ qb[b, 0].double()) * scale  # (L,)
        w = torch.softmax(s, 0)
        ref = (w * vb[b, :, 0].double()).sum()
        vmax = vb[b].double().abs().max().item()
        assert abs(out[b, 0, 0].item() - ref.item()) <= 1e-2 * vmax + 1e-3, (b, out[b, 0, 0].item(), ref.item())

"""Leaks: 10,000 forward + backward calls keep the resident memory flat, and so do 10,000 calls
that fail validation (the C++ exception path) — no buffer, saved tensor, autograd graph or
Python object outlives its call.

Resident memory is read from /proc/self/statm after a warm-up (allocator arenas, OpenMP
threads and torch's caches settle first). The shapes are chosen so that leaking any one tensor
per call would grow the process by far more than the allowed slack.
"""
from __future__ import annotations

import gc
import os

import pytest
import torch

import attention_ext
from attention_ext.function import AttentionFunction

from conftest import SANITIZED

CALLS = 10_000
WARMUP = 500
SLACK_MIB = 20

pytestmark = [
    pytest.mark.slow_on_emulation,
    pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux /proc/self/statm"),
    pytest.mark.skipif(SANITIZED,
                       reason="under AddressSanitizer freed memory sits in ASan's quarantine, so RSS is not "
                              "flat by design (the sanitizer job runs with detect_leaks=0 and relies on this "
                              "test in the regular run)"),
]

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE / 2 ** 20


def settle():
    gc.collect()
    gc.collect()


def _inputs(seed):
    g = torch.Generator().manual_seed(seed)

    def r(*shape, dtype=torch.float32):
        return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype).requires_grad_()

    # (2, 2, 40, 32) float32 = 20 KiB a tensor: one leaked tensor a call is 195 MiB over the run.
    return [
        dict(q=r(2, 2, 40, 32), k=r(2, 2, 70, 32), v=r(2, 2, 70, 32), mask=r(2, 40, 70), causal="bottom_right"),
        dict(q=r(2, 4, 40, 32, dtype=torch.bfloat16), k=r(2, 2, 40, 32, dtype=torch.bfloat16),
             v=r(2, 2, 40, 32, dtype=torch.bfloat16), gqa=True, causal="top_left"),
        dict(q=r(1, 1, 16, dtype=torch.float64), k=r(1, 1024, 16, dtype=torch.float64),
             v=r(1, 1024, 16, dtype=torch.float64)),  # decode forward: split key ranges, merge buffers
        dict(q=r(2, 2, 40, 32), k=r(2, 2, 40, 32), v=r(2, 2, 40, 32), dropout=0.2,
             mask=torch.rand(40, 40, generator=g) < 0.8),
    ]


def one_call(cfg, i):
    q, k, v, mask = cfg["q"], cfg["k"], cfg["v"], cfg.get("mask")
    if cfg.get("dropout"):
        rng = torch.tensor([i, 7], dtype=torch.int64)
        out, lse = AttentionFunction.apply(q, k, v, mask, 0.125, 0, -1, -1, 0.0, None, None, cfg["dropout"], rng)
    else:
        out, lse = attention_ext.attention(q, k, v, attn_mask=mask, causal=cfg.get("causal"),
                                           enable_gqa=cfg.get("gqa", False), return_lse=True)
    leaves = [t for t in (q, k, v, mask) if t is not None and t.requires_grad]
    torch.autograd.grad((out, lse), leaves, (torch.ones_like(out), torch.ones_like(lse)))
    if i % 10 == 0:
        attention_ext.attention_weights(q.detach(), k.detach(), causal=cfg.get("causal"),
                                        enable_gqa=cfg.get("gqa", False))


def test_10000_forward_and_backward_calls_keep_resident_memory_flat():
    cfgs = _inputs(0)
    for i in range(WARMUP):
        one_call(cfgs[i % len(cfgs)], i)
    settle()
    objects = len(gc.get_objects())
    before = rss_mib()
    for i in range(CALLS):
        one_call(cfgs[i % len(cfgs)], i)
    settle()
    growth = rss_mib() - before
    assert growth < SLACK_MIB, f"resident memory grew by {growth:.1f} MiB over {CALLS} forward+backward calls"
    # No Python objects (autograd graphs, saved tensors, contexts) pile up either.
    assert len(gc.get_objects()) - objects < 200


def _failing_calls():
    """Calls that pass the Python checks of the raw ops and fail inside C++ validation (after
    building tensors and messages), plus public calls that fail in Python."""
    q, k, v = torch.randn(2, 64, 32), torch.randn(2, 80, 32), torch.randn(2, 80, 32)
    out, lse = torch.ops.attention_ext.attention_fwd(q, k, v, None, 0.2, 0, -1, -1, 0.0, None, None, 0.0, None)
    ops = torch.ops.attention_ext
    return [
        lambda: ops.attention_fwd(q, k[..., :31], v, None, 0.2, 0, -1, -1, 0.0, None, None, 0.0, None),          # head dims differ
        lambda: ops.attention_fwd(q, k, v, None, 0.2, 5, -1, -1, 0.0, None, None, 0.0, None),                    # causal kind
        lambda: ops.attention_fwd(q, k, v, torch.zeros(3, 64, 80), 0.2, 0, -1, -1, 0.0, None, None, 0.0, None),  # mask shape
        lambda: ops.attention_fwd(q, k, v, None, 0.2, 0, -1, -1, 0.0, None, None, 0.5, torch.zeros(3, dtype=torch.int64)),  # rng_state
        lambda: ops.attention_bwd(out[:, :1], None, q, k, v, None, out, lse, 0.2, 0, -1, -1, 0.0, None, None, 0.0, None, False),
        lambda: ops.attention_bwd(out, None, q, k, v, None, out, lse.double(), 0.2, 0, -1, -1, 0.0, None, None, 0.0, None, False),
        lambda: ops.attention_probs(q, k, torch.zeros(64, 81, dtype=torch.bool), 0.2, 0, -1, -1, 0.0, None, None),
        lambda: attention_ext.attention(q, k, v, scale=float("nan")),
        lambda: attention_ext.scaled_dot_product_attention(q, k, v, dropout_p=1.5),
    ]


def test_10000_calls_that_raise_keep_resident_memory_flat():
    calls = _failing_calls()

    def run(n):
        for i in range(n):
            with pytest.raises((RuntimeError, ValueError, TypeError)):
                calls[i % len(calls)]()

    run(WARMUP)
    settle()
    before = rss_mib()
    run(CALLS)
    settle()
    growth = rss_mib() - before
    # Each failing call builds an error message and a traceback of a few hundred bytes or more:
    # a leak of one would show as several MiB over the run.
    assert growth < 4, f"resident memory grew by {growth:.1f} MiB over {CALLS} failing calls"

"""Leaks: 10,000 forward + backward calls keep the resident memory flat, and so do 10,000 calls
that fail validation (the C++ exception path) — no buffer, saved tensor, autograd graph or
Python object outlives its call.

Two measures, after a warm-up (allocator arenas, OpenMP threads and torch's caches settle
first): the bytes glibc's malloc has handed out and not got back (mallinfo2: exact to the byte,
where tensors' storage and the C++ side's buffers come from), which may grow by at most
HEAP_SLACK_BYTES over the run — any tensor or buffer kept per call, even a 640-byte lse, grows it
by megabytes (measured: a run of flat calls moved it by 0-1.5 KiB) — and resident memory from
/proc/self/statm, which catches memory mapped outside malloc.
"""
from __future__ import annotations

import ctypes
import ctypes.util
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
HEAP_SLACK_BYTES = 256 * 1024  # over CALLS calls: 26 bytes a call

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


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


def _mallinfo2():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.mallinfo2  # glibc >= 2.33
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2
    return fn


_MALLINFO2 = _mallinfo2()


def heap_bytes():
    """Bytes malloc has handed out and not got back (small chunks and mmapped ones), or None
    without glibc's mallinfo2."""
    if _MALLINFO2 is None:
        return None
    info = _MALLINFO2()
    return info.uordblks + info.hblkhd


def assert_heap_flat(before, what):
    after = heap_bytes()
    if before is not None and after is not None:
        assert after - before < HEAP_SLACK_BYTES, f"malloc'd memory grew by {after - before} bytes over {what}"


def settle():
    gc.collect()
    gc.collect()


def _inputs(seed):
    g = torch.Generator().manual_seed(seed)

    def r(*shape, dtype=torch.float32):
        return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype).requires_grad_()

    # (2, 2, 40, 32) float32 = 20 KiB a tensor: one leaked tensor a call is ~49 MiB of resident
    # memory over the run's 2,500 calls of its config; smaller ones show in heap_bytes().
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


def test_10000_forward_and_backward_calls_keep_memory_flat():
    cfgs = _inputs(0)
    for i in range(WARMUP):
        one_call(cfgs[i % len(cfgs)], i)
    settle()
    objects = len(gc.get_objects())
    before, heap_before = rss_mib(), heap_bytes()
    for i in range(CALLS):
        one_call(cfgs[i % len(cfgs)], i)
    settle()
    assert_heap_flat(heap_before, f"{CALLS} forward+backward calls")
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


def test_10000_calls_that_raise_keep_memory_flat():
    calls = _failing_calls()

    def run(n):
        for i in range(n):
            with pytest.raises((RuntimeError, ValueError, TypeError)):
                calls[i % len(calls)]()

    run(WARMUP)
    settle()
    before, heap_before = rss_mib(), heap_bytes()
    run(CALLS)
    settle()
    assert_heap_flat(heap_before, f"{CALLS} failing calls")
    growth = rss_mib() - before
    # Each failing call builds an error message and a traceback of a few hundred bytes or more:
    # a leak of one would show as several MiB over the run.
    assert growth < 4, f"resident memory grew by {growth:.1f} MiB over {CALLS} failing calls"

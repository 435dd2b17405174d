"""Concurrency: many Python threads calling forward and backward at once get bitwise the results
of serial calls. The ops release the GIL while they run, so the calls really overlap, and they
keep no global mutable state: threads using different dtypes, shapes, masks, causal alignments
and dropout states at the same time do not see each other.
"""
from __future__ import annotations

import threading
import time

import pytest
import torch

import attention_ext
from attention_ext.function import AttentionFunction

THREADS = 8
REPEATS = 3


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _randn(g, *shape, dtype):
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


# Workloads that differ in everything the kernels could keep state about: dtype, head dims,
# tile remainders, decode (one query row, split key ranges) vs tiled forward, masks of every kind,
# causal alignment, broadcast and GQA batches, dropout keyed by an explicit (seed, offset).
WORKLOADS = [
    dict(dtype=torch.float32, q=(2, 3, 70, 16), kv=(2, 3, 130, 16), dv=8, causal="top_left"),
    dict(dtype=torch.float64, q=(1, 2, 33, 5), kv=(1, 2, 47, 5), dv=7, mask="float"),
    dict(dtype=torch.bfloat16, q=(2, 4, 65, 32), kv=(2, 2, 64, 32), dv=32, gqa=True, causal="bottom_right"),
    dict(dtype=torch.float16, q=(3, 17, 24), kv=(3, 29, 24), dv=24, mask="bool"),
    dict(dtype=torch.float32, q=(4, 1, 64), kv=(4, 3000, 64), dv=64),  # decode: key ranges split and merged
    dict(dtype=torch.float32, q=(2, 2, 40, 8), kv=(1, 2, 90, 8), dv=8, dropout=0.3),
    dict(dtype=torch.float64, q=(2, 9, 3), kv=(2, 9, 3), dv=3, causal="top_left", mask="bool"),
    dict(dtype=torch.float32, q=(2, 2, 129, 160), kv=(2, 2, 66, 160), dv=1, mask="float", causal="bottom_right"),
]


def make_inputs(index, seed):
    w = WORKLOADS[index % len(WORKLOADS)]
    g = _gen(seed)
    dt = w["dtype"]
    q = _randn(g, *w["q"], dtype=dt).requires_grad_()
    k = _randn(g, *w["kv"], dtype=dt).requires_grad_()
    v = _randn(g, *w["kv"][:-1], w["dv"], dtype=dt).requires_grad_()
    mask = None
    n, m = w["q"][-2], w["kv"][-2]
    if w.get("mask") == "bool":
        mask = torch.rand((n, m), generator=g) < 0.7
    elif w.get("mask") == "float":
        mask = _randn(g, w["q"][-3], n, m, dtype=dt).requires_grad_()
    return w, q, k, v, mask


def run_workload(index, seed):
    """Forward (output, lse, exact weights) and backward (all gradients) of one workload."""
    w, q, k, v, mask = make_inputs(index, seed)
    if w.get("dropout"):
        rng = torch.tensor([seed, 1000 + index], dtype=torch.int64)
        causal = {None: 0, "top_left": 1, "bottom_right": 2}[w.get("causal")]
        out, lse = AttentionFunction.apply(q, k, v, mask, 0.3, causal, -1, -1, 0.0, None, None, w["dropout"], rng)
    else:
        out, lse = attention_ext.attention(q, k, v, attn_mask=mask, causal=w.get("causal"),
                                           enable_gqa=w.get("gqa", False), return_lse=True)
    grad_out = _randn(_gen(seed + 1), *out.shape, dtype=out.dtype)
    leaves = [q, k, v] + ([mask] if mask is not None and mask.requires_grad else [])
    grads = torch.autograd.grad((out, lse), leaves, (grad_out, torch.ones_like(lse)))
    weights = attention_ext.attention_weights(q.detach(), k.detach(),
                                              attn_mask=None if mask is None else mask.detach(),
                                              causal=w.get("causal"), enable_gqa=w.get("gqa", False))
    return [out.detach(), lse.detach(), weights, *grads]


def run_in_threads(jobs):
    """Runs jobs (callables) in THREADS threads released together; returns their results."""
    results = [None] * len(jobs)
    errors = []
    barrier = threading.Barrier(len(jobs))

    def worker(i):
        try:
            barrier.wait()
            results[i] = jobs[i]()
        except BaseException as e:  # surfaced in the main thread
            errors.append((i, e))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(jobs))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=300)
    assert not any(th.is_alive() for th in threads), "a thread did not finish"
    assert not errors, f"thread errors: {errors}"
    return results


def assert_bitwise_equal(got, want, what):
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{what}[{i}]"
        assert torch.equal(a, b), \
            f"{what}[{i}] differs from the serial result (max diff {(a.double() - b.double()).abs().max():.3e})"


def test_threads_with_different_dtypes_shapes_and_masks_match_serial_results_bitwise():
    serial = [run_workload(i, seed=100 + i) for i in range(THREADS)]

    def job(i):
        return lambda: [run_workload(i, seed=100 + i) for _ in range(REPEATS)]

    threaded = run_in_threads([job(i) for i in range(THREADS)])
    for i, reps in enumerate(threaded):
        for r, res in enumerate(reps):
            assert_bitwise_equal(res, serial[i], f"workload {i} repeat {r}")


def test_threads_sharing_the_same_input_tensors_match_serial_results_bitwise():
    """Concurrent reads of the same q/k/v/mask (and autograd graphs over the same leaves)."""
    w, q, k, v, mask = make_inputs(1, seed=7)  # float64 with a float mask that needs a gradient

    def once():
        out, lse = attention_ext.attention(q, k, v, attn_mask=mask, return_lse=True)
        grads = torch.autograd.grad(out.sum() + lse.sum(), [q, k, v, mask])
        return [out.detach(), lse.detach(), *grads]

    serial = once()
    threaded = run_in_threads([lambda: [once() for _ in range(REPEATS)]] * THREADS)
    for i, reps in enumerate(threaded):
        for res in reps:
            assert_bitwise_equal(res, serial, f"thread {i}")


def test_the_same_workload_gives_the_same_bits_whichever_workloads_run_beside_it():
    """Each thread runs a different mix, in a different order: still every result is the serial one."""
    serial = {i: run_workload(i, seed=200 + i) for i in range(len(WORKLOADS))}

    def job(t):
        order = [(t + 3 * j) % len(WORKLOADS) for j in range(len(WORKLOADS))]
        return lambda: [(i, run_workload(i, seed=200 + i)) for i in order]

    for t, results in enumerate(run_in_threads([job(t) for t in range(THREADS)])):
        for i, res in results:
            assert_bitwise_equal(res, serial[i], f"thread {t} workload {i}")


@pytest.mark.slow_on_emulation
def test_the_ops_release_the_gil_while_they_run():
    """While a long forward, then a long backward, runs in a worker thread, the main thread keeps
    executing Python code: if an op held the GIL, no main-thread step would fall inside its run.
    The sequence doubles until both calls take at least 50 ms (more cores, shorter calls)."""
    g = _gen(3)
    for length in (2048, 4096, 8192, 16384):
        q, k, v = (_randn(g, 1, 8, length, 64, dtype=torch.float32).requires_grad_() for _ in range(3))
        spans = {}

        def long_calls():
            # Python-side overhead is microseconds; the rest of each span is inside the kernels.
            t0 = time.perf_counter()
            out = attention_ext.attention(q, k, v)
            t1 = time.perf_counter()
            torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
            spans["forward"], spans["backward"] = (t0, t1), (t1, time.perf_counter())

        worker = threading.Thread(target=long_calls)
        stamps = []
        worker.start()
        while worker.is_alive():
            stamps.append(time.perf_counter())
            time.sleep(0)  # a step of Python work, then let others run
        worker.join()
        if min(t1 - t0 for t0, t1 in spans.values()) >= 0.05:
            break
    for name, (t0, t1) in spans.items():
        assert t1 - t0 > 0.02, f"the {name} was too short to tell ({t1 - t0:.3f} s)"
        margin = 0.2 * (t1 - t0)
        inside = [s for s in stamps if t0 + margin < s < t1 - margin]
        assert len(inside) >= 5, (f"only {len(inside)} main-thread steps ran during the {t1 - t0:.3f} s {name}: "
                                  "the op holds the GIL")

#!/usr/bin/env python
"""Sliding-window attention: time against window size, ours vs torch.

Run as `python benchmarks/bench_window.py [--length L] [--windows 64,256,...]` from a checkout
with an in-place build (or anywhere with an installed attention_ext). For each window w it times
attention(q, k, v, causal="bottom_right", window=(w, 0)) — Mistral's causal sliding window, the
kernels skipping the key tiles outside it — against torch's scaled_dot_product_attention given the
same band as a bool mask (torch has no window argument: that is how a window reaches it), forward
and forward+backward, candidates interleaved as in bench.py. FLOPs count only the visible
(query, key) pairs, so GFLOP/s and % of the machine's FMA peak (measured in the same run) say
how well the visible work runs; ms shows the cost following the window (O(n·w), not O(n²)).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402  (its machine measurements and naming)

import attention_ext  # noqa: E402


def visible_pairs(n, m, window):
    """(query, key) pairs inside the causal window (left = window, right = 0, bottom-right)."""
    i = torch.arange(n, dtype=torch.int64)
    diag = i + (m - n)
    hi = diag.clamp(max=m - 1)
    lo = (diag - window).clamp(min=0) if window is not None else torch.zeros_like(diag)
    return int((hi - lo + 1).clamp(min=0).sum())


def band_mask(n, m, window):
    diag = torch.arange(n).unsqueeze(-1) + (m - n)
    j = torch.arange(m)
    visible = j <= diag
    if window is not None:
        visible &= j >= diag - window
    return visible


def time_interleaved(steps, reps, warmup, before=None):
    """Median seconds per step, the steps timed in turn `reps` times after `warmup` untimed calls
    each; before(step), when given, runs (untimed) before every timed call of step. Each round
    takes the steps in its own order (a shuffle seeded by the round's number, the same in every
    run), so that no step always follows the same other step: one that evicts the caches (a large
    gather, say) would otherwise slow only the step after it."""
    for step in steps.values():
        for _ in range(warmup):
            step()
    samples = {name: [] for name in steps}
    for r in range(reps):
        order = list(steps)
        random.Random(r).shuffle(order)
        for name in order:
            step = steps[name]
            if before is not None:
                before(step)
            t0 = time.perf_counter()
            step()
            samples[name].append(time.perf_counter() - t0)
    return {name: statistics.median(s) for name, s in samples.items()}


def timed_steps(fns, mode, q, k, v, go):
    """One step per candidate: the forward under no_grad, or forward + backward of go."""
    for t in (q, k, v):
        t.requires_grad_(mode == "fwdbwd")
    steps = {}
    for name, fn in fns.items():
        if mode == "fwd":
            def step(fn=fn):
                with torch.no_grad():
                    fn()
        else:
            def step(fn=fn):
                for t in (q, k, v):
                    t.grad = None
                fn().backward(go)
        steps[name] = step
    return steps


def run(length, heads, d, windows, dtype, reps, warmup):
    g = torch.Generator().manual_seed(0)
    q, k, v, go = (torch.randn(1, heads, length, d, generator=g).to(dtype) for _ in range(4))
    rows = []
    for window in windows:
        mask = band_mask(length, length, window)
        pairs = visible_pairs(length, length, window)
        for mode in ("fwd", "fwdbwd"):
            fns = {"ours": lambda: attention_ext.attention(q, k, v, causal="bottom_right", window=(window, 0)),
                   "torch": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)}
            med = time_interleaved(timed_steps(fns, mode, q, k, v, go), reps, warmup)
            flops = 4.0 * heads * pairs * d * (1.0 if mode == "fwd" else 3.5)
            row = {"window": window, "mode": mode, "visible_pairs": pairs,
                   "ms": {c: t * 1e3 for c, t in med.items()},
                   "gflops": {c: flops / t / 1e9 for c, t in med.items()},
                   "torch_over_ours": med["torch"] / med["ours"]}
            rows.append(row)
            print(f"window {str(window):>5s} {mode:6s} ours {row['ms']['ours']:8.1f} ms  torch+mask "
                  f"{row['ms']['torch']:8.1f} ms  torch/ours {row['torch_over_ours']:.2f}", flush=True)
    return rows


def run_modifiers(length, heads, d, dtype, reps, warmup):
    """Full causal attention with each score modifier / sinks, forward and forward+backward, beside
    the plain call and torch's SDPA (is_causal=True; for ALiBi, torch gets the bias as a float
    mask, the only way it takes one; softcap and sinks it cannot do)."""
    g = torch.Generator().manual_seed(0)
    q, k, v, go = (torch.randn(1, heads, length, d, generator=g).to(dtype) for _ in range(4))
    slopes = torch.rand(heads, generator=g)
    sinks = torch.randn(heads, generator=g)
    distance = (torch.arange(length).unsqueeze(-1) - torch.arange(length)).abs().to(dtype)
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    alibi_mask = (-slopes[:, None, None].to(dtype) * distance).masked_fill(~causal, float("-inf"))
    cases = [("none", {}), ("softcap 30", dict(softcap=30.0)), ("ALiBi", dict(alibi_slopes=slopes)),
             ("sinks", dict(sinks=sinks)), ("all three", dict(softcap=30.0, alibi_slopes=slopes, sinks=sinks))]
    rows = []
    for mode in ("fwd", "fwdbwd"):
        fns = {name: (lambda kw=kw: attention_ext.attention(q, k, v, causal="bottom_right", **kw))
               for name, kw in cases}
        fns["torch"] = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)
        fns["torch ALiBi mask"] = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=alibi_mask)
        med = time_interleaved(timed_steps(fns, mode, q, k, v, go), reps, warmup)
        for name in fns:
            rows.append({"case": name, "mode": mode, "ms": med[name] * 1e3, "over_plain": med[name] / med["none"]})
            print(f"{mode:6s} {name:16s} {med[name] * 1e3:8.1f} ms  x{med[name] / med['none']:.2f} of plain",
                  flush=True)
    return rows


def render_modifiers(meta, rows):
    lines = ["", f"## Score modifiers and sinks, full causal (1, {meta['heads']}, {meta['length']}, {meta['length']}, "
             f"{meta['d']})", "",
             "| case | mode | ms | time / plain ours |", "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['mode']} | {r['ms']:.1f} | {r['over_plain']:.2f} |")
    return "\n".join(lines) + "\n"


def render(meta, rows):
    peak = meta["fma_peak_gflops"]
    lines = [f"# Sliding-window attention, {meta['dtype']}, {meta['cpu']}", "",
             f"torch {meta['torch']}, {meta['threads']} threads, kernel variant {meta['variant']}; measured FMA peak "
             f"{peak_text(meta)}. Shape (1, {meta['heads']}, {meta['length']}, "
             f"{meta['length']}, "
             f"{meta['d']}), causal window (w, 0); torch gets the same band as a bool attn_mask. GFLOP/s count the "
             "visible pairs only (backward 2.5x forward).", "",
             f"Command: `{meta['command']}`", "",
             "| window w | mode | ours ms | torch + mask ms | torch / ours | ours GFLOP/s | % of peak |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        w = "full (causal)" if r["window"] is None else str(r["window"])
        lines.append(f"| {w} | {r['mode']} | {r['ms']['ours']:.1f} | {r['ms']['torch']:.1f} | "
                     f"{r['torch_over_ours']:.2f} | {r['gflops']['ours']:.1f} | "
                     f"{100 * r['gflops']['ours'] / peak:.0f}% |")
    return "\n".join(lines) + "\n"


def settle_peak(meta, peak_before):
    """Measures the FMA peak again after the timings and keeps the larger of the two: a shared
    machine's capacity drifts, and a peak taken while a neighbour was busy would overstate every %."""
    peak_after = bench.measure_fma_peak()["gflops"]
    meta["fma_peak_gflops_start_end"] = [peak_before, peak_after]
    meta["fma_peak_gflops"] = max(peak_before, peak_after)


def peak_text(meta):
    """The table header's account of the peak that every % of peak is against."""
    before, after = meta["fma_peak_gflops_start_end"]
    return f"{meta['fma_peak_gflops']:.0f} GFLOP/s (same run; {before:.0f} before the timings, {after:.0f} after)"


def publish(prefix, text, data):
    """Prints the markdown table and, with a prefix (--out), writes PREFIX.md and PREFIX.json."""
    print(text)
    if prefix:
        with open(prefix + ".md", "w") as f:
            f.write(text)
        with open(prefix + ".json", "w") as f:
            json.dump(data, f, indent=1)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--windows", default="64,256,1024,full", help="comma-separated; 'full' = causal, no window")
    ap.add_argument("--dtype", choices=list(bench.DTYPES), default="float32")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--modifiers", action="store_true",
                    help="also time softcap / ALiBi / sinks at full causal against the plain call and torch")
    ap.add_argument("--out", default=None, help="write PREFIX.md and PREFIX.json")
    a = ap.parse_args(argv)
    windows = [None if w == "full" else int(w) for w in a.windows.split(",")]
    peak = bench.measure_fma_peak()
    meta = {"cpu": bench.cpu_name(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "variant": attention_ext.cpu_variant(), "fma_peak_gflops": peak["gflops"], "dtype": a.dtype,
            "length": a.length, "heads": a.heads, "d": a.d,
            "command": "python benchmarks/bench_window.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    print(f"{meta['cpu']}: FMA peak {peak['gflops']:.0f} GFLOP/s on {meta['threads']} threads", flush=True)
    rows = run(a.length, a.heads, a.d, windows, bench.DTYPES[a.dtype], a.reps, a.warmup)
    modifier_rows = []
    if a.modifiers:
        modifier_rows = run_modifiers(a.length, a.heads, a.d, bench.DTYPES[a.dtype], a.reps, a.warmup)
    settle_peak(meta, peak["gflops"])
    text = render(meta, rows) + (render_modifiers(meta, modifier_rows) if modifier_rows else "")
    publish(a.out, text, {"meta": meta, "rows": rows, "modifier_rows": modifier_rows})


if __name__ == "__main__":
    main()

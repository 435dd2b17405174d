#!/usr/bin/env python
"""Packed variable-length batches: time against padding, ours vs torch.

Run as `python benchmarks/bench_varlen.py [--lengths 2048,1500,...] [--heads 8] [--d 64]` from a
checkout with an in-place build (or anywhere with an installed attention_ext). A batch of causal
sequences of the given lengths runs six ways, forward and forward+backward, candidates
interleaved as in bench.py:
  * ours packed: flash_attn_varlen_func on the packed (total, heads, d) tensors (no padding);
  * ours / torch padded causal: attention(causal="top_left") and torch's scaled_dot_product_attention
    (is_causal=True) on the batch padded to the longest sequence (right padding: a real row sees no
    padding key under the causal rule, so no mask is needed and the tiles above the diagonal are
    skipped; the padding rows' outputs are discarded). The fairest padded baseline;
  * ours / torch padded + mask: the same padded batch with the padding and causal structure as a
    bool mask (what a padded batch with an attention mask costs, as a general masked call);
  * torch loop: torch's SDPA (is_causal=True) on each sequence in turn (no padding, one call each).
FLOPs count only the causal pairs inside the sequences (Σ n_b(n_b + 1)/2), so GFLOP/s and % of
the machine's FMA peak (measured in the same run) say how well the useful work runs; the padded
rows show what padding costs.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402  (its machine measurements and naming)
from bench_window import peak_text, publish, settle_peak, time_interleaved  # noqa: E402

import attention_ext  # noqa: E402


def inputs(lengths, heads, d, dtype):
    g = torch.Generator().manual_seed(0)
    total, longest, batch = sum(lengths), max(lengths), len(lengths)
    q, k, v, go = (torch.randn(total, heads, d, generator=g).to(dtype) for _ in range(4))
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    # The padded batch (batch, heads, longest, d) and its mask: key j of sequence b is visible to
    # query i iff j <= i and j < n_b (rows past n_b are padding; their output is discarded).
    padded = [torch.zeros(batch, heads, longest, d, dtype=dtype) for _ in range(4)]
    for b, n in enumerate(lengths):
        for dst, src in zip(padded, (q, k, v, go)):
            dst[b, :, :n] = src[cu[b]:cu[b + 1]].transpose(0, 1)
    j = torch.arange(longest)
    real = j.unsqueeze(0) < torch.tensor(lengths).unsqueeze(-1)  # (batch, longest)
    mask = (j.unsqueeze(-1) >= j) & real.unsqueeze(1)  # (batch, longest, longest)
    mask |= ~real.unsqueeze(-1)  # padding rows see everything real (keeps them finite; discarded)
    return (q, k, v, go, cu), padded, mask.unsqueeze(1)


def candidates(packed, padded, mask, lengths):
    """name -> (the tensors it differentiates, its output's gradient, the call)."""
    q, k, v, go, cu = packed
    pq, pk, pv, pgo = padded
    longest = max(lengths)
    return {
        "ours packed": ((q, k, v), go.unsqueeze(0), lambda: attention_ext.flash_attn_varlen_func(
            q, k, v, cu, cu, longest, longest, causal=True).unsqueeze(0)),
        "ours padded causal": ((pq, pk, pv), pgo, lambda: attention_ext.attention(pq, pk, pv, causal="top_left")),
        "torch padded causal": ((pq, pk, pv), pgo, lambda: F.scaled_dot_product_attention(pq, pk, pv, is_causal=True)),
        "ours padded + mask": ((pq, pk, pv), pgo, lambda: attention_ext.attention(pq, pk, pv, attn_mask=mask)),
        "torch padded + mask": ((pq, pk, pv), pgo, lambda: F.scaled_dot_product_attention(pq, pk, pv, attn_mask=mask)),
        # (1, heads, n, d) views: torch's CPU flash kernel takes 4-D inputs only (3-D ones go to
        # its math fallback, several times slower).
        "torch loop": ((q, k, v), go.unsqueeze(0), lambda: torch.cat([F.scaled_dot_product_attention(
            *(t[a:b].transpose(0, 1).unsqueeze(0) for t in (q, k, v)), is_causal=True)[0].transpose(0, 1)
            for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())]).unsqueeze(0)),
    }


def agreement(packed, padded, mask, lengths):
    """Each candidate's largest difference from ours packed over the real tokens' outputs."""
    with torch.no_grad():
        outs = {name: fn() for name, (_, _, fn) in candidates(packed, padded, mask, lengths).items()}
    def tokens(name):  # padded (batch, heads, longest, d): its real rows; else (1, total, heads, d)
        out = outs[name]
        return torch.cat([out[b, :, :n].transpose(0, 1) for b, n in enumerate(lengths)]) if "padded" in name \
            else out[0]
    ref = tokens("ours packed").double()
    return {name: (tokens(name).double() - ref).abs().max().item() for name in outs}


def steps_for(mode, packed, padded, mask, lengths):
    for t in (*packed[:3], *padded[:3]):
        t.requires_grad_(mode == "fwdbwd")
    fns = candidates(packed, padded, mask, lengths)
    steps = {}
    for name, (tensors, grad, fn) in fns.items():
        if mode == "fwd":
            def step(fn=fn):
                with torch.no_grad():
                    fn()
        else:
            def step(fn=fn, tensors=tensors, grad=grad):
                for t in tensors:
                    t.grad = None
                fn().backward(grad)
        steps[name] = step
    return steps


def run(lengths, heads, d, dtype, reps, warmup):
    packed, padded, mask = inputs(lengths, heads, d, dtype)
    pairs = sum(n * (n + 1) // 2 for n in lengths)
    rows = []
    diffs = agreement(packed, padded, mask, lengths)
    for mode in ("fwd", "fwdbwd"):
        med = time_interleaved(steps_for(mode, packed, padded, mask, lengths), reps, warmup)
        flops = 4.0 * heads * pairs * d * (1.0 if mode == "fwd" else 3.5)
        for name, t in med.items():
            rows.append({"candidate": name, "mode": mode, "ms": t * 1e3, "gflops": flops / t / 1e9,
                         "over_ours_packed": t / med["ours packed"], "max_diff": diffs[name]})
            print(f"{mode:6s} {name:19s} {t * 1e3:9.1f} ms  {flops / t / 1e9:7.1f} GFLOP/s  "
                  f"x{t / med['ours packed']:.2f} of ours packed", flush=True)
    return rows


def render(meta, rows):
    peak = meta["fma_peak_gflops"]
    lengths = meta["lengths"]
    lines = [f"# Packed variable-length batch, {meta['dtype']}, {meta['cpu']}", "",
             f"torch {meta['torch']}, {meta['threads']} threads, kernel variant {meta['variant']}; measured FMA peak "
             f"{peak_text(meta)}. {len(lengths)} causal sequences of lengths "
             f"{', '.join(map(str, lengths))} ({sum(lengths)} tokens; padded: {len(lengths)} x {max(lengths)}), "
             f"{meta['heads']} heads, head dim {meta['d']}. GFLOP/s count the causal pairs inside the sequences "
             "only (backward 2.5x forward), so the padded rows' GFLOP/s are useful work per second.", "",
             f"Command: `{meta['command']}`", "",
             "| candidate | mode | ms | time / ours packed | useful GFLOP/s | % of peak | max diff from ours packed |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['candidate']} | {r['mode']} | {r['ms']:.1f} | {r['over_ours_packed']:.2f} | "
                     f"{r['gflops']:.1f} | {100 * r['gflops'] / peak:.0f}% | {r['max_diff']:.1e} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="2048,1536,1024,768,512,384,256,128",
                    help="comma-separated sequence lengths")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--dtype", choices=list(bench.DTYPES), default="float32")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--out", default=None, help="write PREFIX.md and PREFIX.json")
    a = ap.parse_args(argv)
    lengths = [int(n) for n in a.lengths.split(",")]
    peak = bench.measure_fma_peak()
    meta = {"cpu": bench.cpu_name(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "variant": attention_ext.cpu_variant(), "dtype": a.dtype, "lengths": lengths, "heads": a.heads,
            "d": a.d, "command": "python benchmarks/bench_varlen.py " + " ".join(argv if argv is not None
                                                                                 else sys.argv[1:])}
    print(f"{meta['cpu']}: FMA peak {peak['gflops']:.0f} GFLOP/s on {meta['threads']} threads", flush=True)
    rows = run(lengths, a.heads, a.d, bench.DTYPES[a.dtype], a.reps, a.warmup)
    settle_peak(meta, peak["gflops"])
    text = render(meta, rows)
    publish(a.out, text, {"meta": meta, "rows": rows})


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""The decode kernel's own work per key, with K and V held in cache.

    OMP_NUM_THREADS=1 python benchmarks/decode_in_cache.py [--dtype float32] [--rows 1] [--tokens 256] [--heads-per-kv 4]
        [--kv-cache]

K and V of one cache of `tokens` keys x 8 KV heads x d = 64 are expanded (stride 0) over 512 batch
entries while the queries (--heads-per-kv query heads per KV head, 4 by default, `rows` query rows
each) are distinct, so the decode kernel runs its full loop over 512 x 8 x tokens (key, KV head)
pairs while reading the same 1 MiB (fp32, 256 tokens) held in cache (L2 where a core has 1 MiB of it or more, else L2 and
L3: Zen 3's 512 KiB L2 per core keeps half of it there): what it costs per key when DRAM is not the
limit.
With --kv-cache the same work runs the way a serving loop calls it: one tokens-major KV cache
(1, tokens, 8, d), as `flash_attn_with_kvcache` takes it, read by all 512 batch entries through
cache_batch_idx = 0 (the decode kernel then walks every head of a key at once, in storage order).
The cycle count uses the clock implied by the measured FMA peak (bench.measure_fma_peak on this
thread count, 2 FMA pipes x the fp32 lanes x 2 flops per cycle: on a core with one 512-bit FMA
pipe the clock and the cycle counts come out half their true value).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402

import attention_ext  # noqa: E402

BATCH, KV_HEADS, D = 512, 8, 64


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--rows", type=int, default=1, help="query rows per head")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--heads-per-kv", type=int, default=4, help="query heads per KV head (GQA group size)")
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--kv-cache", action="store_true",
                    help="one tokens-major cache read by every entry through flash_attn_with_kvcache")
    a = ap.parse_args(argv)
    dtype = getattr(torch, a.dtype)
    g = torch.Generator().manual_seed(0)
    if a.kv_cache:
        k = torch.randn(1, a.tokens, KV_HEADS, D, generator=g).to(dtype)
        v = torch.randn(1, a.tokens, KV_HEADS, D, generator=g).to(dtype)
        q = torch.randn(BATCH, a.rows, KV_HEADS * a.heads_per_kv, D, generator=g).to(dtype)
        entry = torch.zeros(BATCH, dtype=torch.int32)

        def call():
            attention_ext.flash_attn_with_kvcache(q, k, v, cache_seqlens=a.tokens, cache_batch_idx=entry)
    else:
        k = torch.randn(1, KV_HEADS, a.tokens, D, generator=g).to(dtype).expand(BATCH, -1, -1, -1)
        v = torch.randn(1, KV_HEADS, a.tokens, D, generator=g).to(dtype).expand(BATCH, -1, -1, -1)
        q = torch.randn(BATCH, KV_HEADS * a.heads_per_kv, a.rows, D, generator=g).to(dtype)

        def call():
            attention_ext.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    with torch.no_grad():
        for _ in range(3):
            call()
        best, start = float("inf"), time.perf_counter()
        while best == float("inf") or time.perf_counter() - start < a.seconds:
            t = time.perf_counter()
            call()
            best = min(best, time.perf_counter() - t)
    peak = bench.measure_fma_peak()
    lanes = {"amx": 16, "avx512": 16, "avx512bf16": 16, "avx2": 8}.get(peak.get("variant"), 4)  # fp32 lanes
    ghz = peak["gflops"] / peak["threads"] / (2 * lanes * 2)  # 2 FMA pipes x lanes x 2 flops
    pairs = BATCH * KV_HEADS * a.tokens
    per_pair = best / pairs
    print(f"{bench.cpu_name()}, {torch.get_num_threads()} thread(s), {a.dtype}, {a.rows} query row(s) x "
          f"{a.heads_per_kv} heads per KV head, {a.tokens} tokens{', one KV cache' if a.kv_cache else ''}: "
          f"{best * 1e3:.2f} ms, "
          f"{per_pair * 1e9:.2f} ns = {per_pair * ghz * 1e9:.0f} cycles per (key, KV head) at {ghz:.2f} GHz "
          f"(implied by the measured FMA peak, {peak['gflops']:.0f} GFLOP/s, assuming 2 FMA pipes)")


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Decode against a KV cache: flash_attn_with_kvcache at the memory-bandwidth limit.

Run as `python benchmarks/bench_kvcache.py [--lengths 2048,8192,32768] [--dtypes float32,bfloat16]`
from a checkout with an in-place build (or anywhere with an installed attention_ext). Decode is
bound by reading K and V once, so every row reports GB/s of K/V read per call against the
machine's streaming read bandwidth measured in the same run (bench.measure_bandwidth: a 512 MiB
tensor read once, at the start and at the end, the larger used), and with --read-beside also against
a read of 512 MiB timed before each of its calls (the machine's rate at the same moments, which on a
VM can move by a quarter within minutes). Per (dtype, cached tokens, batch·kv_heads, query rows) it
times, interleaved (each round in its own shuffled order), each timed call right after two untimed
calls of the same candidate (back to back: the call finds the caches as its own call left them, not
as torch's gather, which evicts them, left them; two, as on a 2-vCPU VM the second call after the
gather's large free ran about 3x slower, benchmarks/README.md; or with --read-beside after the read):
  * ours contiguous: flash_attn_with_kvcache on a (batch, tokens, kv_heads, d) cache;
  * ours contiguous, VARIANT (with --also-variant VARIANT): the same call on another CPU kernel
    variant's code (e.g. avx512, whose bf16 decode converts to fp32, beside avx512bf16's dot products);
  * ours paged 16 / paged 256: caches of the same shape and size (keys drawn afresh for each: the
    timing does not depend on the values) in shuffled blocks of 16 / 256 rows through a block table;
  * torch sliced: torch's scaled_dot_product_attention over the cache's filled rows (a view,
    enable_gqa), what a torch decode step does;
  * torch gathered: torch's SDPA after gathering the paged blocks (what a paged cache costs torch).
Append rows time one call that also writes one new token per entry into the cache (in place)
against the call without it, beside the bare write (index_put_) of those rows, and the call that
also rotates q and the new token (rotary over the whole head dim, GPT-NeoX halves). The % of bandwidth
can pass 100 % when a working set fits the CPU's last-level cache; the table gives each set's size.
Under THP_MEM_ALLOC_ENABLE=1 torch's CPU allocator asks for transparent huge pages for large
tensors (Linux; what a serving process can set): the table says whether the caches had them.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402  (its machine measurements and naming)
from bench_window import publish, time_interleaved  # noqa: E402

import attention_ext  # noqa: E402
from attention_ext import flash_attn_with_kvcache  # noqa: E402

D = 64


def make_cache(batch, kv_heads, tokens, dtype, block_size, g):
    k = torch.randn(batch, tokens, kv_heads, D, generator=g).to(dtype)
    v = torch.randn(batch, tokens, kv_heads, D, generator=g).to(dtype)
    if block_size is None:
        return k, v, None
    per_entry = tokens // block_size
    table = torch.randperm(batch * per_entry, generator=g).view(batch, per_entry).to(torch.int32)
    kp = torch.empty(batch * per_entry, block_size, kv_heads, D, dtype=dtype)
    vp = torch.empty_like(kp)
    kp[table.long()] = k.view(batch, per_entry, block_size, kv_heads, D)
    vp[table.long()] = v.view(batch, per_entry, block_size, kv_heads, D)
    return kp, vp, table


def under_variant(variant, fn):
    """fn run with the CPU kernel variant `variant` active, the previous one restored after."""
    def step():
        previous = attention_ext.cpu_variant()
        attention_ext.set_cpu_variant(variant)
        try:
            fn()
        finally:
            attention_ext.set_cpu_variant(previous)
    return step


class ReadBeside:
    """The machine's streaming read measured before every timed call of the candidates: the
    extension's probe (8 parts per thread side by side) over a 512 MiB tensor, or, without that op,
    torch's sum over it. The bandwidth of a VM can move by a quarter within minutes; the read beside
    a call's timings sets its GB/s against the machine's rate of the same moments, where the run's
    start and end measurements may fall in another phase. Every call then starts with its K/V out
    of the caches and their pages out of the TLB. The read also evicts the code and the small data
    that every call touches (Python's, the dispatcher's, the kernel's): on a Zen 4 a 64-token call
    took 0.28-0.35 ms right after it against 0.03 otherwise, and a call on a 2048-token cache took
    0.1-0.25 ms more first after the read than second, whichever cache (contiguous or paged) went
    first. So after each read one small call of each kind (ours, torch's) runs untimed: what a timed
    call then pays for is its K/V (and the call's own scratch), as in a model, whose layers run the
    same code in turn."""

    def __init__(self, mib=512):
        self.x = torch.ones(int(mib * bench.MIB) // 4)
        self.probe = getattr(torch.ops.attention_ext, "cpu_stream_read_gbps", None)
        self.rates = []

    def __call__(self):
        if self.probe is not None:
            self.rates.append(self.probe(self.x))
            return
        t0 = time.perf_counter()
        self.x.sum()
        self.rates.append(self.x.numel() * 4 / (time.perf_counter() - t0) / 1e9)

    def median(self, since):
        return statistics.median(self.rates[since:])


def run_config(dtype, tokens, batch, kv_heads, heads_per_kv, rows, reps, warmup, also_variant=None, read=None):
    g = torch.Generator().manual_seed(0)
    heads = kv_heads * heads_per_kv
    q = torch.randn(batch, rows, heads, D, generator=g).to(dtype)
    lengths = torch.full((batch,), tokens, dtype=torch.int32)
    caches = {name: make_cache(batch, kv_heads, tokens, dtype, bs, g)
              for name, bs in (("contiguous", None), ("paged 16", 16), ("paged 256", 256))}
    k, v, _ = caches["contiguous"]
    kp, vp, table = caches["paged 16"]
    qt = q.transpose(1, 2)
    steps = {}
    for name, (kc, vc, bt) in caches.items():
        steps["ours " + name] = (lambda kc=kc, vc=vc, bt=bt: flash_attn_with_kvcache(
            q, kc, vc, cache_seqlens=lengths, block_table=bt, causal=True))
    if also_variant:  # the same contiguous call on another variant's kernels, interleaved with the rest
        steps[f"ours contiguous, {also_variant}"] = under_variant(also_variant, steps["ours contiguous"])
    steps["torch sliced"] = lambda: bench.torch_sdpa_gqa(qt, k.transpose(1, 2), v.transpose(1, 2))
    steps["torch gathered"] = lambda: bench.torch_sdpa_gqa(
        qt, kp[table.long()].flatten(1, 2).transpose(1, 2), vp[table.long()].flatten(1, 2).transpose(1, 2))

    def no_grad(fn):
        def step():
            with torch.no_grad():
                fn()
        return step

    timed = {name: no_grad(fn) for name, fn in steps.items()}

    if read is None:
        def before(step):  # back to back: each timed call finds the caches as its own calls left them
            step()
            step()
    else:
        small_k, small_v, _ = make_cache(batch, kv_heads, 64, dtype, None, g)
        small_lengths = torch.full((batch,), 64, dtype=torch.int32)

        def before(step):  # the read, then the code and the calls' small data back in the caches
            read()
            with torch.no_grad():
                flash_attn_with_kvcache(q, small_k, small_v, cache_seqlens=small_lengths, causal=True)
                bench.torch_sdpa_gqa(qt, small_k.transpose(1, 2), small_v.transpose(1, 2))
    since = len(read.rates) if read is not None else 0
    med = time_interleaved(timed, reps, warmup, before)
    read_gbps = read.median(since) if read is not None else None
    reads = len(read.rates) - since if read is not None else 0
    # torch gets no causal rule (its is_causal is top-left, not the cache's bottom-right): it reads
    # every cached key, as ours does (bottom-right causal hides only the last rows' few newest keys).
    kv_bytes = 2 * batch * kv_heads * tokens * D * torch.tensor([], dtype=dtype).element_size()
    results = {name: {"ms": t * 1e3, "gbps": kv_bytes / t / 1e9} for name, t in med.items()}
    return results, kv_bytes, (read_gbps, reads)


def run_append(dtype, tokens, batch, kv_heads, heads_per_kv, reps, warmup):
    g = torch.Generator().manual_seed(1)
    heads = kv_heads * heads_per_kv
    q = torch.randn(batch, 1, heads, D, generator=g).to(dtype)
    k_new = torch.randn(batch, 1, kv_heads, D, generator=g).to(dtype)
    v_new = torch.randn(batch, 1, kv_heads, D, generator=g).to(dtype)
    k, v, _ = make_cache(batch, kv_heads, tokens + 1, dtype, None, g)
    lengths = torch.full((batch,), tokens, dtype=torch.int32)
    rows = torch.arange(batch).unsqueeze(-1)
    positions = torch.full((batch, 1), tokens)

    def write():
        k.index_put_((rows, positions), k_new)
        v.index_put_((rows, positions), v_new)

    steps = {"attend": lambda: flash_attn_with_kvcache(q, k, v, cache_seqlens=lengths + 1, causal=True),
             "append + attend": lambda: flash_attn_with_kvcache(q, k, v, k_new, v_new, cache_seqlens=lengths,
                                                                causal=True),
             "write only": write}
    # Rotary on q and the new keys (GPT-NeoX halves over the whole head dim), as a Llama decode step.
    angles = torch.arange(tokens + 1, dtype=torch.float64).unsqueeze(-1) / 10000 ** (torch.arange(0, D, 2) / D)
    cos, sin = angles.cos().float(), angles.sin().float()
    steps["append + rotary + attend"] = lambda: flash_attn_with_kvcache(
        q, k, v, k_new, v_new, rotary_cos=cos, rotary_sin=sin, cache_seqlens=lengths, causal=True,
        rotary_interleaved=False)
    med = time_interleaved(steps, reps, warmup)
    return {name: t * 1e3 for name, t in med.items()}


def render(meta, rows, append_rows):
    bw, group = meta["bandwidth_gbps"], meta.get("heads_per_kv", 4)
    beside_cols = any(r.get("read_beside_gbps") for r in rows)
    method = meta.get("bandwidth_method", "torch's sum")
    lines = [f"# Decode against a KV cache, {meta['cpu']}", "",
             f"torch {meta['torch']}, {meta['threads']} threads, kernel variant {meta['variant']}; measured streaming "
             f"read bandwidth {bw:.1f} GB/s ({method} over 512 MiB; "
             f"same run: {meta['bandwidth_start_end'][0]:.1f} before the timings, "
             f"{meta['bandwidth_start_end'][1]:.1f} after; the larger is used"
             + ("; `% of the read beside` sets each GB/s against a read of 512 MiB by the extension's probe timed "
                "before every call of the same row, median over the row, so every call starts with K/V out of the "
                "caches and their pages out of the TLB, as in a model whose other layers run between two calls; "
                "after each read one call of ours and one of torch's on a 64-token cache run untimed, so that the "
                "code and small data every call touches are back in the caches"
                if beside_cols else "")
             + f"). Heads = {group} x kv_heads "
             f"({'GQA' if group > 1 else 'one query head per KV head'}), head dim {D}, causal. GB/s = K and V bytes "
             f"read per call / time; each timed call "
             + ("follows the read" if beside_cols else "right after two untimed calls of the same candidate")
             + ", the candidates in a shuffled order per round. Caches allocated "
             f"{'with' if meta.get('thp_mem_alloc') else 'without'} torch's THP_MEM_ALLOC_ENABLE=1 (transparent huge "
             f"pages).", "",
             f"Command: `{meta['command']}`", "",
             "| dtype | tokens | batch x kv_heads | q rows | K/V MiB | candidate | ms | GB/s | % of bandwidth | "
             + ("read beside GB/s | % of the read beside | " if beside_cols else "") + "time / ours contiguous |",
             "|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if beside_cols else "")]
    for r in rows:
        base = r["results"]["ours contiguous"]["ms"]
        beside = r.get("read_beside_gbps")
        for name, res in r["results"].items():
            lines.append(f"| {r['dtype']} | {r['tokens']} | {r['batch']} x {r['kv_heads']} | {r['rows']} | "
                         f"{r['kv_bytes'] / 2**20:.0f} | {name} | {res['ms']:.3f} | {res['gbps']:.1f} | "
                         f"{100 * res['gbps'] / bw:.0f}% | "
                         + (f"{beside:.1f} | {100 * res['gbps'] / beside:.0f}% | " if beside_cols else "")
                         + f"{res['ms'] / base:.2f} |")
    if append_rows:
        lines += ["", "## Appending one token per entry, in place", "",
                  "| dtype | tokens | batch x kv_heads | attend ms | append + attend ms | extra ms | write only ms | "
                  "append + rotary + attend ms | rotary extra ms |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in append_rows:
            t = r["ms"]
            lines.append(f"| {r['dtype']} | {r['tokens']} | {r['batch']} x {r['kv_heads']} | {t['attend']:.3f} | "
                         f"{t['append + attend']:.3f} | {t['append + attend'] - t['attend']:.3f} | "
                         f"{t['write only']:.3f} | {t['append + rotary + attend']:.3f} | "
                         f"{t['append + rotary + attend'] - t['append + attend']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="2048,8192,32768")
    ap.add_argument("--batches", default="1x8,8x8", help="comma list of BATCHxKV_HEADS")
    ap.add_argument("--rows", default="1,4", help="query rows per entry (speculative decoding: several)")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="comma list of float32, bfloat16, float16")
    ap.add_argument("--heads-per-kv", type=int, default=4,
                    help="query heads per KV head (GQA group size; 1: one query head per KV head)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--also-variant", default=None,
                    help="also time the contiguous call on this CPU kernel variant (e.g. avx512 beside avx512bf16)")
    ap.add_argument("--read-beside", action="store_true",
                    help="also read 512 MiB before every timed call (the read probe, timed; then one small call of "
                         "each kind, untimed, to bring the code back): each row's GB/s is then also set against the "
                         "machine's read rate of the same moments, and every call starts with K/V out of the caches "
                         "and the TLB (a model's other layers between two calls do the same)")
    ap.add_argument("--out", default=None, help="write PREFIX.md and PREFIX.json")
    a = ap.parse_args(argv)
    cache_dtypes = {**bench.DTYPES, "float16": torch.float16}  # (fp16 caches are common in serving)
    unknown = [name for name in a.dtypes.split(",") if name not in cache_dtypes]
    if unknown:
        ap.error(f"--dtypes {a.dtypes}: unknown {', '.join(unknown)}; choose from {', '.join(cache_dtypes)}")
    if a.also_variant and a.also_variant not in attention_ext.build_info()["cpu_variants_supported"].split(","):
        ap.error(f"--also-variant {a.also_variant}: this CPU and build support "
                 f"{attention_ext.build_info()['cpu_variants_supported']}")
    bw_first = bench.measure_bandwidth()
    bw_start = bw_first["gbps"]
    thp = os.environ.get("THP_MEM_ALLOC_ENABLE") == "1"  # (torch's CPU allocator asks for huge pages)
    meta = {"cpu": bench.cpu_name(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "variant": attention_ext.cpu_variant(), "thp_mem_alloc": thp, "heads_per_kv": a.heads_per_kv,
            "bandwidth_method": bw_first["method"],
            "command": ("THP_MEM_ALLOC_ENABLE=1 " if thp else "") + "python benchmarks/bench_kvcache.py " +
            " ".join(argv if argv is not None else sys.argv[1:])}
    print(f"{meta['cpu']}: streaming read {bw_start:.1f} GB/s on {meta['threads']} threads", flush=True)
    rows, append_rows = [], []
    read = ReadBeside() if a.read_beside else None
    for dtype_name in a.dtypes.split(","):
        dtype = cache_dtypes[dtype_name]
        for tokens in (int(t) for t in a.lengths.split(",")):
            for spec in a.batches.split(","):
                batch, kv_heads = (int(x) for x in spec.split("x"))
                for nrows in (int(r) for r in a.rows.split(",")):
                    results, kv_bytes, (beside, reads) = run_config(
                        dtype, tokens, batch, kv_heads, a.heads_per_kv, nrows, a.reps, a.warmup, a.also_variant, read)
                    rows.append({"dtype": dtype_name, "tokens": tokens, "batch": batch, "kv_heads": kv_heads,
                                 "rows": nrows, "kv_bytes": kv_bytes, "results": results,
                                 "read_beside_gbps": beside, "read_beside_reads": reads})
                    print(f"{dtype_name} {tokens:6d} {batch}x{kv_heads} rows {nrows}: " + ", ".join(
                        f"{name} {res['gbps']:.1f} GB/s" for name, res in results.items())
                        + (f"; read beside {beside:.1f} GB/s" if beside else ""), flush=True)
                append_rows.append({"dtype": dtype_name, "tokens": tokens, "batch": batch, "kv_heads": kv_heads,
                                    "ms": run_append(dtype, tokens, batch, kv_heads, a.heads_per_kv, a.reps,
                                                      a.warmup)})
    bw_end = bench.measure_bandwidth()["gbps"]
    meta["bandwidth_start_end"] = [bw_start, bw_end]
    meta["bandwidth_gbps"] = max(bw_start, bw_end)
    text = render(meta, rows, append_rows)
    publish(a.out, text, {"meta": meta, "rows": rows, "append_rows": append_rows})


if __name__ == "__main__":
    main()

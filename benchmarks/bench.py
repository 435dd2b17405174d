#!/usr/bin/env python
"""Benchmark: attention_ext vs torch SDPA vs a naive softmax(q k^T * scale) v composition, on the
CPU and, when torch sees one, a CUDA GPU (--device).

Run as `python benchmarks/bench.py [options]` (or `python -m attention_ext bench [options]` from a
checkout). It measures the machine it runs on first — the FMA peak with a compiled loop on every
thread (the CPU kernels' own fma_probe), the streaming read bandwidth, an sgemm — and reports % of
that peak and GB/s beside GFLOP/s and the ratios. See benchmarks/README.md for the conventions;
`--help` for options. It imports whichever attention_ext Python finds (run it from the checkout
root with an in-place build, or anywhere with an installed one).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

import attention_ext

MIB = 1024.0 * 1024.0
# ATTENTION_EXT_BENCH_SMOKE=1: a smoke run of a benchmark script (what the test suite sets when it runs
# them end to end): the FMA and tile probes run a twentieth of their iterations, two reps each. Their
# figures then agree with full probes to within a per cent or so on a quiet machine, but the point is
# the harness: under the sanitizer build the full probes took a minute per script.
SMOKE = os.environ.get("ATTENTION_EXT_BENCH_SMOKE", "0") == "1"
MEMCHECK_TARGET_MIB = 256.0

# (B, H, n, m, d, causal, label)
DEFAULT_SHAPES = [
    (1, 8, 1024, 1024, 64, False, ""),
    (4, 8, 512, 512, 64, False, ""),
    (1, 8, 2048, 2048, 64, True, ""),
    (1, 16, 1024, 1024, 128, False, ""),
    (1, 25, 1024, 1024, 64, False, ""),
    (8, 8, 1, 2048, 64, False, "decode"),
    (1, 8, 8192, 8192, 64, True, "long"),
]
QUICK_SHAPE_IDX = [0, 2, 5]
# Sequence-length sweep (ours vs torch): (1, 8, L, L, 64) for these L.
SWEEP_LENGTHS = [256, 512, 1024, 2048, 4096]
QUICK_SWEEP_LENGTHS = [256, 1024, 4096]
CANDIDATES = ["ours", "torch", "naive"]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DEVICE = "cpu"  # the device being benchmarked (set by main)
# How the inputs are laid out (set by main, --layout): "heads", contiguous (B, H, n, d) tensors; or
# "model", as a model layer has them: q, k, v and the output gradient are (B, n, H·d) tensors (what
# the projections give), each call views them as (B, H, n, d) through a transpose and turns its
# output back into (B, n, H·d) (transpose, reshape), as transformers' attention integrations do.
# The views, the reshape and any copy they need count in the time and memory.
LAYOUT = "heads"


def _torch_sdpa_takes_enable_gqa():
    try:
        F.scaled_dot_product_attention(torch.zeros(1, 2, 1, 1), torch.zeros(1, 1, 1, 1), torch.zeros(1, 1, 1, 1),
                                       enable_gqa=True)
        return True
    except TypeError:  # torch before 2.5
        return False


TORCH_SDPA_GQA = _torch_sdpa_takes_enable_gqa()


def torch_sdpa_gqa(q, k, v, **kwargs):
    """torch's SDPA with K/V heads shared by groups of query heads: enable_gqa where torch has it,
    else K/V expanded to the query heads (repeat_interleave, inside the timed call: what a step
    costs on that torch)."""
    if TORCH_SDPA_GQA:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kwargs)
    groups = q.shape[-3] // k.shape[-3]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(groups, -3), v.repeat_interleave(groups, -3),
                                          **kwargs)


def _sync():
    """Waits for queued GPU work, so wall-clock times cover it (a no-op on the CPU)."""
    if DEVICE == "cuda":
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------------------------
# shapes
# ----------------------------------------------------------------------------------------------
def shape_name(s):
    B, H, n, m, d, causal, label = s
    name = f"{B}x{H}x{n}x{m}x{d}" + ("c" if causal else "")
    return name + (f" ({label})" if label else "")


def parse_shape_spec(tok):
    """'3' -> default shape #3; 'BxHxnxmxd' or 'BxHxnxmxdc' (c = causal) -> custom shape."""
    tok = tok.strip()
    if tok.isdigit():
        i = int(tok)
        if not 0 <= i < len(DEFAULT_SHAPES):
            raise argparse.ArgumentTypeError(f"shape index {i} out of range 0..{len(DEFAULT_SHAPES) - 1}")
        return DEFAULT_SHAPES[i]
    causal = tok.lower().endswith("c")
    body = tok[:-1] if causal else tok
    parts = body.lower().split("x")
    if len(parts) != 5 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"bad shape {tok!r}: use an index or BxHxnxmxd[c], e.g. 1x8x1024x1024x64c")
    B, H, n, m, d = map(int, parts)
    return (B, H, n, m, d, causal, "")


def fwd_flops(s):
    """4·B·H·d per visible (query, key) pair: n·m, or with top-left causal half the square part
    (the usual n²/2 convention for n = m) plus the full rows past it when n > m."""
    B, H, n, m, d, causal, _ = s
    pairs = min(n, m) ** 2 / 2 + max(n - m, 0) * m if causal else n * m
    return 4.0 * B * H * pairs * d


def mode_flops(s, mode):
    return fwd_flops(s) * (1.0 if mode == "fwd" else 3.5)  # bwd = 2.5x fwd


# ----------------------------------------------------------------------------------------------
# candidates
# ----------------------------------------------------------------------------------------------
def make_naive(n, m, causal):
    mask = None
    if causal:  # top-left alignment, same as torch's is_causal; built once, outside the timed region
        mask = ~torch.ones(n, m, dtype=torch.bool, device=DEVICE).tril()

    def naive(q, k, v, is_causal=False):
        s = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
        if mask is not None:
            s = s.masked_fill(mask, float("-inf"))
        return torch.softmax(s, dim=-1) @ v

    return naive


def get_fn(name, s):
    if name == "ours":
        return attention_ext.scaled_dot_product_attention
    if name == "torch":
        return F.scaled_dot_product_attention
    if name == "naive":
        return make_naive(s[2], s[3], s[5])
    raise ValueError(name)


def make_inputs(s, dtype, requires_grad, seed=0):
    """q, k, v and a fixed random output gradient in LAYOUT's shapes."""
    B, H, n, m, d, causal, _ = s
    g = torch.Generator().manual_seed(seed)
    shapes = [(B, H, n, d), (B, H, m, d), (B, H, m, d), (B, H, n, d)] if LAYOUT == "heads" else \
        [(B, n, H * d), (B, m, H * d), (B, m, H * d), (B, n, H * d)]
    q, k, v, go = (torch.randn(shape, generator=g).to(device=DEVICE, dtype=dtype) for shape in shapes)
    for t in (q, k, v):
        t.requires_grad_(requires_grad)
    return q, k, v, go


def call_in_layout(fn, s, q, k, v):
    """fn on the inputs of make_inputs, its output in their layout."""
    if LAYOUT == "heads":
        return fn(q, k, v, is_causal=s[5])
    B, H, n, m, d = s[:5]
    heads = [t.view(B, t.shape[1], H, d).transpose(1, 2) for t in (q, k, v)]
    return fn(*heads, is_causal=s[5]).transpose(1, 2).reshape(B, n, H * d)


def make_step(fn, s, mode, q, k, v, go):
    if mode == "fwd":
        def step():
            with torch.no_grad():
                return call_in_layout(fn, s, q, k, v)
    else:
        def step():
            q.grad = k.grad = v.grad = None
            out = call_in_layout(fn, s, q, k, v)
            out.backward(go)
            return out
    return step


# ----------------------------------------------------------------------------------------------
# timing
# ----------------------------------------------------------------------------------------------
def time_shape(s, mode, dtype, cands, reps, warmup, min_sample_s):
    """Warm up each candidate, then interleave A B C A B C ... for `reps` rounds.
    Each sample runs `inner` calls back to back (inner chosen so a sample lasts >= min_sample_s,
    but at most 1000 calls: a sample of a call under min_sample_s / 1000 is shorter)."""
    q, k, v, go = make_inputs(s, dtype, requires_grad=(mode == "fwdbwd"))
    steps, inner = {}, {}
    for c in cands:
        step = make_step(get_fn(c, s), s, mode, q, k, v, go)
        steps[c] = step
        t_w = float("inf")
        for _ in range(max(1, warmup)):
            _sync()
            t0 = time.perf_counter()
            step()
            _sync()
            t_w = min(t_w, time.perf_counter() - t0)
        inner[c] = max(1, min(1000, int(math.ceil(min_sample_s / max(t_w, 1e-7)))))
    samples = {c: [] for c in cands}
    for _ in range(reps):
        for c in cands:
            step, r = steps[c], inner[c]
            _sync()
            t0 = time.perf_counter()
            for _ in range(r):
                step()
            _sync()
            samples[c].append((time.perf_counter() - t0) / r)
    return samples, inner


def check_close(s, dtype):
    """Forward max-abs-diff of ours vs torch (sanity check, not timed)."""
    q, k, v, _ = make_inputs(s, dtype, requires_grad=False, seed=1)
    with torch.no_grad():
        a = call_in_layout(attention_ext.scaled_dot_product_attention, s, q, k, v)
        b = call_in_layout(F.scaled_dot_product_attention, s, q, k, v)
    return (a.float() - b.float()).abs().max().item()


def run_sweep(lengths, modes, dtype, reps, warmup, min_sample_s):
    """GFLOP/s of ours and torch at (1, 8, L, L, 64) for each L, interleaved like the shapes."""
    out = []
    for length in lengths:
        s = (1, 8, length, length, 64, False, "")
        for mode in modes:
            samples, _ = time_shape(s, mode, dtype, ["ours", "torch"], reps, warmup, min_sample_s)
            med = {c: statistics.median(v) for c, v in samples.items()}
            fl = mode_flops(s, mode)
            row = {"length": length, "mode": mode, "median_ms": {c: med[c] * 1e3 for c in med},
                   "gflops": {c: fl / med[c] / 1e9 for c in med}, "ratio": med["torch"] / med["ours"]}
            out.append(row)
            print(f"[sweep] {mode:6s} L={length:5d}  ours {row['gflops']['ours']:6.1f} GF/s  torch "
                  f"{row['gflops']['torch']:6.1f} GF/s  ours/torch {row['ratio']:.2f}", flush=True)
    return out


def measure_fma_peak(reps=5, iterations=20_000_000):
    """The CPU's float32 FMA peak in GFLOP/s on every torch thread at once (best of reps): the
    active kernel variant's widest vectors in independent FMA chains (csrc/cpu/fma_probe.inc)."""
    if SMOKE:
        reps, iterations = min(reps, 2), iterations // 20
    runs = [torch.ops.attention_ext.cpu_fma_peak_gflops(iterations) for _ in range(reps)]
    res = {"gflops": max(runs), "gflops_runs": runs, "threads": torch.get_num_threads(),
           "variant": attention_ext.cpu_variant(), "iterations": iterations}
    # The kernels' own tile GEMM on cache-resident tiles (csrc/cpu/fma_probe.inc): the ceiling of their
    # GEMMs on this machine, so a table shows how much of the distance to the FMA peak is the GEMM's.
    if hasattr(torch.ops.attention_ext, "cpu_tile_gemm_gflops"):
        gemm_runs = [torch.ops.attention_ext.cpu_tile_gemm_gflops(max(1, iterations // 500)) for _ in range(reps)]
        res.update(tile_gemm_gflops=max(gemm_runs), tile_gemm_gflops_runs=gemm_runs)
    # The same GEMMs with the online-softmax step between them: the fp32 forward's per-tile work in cache.
    if hasattr(torch.ops.attention_ext, "cpu_tile_forward_gflops"):
        fwd_runs = [torch.ops.attention_ext.cpu_tile_forward_gflops(max(1, iterations // 500)) for _ in range(reps)]
        res.update(tile_forward_gflops=max(fwd_runs), tile_forward_gflops_runs=fwd_runs)
    # The fused backward's five products and its P/dS pass on one tile pair: the fp32 backward's
    # per-tile work in cache (2.5x the forward probe's flops per round, so 2.5x fewer rounds).
    if hasattr(torch.ops.attention_ext, "cpu_tile_backward_gflops"):
        bwd_runs = [torch.ops.attention_ext.cpu_tile_backward_gflops(max(1, iterations // 1250)) for _ in range(reps)]
        res.update(tile_backward_gflops=max(bwd_runs), tile_backward_gflops_runs=bwd_runs)
    return res


def measure_bandwidth(mib=512, reps=7):
    """Streaming read bandwidth in GB/s over a float32 tensor far larger than the caches, read once
    per rep, median of reps, by the larger of two readers: the extension's own probe on the CPU
    (torch.ops.attention_ext.cpu_stream_read_gbps: each torch thread reads its share as 8 parts
    side by side, which one sequential stream per core does not match on every machine: 17 against
    25 GB/s on a Xeon VM) and torch's multithreaded sum."""
    x = torch.ones(int(mib * MIB) // 4, device=DEVICE)
    x.sum()
    ts = []
    for _ in range(reps):
        _sync()
        t0 = time.perf_counter()
        x.sum()
        _sync()
        ts.append(time.perf_counter() - t0)
    torch_sum = x.numel() * 4 / statistics.median(ts) / 1e9
    res = {"gbps": torch_sum, "gbps_best": x.numel() * 4 / min(ts) / 1e9, "mib": mib, "reps": reps,
           "torch_sum_gbps": torch_sum, "method": "torch's sum"}
    probe = getattr(torch.ops.attention_ext, "cpu_stream_read_gbps", None) if DEVICE == "cpu" else None
    if probe is not None:
        probe(x)
        runs = [probe(x) for _ in range(reps)]
        res["probe_gbps"], res["probe_gbps_runs"] = statistics.median(runs), runs
        if res["probe_gbps"] > torch_sum:
            res.update(gbps=res["probe_gbps"], gbps_best=max(runs), method="8 parts per thread side by side")
    return res


def mode_bytes(s, mode, dtype):
    """Bytes a call must move at least: Q, K, V read and O written once (and dO, dQ, dK, dV for
    fwd+bwd) — the bound that matters for decode, where each K/V byte is used for one query row."""
    esz = torch.empty((), dtype=dtype).element_size()
    B, H, n, m, d = s[:5]
    once = B * H * (2 * n * d + 2 * m * d) * esz
    return once * (3 if mode == "fwdbwd" else 1)


def measure_sgemm_peak(n=None, reps=10):
    n = n or (8192 if DEVICE == "cuda" else 2048)
    a = torch.randn(n, n, device=DEVICE)
    b = torch.randn(n, n, device=DEVICE)
    for _ in range(3):
        torch.mm(a, b)
    ts = []
    for _ in range(reps):
        _sync()
        t0 = time.perf_counter()
        torch.mm(a, b)
        _sync()
        ts.append(time.perf_counter() - t0)
    flops = 2.0 * n ** 3
    return {"n": n, "reps": reps, "median_s": statistics.median(ts), "best_s": min(ts),
            "gflops_median": flops / statistics.median(ts) / 1e9, "gflops_best": flops / min(ts) / 1e9}


# ----------------------------------------------------------------------------------------------
# memory (fresh subprocess per measurement)
# ----------------------------------------------------------------------------------------------
def _status_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(field)


def _reset_hwm():
    """Resets VmHWM to the current RSS (Linux >= 4.0). Returns False if not permitted."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def necessary_mib(s, mode, dtype):
    """What any implementation must allocate: the output, and for fwd+bwd also dq, dk, dv."""
    esz = torch.empty((), dtype=dtype).element_size()
    B, H, n, m, d = s[:5]
    return (B * H * n * d * esz + (B * H * (n + 2 * m) * d * esz if mode == "fwdbwd" else 0)) / MIB


def mem_child(spec):
    """Runs in a fresh interpreter: inputs + a small warm-up call, then one real call; prints JSON."""
    import resource
    global LAYOUT
    LAYOUT = spec.get("layout", "heads")
    s = tuple(spec["shape"])
    dtype = DTYPES[spec["dtype"]]
    mode, cand = spec["mode"], spec["cand"]
    fn = get_fn(cand, s)
    # warm-up on a tiny shape of the same kind: loads kernels, starts thread pools, etc.
    tiny = (1, 1, min(s[2], 64), 64, s[4], s[5], "")
    tq, tk, tv, tgo = make_inputs(tiny, dtype, requires_grad=(mode == "fwdbwd"))
    make_step(get_fn(cand, tiny), tiny, mode, tq, tk, tv, tgo)()
    del tq, tk, tv, tgo
    q, k, v, go = make_inputs(s, dtype, requires_grad=(mode == "fwdbwd"))
    step = make_step(fn, s, mode, q, k, v, go)
    base_rss = _status_kib("VmRSS")
    hwm_ok = _reset_hwm()
    ru_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    out = step()
    dt = time.perf_counter() - t0
    if hwm_ok:
        extra_kib = _status_kib("VmHWM") - base_rss
        method = "VmHWM after clear_refs=5 minus VmRSS before the call"
    else:  # high-water mark since process start: may under-report if RSS had dropped below it
        extra_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - ru_before
        method = "ru_maxrss delta (VmHWM reset not permitted; may under-report)"
    del out
    print(json.dumps({"extra_mib": extra_kib / 1024.0, "base_rss_mib": base_rss / 1024.0,
                      "necessary_mib": necessary_mib(s, mode, dtype), "method": method, "seconds": dt}))


def run_mem_cuda(s, mode, dtype_name, cand):
    """GPU memory of one call, in this process: peak allocated by torch's caching allocator during
    the call minus what was allocated before it (inputs and everything else alive)."""
    dtype = DTYPES[dtype_name]
    q, k, v, go = make_inputs(s, dtype, requires_grad=(mode == "fwdbwd"))
    step = make_step(get_fn(cand, s), s, mode, q, k, v, go)
    try:
        step()  # warm-up (kernels loaded, workspaces created)
        _sync()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = step()
        _sync()
        extra = torch.cuda.max_memory_allocated() - base
    except torch.cuda.OutOfMemoryError as e:
        return {"error": f"out of memory: {e}".splitlines()[0]}
    del out
    return {"extra_mib": extra / MIB, "necessary_mib": necessary_mib(s, mode, dtype),
            "method": "torch.cuda.max_memory_allocated during the call minus memory_allocated before it"}


def run_mem_child(s, mode, dtype_name, cand, timeout=1800):
    if DEVICE == "cuda":
        return run_mem_cuda(s, mode, dtype_name, cand)
    spec = {"shape": list(s), "mode": mode, "dtype": dtype_name, "cand": cand, "layout": LAYOUT}
    # The child imports the same attention_ext as this process (the directory that holds it first).
    env = dict(os.environ)
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(attention_ext.__file__)))
    env["PYTHONPATH"] = package_parent + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.run([sys.executable, os.path.abspath(__file__), "--threads", str(torch.get_num_threads()),
                        "--_mem-child", json.dumps(spec)],
                       capture_output=True, text=True, timeout=timeout, env=env)
    if p.returncode != 0:
        return {"error": (p.stderr or p.stdout).strip().splitlines()[-1:] or ["rc=%d" % p.returncode]}
    return json.loads(p.stdout.strip().splitlines()[-1])


def memory_check(dtype_name="float32", n=32768, d=64):
    s = (1, 1, n, n, d, True, "memory-check")
    print(f"[memory-check] ours, {shape_name(s)}, {dtype_name}, forward+backward in a fresh subprocess ...",
          flush=True)
    r = run_mem_child(s, "fwdbwd", dtype_name, "ours")
    if "error" in r:
        print(f"[memory-check] FAILED: {r['error']}")
        return {"shape": list(s), "error": r["error"]}
    esz = torch.empty((), dtype=DTYPES[dtype_name]).element_size()
    inputs_mib = 4 * n * d * esz / MIB
    ok = r["extra_mib"] < MEMCHECK_TARGET_MIB
    r.update({"shape": list(s), "dtype": dtype_name, "inputs_mib": inputs_mib,
              "target_mib": MEMCHECK_TARGET_MIB, "pass": ok,
              "naive_scores_mib": n * n * esz / MIB})
    print(f"[memory-check] extra peak RSS over inputs: {r['extra_mib']:.1f} MiB "
          f"(of which out + dq/dk/dv = {r['necessary_mib']:.1f} MiB; inputs q,k,v,grad_out = {inputs_mib:.1f} MiB; "
          f"target < {MEMCHECK_TARGET_MIB:.0f} MiB) -> {'PASS' if ok else 'FAIL'}; "
          f"call took {r['seconds']:.1f} s; method: {r['method']}")
    return r


# ----------------------------------------------------------------------------------------------
# reporting
# ----------------------------------------------------------------------------------------------
def fmt(x, spec):
    return "–" if x is None else format(x, spec)


def render_markdown(res):
    L = []
    meta = res["meta"]
    pk = res["sgemm_peak"]
    L.append(f"# attention_ext {meta.get('device', 'cpu').upper()} benchmark ({meta['dtype']})\n")
    L.append(f"- {meta['cpu']}; torch {meta['torch']} ({meta['torch_threads']} threads); "
             f"attention_ext {meta['build_info'].get('version')} cpu_variant=`{meta['build_info'].get('cpu_variant')}`")
    L.append(f"- command: `{meta['command']}`")
    if meta.get("layout") == "model":
        L.append("- **inputs in a model layer's layout** (`--layout model`): q, k, v and the output gradient are "
                 "(B, n, H·d) tensors, viewed as (B, H, n, d) through a transpose for each call, the output turned "
                 "back into (B, n, H·d) by transpose and reshape; any copy that needs is in the times and memory")
    L.append(f"- load average before/after: {meta['loadavg_before']} / {meta.get('loadavg_after')}")
    L.append(f"- reps={meta['reps']} (interleaved ours, torch, naive, ours, ... after {meta['warmup']} warm-up calls "
             f"each; each sample >= {meta['min_sample_s'] * 1e3:.0f} ms of back-to-back calls); times are medians per call")
    se = ""
    if "start_gflops_median" in pk:
        se = (f"; measured at the start ({pk['start_gflops_median']:.1f}) and at the end "
              f"({pk['end_gflops_median']:.1f}) of the run, the higher one is used")
    blas = "cuBLAS sgemm, TF32 off" if meta.get("device") == "cuda" else "MKL sgemm"
    fma, bw = res.get("fma_peak"), res.get("bandwidth")
    if fma:
        L.append(f"- **measured FMA peak: {fma['gflops']:.1f} GFLOP/s** float32 on {fma['threads']} threads "
                 f"(independent FMA chains in the `{fma['variant']}` variant's vectors, best of "
                 f"{len(fma['gflops_runs'])}"
                 + (f"; measured at the start ({fma['start_gflops']:.1f}) and at the end ({fma['end_gflops']:.1f}) "
                    "of the run, the higher one is used" if "start_gflops" in fma else "")
                 + "); `% peak` columns are against it"
                 + ("; **smoke run** (ATTENTION_EXT_BENCH_SMOKE=1: shortened probes)" if SMOKE else ""))
        if "tile_gemm_gflops" in fma:
            L.append(f"- **tile-GEMM ceiling: {fma['tile_gemm_gflops']:.1f} GFLOP/s = "
                     f"{100 * fma['tile_gemm_gflops'] / fma['gflops']:.0f}% of the FMA peak**: the kernels' own "
                     f"register-blocked GEMM running the forward's two 64x64x64 tile products on cache-resident tiles "
                     f"(best of {len(fma['tile_gemm_gflops_runs'])}, same threads): what the GEMMs reach when "
                     f"memory, softmax and masking cost nothing")
        if "tile_forward_gflops" in fma:
            L.append(f"- **forward-tile ceiling: {fma['tile_forward_gflops']:.1f} GFLOP/s = "
                     f"{100 * fma['tile_forward_gflops'] / fma['gflops']:.0f}% of the FMA peak**: the same two "
                     f"products with the fp32 forward's online-softmax step between them (scores scaled as stored, "
                     f"max, 2^(s - m), sums, O rescaled as the P V product loads it), d = 64, on cache-resident tiles "
                     f"(best of {len(fma['tile_forward_gflops_runs'])}, same threads): the fp32 forward's rate when "
                     f"memory, packing, masking and the loop around the tiles cost nothing")
        if "tile_backward_gflops" in fma:
            L.append(f"- **backward-tile ceiling: {fma['tile_backward_gflops']:.1f} GFLOP/s = "
                     f"{100 * fma['tile_backward_gflops'] / fma['gflops']:.0f}% of the FMA peak**: the fp32 fused "
                     f"backward's work on one 64x64 tile pair, d = 64 (S = Q K^T, dP = dO V^T, P and dS in one pass, "
                     f"dV += P^T dO, dK += dS^T Q, dQ += dS K) on tiles held in cache (best of "
                     f"{len(fma['tile_backward_gflops_runs'])}, same threads): the backward's rate when memory, packing, "
                     f"masking, the delta and row-shift passes and the loop around the tiles cost nothing (fwd+bwd "
                     f"runs at most at 3.5 / (1 / forward-tile + 2.5 / backward-tile) = "
                     f"{3.5 / (1 / fma.get('tile_forward_gflops', fma['tile_backward_gflops']) + 2.5 / fma['tile_backward_gflops']) / fma['gflops'] * 100:.0f}% "
                     f"of the peak)")
    if bw:
        how = (f"the extension's read probe, each thread reading its share as 8 parts side by side: "
               f"{bw['probe_gbps']:.1f}; torch's sum {bw['torch_sum_gbps']:.1f}; the larger is used"
               if "probe_gbps" in bw else "torch's sum")
        L.append(f"- **measured streaming read bandwidth: {bw['gbps']:.1f} GB/s** ({bw['mib']} MiB read once, median "
                 f"of {bw['reps']}, by {how}; best {bw['gbps_best']:.1f}); `ours GB/s` counts Q, K, V read and O "
                 f"written once "
                 f"for the forward, and 3x that for fwd+bwd (the forward's, then the backward reading Q, K, V, O, "
                 f"dO and writing dQ, dK, dV)")
    L.append(f"- sgemm reference: torch.mm {pk['n']}x{pk['n']} fp32 ({blas}) = **{pk['gflops_median']:.1f} GFLOP/s** "
             f"(median of {pk['reps']}; best {pk['gflops_best']:.1f}{se})")
    over = any(v > 100.0 for r in res["rows"] for v in r["pct_sgemm"].values())
    busy = meta.get("device", "cpu") == "cpu" and float(meta["loadavg_before"].split()[0]) > 0.5
    if over or busy:
        L.append("- **caution:** " + ("the machine was busy (1-min load > 0.5 before the run): absolute times and "
                                      "GFLOP/s are depressed and noisy; the interleaved ratios are the robust part. "
                                      if busy else "")
                 + (("`% sgemm` above 100: bf16 rows are set against fp32 references (the FMA peak and sgemm), "
                     "and bf16 dot-product instructions (AVX512-BF16's vdpbf16ps, tensor cores) do twice the "
                     "multiply-adds per fp32 lane or more; above 100 says nothing about load there."
                     if meta.get("dtype") in ("bfloat16", "float16") else
                     "`% sgemm` above 100 means the sgemm reference was itself caught by load, not that attention "
                     "beats GEMM.") if over else ""))
    bw_over = res.get("bandwidth") and any(100.0 * r["ours_gbps"] / res["bandwidth"]["gbps"] > 100.0
                                           for r in res["rows"])
    if bw_over:
        L.append("- **caution:** `ours % bw` above 100: every call of a shape reads the same K/V, so K/V that fit "
                 "in the last-level cache stay partly resident from one call to the next and read faster than "
                 "DRAM (`benchmarks/bench_kvcache.py` gives each decode working set's size beside its GB/s)")
    L.append("- FLOPs: fwd = 4·B·H·n·m·d (causal: ×0.5 for n = m; in general min(n, m)²/2 + max(n − m, 0)·m "
             "visible pairs instead of n·m); fwd+bwd = 3.5 × fwd. "
             "`ours/torch`, `ours/naive` = throughput ratio (= their time / our time; > 1 means ours is faster)")
    L.append("- shape = BxHxnxmxd, `c` = causal (top-left). `maxdiff` = max |ours − torch| of the forward output. "
             "`spread %` = (max − min) / median over the reps, worst candidate of the row (a noise flag); "
             "per-sample times, min/max and paired per-rep ratios are in the JSON")
    if res.get("memory_method"):
        L.append(f"- memory: extra peak RSS in MiB above the inputs (q, k, v, grad_out), one fresh subprocess per "
                 f"(candidate, shape, mode), one call after a tiny warm-up; method: {res['memory_method']}. "
                 f"Includes the output (and dq, dk, dv for fwd+bwd): that unavoidable part is the `need` column. "
                 f"Page-granular, includes allocator slack.")
    L.append("")
    cands = meta["candidates"]
    for mode in meta["modes"]:
        rows = [r for r in res["rows"] if r["mode"] == mode]
        if not rows:
            continue
        L.append(f"## {'forward' if mode == 'fwd' else 'forward + backward'}\n")
        hdr = ["shape"] + [f"{c} ms" for c in cands] + [f"{c} GF/s" for c in cands]
        hdr += (["ours % peak", "torch % peak"] if res.get("fma_peak") else []) + ["ours % sgemm"]
        hdr += ["ours GB/s"] + (["ours % bw"] if res.get("bandwidth") else [])
        hdr += ["ours/torch"] + (["ours/naive"] if "naive" in cands else [])
        have_mem = any(r.get("mem") for r in rows)
        if have_mem:
            hdr += [f"{c} MiB" for c in cands] + ["need MiB"]
        hdr += ["spread %", "maxdiff"]
        L.append("| " + " | ".join(hdr) + " |")
        L.append("|" + "|".join(["---"] + ["---:"] * (len(hdr) - 1)) + "|")
        for r in rows:
            cells = [r["shape_name"]]
            cells += [fmt(r["median_ms"].get(c), ".3f") for c in cands]
            cells += [fmt(r["gflops"].get(c), ".1f") for c in cands]
            if res.get("fma_peak"):
                cells += [fmt(r["pct_peak"].get(c), ".1f") for c in ("ours", "torch")]
            cells += [fmt(r["pct_sgemm"].get("ours"), ".1f")]
            cells += [fmt(r.get("ours_gbps"), ".1f")]
            if res.get("bandwidth"):
                cells += [fmt(100.0 * r["ours_gbps"] / res["bandwidth"]["gbps"], ".0f")]
            cells += [fmt(r["ratio"].get("ours/torch"), ".2f")]
            if "naive" in cands:
                cells += [fmt(r["ratio"].get("ours/naive"), ".2f")]
            if have_mem:
                m = r.get("mem") or {}
                cells += [fmt((m.get(c) or {}).get("extra_mib"), ".1f") for c in cands]
                need = next((v.get("necessary_mib") for v in m.values() if v and "necessary_mib" in v), None)
                cells += [fmt(need, ".1f")]
            cells += [fmt(r.get("spread_pct"), ".0f"), fmt(r.get("maxdiff"), ".1e")]
            L.append("| " + " | ".join(cells) + " |")
        L.append("")
    if res.get("sweep"):
        L.append("## sequence-length sweep (1x8xLxLx64, ours vs torch)\n")
        L.append("| L | mode | ours ms | torch ms | ours GF/s | torch GF/s | ours/torch |")
        L.append("|---:|---|---:|---:|---:|---:|---:|")
        for r in res["sweep"]:
            L.append(f"| {r['length']} | {r['mode']} | {r['median_ms']['ours']:.3f} | {r['median_ms']['torch']:.3f} | "
                     f"{r['gflops']['ours']:.1f} | {r['gflops']['torch']:.1f} | {r['ratio']:.2f} |")
        L.append("")
    if res.get("memory_check"):
        L.append(render_memcheck(res["memory_check"]))
    return "\n".join(L)


def render_memcheck(mc):
    L = ["## memory check (opt-in `--memory-check`)\n"]
    if "error" in mc:
        L.append(f"- FAILED: {mc['error']}")
    else:
        B, H, n, m, d = mc["shape"][:5]
        L.append(f"- ours, B=H=1, n=m={n}, d={d}, causal, {mc['dtype']}, forward + backward (fixed random "
                 f"grad_out), one call in a fresh subprocess after a tiny warm-up")
        L.append(f"- extra peak RSS over the inputs: **{mc['extra_mib']:.1f} MiB** "
                 f"(target < {mc['target_mib']:.0f} MiB: **{'PASS' if mc['pass'] else 'FAIL'}**); of which "
                 f"output + dq/dk/dv = {mc['necessary_mib']:.1f} MiB; inputs q, k, v, grad_out = "
                 f"{mc['inputs_mib']:.1f} MiB; a materialised n×m fp score matrix alone would be "
                 f"{mc['naive_scores_mib']:.0f} MiB")
        L.append(f"- wall time of the call: {mc['seconds']:.1f} s; method: {mc['method']}")
    L.append("")
    return "\n".join(L)


def make_plot(res, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[plot] matplotlib is not installed; skipping --plot (pip install matplotlib to enable it)")
        return False
    modes = res["meta"]["modes"]
    cands = res["meta"]["candidates"]
    sweep = res.get("sweep") or []
    nplots = len(modes) + (1 if sweep else 0)
    fig, axes = plt.subplots(nplots, 1, figsize=(11, 4.2 * nplots), squeeze=False)
    peak = res["sgemm_peak"]["gflops_median"]
    if sweep:
        ax = axes[-1, 0]
        for mode, color in zip(modes, ("tab:blue", "tab:purple")):
            pts = [r for r in sweep if r["mode"] == mode]
            label = "fwd" if mode == "fwd" else "fwd+bwd"
            ax.plot([r["length"] for r in pts], [r["gflops"]["ours"] for r in pts], "o-", color=color,
                    label=f"ours {label}")
            ax.plot([r["length"] for r in pts], [r["gflops"]["torch"] for r in pts], "s--", color=color,
                    alpha=0.6, label=f"torch {label}")
        ax.axhline(peak, color="k", ls="--", lw=1, label=f"sgemm {peak:.0f} GF/s")
        ax.set_xscale("log", base=2)
        ax.set_xticks([r["length"] for r in sweep if r["mode"] == modes[0]])
        ax.set_xticklabels([str(r["length"]) for r in sweep if r["mode"] == modes[0]])
        ax.set_xlabel("sequence length L (n = m = L; B=1, H=8, d=64)")
        ax.set_ylabel("GFLOP/s")
        ax.set_ylim(bottom=0)
        ax.set_title(f"GFLOP/s by sequence length ({res['meta']['dtype']})")
        ax.legend(fontsize=8)
    for ax, mode in zip(axes[:len(modes), 0], modes):
        rows = [r for r in res["rows"] if r["mode"] == mode]
        w = 0.8 / len(cands)
        for j, c in enumerate(cands):
            xs = [i + (j - (len(cands) - 1) / 2) * w for i in range(len(rows))]
            ax.bar(xs, [r["gflops"].get(c) or 0 for r in rows], w, label=c)
        ax.axhline(peak, color="k", ls="--", lw=1, label=f"sgemm {peak:.0f} GF/s")
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels([r["shape_name"] for r in rows], fontsize=8)
        ax.set_ylabel("GFLOP/s")
        ax.set_title(f"{'forward' if mode == 'fwd' else 'forward + backward'} ({res['meta']['dtype']})")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"[plot] wrote {path}")
    return True


# ----------------------------------------------------------------------------------------------
# main
# ----------------------------------------------------------------------------------------------
def cpu_name():
    """The CPU as /proc/cpuinfo names it, with family/model and its widest vector ISA: the model
    name alone ("AMD EPYC") does not tell a Zen 3 from a Zen 5."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        return platform.processor() or "unknown CPU"
    flags = fields.get("flags", "").split()
    isa = next((name for name, flag in (("AVX-512", "avx512f"), ("AVX2", "avx2")) if flag in flags), "no AVX2")
    return (f"{fields.get('model name', 'unknown CPU')} (family {fields.get('cpu family', '?')}, "
            f"model {fields.get('model', '?')}, {isa}, {os.cpu_count()} logical CPUs)")


def run_device(a, shapes, modes, cands, dtype, reps, min_sample_s, out_prefix):
    """Times every shape (and the sweep) on DEVICE; writes out_prefix.md/.json/.png if given."""
    meta = {"dtype": a.dtype, "layout": LAYOUT, "modes": modes, "candidates": cands, "reps": reps, "warmup": a.warmup,
            "min_sample_s": min_sample_s, "device": DEVICE,
            "cpu": cpu_name() if DEVICE == "cpu" else torch.cuda.get_device_name(), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "build_info": attention_ext.build_info(),
            "python": platform.python_version(), "command": ("THP_MEM_ALLOC_ENABLE=1 " if os.environ.get("THP_MEM_ALLOC_ENABLE") == "1" else "")
            + " ".join(["python"] + sys.argv),  # (torch's allocator then asks for huge pages: faults change)
            "loadavg_before": " ".join(f"{x:.2f}" for x in os.getloadavg()),
            "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    print(f"[bench] {DEVICE}: {meta['cpu']} | torch {meta['torch']} threads={meta['torch_threads']} | "
          f"ours variant={meta['build_info'].get('cpu_variant')} | dtype={a.dtype} reps={reps}", flush=True)
    if DEVICE == "cpu" and os.getloadavg()[0] > 0.5:
        print(f"[bench] WARNING: 1-min load average is {os.getloadavg()[0]:.2f}; other processes compete for the "
              f"cores, so absolute numbers will be low and noisy (ratios from interleaved runs hold up better)",
              flush=True)
    fma = measure_fma_peak() if DEVICE == "cpu" else None
    bandwidth = measure_bandwidth()
    peak = measure_sgemm_peak()
    print(f"[bench] machine: " + (f"FMA peak {fma['gflops']:.1f} GFLOP/s ({fma['threads']} threads, "
                                  f"{fma['variant']}), " if fma else "") +
          (f"tile GEMM {fma['tile_gemm_gflops']:.1f} GFLOP/s, " if fma and "tile_gemm_gflops" in fma else "") +
          (f"forward tile {fma['tile_forward_gflops']:.1f} GFLOP/s, " if fma and "tile_forward_gflops" in fma else "") +
          (f"backward tile {fma['tile_backward_gflops']:.1f} GFLOP/s, " if fma and "tile_backward_gflops" in fma else "") +
          f"streaming read {bandwidth['gbps']:.1f} GB/s, torch.mm {peak['n']}^2 fp32 {peak['gflops_median']:.1f} "
          f"GFLOP/s (best {peak['gflops_best']:.1f})", flush=True)

    rows = []
    for s in shapes:
        maxdiff = check_close(s, dtype)
        for mode in modes:
            samples, inner = time_shape(s, mode, dtype, cands, reps, a.warmup, min_sample_s)
            fl = mode_flops(s, mode)
            med = {c: statistics.median(samples[c]) for c in cands}
            row = {"shape": list(s), "shape_name": shape_name(s), "mode": mode, "flops": fl,
                   "inner": inner, "samples_s": samples, "maxdiff": maxdiff,
                   "median_ms": {c: med[c] * 1e3 for c in cands},
                   "min_ms": {c: min(samples[c]) * 1e3 for c in cands},
                   "max_ms": {c: max(samples[c]) * 1e3 for c in cands},
                   "spread_pct": max(100.0 * (max(samples[c]) - min(samples[c])) / med[c] for c in cands),
                   "gflops": {c: fl / med[c] / 1e9 for c in cands},
                   "pct_sgemm": {c: 100.0 * fl / med[c] / 1e9 / peak["gflops_median"] for c in cands},
                   "pct_peak": {c: 100.0 * fl / med[c] / 1e9 / fma["gflops"] for c in cands} if fma else {},
                   "ours_gbps": mode_bytes(s, mode, dtype) / med["ours"] / 1e9,
                   "ratio": {}, "paired_ratio_median": {}}
            for other in cands[1:]:
                row["ratio"][f"ours/{other}"] = med[other] / med["ours"]
                row["paired_ratio_median"][f"ours/{other}"] = statistics.median(
                    b / o for o, b in zip(samples["ours"], samples[other]))
            rows.append(row)
            print(f"[bench] {mode:6s} {shape_name(s):24s} " +
                  "  ".join(f"{c} {med[c] * 1e3:8.3f} ms {row['gflops'][c]:6.1f} GF/s" for c in cands) +
                  "  ours/torch %.2f" % row["ratio"]["ours/torch"] +
                  ("  ours/naive %.2f" % row["ratio"]["ours/naive"] if "naive" in cands else ""), flush=True)
    sweep = []
    if not a.no_sweep and not a.shapes:
        lengths = QUICK_SWEEP_LENGTHS if a.quick else SWEEP_LENGTHS
        sweep = run_sweep(lengths, modes, dtype, reps, a.warmup, min_sample_s)
    meta["loadavg_after"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    # second sgemm measurement at the end: on a shared machine a single one can be caught by a burst of
    # load; the reference is the better (higher) of the two medians, both are reported
    peak_end = measure_sgemm_peak()
    print(f"[bench] fp32 sgemm reference again at the end: {peak_end['gflops_median']:.1f} GFLOP/s", flush=True)
    peak = dict(peak_end if peak_end["gflops_median"] > peak["gflops_median"] else peak,
                start_gflops_median=peak["gflops_median"], end_gflops_median=peak_end["gflops_median"])
    for row in rows:
        row["pct_sgemm"] = {c: 100.0 * row["gflops"][c] / peak["gflops_median"] for c in cands}
    if fma:  # the FMA peak likewise: a machine whose capacity drifts would overstate every % of peak
        fma_end = measure_fma_peak()
        print(f"[bench] FMA peak again at the end: {fma_end['gflops']:.1f} GFLOP/s", flush=True)
        fma = dict(fma_end if fma_end["gflops"] > fma["gflops"] else fma, start_gflops=fma["gflops"],
                   end_gflops=fma_end["gflops"])
        for row in rows:
            row["pct_peak"] = {c: 100.0 * row["gflops"][c] / fma["gflops"] for c in cands}

    res = {"meta": meta, "sgemm_peak": peak, "fma_peak": fma, "bandwidth": bandwidth, "rows": rows}
    if sweep:
        res["sweep"] = sweep
    if not a.no_memory:
        print("[bench] memory: one fresh subprocess per (candidate, shape, mode) ...", flush=True)
        for row in rows:
            s = tuple(row["shape"])
            row["mem"] = {c: run_mem_child(s, row["mode"], a.dtype, c) for c in cands}
            res["memory_method"] = next((v["method"] for v in row["mem"].values() if "method" in v),
                                        res.get("memory_method"))
            print(f"[bench] memory {row['mode']:6s} {row['shape_name']:24s} " + "  ".join(
                f"{c} {fmt(v.get('extra_mib'), '.1f')} MiB" if "error" not in v else f"{c} ERROR {v['error']}"
                for c, v in row["mem"].items()), flush=True)
    md = render_markdown(res)
    print()
    print(md)
    if out_prefix:
        os.makedirs(os.path.dirname(os.path.abspath(out_prefix)), exist_ok=True)
        with open(out_prefix + ".md", "w") as f:
            f.write(md + "\n")
        with open(out_prefix + ".json", "w") as f:
            json.dump(res, f, indent=2)
        print(f"[bench] wrote {out_prefix}.md and {out_prefix}.json")
        if a.plot:
            make_plot(res, out_prefix + ".png")
    elif a.plot:
        print("[plot] --plot needs --out PREFIX; skipping")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", choices=list(DTYPES), default="float32")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                    help="auto: the CPU, then the GPU if torch sees one (PREFIX_cpu / PREFIX_cuda outputs)")
    ap.add_argument("--mode", choices=["fwd", "fwdbwd", "both"], default="both")
    ap.add_argument("--layout", choices=["heads", "model"], default="heads",
                    help="heads: contiguous (B, H, n, d) inputs; model: (B, n, H*d) inputs viewed through a "
                         "transpose and the output reshaped back, as in a model layer")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions per candidate (default 7, --quick 3)")
    ap.add_argument("--warmup", type=int, default=2, help="warm-up calls per candidate before timing")
    ap.add_argument("--min-sample-ms", type=float, default=None,
                    help="each timed sample loops calls until it lasts this long (default 50, --quick 20)")
    ap.add_argument("--quick", action="store_true", help=f"3 reps, shapes {QUICK_SHAPE_IDX}, shorter samples")
    ap.add_argument("--shapes", default=None,
                    help="comma list of default-shape indices and/or BxHxnxmxd[c] specs (see --list-shapes)")
    ap.add_argument("--list-shapes", action="store_true")
    ap.add_argument("--no-naive", action="store_true")
    ap.add_argument("--no-sweep", action="store_true", help="skip the sequence-length sweep (ours vs torch)")
    ap.add_argument("--no-memory", action="store_true", help="skip the per-(candidate, shape) memory subprocesses")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--out", default=None, help="write PREFIX.md and PREFIX.json (and PREFIX.png with --plot)")
    ap.add_argument("--plot", action="store_true", help="PNG of GFLOP/s (needs matplotlib and --out)")
    ap.add_argument("--memory-check", action="store_true",
                    help="separate, opt-in mode: only the 32768x32768 causal fwd+bwd memory check of ours (slow). "
                         "With --out PREFIX and an existing PREFIX.json from a benchmark run, the result is added "
                         "to it and PREFIX.md is re-rendered; otherwise PREFIX.md/.json hold just the check")
    ap.add_argument("--memory-check-n", type=int, default=32768, help=argparse.SUPPRESS)
    ap.add_argument("--_mem-child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)

    if a.threads:
        torch.set_num_threads(a.threads)
    if a._mem_child is not None:
        mem_child(json.loads(a._mem_child))
        return 0
    if a.list_shapes:
        for i, s in enumerate(DEFAULT_SHAPES):
            print(f"{i}: {shape_name(s)}  fwd {fwd_flops(s) / 1e9:.2f} GFLOP")
        return 0

    if a.memory_check:
        r = memory_check(a.dtype, n=a.memory_check_n)
        if a.out:
            res = {}
            if os.path.exists(a.out + ".json"):
                with open(a.out + ".json") as f:
                    res = json.load(f)
            res["memory_check"] = r
            with open(a.out + ".json", "w") as f:
                json.dump(res, f, indent=2)
            md = render_markdown(res) if "rows" in res else render_memcheck(r)
            with open(a.out + ".md", "w") as f:
                f.write(md + "\n")
            print(f"[memory-check] wrote {a.out}.md and {a.out}.json")
        return 0 if r.get("pass") else 1

    reps = a.reps if a.reps is not None else (3 if a.quick else 7)
    min_sample_s = (a.min_sample_ms if a.min_sample_ms is not None else (20 if a.quick else 50)) / 1e3
    if a.shapes:
        try:
            shapes = [parse_shape_spec(t) for t in a.shapes.split(",") if t.strip()]
        except argparse.ArgumentTypeError as e:
            ap.error(str(e))
    else:
        shapes = [DEFAULT_SHAPES[i] for i in QUICK_SHAPE_IDX] if a.quick else list(DEFAULT_SHAPES)
    modes = ["fwd", "fwdbwd"] if a.mode == "both" else [a.mode]
    cands = [c for c in CANDIDATES if not (a.no_naive and c == "naive")]
    dtype = DTYPES[a.dtype]

    devices = ["cpu", "cuda"] if a.device == "auto" and torch.cuda.is_available() else (
        ["cpu"] if a.device == "auto" else [a.device])
    if "cuda" in devices and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA device")
    global DEVICE, LAYOUT
    LAYOUT = a.layout
    for device in devices:
        DEVICE = device
        out = a.out if (a.out is None or len(devices) == 1) else f"{a.out}_{device}"
        run_device(a, shapes, modes, cands, dtype, reps, min_sample_s, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

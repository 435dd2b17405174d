"""GPU benchmark: attention_ext against each of torch's SDPA backends (flash, efficient, cuDNN,
math, selected with torch.nn.attention.sdpa_kernel), forward and backward, in one run.

Shapes (B, n) in {(16, 1k), (8, 2k), (4, 4k), (2, 8k)} with H·d = 2048 and d in {64, 128}, causal
off and on; fp16 and bf16 (targets against flash), fp32 (target against efficient). Timing: CUDA
events around each call after warm-up, median of --reps. TFLOP/s counts 4·B·H·n²·d for the forward
(half with causal) and 2.5x that for the backward; "% peak" is against the H100/H200 dense bf16/fp16
tensor-core peak of 989 TFLOP/s. Writes a markdown table and JSON (to --out PREFIX, default
$OUT/results_gpu when OUT is set) with, per row, every backend's time and ours' speed ratio to it
(> 1: ours is faster), and a target summary.

  python benchmarks/bench_gpu.py                      # everything (about a minute on an H200)
  python benchmarks/bench_gpu.py --dtypes bfloat16 --modes fwd --d 128
  python benchmarks/bench_gpu.py --device cpu --dry-run  # tiny shapes on the CPU: checks the script
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import attention_ext  # noqa: E402

PEAK_TFLOPS = 989.0  # H100/H200 SXM dense fp16/bf16 tensor-core peak
SHAPES = [(16, 1024), (8, 2048), (4, 4096), (2, 8192)]
HIDDEN = 2048  # H * d
BACKENDS = ["flash", "efficient", "cudnn", "math"]
# The backend each dtype's target is measured against, and the ratio (torch time / ours) to reach.
TARGETS = {("float16", "fwd"): ("flash", 1.0), ("float16", "bwd"): ("flash", 0.8),
           ("bfloat16", "fwd"): ("flash", 1.0), ("bfloat16", "bwd"): ("flash", 0.8),
           ("float32", "fwd"): ("efficient", 1.0), ("float32", "bwd"): ("efficient", 1.0)}
MATH_MAX_N = 2048  # the math backend materialises (B, H, n, n) scores: skipped above this


def sdpa_backend(name):
    from torch.nn.attention import SDPBackend
    return {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}[name]


def make_call(name, q, k, v, causal):
    """A zero-argument function computing the attention output with candidate `name`."""
    if name == "ours":
        return lambda: attention_ext.scaled_dot_product_attention(q, k, v, is_causal=causal)
    from torch.nn.attention import sdpa_kernel
    backend = sdpa_backend(name)

    def call():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return call


class Timer:
    """Wall time of fn() in ms: CUDA events on the GPU, perf_counter (after nothing) on the CPU."""

    def __init__(self, device):
        self.device = device

    def __call__(self, fn):
        if self.device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3


def time_candidate(name, q, k, v, causal, mode, timer, warmup, reps):
    """Median ms of the forward, or of the backward alone (forward outside the timed region)."""
    call = make_call(name, q, k, v, causal)
    if mode == "fwd":
        with torch.no_grad():
            fn = call
            for _ in range(warmup):
                fn()
            return statistics.median(timer(fn) for _ in range(reps))
    grad = torch.randn_like(q)
    samples = []
    for r in range(warmup + reps):
        out = call()
        fn = lambda: torch.autograd.grad(out, (q, k, v), grad)  # noqa: E731
        t = timer(fn)
        if r >= warmup:
            samples.append(t)
    return statistics.median(samples)


def flops(b, h, n, d, causal, mode):
    fwd = 4.0 * b * h * n * n * d * (0.5 if causal else 1.0)
    return fwd if mode == "fwd" else 2.5 * fwd


def run(args):
    device = args.device
    dtypes = args.dtypes.split(",")
    modes = args.modes.split(",")
    ds = [int(x) for x in args.d.split(",")]
    shapes = SHAPES if not args.dry_run else [(2, 64), (1, 128)]
    hidden = HIDDEN if not args.dry_run else 128
    timer = Timer(device)
    warmup, reps = (1, 2) if args.dry_run else (args.warmup, args.reps)
    rows, t_start, skipped = [], time.time(), 0
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        for mode in modes:
            for d in ds:
                for b, n in shapes:
                    for causal in (False, True):
                        if time.time() - t_start > args.budget_s:
                            skipped += 1
                            continue
                        h = hidden // d
                        torch.manual_seed(0)
                        q, k, v = (torch.randn(b, h, n, d, device=device, dtype=dtype, requires_grad=(mode == "bwd"))
                                   for _ in range(3))
                        row = {"dtype": dtype_name, "mode": mode, "B": b, "H": h, "n": n, "d": d, "causal": causal,
                               "ms": {}, "error": {}}
                        for name in ["ours"] + BACKENDS:
                            if name == "math" and n > MATH_MAX_N:
                                row["error"][name] = f"skipped (n > {MATH_MAX_N})"
                                continue
                            try:
                                row["ms"][name] = time_candidate(name, q, k, v, causal, mode, timer, warmup, reps)
                            except RuntimeError as e:  # backend unavailable for this call, or out of memory
                                row["error"][name] = str(e).splitlines()[0][:120] if str(e) else type(e).__name__
                                if device == "cuda":
                                    torch.cuda.empty_cache()
                        ours = row["ms"].get("ours")
                        if ours:
                            row["tflops"] = flops(b, h, n, d, causal, mode) / (ours * 1e-3) / 1e12
                            row["pct_peak"] = 100.0 * row["tflops"] / PEAK_TFLOPS
                        row["ratio"] = {name: row["ms"][name] / ours for name in BACKENDS
                                        if ours and name in row["ms"]}
                        rows.append(row)
                        print(format_row(row), flush=True)
                        del q, k, v
    return rows, skipped


def format_row(r):
    ratios = " ".join(f"{name}={r['ratio'][name]:.2f}x" for name in BACKENDS if name in r["ratio"])
    ours = r["ms"].get("ours")
    return (f"{r['dtype']:>8} {r['mode']} B={r['B']:<2} H={r['H']:<2} n={r['n']:<5} d={r['d']:<3} "
            f"causal={int(r['causal'])}  ours={ours if ours is None else round(ours, 3)} ms "
            f"{r.get('tflops', 0):.1f} TFLOP/s  {ratios}")


def targets(rows):
    """One line per (dtype, mode): the worst ratio against the target backend, and whether it is met."""
    out = []
    for (dtype, mode), (backend, goal) in TARGETS.items():
        sel = [r for r in rows if r["dtype"] == dtype and r["mode"] == mode and backend in r["ratio"]]
        if not sel:
            continue
        worst = min(sel, key=lambda r: r["ratio"][backend])
        out.append({"dtype": dtype, "mode": mode, "against": backend, "target": goal,
                    "worst_ratio": worst["ratio"][backend],
                    "worst_shape": f"B={worst['B']} n={worst['n']} d={worst['d']} causal={int(worst['causal'])}",
                    "met": all(r["ratio"][backend] >= goal for r in sel)})
    return out


def write(prefix, rows, summary, meta):
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    with open(prefix + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows, "targets": summary}, f, indent=1)
    lines = [f"# GPU benchmark: {meta['device_name']}, torch {meta['torch']}", "",
             f"Command: `{meta['command']}`. Median of {meta['reps']} CUDA-event timings after {meta['warmup']} "
             f"warm-up calls. Ratio = torch backend time / ours (> 1: ours faster). TFLOP/s: 4·B·H·n²·d forward "
             f"(½ causal), 2.5x for the backward; % of the {PEAK_TFLOPS:.0f} TFLOP/s dense bf16/fp16 peak.", "",
             "| dtype | mode | B | H | n | d | causal | ours ms | TFLOP/s | % peak | " +
             " | ".join(f"vs {b}" for b in BACKENDS) + " |",
             "|" + "---|" * (10 + len(BACKENDS))]
    for r in rows:
        ours = r["ms"].get("ours")
        cells = [r["dtype"], r["mode"], r["B"], r["H"], r["n"], r["d"], "yes" if r["causal"] else "no",
                 f"{ours:.3f}" if ours else "error", f"{r.get('tflops', 0):.1f}", f"{r.get('pct_peak', 0):.1f}"]
        cells += [f"{r['ratio'][b]:.2f}x" if b in r["ratio"] else "n/a" for b in BACKENDS]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    lines += ["", "## Targets", "", "| dtype | mode | against | target | worst ratio | at | met |", "|---|---|---|---|---|---|---|"]
    for t in summary:
        lines.append(f"| {t['dtype']} | {t['mode']} | {t['against']} | ≥ {t['target']:.1f}x | {t['worst_ratio']:.2f}x | "
                     f"{t['worst_shape']} | {'yes' if t['met'] else 'no'} |")
    errors = [(r, name, msg) for r in rows for name, msg in r["error"].items()]
    if errors:
        lines += ["", "## Not measured", ""]
        lines += [f"- {r['dtype']} {r['mode']} B={r['B']} n={r['n']} d={r['d']} causal={int(r['causal'])}: "
                  f"{name}: {msg}" for r, name, msg in errors]
    with open(prefix + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--dtypes", default="float16,bfloat16,float32")
    ap.add_argument("--modes", default="fwd,bwd")
    ap.add_argument("--d", default="64,128", help="head dims (H = 2048 / d)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=float("inf"),
                    help="stop starting new rows after this many seconds (the rest are listed as skipped)")
    ap.add_argument("--out", default=None, help="PREFIX for PREFIX.md / PREFIX.json (default $OUT/results_gpu)")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes, 2 reps: checks the script, not speed")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA device (use --device cpu --dry-run to check the script)")
    out = args.out or (os.path.join(os.environ["OUT"], "results_gpu") if os.environ.get("OUT") else None)
    rows, skipped = run(args)
    summary = targets(rows)
    for t in summary:
        print(f"target {t['dtype']} {t['mode']} vs {t['against']} >= {t['target']}x: worst {t['worst_ratio']:.2f}x "
              f"({t['worst_shape']}) -> {'met' if t['met'] else 'NOT met'}")
    if skipped:
        print(f"{skipped} rows skipped: --budget-s {args.budget_s:g} reached")
    if out:
        meta = {"device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu (dry run)",
                "torch": torch.__version__, "cuda": torch.version.cuda,
                "reps": 2 if args.dry_run else args.reps, "warmup": 1 if args.dry_run else args.warmup,
                "command": "python benchmarks/bench_gpu.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                "build": attention_ext.build_info(), "skipped_rows": skipped}
        write(out, rows, summary, meta)
        print(f"wrote {out}.md and {out}.json")
    return 0 if rows and all("ours" in r["ms"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

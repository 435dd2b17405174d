"""GPU benchmark: attention_ext against each of torch's SDPA backends (flash, efficient, cuDNN,
math, selected with torch.nn.attention.sdpa_kernel), forward and backward, in one run.

Shapes (B, n) in {(16, 1k), (8, 2k), (4, 4k), (2, 8k)} with H·d = 2048 and d in {64, 128}, causal
off and on; fp16 and bf16 (targets against flash), fp32 (target against efficient). Timing: CUDA
events around --inner calls back to back (so the host's per-call work overlaps the GPU's instead of
being counted), after warm-up, median of --reps samples; the backward is timed alone, repeated on one
retained graph. TFLOP/s counts 4·B·H·n²·d for the forward (half with causal) and 2.5x that for the
backward; "% peak" is against the GPU's dense peak for the dtype's units (fp16/bf16: tensor cores;
fp32: the FP32 pipes, which our fp32 kernels use; see PEAKS_TFLOPS), "n/a" for a GPU not listed. Writes a markdown table and JSON (to --out PREFIX, default
$OUT/results_gpu when OUT is set) with, per row, every backend's time and ours' speed ratio to it
(> 1: ours is faster), and a target summary.

Rows run tensor-core dtypes (fp16, bf16) first whatever the order given, so a run stopped by
--budget-s still has them, and both files are rewritten after every row (meta.status: "in
progress", "complete", or "stopped by --budget-s"). The JSON also records which sources were measured: the commit,
the csrc/ tree (git rev-parse HEAD:csrc), whether csrc/ has uncommitted changes, and the digest of
the csrc/ files (the one setup.py records in the build it makes).

The script imports whichever attention_ext Python finds; it does not add the checkout to sys.path.
To measure a checkout's in-place build, run it from the checkout root with the root on PYTHONPATH
(tests/gpu_check.sh does this); an installed attention_ext needs nothing:

  PYTHONPATH=. python benchmarks/bench_gpu.py            # everything: 96 rows
  PYTHONPATH=. python benchmarks/bench_gpu.py --dtypes bfloat16 --modes fwd --d 128
  PYTHONPATH=. python benchmarks/bench_gpu.py --device cpu --dry-run  # tiny CPU shapes: checks the script
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

import attention_ext

# Dense peaks in TFLOP/s by device-name fragment: fp16/bf16 on the tensor cores, fp32 on the FP32
# pipes (no TF32: the fp32 kernels do not use tensor cores). NVIDIA's datasheet figures (SXM parts).
PEAKS_TFLOPS = {"H200": {"float16": 989.4, "bfloat16": 989.4, "float32": 66.9},
                "H100": {"float16": 989.4, "bfloat16": 989.4, "float32": 66.9},
                "A100": {"float16": 312.0, "bfloat16": 312.0, "float32": 19.5}}


def peaks_text(device_name):
    """'float16 989.4, bfloat16 989.4, float32 66.9 TFLOP/s', or that the GPU is not listed."""
    peaks = next((p for key, p in PEAKS_TFLOPS.items() if key in device_name), None)
    if peaks is None:
        return f"{device_name} is not listed in PEAKS_TFLOPS: n/a"
    return ", ".join(f"{dtype} {value:g}" for dtype, value in peaks.items()) + " TFLOP/s"


def peak_tflops(device_name, dtype_name):
    """The listed dense peak for this GPU and dtype, None if the GPU is not listed."""
    return next((p.get(dtype_name) for key, p in PEAKS_TFLOPS.items() if key in device_name), None)



SHAPES = [(16, 1024), (8, 2048), (4, 4096), (2, 8192)]
HIDDEN = 2048  # H * d
BACKENDS = ["flash", "efficient", "cudnn", "math"]
# The backend each dtype's target is measured against, and the ratio (torch time / ours) to reach.
TARGETS = {("float16", "fwd"): ("flash", 1.0), ("float16", "bwd"): ("flash", 0.8),
           ("bfloat16", "fwd"): ("flash", 1.0), ("bfloat16", "bwd"): ("flash", 0.8),
           ("float32", "fwd"): ("efficient", 1.0), ("float32", "bwd"): ("efficient", 1.0)}
MATH_MAX_N = 2048  # the math backend materialises (B, H, n, n) scores: skipped above this
# Dtypes the tensor-core kernels serve: their rows run first (the targets that matter most).
TENSOR_CORE_DTYPES = ("float16", "bfloat16")
DTYPES = ("float16", "bfloat16", "float32")  # those with a target (float64 has no fast path to race)


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

    def __init__(self, device, inner=1):
        self.device, self.inner = device, inner

    def __call__(self, fn):
        """ms per call of fn, over self.inner calls back to back."""
        if self.device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(self.inner):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / self.inner
        t0 = time.perf_counter()
        for _ in range(self.inner):
            fn()
        return (time.perf_counter() - t0) * 1e3 / self.inner


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
        out = call()  # (outside the timed region; its graph is kept for the timer's repeated backwards)
        fn = lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)  # noqa: E731
        t = timer(fn)
        if r >= warmup:
            samples.append(t)
        del out
    return statistics.median(samples)


def flops(b, h, n, d, causal, mode):
    fwd = 4.0 * b * h * n * n * d * (0.5 if causal else 1.0)
    return fwd if mode == "fwd" else 2.5 * fwd


def dtype_order(names):
    """The dtypes to run, tensor-core ones first, each once, otherwise in the order given."""
    unique = list(dict.fromkeys(names))
    return [n for n in unique if n in TENSOR_CORE_DTYPES] + [n for n in unique if n not in TENSOR_CORE_DTYPES]


def plan(args):
    """Every row's (dtype, mode, d, B, n, causal), in the order they run."""
    shapes = SHAPES if not args.dry_run else [(2, 64), (1, 128)]
    return [(dtype, mode, d, b, n, causal)
            for dtype in dtype_order(args.dtypes.split(","))
            for mode in args.modes.split(",")
            for d in (int(x) for x in args.d.split(","))
            for b, n in shapes
            for causal in (False, True)]


def run(args, on_row=None):
    """Measures the planned rows until --budget-s is spent; on_row(rows, skipped) after each row."""
    device = args.device
    hidden = HIDDEN if not args.dry_run else 128
    timer = Timer(device, 1 if args.dry_run else args.inner)
    warmup, reps = (1, 2) if args.dry_run else (args.warmup, args.reps)
    rows, t_start, skipped = [], time.time(), 0
    for dtype_name, mode, d, b, n, causal in plan(args):
        if time.time() - t_start > args.budget_s:
            skipped += 1
            continue
        dtype = getattr(torch, dtype_name)
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
            peak = peak_tflops(torch.cuda.get_device_name() if device == "cuda" else "", dtype_name)
            row["pct_peak"] = None if peak is None else 100.0 * row["tflops"] / peak
        row["ratio"] = {name: row["ms"][name] / ours for name in BACKENDS if ours and name in row["ms"]}
        rows.append(row)
        print(format_row(row), flush=True)
        del q, k, v
        if on_row is not None:
            on_row(rows, skipped)
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


def sources():
    """Which sources were measured: the commit, csrc/ tree (git rev-parse HEAD:csrc), whether csrc/
    has uncommitted changes, and the digest of csrc/ of the checkout this script is in (None where
    git or csrc/ is missing), and the csrc/ digest recorded by the build attention_ext loaded:
    equal digests mean the numbers are those of this checkout's kernels."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def git(*cmd):
        try:
            return subprocess.run(["git", "-C", root, *cmd], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None

    def git_out(*cmd):
        proc = git(*cmd)
        return proc.stdout.strip() if proc is not None and proc.returncode == 0 else None

    def csrc_uncommitted_changes():
        """csrc/ against HEAD's, by read-only commands (`git diff` would rewrite the index)."""
        listing = git_out("ls-tree", "-r", "HEAD", "--", "csrc")  # "mode type blob\tpath" lines
        tracked = git_out("ls-files", "--", "csrc")
        untracked = git_out("ls-files", "--others", "--exclude-standard", "--", "csrc")
        if listing is None or tracked is None or untracked is None:
            return None
        committed = {}  # path -> blob id
        for line in listing.splitlines():
            meta, path = line.split("\t", 1)
            committed[path] = meta.split()[2]
        if set(committed) != set(tracked.splitlines()) | set(untracked.splitlines()):
            return True
        paths = sorted(committed)
        if not all(os.path.isfile(os.path.join(root, p)) for p in paths):
            return True
        try:
            hashed = subprocess.run(["git", "-C", root, "hash-object", "--stdin-paths"], input="\n".join(paths),
                                    capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return hashed.returncode != 0 or hashed.stdout.split() != [committed[p] for p in paths]

    commit = git_out("rev-parse", "HEAD")
    dirty = csrc_uncommitted_changes() if commit is not None else None
    csrc = os.path.join(root, "csrc")
    build = attention_ext._build
    try:
        build_digest = build._build_config(build.compiled_ops_dir()).get("CSRC_DIGEST")
    except ImportError:  # ops loaded some other way (ATTENTION_EXT_JIT=1): nothing recorded
        build_digest = None
    return {"commit": commit, "csrc_tree": git_out("rev-parse", "HEAD:csrc") if commit else None,
            "csrc_uncommitted_changes": dirty,
            "csrc_digest": build.source_digest(csrc) if os.path.isdir(csrc) else None,
            "build_csrc_digest": build_digest}


def _replace(path, text):
    """Writes path whole or not at all (a run killed mid-write leaves the previous version)."""
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def write(prefix, rows, summary, meta):
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    _replace(prefix + ".json", json.dumps({"meta": meta, "rows": rows, "targets": summary}, indent=1))
    src = {k: "unknown" if v is None else v for k, v in meta["sources"].items()}
    changes = ", with uncommitted changes in csrc/" if src["csrc_uncommitted_changes"] is True else ""
    lines = [f"# GPU benchmark: {meta['device_name']}, torch {meta['torch']}", "",
             f"Status: {meta['status']} ({len(rows)} of {meta['rows_planned']} rows). Sources: commit "
             f"{src['commit']}, csrc/ tree {src['csrc_tree']}{changes}; csrc/ digest {src['csrc_digest'][:16]}, "
             f"the build's {src['build_csrc_digest'][:16]}.", "",
             f"Command: `{meta['command']}`. Median of {meta['reps']} CUDA-event samples of {meta.get('inner', 1)} "
             f"calls back to back, after {meta['warmup']} warm-up calls. Ratio = torch backend time / ours (> 1: ours "
             f"faster). TFLOP/s: 4·B·H·n²·d forward (½ causal), 2.5x for the backward; % of the GPU's dense peak "
             f"for the dtype ({peaks_text(meta['device_name'])}).", "",
             "| dtype | mode | B | H | n | d | causal | ours ms | TFLOP/s | % peak | " +
             " | ".join(f"vs {b}" for b in BACKENDS) + " |",
             "|" + "---|" * (10 + len(BACKENDS))]
    for r in rows:
        ours = r["ms"].get("ours")
        cells = [r["dtype"], r["mode"], r["B"], r["H"], r["n"], r["d"], "yes" if r["causal"] else "no",
                 f"{ours:.3f}" if ours else "error", f"{r.get('tflops', 0):.1f}",
                 "n/a" if r.get("pct_peak") is None else f"{r['pct_peak']:.1f}"]
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
    _replace(prefix + ".md", "\n".join(lines) + "\n")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--dtypes", default="float16,bfloat16,float32",
                    help=f"comma-separated, of {', '.join(DTYPES)}; fp16/bf16 rows run first whatever the order")
    ap.add_argument("--modes", default="fwd,bwd")
    ap.add_argument("--d", default="64,128", help="head dims (H = 2048 / d)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--inner", type=int, default=5,
                    help="calls per timed sample, back to back (hides the host's per-call work)")
    ap.add_argument("--budget-s", type=float, default=float("inf"),
                    help="stop starting new rows after this many seconds (the rest are listed as skipped)")
    ap.add_argument("--out", default=None, help="PREFIX for PREFIX.md / PREFIX.json (default $OUT/results_gpu)")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes, 2 reps: checks the script, not speed")
    args = ap.parse_args(argv)
    unknown = sorted(set(args.dtypes.split(",")) - set(DTYPES))
    if unknown:
        ap.error(f"--dtypes: {', '.join(unknown)} not among {', '.join(DTYPES)}")
    unknown = sorted(set(args.modes.split(",")) - {"fwd", "bwd"})
    if unknown:
        ap.error(f"--modes: {', '.join(unknown)} not among fwd, bwd")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA device (use --device cpu --dry-run to check the script)")
    out = args.out or (os.path.join(os.environ["OUT"], "results_gpu") if os.environ.get("OUT") else None)
    planned = len(plan(args))
    meta = {"device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu (dry run)",
            "torch": torch.__version__, "cuda": torch.version.cuda,
            "reps": 2 if args.dry_run else args.reps, "warmup": 1 if args.dry_run else args.warmup,
            "inner": 1 if args.dry_run else args.inner,
            "command": "python benchmarks/bench_gpu.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "build": attention_ext.build_info(), "sources": sources(), "rows_planned": planned,
            "status": "in progress", "skipped_rows": 0}

    def save(rows, skipped, status):
        if out:
            meta.update(status=status, skipped_rows=skipped)
            write(out, rows, targets(rows), meta)

    # After every row: a run cut short (budget, crash, the GPU session's end) keeps what it measured.
    rows, skipped = run(args, on_row=lambda rows, skipped: save(rows, skipped, "in progress"))
    summary = targets(rows)
    for t in summary:
        print(f"target {t['dtype']} {t['mode']} vs {t['against']} >= {t['target']}x: worst {t['worst_ratio']:.2f}x "
              f"({t['worst_shape']}) -> {'met' if t['met'] else 'NOT met'}")
    if skipped:
        print(f"{skipped} rows skipped: --budget-s {args.budget_s:g} reached")
    if out:
        save(rows, skipped, f"stopped by --budget-s {args.budget_s:g}" if skipped else "complete")
        print(f"wrote {out}.md and {out}.json")
    return 0 if rows and all("ours" in r["ms"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Where the microseconds of a small call go: our call beside its parts and the floors under them.

    python benchmarks/bench_call_overhead.py [--shape 1x4x1x64x32] [--kv-heads N] [--kvcache] [--reps 15]
                                             [--out PREFIX]

For one small shape (B×H×n×m×d, fp32, CPU) it times, interleaved in one run (median of --reps
samples, each a loop of back-to-back calls lasting >= 20 ms):
  * the forward without autograd: ours (the public call) and the op alone (the direct entry, or
    torch.ops in a JIT build);
  * the forward recording autograd: ours (through the autograd Function) and the floor of any
    Python autograd.Function of the same arity (a Function whose forward returns views and saves as
    many tensors: no kernel);
  * the backward (torch.autograd.grad of a kept graph): ours, the op alone, and the two floors:
    the engine running one C++ node (x * 2) and running a Python Function's node whose backward
    only allocates its gradients.
The gaps between the rows are what a change to the library can and cannot remove: the Python
Function and its node are the documented autograd path, whose floor is set by torch. Torch's own
SDPA is compared in bench.py (--shapes 1x4x1x64x32,...): its kernels start the thread pool even
for these sizes, and interleaved with single-threaded calls its times here swing by 100x on a
shared VM, so they are not repeated in this table.
With --kv-heads N (a divisor of H), K and V have N heads and ours is called with enable_gqa=True
(a GQA decode step); the op alone then takes the query heads split into (N, H/N) and K/V with a
broadcast dim, as the library passes them, and the forward without autograd is also timed through
torch's SDPA with enable_gqa (a decode step's comparison; subject to the swings above: compare
the minima too).
With --kvcache, a fourth group times a decode step through flash_attn_with_kvcache (n new query
rows against a (B, m, N, d) cache holding m keys, causal): attending alone; appending the n new
keys and values in place, then attending; the same after rotating q and the new keys (rotary
tables over the whole head dim, GPT-NeoX halves, as a Llama step); all three again through the
Python path, with the C++ step that takes such calls whole switched off (csrc/kv_cache_step.h;
prebuilt extension only); the attention op alone (its direct entry, as the call makes it); and
torch's step over the same cache: SDPA over it (enable_gqa, a view), writing the new rows by slice
assignment, then SDPA, and the same after rotating q and the new keys with torch ops.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402  (its machine naming)
from bench_window import publish  # noqa: E402

import attention_ext  # noqa: E402
from attention_ext import _ops  # noqa: E402
from attention_ext._ops import call_below_autograd, ops  # noqa: E402


def per_call_us(fn, min_seconds=0.02):
    """Microseconds per call of a loop of back-to-back calls lasting at least min_seconds."""
    calls = 8
    while True:
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        elapsed = time.perf_counter() - t0
        if elapsed >= min_seconds:
            return elapsed / calls * 1e6
        calls *= 2


def interleaved(fns, reps):
    for fn in fns.values():
        per_call_us(fn, 0.005)
    samples = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            samples[name].append(per_call_us(fn))
    return {name: (statistics.median(s), min(s), max(s)) for name, s in samples.items()}


class PythonFunctionFloor(torch.autograd.Function):
    """A Python autograd.Function with our Function's interface (q, k, v -> out, lse; five tensors
    saved) and no kernel: what torch charges for the Python Function and, in backward, its node."""

    @staticmethod
    def forward(ctx, q, k, v):
        out, lse = q.view_as(q), q[..., 0]
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, _, _ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def decode_step_calls(q, kv_heads, m, g, direct):
    """A decode step's calls (--kvcache): q (B, H, n, d) as n new rows against a (B, m, kv_heads, d)
    cache whose last n slots take the new keys and values; `direct` names the op's path."""
    from attention_ext import flash_attn_with_kvcache
    b, h, n, d = q.shape
    if n > m:
        raise SystemExit(f"--kvcache needs n <= m (the new rows go into the cache), got n={n}, m={m}")
    q_tokens = q.transpose(1, 2).contiguous()  # (B, n, H, d)
    k_cache, v_cache = (torch.randn(b, m, kv_heads, d, generator=g) for _ in range(2))
    k_new, v_new = (torch.randn(b, n, kv_heads, d, generator=g) for _ in range(2))
    filled = torch.full((b,), m, dtype=torch.int32)
    before = torch.full((b,), m - n, dtype=torch.int32)
    # The op's view of the step (flash_attn_with_kvcache's): query heads (kv_heads, groups), the
    # caches heads-first with a broadcast dim.
    q_op = q_tokens.unflatten(2, (kv_heads, h // kv_heads)).permute(0, 2, 3, 1, 4)
    k_op, v_op = (c.permute(0, 2, 1, 3).unsqueeze(2) for c in (k_cache, v_cache))
    op_args = (q_op, k_op, v_op, filled, None, None, None, d ** -0.5, 2, -1, 0, 0.0, None)
    kt, vt = (c.transpose(1, 2) for c in (k_cache, v_cache))  # torch's (B, kv_heads, m, d) views

    def torch_write_then_attend():
        k_cache[:, m - n:] = k_new
        v_cache[:, m - n:] = v_new
        return bench.torch_sdpa_gqa(q, kt, vt)

    def no_grad(fn):
        def call():
            with torch.no_grad():
                return fn()
        return call

    def python_path(fn):  # the call with the C++ step (csrc/kv_cache_step.h) switched off
        def call():
            step, _ops.KVCACHE_STEP = _ops.KVCACHE_STEP, None
            try:
                return fn()
            finally:
                _ops.KVCACHE_STEP = step
        return call

    # Rotary (GPT-NeoX halves over the whole head dim) at the new rows' positions, as a Llama step.
    angles = torch.arange(m, dtype=torch.float64)[:, None] / 10000 ** (torch.arange(0, d, 2) / d)
    cos, sin = angles.cos().float(), angles.sin().float()
    cos_new, sin_new = (torch.cat((t[m - n:], t[m - n:]), -1)[None, :, None] for t in (cos, sin))  # (1, n, 1, d)

    def rotate_half(x):
        return torch.cat((-x[..., d // 2:], x[..., :d // 2]), -1)

    def torch_rotary_write_then_attend():
        q_rot = q_tokens * cos_new + rotate_half(q_tokens) * sin_new
        k_cache[:, m - n:] = k_new * cos_new + rotate_half(k_new) * sin_new
        v_cache[:, m - n:] = v_new
        return bench.torch_sdpa_gqa(q_rot.transpose(1, 2), kt, vt)

    attend = no_grad(lambda: flash_attn_with_kvcache(q_tokens, k_cache, v_cache, cache_seqlens=filled,
                                                     causal=True))
    append = no_grad(lambda: flash_attn_with_kvcache(q_tokens, k_cache, v_cache, k_new, v_new,
                                                     cache_seqlens=before, causal=True))
    rotary = no_grad(lambda: flash_attn_with_kvcache(q_tokens, k_cache, v_cache, k_new, v_new, rotary_cos=cos,
                                                     rotary_sin=sin, cache_seqlens=before, causal=True,
                                                     rotary_interleaved=False))
    python_rows = {}
    if _ops.KVCACHE_STEP is not None:
        python_rows = {"ours: attend, Python path": python_path(attend),
                       "ours: append n rows, attend, Python path": python_path(append),
                       "ours: rotary, append n rows, attend, Python path": python_path(rotary)}
    return {
        "ours: attend": attend,
        "ours: append n rows, attend": append,
        "ours: rotary, append n rows, attend": rotary,
        **python_rows,
        f"the attention op alone ({direct})": no_grad(lambda: call_below_autograd(ops.attention_kvcache_fwd,
                                                                                 *op_args)),
        "torch: SDPA over the cache": no_grad(lambda: bench.torch_sdpa_gqa(q, kt, vt)),
        "torch: write n rows (slice assignment), SDPA": no_grad(torch_write_then_attend),
        "torch: rotary (torch ops), write n rows, SDPA": no_grad(torch_rotary_write_then_attend),
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="1x4x1x64x32", help="BxHxnxmxd")
    ap.add_argument("--kv-heads", type=int, default=None, help="K/V heads (GQA), a divisor of H")
    ap.add_argument("--kvcache", action="store_true", help="also time a decode step through flash_attn_with_kvcache")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", default=None, help="write PREFIX.md and PREFIX.json")
    a = ap.parse_args(argv)
    b, h, n, m, d = (int(x) for x in a.shape.split("x"))
    g = torch.Generator().manual_seed(0)
    kv_heads = a.kv_heads or h
    if h % kv_heads != 0:
        ap.error(f"--kv-heads {kv_heads} must divide the {h} query heads")
    gqa = kv_heads != h
    q = torch.randn(b, h, n, d, generator=g)
    k, v = (torch.randn(b, kv_heads, m, d, generator=g) for _ in range(2))
    grad_out = torch.randn(b, h, n, d, generator=g)
    scale = d ** -0.5
    # The op's view of a GQA call: query heads (kv_heads, groups), K/V a broadcast dim.
    q_op, grad_op = ((t.unflatten(1, (kv_heads, h // kv_heads)) if gqa else t) for t in (q, grad_out))
    k_op, v_op = ((t.unsqueeze(2) if gqa else t) for t in (k, v))
    fwd_args = (q_op, k_op, v_op, None, scale, 0, -1, -1, 0.0, None, None, 0.0, None)
    out, lse = call_below_autograd(ops.attention_fwd, *fwd_args)
    bwd_args = (grad_op, None, q_op, k_op, v_op, None, out, lse, scale, 0, -1, -1, 0.0, None, None, 0.0, None, False,
                False)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]

    def ours(*args):
        return attention_ext.scaled_dot_product_attention(*args, enable_gqa=gqa)

    def graph(fn):
        result = fn(*leaves)
        return result[0] if isinstance(result, tuple) else result

    ours_graph = graph(ours)
    floor_graph = graph(PythonFunctionFloor.apply)
    x = torch.randn(4, requires_grad=True)
    one_node = x * 2
    grad_one = torch.ones(4)

    def backward_of(result):
        return lambda: torch.autograd.grad(result, leaves, grad_out, retain_graph=True)

    direct = "direct entry" if _ops._DIRECT_ENTRIES else "torch.ops (JIT build: no direct entry)"
    label = "torch SDPA (enable_gqa)" if bench.TORCH_SDPA_GQA else "torch SDPA (K/V repeat_interleave'd: no enable_gqa)"
    torch_sdpa = {label: lambda: bench.torch_sdpa_gqa(q, k, v)} if gqa else {}
    groups = {
        "forward, no autograd": {
            "ours": lambda: ours(q, k, v),
            f"the op alone ({direct})": lambda: call_below_autograd(ops.attention_fwd, *fwd_args),
            **torch_sdpa,
        },
        "forward, recording autograd": {
            "ours (autograd Function)": lambda: ours(*leaves),
            "floor: a Python Function, no kernel": lambda: PythonFunctionFloor.apply(*leaves),
        },
        "backward (autograd.grad of a kept graph)": {
            "ours": backward_of(ours_graph),
            f"the op alone ({direct})": lambda: call_below_autograd(ops.attention_bwd, *bwd_args),
            "floor: engine + a Python Function's node, no kernel": backward_of(floor_graph),
            "floor: engine + one C++ node (x * 2)": lambda: torch.autograd.grad(one_node, x, grad_one,
                                                                                 retain_graph=True),
        },
    }
    if a.kvcache:
        groups["decode step against a KV cache, no autograd"] = decode_step_calls(q, kv_heads, m, g, direct)
    load_before = os.getloadavg()
    results = {group: interleaved(fns, a.reps) for group, fns in groups.items()}
    load_after = os.getloadavg()
    lines = [
        "# attention_ext small-call overhead (CPU, float32)",
        "",
        f"- {bench.cpu_name()}; torch {torch.__version__} ({torch.get_num_threads()} threads); attention_ext "
        f"{attention_ext.__version__} cpu_variant=`{attention_ext.cpu_variant()}`",
        f"- command: `python benchmarks/bench_call_overhead.py --shape {a.shape}"
        + (f" --kv-heads {a.kv_heads}" if a.kv_heads else "") + (" --kvcache" if a.kvcache else "")
        + f" --reps {a.reps}"
        + (f" --out {a.out}`" if a.out else "`"),
        f"- shape {a.shape} (BxHxnxmxd)" + (f", {kv_heads} K/V heads (enable_gqa)" if gqa else "")
        + f"; µs per call, median of {a.reps} interleaved samples (each >= 20 ms of "
        "back-to-back calls), min–max beside it",
        "- load average before/after: " + " ".join(f"{x:.2f}" for x in load_before) + " / "
        + " ".join(f"{x:.2f}" for x in load_after),
        "",
    ]
    for group, rows in results.items():
        lines += [f"## {group}", "", "| call | µs | min–max |", "|---|---:|---:|"]
        lines += [f"| {name} | {med:.1f} | {lo:.1f}–{hi:.1f} |" for name, (med, lo, hi) in rows.items()]
        lines.append("")
    publish(a.out, "\n".join(lines), {"shape": a.shape, "kv_heads": kv_heads, "reps": a.reps, "cpu": bench.cpu_name(),
                                      "results": {g: {k: list(v) for k, v in r.items()} for g, r in results.items()}})


if __name__ == "__main__":
    main()

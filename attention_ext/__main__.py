"""python -m attention_ext [demo|check|bench]

demo (default): build info, the worked example (README.md) step by step, a gradcheck verdict, and a
                quick timing against torch's SDPA and the naive composition.
check:          the correctness matrix on every available device and dtype; exits non-zero on
                any failure.
bench:          benchmarks/bench.py of the checkout this package belongs to (ours vs torch vs naive,
                against the machine's measured peak), markdown table and optional PNG plot.
"""
from __future__ import annotations

import argparse
import math
import sys
import time

import torch

import attention_ext
from attention_ext.reference import attention_reference


def _fmt(t: torch.Tensor) -> str:
    rows = ["  [" + ", ".join(f"{x:7.3f}" for x in row) + "]" for row in t.tolist()]
    return "\n".join(rows)


def _median_time(fn, reps=7):
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def demo() -> int:
    info = attention_ext.build_info()
    print("attention_ext", info["version"])
    for key in ("torch_version", "torch_version_running", "compiler", "openmp", "cpu_variants_compiled",
                "cpu_variant", "cuda", "cuda_archs", "threads", "loaded_from"):
        print(f"  {key:22s} {info.get(key, '')}")

    print("\nThe worked example (n = 3, d_k = d_v = 2):")
    q = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], dtype=torch.float64)
    k = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.5, 0.5]], dtype=torch.float64)
    v = torch.tensor([[10.0, 0.0], [0.0, 10.0], [5.0, 5.0]], dtype=torch.float64)
    s = q @ k.T
    print("S = Q Kᵀ\n" + _fmt(s))
    print("S / sqrt(d_k)\n" + _fmt(s / math.sqrt(2)))
    w = attention_ext.attention_weights(q, k)
    print("W = softmax(S / sqrt(d_k)) (row-wise; attention_ext.attention_weights)\n" + _fmt(w))
    o = attention_ext.scaled_dot_product_attention(q, k, v)
    print("O = W V (attention_ext.scaled_dot_product_attention)\n" + _fmt(o))
    expected = torch.tensor([[6.15, 3.85], [3.85, 6.15], [5.0, 5.0]], dtype=torch.float64)
    ok_example = torch.allclose(o, expected, atol=6e-3)
    print("matches the expected O = [[6.15, 3.85], [3.85, 6.15], [5, 5]]:", "yes" if ok_example else "NO")

    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    ok_grad = torch.autograd.gradcheck(attention_ext.scaled_dot_product_attention, (qg, kg, vg))
    print("gradcheck (float64, the fused kernels themselves):", "passed" if ok_grad else "FAILED")

    B, H, n, d = 1, 8, 1024, 64
    print(f"\nQuick timing, forward, float32, (B, H, n, m, d) = ({B}, {H}, {n}, {n}, {d}), "
          f"{torch.get_num_threads()} threads, median of 7:")
    torch.manual_seed(0)
    qt, kt, vt = (torch.randn(B, H, n, d) for _ in range(3))
    flops = 4 * B * H * n * n * d

    def naive():
        return torch.softmax(qt @ kt.transpose(-1, -2) / math.sqrt(d), dim=-1) @ vt

    results = [
        ("attention_ext", _median_time(lambda: attention_ext.scaled_dot_product_attention(qt, kt, vt))),
        ("torch SDPA", _median_time(lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt))),
        ("naive softmax(QKᵀ)V", _median_time(naive)),
    ]
    ours = results[0][1]
    for name, t in results:
        print(f"  {name:22s} {t * 1e3:8.2f} ms  {flops / t / 1e9:7.1f} GFLOP/s  time / ours: {t / ours:4.2f}")
    return 0 if ok_example and ok_grad else 1


# ----------------------------------------------------------------------------------------------
# check: the correctness matrix.

def _devices(choice):
    """The devices to check: every one available, or the one asked for, which must be (a check
    of nothing is no pass)."""
    devs = ["cpu"]
    if torch.cuda.is_available() and attention_ext.build_info()["cuda"] == "1":
        devs.append("cuda")
    if choice is not None and choice not in devs:
        why = ("this build has no CUDA kernels (build_info()['cuda'] is 0)" if attention_ext.build_info()["cuda"] != "1"
               else "torch sees no CUDA device")
        raise SystemExit(f"attention_ext check: --device {choice} cannot be checked: {why}")
    return [d for d in devs if choice in (None, d)]


def _dtypes(choice):
    names = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    return [t for n, t in names.items() if choice in (None, n)]


def _forward_case(device, dtype, shape, causal, masked):
    b, h, n, m, dk, dv = shape
    g = torch.Generator().manual_seed(0)
    mk = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)  # noqa: E731
    q, k, v = mk(b, h, n, dk), mk(b, h, m, dk), mk(b, h, m, dv)
    mask = (torch.rand(b, 1, n, m, generator=g) > 0.2).to(device) if masked else None
    out = attention_ext.attention(q, k, v, attn_mask=mask, causal=causal)
    ref = attention_reference(q.cpu(), k.cpu(), v.cpu(), mask.cpu() if masked else None, causal=causal)[0]
    err = (out.double().cpu() - ref).abs().max().item()
    budget = {torch.float64: 1e-10, torch.float32: 2e-5}.get(dtype)
    if budget is None:  # twice plain torch's own error in this precision
        lp = attention_reference(q, k, v, mask, causal=causal, dtype=None)[0]
        budget = max(2 * (lp.double().cpu() - ref).abs().max().item(), 2e-3)
    return err, budget


def check(args) -> int:
    devices = _devices(args.device)
    rows = []
    failures = 0
    shapes = [(1, 2, 17, 33, 5, 7), (2, 3, 64, 64, 64, 64), (1, 2, 130, 257, 128, 32)]
    if args.quick:
        shapes = shapes[:2]

    def record(config, fn):
        nonlocal failures
        t0 = time.perf_counter()
        try:
            result = fn()
            if isinstance(result, bool):  # a pass/fail check such as gradcheck
                ok, detail = result, "passed" if result else "failed"
            else:
                err, tol = result
                ok = err <= tol
                detail = f"{err:.2e} (tol {tol:.1e})"
        except Exception as e:  # a crash is a failure with its message
            ok, detail = False, f"{type(e).__name__}: {e}"
        dt = time.perf_counter() - t0
        failures += not ok
        line = f"{config:58s} {detail:28s} {'ok' if ok else 'FAIL':5s} {dt:6.2f}s"
        print(line, flush=True)
        rows.append(line)

    print(f"{'configuration':58s} {'max error':28s} {'verdict':5s} {'time':>7s}")
    for device in devices:
        for dtype in _dtypes(args.dtype):
            for shape in shapes:
                for causal in (None, "top_left", "bottom_right"):
                    masked = causal is None
                    name = f"{device} {str(dtype)[6:]} fwd {shape} {causal or ('mask' if masked else '')}"
                    record(name, lambda: _forward_case(device, dtype, shape, causal, masked))
        if args.dtype in (None, "float64"):
            def grad_check(fn, inputs):
                return lambda: bool(fn(inputs))

            def make(*shapes, device=device):
                return [torch.randn(*s, dtype=torch.float64, device=device, requires_grad=True) for s in shapes]

            for causal in (None, "top_left", "bottom_right"):
                f = lambda t, c=causal: torch.autograd.gradcheck(  # noqa: E731
                    lambda q, k, v, m: attention_ext.attention(q, k, v, attn_mask=m, causal=c), t)
                record(f"{device} float64 gradcheck q,k,v,mask {causal or ''}",
                       grad_check(f, make((2, 4, 3), (2, 5, 3), (2, 5, 2), (4, 5))))
            g = lambda t: torch.autograd.gradgradcheck(  # noqa: E731
                lambda q, k, v: attention_ext.attention(q, k, v, causal="top_left"), t)
            record(f"{device} float64 gradgradcheck q,k,v causal", grad_check(g, make((1, 3, 2), (1, 4, 2), (1, 4, 2))))

            def opcheck_case():
                q, k, v = make((2, 5, 4), (2, 7, 4), (2, 7, 3))
                torch.library.opcheck(torch.ops.attention_ext.attention_fwd, (q, k, v, None, 0.5, 1, -1, -1, 0.0, None,
                                                                                None, 0.0, None))
                return True

            record(f"{device} opcheck attention_fwd", opcheck_case)
    if "cuda" in devices:
        def agreement():
            q, k, v = (torch.randn(2, 3, 70, 32, dtype=torch.float64) for _ in range(3))
            a = attention_ext.scaled_dot_product_attention(q, k, v, is_causal=True)
            b = attention_ext.scaled_dot_product_attention(q.cuda(), k.cuda(), v.cuda(), is_causal=True).cpu()
            return (a - b).abs().max().item(), 1e-10

        record("cpu/cuda agreement float64 causal", agreement)
    print(f"\n{len(rows) - failures} passed, {failures} failed")
    return 1 if failures else 0


def _load_benchmark():
    """benchmarks/bench.py of the checkout this package was imported from (the benchmark is part of
    the repository, not of the installed package)."""
    import importlib.util
    import os

    from attention_ext._build import ROOT_DIR

    path = os.path.join(ROOT_DIR, "benchmarks", "bench.py")
    if not os.path.exists(path):
        raise SystemExit("attention_ext: the benchmark is benchmarks/bench.py in the source repository, which this "
                         f"installation ({os.path.dirname(attention_ext.__file__)}) does not include; run "
                         "`python benchmarks/bench.py` in a checkout")
    spec = importlib.util.spec_from_file_location("attention_ext_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m attention_ext", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("demo", help="build info, the worked example, gradcheck, quick timing (default)")
    p_check = sub.add_parser("check", help="correctness matrix over devices and dtypes")
    p_check.add_argument("--device", choices=["cpu", "cuda"])
    p_check.add_argument("--dtype", choices=["float64", "float32", "bfloat16", "float16"])
    p_check.add_argument("--quick", action="store_true", help="fewer shapes")
    p_bench = sub.add_parser("bench", help="benchmark vs torch's SDPA and the naive composition")
    p_bench.add_argument("rest", nargs=argparse.REMAINDER, help="options passed to the benchmark (see --help)")
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "bench":  # everything after 'bench' belongs to the benchmark's parser
        return _load_benchmark().main(argv[1:])
    args = parser.parse_args(argv)
    if args.command in (None, "demo"):
        return demo()
    if args.command == "check":
        return check(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())

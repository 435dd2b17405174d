"""Small programs for tests/gpu_check.sh (not a pytest module): the smoke run before the CUDA
tests, and the workload that compute-sanitizer watches.

  python tests/gpu_check_snippet.py smoke    # build has CUDA kernels; one forward+backward per dtype
  python tests/gpu_check_snippet.py full     # every kernel: SIMT and tensor-core, all dtypes (memcheck)
  python tests/gpu_check_snippet.py small    # the same calls in float32 and float16 (racecheck, synccheck)
  python tests/gpu_check_snippet.py splitkv  # tensor-core forwards long enough to split the keys
                                             # (run with ATTENTION_EXT_CUDA_KV_SPLITS=3): the combine kernel

--device cpu runs the same calls on CPU tensors: the CPU kernels in a CPU build, the emulated CUDA
kernels in an emulation build (GPU_CHECK_DRY_RUN=1 uses that to check this file without a GPU).
attention_ext is whatever Python imports; gpu_check.sh puts the checkout first on PYTHONPATH.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

import attention_ext

ALL_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
TENSOR_CORE_DTYPES = [torch.float16, torch.bfloat16]
# Smoke tolerance against the float64 reference, relative to max(1, |reference|).
SMOKE_TOL = {torch.float64: 1e-9, torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def describe(device):
    """One `info:` line per fact (gpu_check.sh copies them to summary.txt)."""
    info = attention_ext.build_info()
    print(f"info: torch {torch.__version__}, cuda {torch.version.cuda}, python {sys.version.split()[0]}")
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        print(f"info: gpu {props.name}, compute capability {props.major}.{props.minor}, "
              f"{props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB")
    print(f"info: attention_ext {info['version']} cuda={info['cuda']} cuda_archs={info['cuda_archs'] or '-'} "
          f"cuda_emulation={info.get('cuda_emulation')} from {info['loaded_from']}")
    return info


def check_build_matches_checkout(strict):
    """The loaded build was compiled from this checkout's csrc/ (setup.py records a digest of it):
    otherwise the tests would run some other build. Strict after a fresh build; a note in a dry run
    (the shared in-place build may lag behind edits of csrc/)."""
    from attention_ext import _build

    package_root = os.path.dirname(_build.PACKAGE_DIR)
    if not os.path.isdir(_build.SOURCE_DIR):
        print("info: no csrc/ beside the imported package: cannot compare the build with its sources")
        return
    ops_dir = _build.compiled_ops_dir()
    recorded = _build._build_config(ops_dir).get("CSRC_DIGEST")
    current = _build.source_digest(_build.SOURCE_DIR)
    print(f"info: csrc digest {current[:16]} (checkout {package_root}); build's {str(recorded)[:16]}")
    if recorded != current:
        message = "the loaded build was not compiled from this checkout's csrc/"
        if strict:
            sys.exit("smoke: " + message)
        print("info: note: " + message)


def smoke(device, dry_run):
    info = describe(device)
    if device == "cuda":
        assert info["cuda"] == "1", f"this build has no CUDA kernels: {info}"
        assert torch._C._dispatch_has_kernel_for_dispatch_key("attention_ext::attention_fwd", "CUDA"), \
            "attention_fwd has no CUDA kernel registered"
    check_build_matches_checkout(strict=not dry_run)
    from attention_ext.reference import attention_reference

    for dt in ALL_DTYPES:
        torch.manual_seed(0)
        # d = 64 in fp16/bf16: the tensor-core forward and backward; partial tiles on both sides.
        q, k, v = (torch.randn(2, 3, n, 64, dtype=torch.float64) for n in (70, 90, 90))
        leaves = [t.to(device=device, dtype=dt).requires_grad_() for t in (q, k, v)]
        out = attention_ext.scaled_dot_product_attention(*leaves, is_causal=True)
        grad = torch.randn(out.shape, dtype=torch.float64)
        out.backward(grad.to(device=device, dtype=dt))
        sync(device)
        ref_leaves = [t.requires_grad_() for t in (q, k, v)]
        ref = attention_reference(*ref_leaves, causal="top_left")[0]
        ref.backward(grad)
        worst = 0.0
        for name, ours, theirs in [("out", out, ref)] + [(f"d{c}", t.grad, r.grad) for c, t, r in
                                                          zip("qkv", leaves, ref_leaves)]:
            err = (ours.detach().double().cpu() - theirs.detach()).abs().max().item()
            tol = SMOKE_TOL[dt] * max(1.0, theirs.abs().max().item())
            assert err <= tol, f"{dt} {name}: max abs error {err:.3e} > {tol:.3e}"
            worst = max(worst, err)
        print(f"smoke {str(dt):>14} on {device}: forward+backward ok (max abs error {worst:.2e})")
    print("smoke ok")


def every_kernel(device, dtypes):
    """Calls reaching each kernel: partial tiles, float/bool/broadcast masks and their gradient,
    dropout, GQA, both causal kinds, lse gradient, attention weights, the dropout keep-mask; in
    fp16/bf16 also the tensor-core forward and backward at d = 64 and 128."""
    for dt in dtypes:
        torch.manual_seed(0)
        q = torch.randn(2, 4, 37, 40, device=device, dtype=dt, requires_grad=True)
        k = torch.randn(2, 2, 70, 40, device=device, dtype=dt, requires_grad=True)
        v = torch.randn(2, 2, 70, 72, device=device, dtype=dt, requires_grad=True)
        k4, v4 = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
        mask = torch.randn(1, 4, 37, 70, device=device, dtype=dt, requires_grad=True)
        attention_ext.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.2,
                                                   enable_gqa=True).sum().backward()
        bool_mask = torch.rand(37, 1, device=device) > 0.2
        o2, lse = attention_ext.attention(q, k[:, :1].expand(2, 4, 70, 40), v[:, :1].expand(2, 4, 70, 72),
                                          attn_mask=bool_mask, return_lse=True)
        (o2.sum() + lse[torch.isfinite(lse)].sum()).backward()
        attention_ext.attention(q, k4, v4, causal="bottom_right").sum().backward()
        row_mask = torch.randn(70, device=device, dtype=dt, requires_grad=True)  # (m,): broadcast over rows
        attention_ext.attention(q, k4, v4, attn_mask=row_mask).sum().backward()
        col_mask = torch.randn(37, 1, device=device, dtype=dt, requires_grad=True)  # (n, 1): over keys
        attention_ext.attention(q, k4, v4, attn_mask=col_mask).sum().backward()
        attention_ext.attention_weights(q, k4, causal="top_left")
        if dt in TENSOR_CORE_DTYPES:
            for d in (64, 128):
                qt = torch.randn(2, 4, 100, d, device=device, dtype=dt, requires_grad=True)
                kt = torch.randn(2, 2, 90, d, device=device, dtype=dt, requires_grad=True)
                vt = torch.randn(2, 2, 90, d, device=device, dtype=dt, requires_grad=True)
                attention_ext.scaled_dot_product_attention(qt, kt, vt, dropout_p=0.1,
                                                           enable_gqa=True).sum().backward()
                mt = torch.randn(4, 100, 90, device=device, dtype=dt, requires_grad=True)
                attention_ext.attention(qt, kt.repeat_interleave(2, 1), vt.repeat_interleave(2, 1),
                                        attn_mask=mt, causal="bottom_right").sum().backward()
        sync(device)
        print(f"{str(dt):>14}: done")
    torch.ops.attention_ext.dropout_keep_mask(torch.tensor([1, 2], device=device), [3], 17, 33, 0.3)
    sync(device)


def split_kv(device):
    """Tensor-core forwards over 300 keys: with ATTENTION_EXT_CUDA_KV_SPLITS=3 the keys go in three
    ranges of 128 (ranges are whole 64-key tiles), the last one partial, merged by the combine
    kernel into out and lse. Decode (1 row) and a partial query tile, two batch positions;
    causal bottom_right, a float mask, dropout. Forward only: the backward never splits (the
    full snippet covers it)."""
    splits = os.environ.get("ATTENTION_EXT_CUDA_KV_SPLITS", "")
    print(f"ATTENTION_EXT_CUDA_KV_SPLITS={splits or '(unset: the plan decides)'}")
    with torch.no_grad():
        for dt in TENSOR_CORE_DTYPES:
            for d in (64, 128):
                for n in (1, 37):
                    torch.manual_seed(1)
                    q = torch.randn(2, 2, n, d, device=device, dtype=dt)
                    k = torch.randn(2, 2, 300, d, device=device, dtype=dt)
                    v = torch.randn(2, 2, 300, d, device=device, dtype=dt)
                    attention_ext.attention(q, k, v, return_lse=True)
                    attention_ext.attention(q, k, v, dropout_p=0.25)
                    mask = torch.randn(1, 2, n, 300, device=device, dtype=dt)
                    attention_ext.attention(q, k, v, attn_mask=mask, causal="bottom_right")
            sync(device)
            print(f"{str(dt):>14}: done")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=["smoke", "full", "small", "splitkv"])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--dry-run", action="store_true",
                    help="smoke: a build from other sources than the checkout's csrc/ is noted, not fatal")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA device")
    if args.mode == "smoke":
        smoke(args.device, args.dry_run)
        return 0
    if args.mode == "splitkv":
        split_kv(args.device)
    else:
        every_kernel(args.device, ALL_DTYPES if args.mode == "full" else [torch.float32, torch.float16])
    print("snippet ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""GPU benchmark: ours vs torch's SDPA vs the naive composition on the CUDA device (see
benchmarks/README.md). The same code as the CPU benchmark, run with --device cuda; with $OUT set
(tests/gpu_check.sh) it writes $OUT/results_gpu_<dtype>.{md,json,png}.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from attention_ext.bench import main  # noqa: E402

if __name__ == "__main__":
    args = sys.argv[1:]
    if not any(a.startswith("--device") for a in args):
        args = ["--device", "cuda"] + args
    if os.environ.get("OUT") and not any(a.startswith("--out") for a in args):
        dtype = "bfloat16" if "bfloat16" in args else "float32"
        args += ["--out", os.path.join(os.environ["OUT"], f"results_gpu_{dtype}"), "--plot"]
    sys.exit(main(args))

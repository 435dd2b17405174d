#!/usr/bin/env bash
# The one GPU check for a fresh CUDA machine with torch + nvcc: builds the extension with the CUDA
# kernels, runs tests/test_cuda.py and tests/test_tensor_core.py, benchmarks/bench_gpu.py, then
# compute-sanitizer (memcheck, racecheck, synccheck) on a small snippet that reaches every kernel
# (SIMT and tensor-core), and the whole test suite. Every log goes to $OUT
# (or ./gpu_check_out); summary.txt has one line per step. Designed for < 9 minutes on an H200
# with 16 cores: each step gets min(its cap, what is left of GPU_CHECK_BUDGET seconds).
#
#   OUT=/tmp/out tests/gpu_check.sh        # TORCH_CUDA_ARCH_LIST defaults to 9.0 here
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-./gpu_check_out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
START=$(date +%s)
BUDGET=${GPU_CHECK_BUDGET:-510}
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
FAILED=0

log() { echo "[$(($(date +%s) - START))s] $*" | tee -a "$SUMMARY"; }
left() { echo $((BUDGET - ($(date +%s) - START))); }
cap() {  # cap SECONDS -> min(SECONDS, time left - 10), at least 5
  local l
  l=$(($(left) - 10))
  [ "$l" -lt "$1" ] && echo $((l > 5 ? l : 5)) || echo "$1"
}
step() {  # step NAME CAP_SECONDS CMD... ; output in $OUT/NAME.log
  local name=$1 t rc s0
  t=$(cap "$2")
  shift 2
  s0=$(date +%s)
  timeout --signal=TERM --kill-after=10 "$t" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  if [ $rc -eq 0 ]; then
    log "ok    $name ($(($(date +%s) - s0))s)"
  else
    [ $rc -eq 124 ] && log "TIMEOUT $name after ${t}s" || log "FAIL  $name (rc=$rc, $(($(date +%s) - s0))s)"
    tail -25 "$OUT/$name.log" | sed 's/^/      /' | tee -a "$SUMMARY" >/dev/null
    FAILED=$((FAILED + 1))
  fi
  return $rc
}

{
  nvidia-smi || true
  command -v nvcc && nvcc --version
  python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"
} >"$OUT/env.log" 2>&1
log "env: $(grep -m1 '^torch' "$OUT/env.log")"

# 1. Build (in place: attention_ext/_C*.so) with the CUDA kernels.
export FORCE_CUDA=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16} NVCC_THREADS=${NVCC_THREADS:-2}
if ! step build 300 python setup.py build_ext --inplace; then
  log "build failed: nothing else can run"
  exit 1
fi
step build_info 30 python -c "import attention_ext, json; i = attention_ext.build_info(); print(json.dumps(i, indent=1)); assert str(i['cuda']) == '1', 'no CUDA kernels in this build'"

# 2. The CUDA tests.
step test_cuda 200 python -m pytest tests/test_cuda.py tests/test_tensor_core.py -q -rfEs -p no:cacheprovider --durations=10

# 3. The benchmark (results_gpu.{md,json} in $OUT); stops starting rows when its budget is spent.
step bench_gpu 150 python benchmarks/bench_gpu.py --budget-s 120 --out "$OUT/results_gpu"

# 4. compute-sanitizer on a small snippet touching every kernel (partial tiles, masks, dropout,
#    GQA, mask gradient, dv chunks, all dtypes; the tensor-core forward and backward at d = 64, 128).
SAN=$(command -v compute-sanitizer || echo "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer")
cat >"$OUT/sanitize_snippet.py" <<'PY'
import sys
import torch
import attention_ext
dtypes = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
if len(sys.argv) > 1 and sys.argv[1] == "small":
    dtypes = [torch.float32, torch.float16]
dev = "cuda"
for dt in dtypes:
    torch.manual_seed(0)
    q = torch.randn(2, 4, 37, 40, device=dev, dtype=dt, requires_grad=True)
    k = torch.randn(2, 2, 70, 40, device=dev, dtype=dt, requires_grad=True)
    v = torch.randn(2, 2, 70, 72, device=dev, dtype=dt, requires_grad=True)
    mask = torch.randn(1, 4, 37, 70, device=dev, dtype=dt, requires_grad=True)
    out = attention_ext.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.2, enable_gqa=True)
    out.sum().backward()
    bmask = torch.rand(37, 1, device=dev) > 0.2
    o2, lse = attention_ext.attention(q, k[:, :1].expand(2, 4, 70, 40), v[:, :1].expand(2, 4, 70, 72),
                                      attn_mask=bmask, return_lse=True)
    (o2.sum() + lse[torch.isfinite(lse)].sum()).backward()
    o3 = attention_ext.attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), causal="bottom_right")
    o3.sum().backward()
    rowmask = torch.randn(70, device=dev, dtype=dt, requires_grad=True)  # (m,) mask: rows broadcast
    o4 = attention_ext.attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=rowmask)
    o4.sum().backward()
    colmask = torch.randn(37, 1, device=dev, dtype=dt, requires_grad=True)  # keys broadcast
    o5 = attention_ext.attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=colmask)
    o5.sum().backward()
    attention_ext.attention_weights(q, k.repeat_interleave(2, 1), causal="top_left")
    if dt in (torch.float16, torch.bfloat16):  # the tensor-core kernels
        for d in (64, 128):
            qt = torch.randn(2, 4, 100, d, device=dev, dtype=dt, requires_grad=True)
            kt = torch.randn(2, 2, 90, d, device=dev, dtype=dt, requires_grad=True)
            vt = torch.randn(2, 2, 90, d, device=dev, dtype=dt, requires_grad=True)
            ot = attention_ext.scaled_dot_product_attention(qt, kt, vt, dropout_p=0.1, enable_gqa=True)
            ot.sum().backward()
            mt = torch.randn(4, 100, 90, device=dev, dtype=dt, requires_grad=True)
            ot = attention_ext.attention(qt, kt.repeat_interleave(2, 1), vt.repeat_interleave(2, 1),
                                         attn_mask=mt, causal="bottom_right")
            ot.sum().backward()
torch.ops.attention_ext.dropout_keep_mask(torch.tensor([1, 2], device=dev), [3], 17, 33, 0.3)
torch.cuda.synchronize()
print("snippet ok")
PY
if [ -x "$SAN" ]; then
  step memcheck 90 "$SAN" --tool memcheck --error-exitcode 1 --leak-check no python "$OUT/sanitize_snippet.py"
  step racecheck 120 "$SAN" --tool racecheck --error-exitcode 1 --racecheck-report all python "$OUT/sanitize_snippet.py" small
  step synccheck 60 "$SAN" --tool synccheck --error-exitcode 1 python "$OUT/sanitize_snippet.py" small
else
  log "skip  compute-sanitizer (not found at $SAN)"
fi

# 5. The whole suite (CPU tests included), with what time is left.
step test_all 240 python -m pytest tests -q -x -rfEs -p no:cacheprovider --ignore=tests/test_cuda.py --ignore=tests/test_tensor_core.py

log "done: $FAILED step(s) failed, $(($(date +%s) - START))s total; logs in $OUT"
[ "$FAILED" -eq 0 ]

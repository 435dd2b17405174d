#!/usr/bin/env bash
# Compile-checks the CUDA sources without a GPU: every csrc/cuda/*.cu standalone with the machine's
# nvcc for sm_80 and sm_90 (the flags setup.py passes, plus the two archs), in parallel, and a
# g++ -fsyntax-only pass over the torch-facing csrc/cuda/*.cpp when the installed torch ships its
# CUDA headers. Fails on any error, and if the PTX holds tanh.approx (the build's --use_fast_math
# turns tanhf into it: the softcap must go through attention_semantics.h's tanh_acc); prints one
# line per file and a summary.
#
#   .ci/compile_cuda.sh            # jobs = number of cores
#   JOBS=2 NVCC=/path/nvcc .ci/compile_cuda.sh
set -u -o pipefail
cd "$(dirname "$0")/.."

NVCC=${NVCC:-nvcc}
JOBS=${JOBS:-$(nproc 2>/dev/null || echo 2)}
OUTDIR=$(mktemp -d /tmp/attention_ext_cuda.XXXXXX)
trap 'rm -rf "$OUTDIR"' EXIT
# The described nvcc flags (csrc/build_sources.txt, as setup.py and CMake read them), the two archs.
read -ra DESCRIBED_FLAGS <<< "$(sed -n 's/#.*//; s/^nvccflags[[:space:]]\+//p' csrc/build_sources.txt | tr '\n' ' ')"
NVCC_FLAGS=("${DESCRIBED_FLAGS[@]}" -I csrc
            -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90
            -Xptxas -warn-spills)

if ! command -v "$NVCC" >/dev/null 2>&1; then
  echo "compile_cuda: nvcc not found (set NVCC=...)" >&2
  exit 2
fi
echo "compile_cuda: $("$NVCC" --version | tail -1), $JOBS jobs, output in $OUTDIR"

compile_one() {  # $1 = source; prints "ok|FAIL  file  seconds"
  local src=$1 name log t0 t1 rc
  name=$(basename "$src" .cu)
  log="$OUTDIR/$name.log"
  t0=$(date +%s.%N)
  mkdir -p "$OUTDIR/$name.keep"
  "$NVCC" "${NVCC_FLAGS[@]}" --keep --keep-dir "$OUTDIR/$name.keep" -c -o "$OUTDIR/$name.o" "$src" >"$log" 2>&1
  rc=$?
  if [ $rc -eq 0 ] && grep -q 'tanh\.approx' "$OUTDIR/$name.keep"/*.ptx; then
    echo "the PTX uses tanh.approx (an approximate tanh): $(grep -c 'tanh\.approx' "$OUTDIR/$name.keep"/*.ptx | tr '\n' ' ')" >>"$log"
    rc=1
  fi
  rm -rf "$OUTDIR/$name.keep"
  t1=$(date +%s.%N)
  if [ $rc -eq 0 ]; then
    printf 'ok    %-32s %6.1fs\n' "$src" "$(echo "$t1 - $t0" | bc)"
    grep -iE 'warning' "$log" | sed 's/^/      /' | head -20
  else
    printf 'FAIL  %-32s %6.1fs\n' "$src" "$(echo "$t1 - $t0" | bc)"
    sed 's/^/      /' "$log" | head -60
  fi
  return $rc
}
export -f compile_one
export NVCC OUTDIR
export NVCC_FLAGS_STR="${NVCC_FLAGS[*]}"

start=$(date +%s)
sources=(csrc/cuda/*.cu)
# Largest translation units first so the slowest compiles start early.
results=$(printf '%s\n' "${sources[@]}" | sort -r | xargs -P "$JOBS" -I{} bash -c \
  'NVCC_FLAGS=($NVCC_FLAGS_STR); compile_one "$1"' _ {})
status=$?
echo "$results"
failed=$(echo "$results" | grep -c '^FAIL' || true)
passed=$(echo "$results" | grep -c '^ok' || true)

# The binding: syntax only, against the installed torch's CUDA headers (if it ships them).
binding_status="skipped"
TORCH_INC=$(python -c "import torch, os; print(os.path.join(os.path.dirname(torch.__file__), 'include'))" 2>/dev/null || true)
CUDA_INC=$(dirname "$(dirname "$(readlink -f "$(command -v "$NVCC")")")")/include
[ -f "$CUDA_INC/cuda_runtime_api.h" ] || CUDA_INC=$("$NVCC" -v -x cu -E /dev/null -o /dev/null 2>&1 | sed -n 's/.*INCLUDES="-I\([^"]*\)".*/\1/p' | head -1)
if [ -n "$TORCH_INC" ] && [ -f "$TORCH_INC/c10/cuda/CUDAGuard.h" ] && [ -f "$CUDA_INC/cuda_runtime_api.h" ]; then
  # A CPU torch wheel lacks the build-generated c10/cuda/impl/cuda_cmake_macros.h: stub it.
  stub="$OUTDIR/stub"
  if [ ! -f "$TORCH_INC/c10/cuda/impl/cuda_cmake_macros.h" ]; then
    mkdir -p "$stub/c10/cuda/impl"
    printf '#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n' >"$stub/c10/cuda/impl/cuda_cmake_macros.h"
  fi
  binding_status="ok"
  for src in csrc/cuda/*.cpp; do
    [ -f "$src" ] || continue
    if g++ -std=c++17 -fsyntax-only -Wall -Wextra -DATTENTION_EXT_WITH_CUDA -I csrc -isystem "$TORCH_INC" \
        -isystem "$TORCH_INC/torch/csrc/api/include" -isystem "$stub" -isystem "$CUDA_INC" "$src" \
        >"$OUTDIR/binding.log" 2>&1; then
      echo "ok    $src (g++ -fsyntax-only)"
      sed 's/^/      /' "$OUTDIR/binding.log" | head -20
    else
      echo "FAIL  $src (g++ -fsyntax-only)"
      sed 's/^/      /' "$OUTDIR/binding.log" | head -60
      binding_status="FAIL"
      failed=$((failed + 1))
    fi
  done
else
  echo "skip  csrc/cuda/*.cpp: the installed torch has no CUDA headers (c10/cuda/CUDAGuard.h) or no cuda_runtime_api.h"
fi

end=$(date +%s)
echo "summary: ${passed}/${#sources[@]} .cu files compiled for sm_80+sm_90, ${failed} failed, binding syntax check: ${binding_status}, wall $((end - start))s"
[ "$failed" -eq 0 ] && [ $status -eq 0 ]
